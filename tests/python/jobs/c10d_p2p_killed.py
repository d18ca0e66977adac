"""A point-to-point peer that dies or hangs under the "gradlink" backend: the pending recv and
send on the other ranks fail within seconds (the job's verdict), naming it, never a wait until
the process group's 60 s timeout.

argv: rank, size (3), tmp dir, "kill" or "stop". Rank 2 exchanges a few messages with rank 0,
then is SIGKILLed or SIGSTOPped while rank 0 waits in a recv from it and rank 1 in a send
(announced, larger than an eager message) to it."""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import gradlink.torch  # noqa: F401

rank, size, tmp, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
victim = 2
t = torch.ones(1000)
for _ in range(3):  # the connections are up
    if rank == 0:
        dist.send(t, dst=victim)
        dist.recv(t, src=victim)
    elif rank == victim:
        dist.recv(t, src=0)
        dist.send(t, dst=0)
dist.barrier()
pid_file = os.path.join(tmp, "victim.pid")
if rank == victim:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(0.5)  # the others are waiting by now
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    time.sleep(120)
start = time.monotonic()
try:
    if rank == 0:
        dist.recv(t, src=victim)
    else:
        dist.send(torch.ones(1 << 20), dst=victim)
except RuntimeError as e:
    print("C10D P2P LOST rank %d after %.2f s: %s" % (rank, time.monotonic() - start, e),
          flush=True)
    if rank == 0 and how == "stop":
        os.kill(int(open(pid_file).read()), signal.SIGKILL)  # the test ends with it
    os._exit(0)  # the job has failed: nothing to leave cleanly
raise AssertionError("the %s never failed" % ("recv" if rank == 0 else "send"))
