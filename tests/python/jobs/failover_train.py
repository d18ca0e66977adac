"""Training that a test kills a server under: DistributedOptimizer, DDP with gradlink's comm
hook, or DDP over the "gradlink" torch.distributed backend (no hook). Prints "STEP k" after each step (the test signals on those) and saves rank r's final
parameters; a run with a server lost must end with the same bits as one without."""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import gradlink.torch as gl  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--mode", choices=("optimizer", "ddp", "c10d"), required=True)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--step-s", type=float, default=0.05, help="sleep per step: room for the kill")
ap.add_argument("--out", required=True)
a = ap.parse_args()

torch.set_num_threads(1)
gl.init()
rank, size = gl.rank(), gl.size()


def make_model():
    # ~1 MiB of fp32 parameters: several partitions on every server.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 4))


model = make_model()
if a.mode == "optimizer":
    opt = gl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters())
else:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    # c10d: the backend shares this process's worker (gl.init() above), and DDP's buckets are
    # its allreduces.
    dist.init_process_group("gloo" if a.mode == "ddp" else "gradlink",
                            init_method="file://" + os.path.join(a.out, "store"),
                            rank=rank, world_size=size)
    model = DDP(model, bucket_cap_mb=0.25)
    if a.mode == "ddp":
        model.register_comm_hook(gl.DDPHookState(model), gl.ddp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(a.steps):
    x, y = common.shard(common.global_batch(step, 0, size), rank, size)
    opt.zero_grad()
    common.loss_fn(model(x.float()), y.float()).backward()
    opt.step()
    print("STEP %d" % step, flush=True)
    time.sleep(a.step_s)
state = (model if a.mode == "optimizer" else model.module).state_dict()
torch.save(state, os.path.join(a.out, "rank%d.pt" % rank))
print("TRAINED rank %d servers_lost %d" % (rank, gl.stats()["servers_lost"]), flush=True)
gl.shutdown()
