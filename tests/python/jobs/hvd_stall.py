"""The stall inspector under gradlink.torch with Horovod's variables: rank 1 reaches the
allreduce of 'grad.late' STALL_DELAY seconds after rank 0; with
HOROVOD_STALL_CHECK_TIME_SECONDS=1 the scheduler and rank 0 name rank 1 and the tensor, and the
sum is still right once rank 1 arrives."""
import os
import time

import torch

import gradlink.torch as hvd

hvd.init()
t = torch.full((1000,), float(hvd.rank() + 1))
hvd.allreduce(t, op=hvd.Sum, name="grad.early")
if hvd.rank() == 1:
    time.sleep(float(os.environ.get("STALL_DELAY", "3.5")))
out = hvd.allreduce(t, op=hvd.Sum, name="grad.late")
assert torch.equal(out, torch.full((1000,), 3.0)), out
print("HVD STALL ok rank", hvd.rank())
