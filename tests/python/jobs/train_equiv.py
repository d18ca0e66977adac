"""DistributedOptimizer on shards == single-process training on the global batch."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import gradlink.torch as gl  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--opt", default="sgd")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--passes", type=int, default=1)
ap.add_argument("--bucket-bytes", type=int, default=None)
ap.add_argument("--out", required=True)
a = ap.parse_args()

torch.set_num_threads(1)
gl.init()
rank, size = gl.rank(), gl.size()
model = common.make_model(seed=rank)  # different on purpose: broadcast_parameters fixes it
if rank == 0:
    model = common.make_model(seed=0)
gl.broadcast_parameters(model.state_dict(), root_rank=0)
opt = gl.DistributedOptimizer(common.make_optimizer(a.opt, model.parameters()),
                              named_parameters=model.named_parameters(),
                              backward_passes_per_step=a.passes,
                              bucket_bytes=a.bucket_bytes)
gl.broadcast_optimizer_state(opt, root_rank=0)
for step in range(a.steps):
    opt.zero_grad()
    for micro in range(a.passes):
        x, y = common.shard(common.global_batch(step, micro, size), rank, size)
        loss = common.loss_fn(model(x), y)
        loss.backward()
    opt.step()
    print("step %d loss %.6f" % (step, loss.item()))
# Small gradients went in fused buckets unless buckets are off.
fused = gl.stats()["fused_ops"]
assert (fused > 0) == (a.bucket_bytes != 0), fused
print("fused ops %d" % fused)
# Host buffers of the staging pipeline (GRADLINK_STAGE_HOST=1 sends every gradient through it).
print("staging buffers %d" % gl._core.staging_stats()["allocated"])
torch.save(model.state_dict(), os.path.join(a.out, "rank%d.pt" % rank))
gl.shutdown()
