"""Worker --victim kills itself (SIGKILL) mid-training; the others must raise, quickly."""

import argparse
import os
import signal
import time

import torch

import gradlink
import gradlink.torch as gl

ap = argparse.ArgumentParser()
ap.add_argument("--victim", type=int, default=1)
ap.add_argument("--steps-before", type=int, default=5)
a = ap.parse_args()

gl.init()
rank = gl.rank()
x = torch.ones(1 << 16)
last_ok = time.monotonic()
for step in range(100000):
    if rank == a.victim and step == a.steps_before:
        print("rank %d: killing myself" % rank, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        gl.push_pull(x, name="grad", average=True)
    except gradlink.GradlinkError as e:
        print("RAISED %s after %.2f s at step %d: %s"
              % (type(e).__name__, time.monotonic() - last_ok, step, e), flush=True)
        raise SystemExit(3)
    last_ok = time.monotonic()
    time.sleep(0.01)
print("rank %d: never noticed" % rank)
