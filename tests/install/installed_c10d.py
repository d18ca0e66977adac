"""One rank of a torch.distributed job on the "gradlink" backend of an installed gradlink (no
gradlink-run: rank 0 hosts the scheduler and starts gradlink-server from the package's bin/).
argv: rank, size, store file. Prints "INSTALLED C10D OK rank R" when all_reduce summed right."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import gradlink
import gradlink.torch  # noqa: F401  (registers the backend)

rank, size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
venv = os.path.realpath(os.environ["GRADLINK_TEST_VENV"]) + os.sep
assert os.path.realpath(gradlink.__file__).startswith(venv), gradlink.__file__
dist.init_process_group("gradlink", init_method="file://" + store, rank=rank, world_size=size,
                        timeout=datetime.timedelta(seconds=60))
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1000,), float(size * (size + 1) // 2))), t[:4]
from gradlink import _gradlink_c10d  # noqa: E402
assert os.path.realpath(_gradlink_c10d.__file__).startswith(venv), _gradlink_c10d.__file__
dist.destroy_process_group()
print("INSTALLED C10D OK rank %d" % rank)
