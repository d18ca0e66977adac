"""bench/server_path.py at a tiny size: its jobs run with real binaries, its allocation counter
builds and reads, and every column of its row is a number in range."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import BIN, REPO

SCRIPT = os.path.join(REPO, "bench", "server_path.py")


def test_server_path_measures_one_cell():
    for b in ("gradlink-scheduler", "gradlink-server", "gradlink-bench"):
        if not os.access(os.path.join(BIN, b), os.X_OK):
            pytest.skip("%s is not built (%s)" % (b, BIN))
    if not shutil.which("cc"):
        pytest.skip("no C compiler for bench/tools/alloc_count.c")
    out = subprocess.run([sys.executable, SCRIPT, "--bin-dir", BIN, "--shapes", "2x1", "--sizes",
                          "64K", "--iters", "3", "--window", "1", "--no-perftest", "--timeout",
                          "120"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| this build |")]
    assert len(rows) == 1, out.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "2 x 1" and cells[2] == "64K", cells
    busbw, cpu_per_gb, allocs = float(cells[3]), float(cells[4]), float(cells[5])
    assert 0 < busbw < 100, cells
    assert 0 < cpu_per_gb < 1000, cells  # the servers did work in the window
    assert 0 <= allocs < 1000, cells
    counted, messages = (float(x) for x in cells[6].split("/"))
    assert counted == int(counted) and counted >= 0 and messages > 0, cells
    assert abs(counted / messages - allocs) < 0.0006, cells  # the per-message column is that ratio
    wcounted, wmessages = (float(x) for x in cells[7].split("/"))
    assert wcounted == int(wcounted) and wcounted >= 0 and wmessages == messages, cells
    assert cells[8] == "-", cells  # --no-perftest
