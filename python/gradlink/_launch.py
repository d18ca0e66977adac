"""The commands an installed gradlink puts on PATH (pyproject.toml's console scripts):
gradlink-run, gradlink-scheduler, gradlink-server and gradlink-bench, each replaced by the
program of that name in the package's bin/ (cmake/install.cmake puts them there). gradlink-run
runs under this interpreter, and finds the binaries beside itself.

In a source tree (python/gradlink/ with no bin/) there is nothing to run: the programs are in
the CMake build's bin/.
"""

import os
import sys

BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def _exec(name, script=False):
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        sys.exit("gradlink: %s is not installed in %s (this gradlink is not an installed "
                 "package: run the CMake build's bin/%s)" % (name, BIN, name))
    argv = ([sys.executable, path] if script else [path]) + sys.argv[1:]
    os.execv(argv[0], argv)


def gradlink_run():
    _exec("gradlink-run", script=True)


def gradlink_scheduler():
    _exec("gradlink-scheduler")


def gradlink_server():
    _exec("gradlink-server")


def gradlink_bench():
    _exec("gradlink-bench")
