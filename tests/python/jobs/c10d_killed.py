"""A peer killed mid-job under the "gradlink" backend: every other rank's pending work raises
within seconds, naming it (never a hang until the process group's 60 s timeout).
argv: rank, size, tmp dir; rank size-1 is killed (SIGKILL) after 20 steps."""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import gradlink.torch  # noqa: F401

rank, size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
t = torch.ones(1 << 16)
last = time.monotonic()
for step in range(10**6):
    if rank == size - 1 and step == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    works = [dist.all_reduce(t.clone(), async_op=True) for _ in range(3)]
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:
        print("C10D KILLED rank %d after %.2f s: %s" % (rank, time.monotonic() - last, e),
              flush=True)
        break
    last = time.monotonic()
else:
    raise AssertionError("the loop never failed")
