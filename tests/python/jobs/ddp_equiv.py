"""DDP with gradlink.torch.ddp_hook == DDP with the default (gloo all-reduce) communication."""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import gradlink.torch as gl  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--out", required=True)
a = ap.parse_args()

torch.set_num_threads(1)
gl.init()
rank, size = gl.rank(), gl.size()
dist.init_process_group("gloo", init_method="file://" + os.path.join(a.out, "store"),
                        rank=rank, world_size=size)


def make_model():
    # ~2 MiB of parameters, two layers of the same shape: several buckets (DDP's first bucket
    # holds up to 1 MiB), some with the same signature, rebuilt after the first iteration.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
        torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4))


def build(hook_state):
    m = DDP(make_model(), bucket_cap_mb=0.25)
    if hook_state != "gloo":
        m.register_comm_hook(hook_state(m) if hook_state else None, gl.ddp_hook)
    return m


variants = {"gloo": build("gloo"), "named": build(gl.DDPHookState), "shapes": build(None)}
opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in variants.items()}
for step in range(a.steps):
    x, y = common.shard(common.global_batch(step, 0, size), rank, size)
    for k, m in variants.items():
        opts[k].zero_grad()
        common.loss_fn(m(x.float()), y.float()).backward()
        opts[k].step()
result = {k: m.module.state_dict() for k, m in variants.items()}
for k in ("named", "shapes"):
    for name, v in result["gloo"].items():
        diff = (result[k][name] - v).abs().max().item()
        assert torch.allclose(result[k][name], v, rtol=1e-5, atol=1e-6), (k, name, diff)
print("DDP OK rank %d" % rank)
torch.save(result, os.path.join(a.out, "rank%d.pt" % rank))
dist.destroy_process_group()
gl.shutdown()
