"""broadcast_parameters / broadcast_optimizer_state make every rank equal to the root."""

import argparse
import os

import torch

import gradlink.torch as gl

ap = argparse.ArgumentParser()
ap.add_argument("--root", type=int, default=1)
ap.add_argument("--out", required=True)
a = ap.parse_args()

torch.set_num_threads(1)
gl.init()
rank = gl.rank()
torch.manual_seed(100 + rank)  # every rank different
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
model.register_buffer("mask", torch.rand(5) > 0.5)                     # bool
model.register_buffer("codes", torch.randint(0, 255, (7,), dtype=torch.uint8))
model.register_buffer("halfbuf", torch.randn(3).half())
model.register_buffer("zero", torch.tensor([-0.0, 0.0]) * (1 if rank == a.root else -1))
opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
for _ in range(rank + 1):  # different optimizer state on every rank
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()

before = {"model": {k: v.clone() for k, v in model.state_dict().items()},
          "opt": opt.state_dict()}
torch.save(before, os.path.join(a.out, "before%d.pt" % rank))
gl.broadcast_parameters(model.state_dict(), root_rank=a.root)
gl.broadcast_optimizer_state(opt, root_rank=a.root)
# A named_parameters() iterable works too (and changes nothing now).
gl.broadcast_parameters(model.named_parameters(), root_rank=a.root, prefix="again")
after = {"model": model.state_dict(), "opt": opt.state_dict()}
torch.save(after, os.path.join(a.out, "after%d.pt" % rank))
# The optimizer still works after loading the root's state.
opt.zero_grad()
model(torch.randn(4, 8)).sum().backward()
opt.step()
print("broadcast done rank %d" % rank)
gl.shutdown()
