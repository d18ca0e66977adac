"""An exception nobody catches after init_process_group("gradlink"): the process leaves the job
at once (fail fast) and its traceback and gradlink's line reach stderr, also where torch 2.x's
own excepthook wraps gradlink's and buffers what it prints.

argv: rank, size, tmp dir."""

import datetime
import os
import sys

import torch.distributed as dist

import gradlink.torch  # noqa: F401

rank, size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=30))
raise ValueError("deliberately uncaught on rank %d" % rank)
