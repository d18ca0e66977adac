"""Training on the GPU through gradlink (CUDA tensors staged through host memory): 2 workers
sharing one GPU, the model and its gradients on it. DistributedOptimizer, and DDP with
gradlink.torch.ddp_hook (DDP over Gloo takes the CUDA tensors it is given; the hook sums its
buckets through gradlink): parameters equal to single-process training on the global batch (on
the CPU, float64). Asserts inside; prints "CUDA TRAIN OK rank r"."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import gradlink.torch as gl  # noqa: E402

STEPS = 4
torch.set_num_threads(1)
gl.init()
rank, size = gl.rank(), gl.size()
dev = torch.device("cuda", 0)


def check(model, what):
    want = common.reference("sgd", STEPS, size=size)
    for name, got in model.state_dict().items():
        name = name[len("module."):] if name.startswith("module.") else name
        torch.testing.assert_close(got.cpu(), want[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m: "%s rank %d %s: %s" % (what, rank, name, m))


def train(model, opt):
    for step in range(STEPS):
        opt.zero_grad()
        x, y = common.shard(common.global_batch(step, 0, size), rank, size)
        common.loss_fn(model(x.to(dev)), y.to(dev)).backward()
        opt.step()


# DistributedOptimizer.
model = common.make_model().to(dev)
train(model, gl.DistributedOptimizer(common.make_optimizer("sgd", model.parameters()),
                                     named_parameters=model.named_parameters()))
check(model, "DistributedOptimizer")

# DDP with gradlink's hook.
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%s" % os.environ["CUDA_TRAIN_PORT"],
                        rank=rank, world_size=size)
ddp = DDP(common.make_model().to(dev), device_ids=[0])
ddp.register_comm_hook(None, gl.ddp_hook)
train(ddp, common.make_optimizer("sgd", ddp.parameters()))
check(ddp, "DDP hook")
print("CUDA TRAIN OK rank %d" % rank)
gl.shutdown()
