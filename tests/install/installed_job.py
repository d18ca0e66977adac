"""One worker of the job tests/install/pip_test.sh runs with an installed gradlink
(`gradlink-run -n 2 -s 2 -- python installed_job.py`): sums a tensor through gradlink.torch and
checks every element against a loop over the ranks' inputs, then checks that gradlink, its
compiled modules, libgradlink, UCX and UCX's transport modules all came from the venv
($GRADLINK_TEST_VENV). Prints "INSTALLED JOB OK rank R" on success."""

import os
import sys

import torch

import gradlink
import gradlink.byteps.torch  # noqa: F401
import gradlink.torch as gl

venv = os.path.realpath(os.environ["GRADLINK_TEST_VENV"]) + os.sep


def inside(path):
    return os.path.realpath(path).startswith(venv)


assert inside(gradlink.__file__), "gradlink from %s, not %s" % (gradlink.__file__, venv)
assert inside(gradlink._gradlink.__file__), gradlink._gradlink.__file__

gl.init()
rank, size = gl.rank(), gl.size()
assert size == 2, size
n = 100000


def inputs(r):
    return torch.arange(n, dtype=torch.float32).remainder(977) * (r + 1) + r


t = inputs(rank)
gl.push_pull(t, average=False, name="installed.grad")
expected = torch.zeros(n)
for r in range(size):
    expected += inputs(r)
wrong = int((t != expected).sum())
assert wrong == 0, "%d of %d sums wrong" % (wrong, n)

# What the dynamic loader mapped: gradlink's libraries and UCX's (the transport modules too,
# which UCX loads from <directory of libucs>/ucx) from the venv, none from anywhere else.
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        name = os.path.basename(path)
        if name.startswith(("libgradlink", "libucp", "libuct", "libucs", "libucm", "_gradlink")):
            maps.add(path)
outside = sorted(p for p in maps if not inside(p))
assert not outside, "loaded from outside the venv: %s" % outside
names = {os.path.basename(p) for p in maps}
for lib in ("libgradlink.so.0.1", "libucp.so.0", "libuct.so.0", "libucs.so.0", "libuct_cma.so.0"):
    assert lib in names, "%s not loaded (loaded: %s)" % (lib, sorted(names))
gl.shutdown()
print("INSTALLED JOB OK rank %d: %d sums right; %s" % (rank, n, ", ".join(sorted(names))))
