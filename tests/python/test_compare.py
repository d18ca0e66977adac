"""bench/compare at tiny sizes: every system whose dependency is here runs and passes its check,
the table's arithmetic holds, a corrupted result fails the run, and bad options are named."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import BIN, REPO

COMPARE = os.path.join(REPO, "bench", "compare")
GRADLINK = ["gradlink-default", "gradlink-local", "gradlink-shm-1s", "gradlink-shm-2s", "gradlink-tcp-1s",
            "gradlink-tcp-2s"]
MPI = ["mpi-shm", "mpi-tcp"]
SYSTEMS = GRADLINK + MPI + ["gloo"]
TINY = ["--bin", BIN, "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "--warmup", "1", "--repeats", "1",
        "--timeout", "60"]  # compare stops a hung run itself (its processes are in their own groups)


def python_for_compare():
    """The interpreter bench/compare runs under (its wrapper's rule)."""
    venv = os.path.join(REPO, ".venv", "bin", "python")
    return venv if os.access(venv, os.X_OK) else "/usr/bin/python3"


def available():
    """{system: reason it must be skipped, or None}, decided here, not by bench/compare."""
    out = {}
    gl = None
    for b in ("gradlink-bench", "gradlink-server"):
        if not os.access(os.path.join(BIN, b), os.X_OK):
            gl = "%s not built" % b
    out.update({s: gl for s in GRADLINK})
    mpi = None
    if not os.access(os.path.join(BIN, "mpi_allreduce"), os.X_OK):
        mpi = "mpi_allreduce not built"
    elif not shutil.which("mpirun"):
        mpi = "mpirun missing"
    out.update({s: mpi for s in MPI})
    torch_ok = subprocess.run([python_for_compare(), "-c", "import torch.distributed"],
                              capture_output=True, timeout=120).returncode == 0
    out["gloo"] = None if torch_ok else "torch missing"
    return out


def run_compare(args, timeout=150):
    p = subprocess.run([COMPARE] + args, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return p.returncode, p.stdout, p.stderr


def table_rows(text):
    """{(size, system): [cells]} of the main table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and re.fullmatch(r"\d+[KMG]?", cells[0]) and cells[1] in SYSTEMS:
            rows[(cells[0], cells[1])] = cells
    return rows


def test_every_available_system_runs_and_checks(tmp_path):
    avail = available()
    if all(avail.values()):
        pytest.skip("no system can run here: %s" % avail)
    results = tmp_path / "results.md"
    results.write_text("# earlier content\n")
    png = tmp_path / "compare.png"
    rc, out, err = run_compare(TINY + ["--results", str(results), "--plot", str(png)])
    assert rc == 0, out + err
    rows = table_rows(out)
    for system, why in avail.items():
        if why:
            assert re.search(r"skipped %s: " % system, err), (system, why, err)
            assert not any(s == system for (_, s) in rows), out
            continue
        for size, nbytes in (("4K", 4096), ("16K", 16384)):
            cells = rows.get((size, system))
            assert cells, "no row for %s at %s in:\n%s\n%s" % (system, size, out, err)
            assert cells[6] == "OK 1/1", cells
            time_us, fastest, algbw = float(cells[2]), float(cells[3]), float(cells[4])
            lo, med, hi = (float(x) for x in cells[5].split("/"))
            assert 0 < fastest <= time_us * 1.001, cells
            # algbw = bytes / time; with 2 ranks busbw = algbw; one repeat: min = median = max.
            assert algbw == pytest.approx(nbytes / (time_us * 1e3), rel=0.02, abs=2e-3), cells
            assert med == pytest.approx(algbw, rel=0.02, abs=2e-3) and lo == med == hi, cells
    ran = {s for (_, s) in rows}
    if ran & set(GRADLINK) and ran - set(GRADLINK):
        # The ratio column: best gradlink's median busbw over each baseline's; with one repeat and
        # the same bytes that is the baseline's time over best gradlink's (times have more digits).
        for size in ("4K", "16K"):
            best = [s for (z, s), c in rows.items() if z == size and c[7] == "best"]
            assert len(best) == 1 and best[0] in GRADLINK, rows
            t_best = float(rows[(size, best[0])][2])
            assert t_best == pytest.approx(min(float(rows[(size, g)][2]) for g in ran & set(GRADLINK)),
                                           rel=0.01), rows
            for s in ran - set(GRADLINK):
                ratio = float(rows[(size, s)][7].rstrip("x"))
                assert ratio == pytest.approx(float(rows[(size, s)][2]) / t_best, rel=0.02, abs=0.006), \
                    rows[(size, s)]
    text = results.read_text()
    assert text.startswith("# earlier content\n"), "the results file must be appended to"
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert "## %s" % head in text and "Command: `bench/compare " in text, text
    assert table_rows(text) == rows
    if "plot written" in err:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in err, err


def test_a_wrong_value_fails_the_run(tmp_path):
    avail = available()
    system = next((s for s in ("mpi-shm", "gloo") if not avail[s]), None)
    if system is None:
        pytest.skip("neither MPI nor Gloo can run here: %s" % avail)
    rc, out, err = run_compare(TINY + ["--systems", system, "--selftest-corrupt", system,
                                       "--no-plot", "--results", str(tmp_path / "r.md")])
    assert rc != 0, out + err
    assert "FAILED: WRONG VALUES from %s (repeat 1)" % system in err, err
    assert "4096 bytes: WRONG:1" in err, err
    assert not (tmp_path / "r.md").exists(), "a failed comparison must not append results"


def test_bad_options_are_named(tmp_path):
    rc, _, err = run_compare(["--systems", "gradlink-shm-1s,bogus", "--no-plot", "--no-results"])
    assert rc == 2 and "unknown bogus" in err, err
    rc, _, err = run_compare(["-b", "64M", "-e", "4K", "--no-plot", "--no-results"])
    assert rc == 2 and "smaller than -b" in err, err
    rc, _, err = run_compare(["-f", "1", "--no-plot", "--no-results"])
    assert rc == 2 and "must be > 1" in err, err
