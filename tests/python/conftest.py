"""Helpers of the gradlink Python tests: where the build is, and running jobs via gradlink-run.

The build directory is $GRADLINK_BUILD_DIR, else <repo>/build. Tests that need the compiled
module or the binaries are skipped (with the reason) when they have not been built."""

import glob
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
BUILD = os.path.abspath(os.environ.get("GRADLINK_BUILD_DIR") or os.path.join(REPO, "build"))
BIN = os.path.join(BUILD, "bin")
LAUNCHER = os.path.join(REPO, "tools", "gradlink-run")

os.environ["GRADLINK_BUILD_DIR"] = BUILD  # absolute: jobs run in other directories
if os.path.join(REPO, "python") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "python"))


def _missing():
    if not glob.glob(os.path.join(BUILD, "python", "gradlink", "_gradlink*.so")):
        return "the Python module is not built (%s/python/gradlink/_gradlink*.so)" % BUILD
    for b in ("gradlink-scheduler", "gradlink-server"):
        if not os.path.exists(os.path.join(BIN, b)):
            return "%s is not built (%s)" % (b, BIN)
    return None


@pytest.fixture(scope="session")
def built():
    why = _missing()
    if why:
        pytest.skip(why + ": build with cmake first (GRADLINK_BUILD_PYTHON=ON)")
    return BUILD


@dataclass
class Job:
    rc: int
    out: str
    err: str
    argv: list

    @property
    def text(self):
        return self.out + self.err

    def lines(self, prefix):
        return [line[len(prefix):].strip() for line in self.text.splitlines()
                if line.startswith(prefix)]

    def explain(self):
        return "job %s\nexit %d\n--- stdout\n%s\n--- stderr\n%s" % (
            " ".join(self.argv), self.rc, self.out, self.err)


@pytest.fixture
def run_job(built, tmp_path):
    """run_job(workers, servers, script_or_argv, timeout=..., launcher_args=[...]) -> Job."""

    def run(workers, servers, argv, timeout=60, launcher_args=(), env=None):
        argv = [argv] if isinstance(argv, str) else list(argv)
        if os.sep not in argv[0] and os.path.exists(os.path.join(JOBS, argv[0])):
            argv[0] = os.path.join(JOBS, argv[0])  # a script of tests/python/jobs
        cmd = [sys.executable, LAUNCHER, "--bin-dir", BIN, "-n", str(workers), "-s", str(servers),
               "--timeout", str(max(5, timeout - 15)), *launcher_args, "--",
               sys.executable, *argv]
        full_env = dict(os.environ)
        full_env.update(env or {})
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                             cwd=str(tmp_path))
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)  # gradlink-run stops its processes
            try:
                out, err = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            pytest.fail("job did not end within %d s: %s\n%s\n%s"
                        % (timeout, " ".join(cmd), out.decode(errors="replace"),
                           err.decode(errors="replace")))
        return Job(p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), cmd)

    return run
