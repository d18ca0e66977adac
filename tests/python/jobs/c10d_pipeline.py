"""examples/pipeline_parallel.py as a job of the tests (spawn runs scripts of this directory):
2 pipeline stages x 2 data-parallel replicas over the "gradlink" backend, checked against
one-process training. argv: rank, size, a directory for the FileStore, then the example's
options (--check). Prints "PIPELINE OK rank R"."""

import os
import runpy
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples",
                       "pipeline_parallel.py")
sys.argv[0] = EXAMPLE
runpy.run_path(EXAMPLE, run_name="__main__")
