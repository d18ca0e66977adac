#!/usr/bin/env python3
"""Runs Horovod's own PyTorch test file (test/parallel/test_torch.py of a fetched horovod/horovod)
on gradlink, as a Horovod user would: the file's `import horovod.torch as hvd` becomes
`import gradlink.torch as hvd`, and the three helpers it takes from Horovod's test/utils/common.py
(which needs Horovod's runner) are supplied by a small module of our own, written beside it.
Nothing of Horovod's is copied into the project: the file is read from the path given.

    scripts/horovod/run_suite.py --tests ~/horovod/test/parallel [-n 2 3 4] [--mode each|file|both]

`each`: every test in its own `gradlink-run -n N -s 2` job; `file`: the whole file in one job.
Each job runs `python -m pytest` with a JUnit report, from which every test's outcome (and each
skip's reason) is read; a job that outlives --timeout counts as a hang. Prints one summary line
per (mode, N), and with --json the outcomes test by test. Exit status 0 only when no test failed
or hung.

Deselected (not run), each for a Horovod internal that gradlink cannot honestly have; the reasons
are in docs/horovod_api.md: DESELECTED below.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# test name -> (the worker counts it is not run at, why); at most 3, docs/horovod_api.md
# repeats them.
_FP16_AT_3 = (
    (3,), "with 3 workers it compares a float16 sum, exactly, with a float32 product that no "
    "float16 number holds (3 x a float16 value needs more mantissa bits): no float16 result can "
    "pass, Horovod's included (the reduce-scatters compare each rank's own slice, so ranks that "
    "fail at different iterations fall out of step); with 2 and 4 workers it runs")
DESELECTED = {
    "test_horovod_allreduce_prescale": _FP16_AT_3,
    "test_horovod_reducescatter_prescale": _FP16_AT_3,
    "test_horovod_grouped_reducescatter_prescale": _FP16_AT_3,
}


def deselected(name, n):
    return name in DESELECTED and n in DESELECTED[name][0]

# Our stand-ins for the three helpers of Horovod's test/utils/common.py the file imports.
COMMON = '''"""Stand-ins (gradlink's, scripts/horovod/run_suite.py) for the helpers test_torch.py imports
from Horovod's test/utils/common.py."""
import contextlib
import os
import shutil
import tempfile


def mpi_env_rank_and_size():
    """(rank, size) as an MPI launcher set them, else (0, 1): gradlink-run is not one."""
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    else:
        test.skipTest(message)


@contextlib.contextmanager
def temppath():
    d = tempfile.mkdtemp()
    try:
        yield os.path.join(d, "temp_test_file")
    finally:
        shutil.rmtree(d, ignore_errors=True)
'''


def prepare(tests_dir, work):
    src = os.path.join(tests_dir, "test_torch.py")
    with open(src) as f:
        text = f.read()
    text, n = re.subn(r"^import horovod\.torch as hvd$", "import gradlink.torch as hvd", text,
                      flags=re.M)
    if n != 1:
        sys.exit("run_suite: %s has no line 'import horovod.torch as hvd'" % src)
    with open(os.path.join(work, "test_torch.py"), "w") as f:
        f.write(text)
    with open(os.path.join(work, "common.py"), "w") as f:
        f.write(COMMON)
    return re.findall(r"^    def (test_\w+)\(self", text, flags=re.M)


def outcomes(xml_path):
    """{test name: (outcome, message)} from a pytest JUnit report."""
    out = {}
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return out
    for case in root.iter("testcase"):
        name = case.get("name")
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, msg = "failed", (child.get("message") or "")[:300]
                break
            if child.tag == "skipped":
                outcome, msg = "skipped", (child.get("message") or "")[:300]
        out[name] = (outcome, msg)
    return out


def run_job(run, n, servers, work, selector, timeout, log):
    """One gradlink-run job of pytest on `selector`; returns ({rank: outcomes}, status, seconds)."""
    reports = os.path.join(work, "reports")
    shutil.rmtree(reports, ignore_errors=True)
    os.makedirs(reports)
    # Each rank writes its own report ({rank} filled in by the shell of every worker).
    cmd = [run, "-n", str(n), "-s", str(servers), "--", "sh", "-c",
           'exec "$0" -m pytest -v -p no:cacheprovider -o junit_family=xunit1 -o faulthandler_timeout=60 '
           '--junitxml="%s/rank$GRADLINK_RANK.xml" "$@"' % reports,
           sys.executable] + selector
    deselect = []
    for name in DESELECTED:
        if deselected(name, n):
            deselect += ["--deselect", "test_torch.py::TorchTests::" + name]
    cmd += deselect
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                           start_new_session=True)
        status = p.returncode
    except subprocess.TimeoutExpired as e:
        status = "hang"
        # gradlink-run and everything it started (its own session).
        subprocess.run(["pkill", "-KILL", "-f", work], check=False)
        del e
    took = time.monotonic() - start
    per_rank = {}
    for r in range(n):
        per_rank[r] = outcomes(os.path.join(reports, "rank%d.xml" % r))
    return per_rank, status, took


def merge(per_rank, names, status):
    """One outcome per test: failed if any rank failed it or did not report it."""
    result = {}
    for name in names:
        seen = [per_rank[r].get(name) for r in per_rank]
        if any(s is None for s in seen):
            result[name] = ("hang" if status == "hang" else "failed",
                            "no report from every rank (job status %s)" % status)
        elif any(s[0] == "failed" for s in seen):
            result[name] = ("failed", next(s[1] for s in seen if s[0] == "failed"))
        else:
            result[name] = seen[0]
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", required=True, help="Horovod's test/parallel directory")
    ap.add_argument("-n", type=int, nargs="+", default=[2], help="worker counts")
    ap.add_argument("-s", "--servers", type=int, default=2)
    ap.add_argument("--mode", choices=["each", "file", "both"], default="both")
    ap.add_argument("-k", help="only tests whose names contain this")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds a job may take (each: 120; file: 1200)")
    ap.add_argument("--json", help="write every outcome here")
    ap.add_argument("--log", default=None, help="the jobs' output (default: a temp file)")
    args = ap.parse_args()

    run = os.path.join(os.environ.get("GRADLINK_BUILD_DIR", os.path.join(REPO, "build")),
                       "bin", "gradlink-run")
    if not os.access(run, os.X_OK):
        run = shutil.which("gradlink-run") or sys.exit("run_suite: no gradlink-run (make build)")
    work = tempfile.mkdtemp(prefix="gradlink-hvd-")
    names = prepare(os.path.abspath(args.tests), work)
    if args.k:
        names = [t for t in names if args.k in t]
    log_path = args.log or os.path.join(work, "jobs.log")
    log = open(log_path, "w")
    modes = ["each", "file"] if args.mode == "both" else [args.mode]
    report = {}
    bad = 0
    for mode in modes:
        for n in args.n:
            results = {}
            if mode == "each":
                statuses = {}
                for name in names:
                    if deselected(name, n):
                        continue
                    log.write("\n==== %s n=%d %s\n" % (mode, n, name))
                    log.flush()
                    per_rank, status, took = run_job(
                        run, n, args.servers, work, ["test_torch.py::TorchTests::" + name],
                        args.timeout or 120, log)
                    results.update(merge(per_rank, [name], status))
                    statuses[name] = (status, round(took, 1))
                    print("  %-55s %-8s job %s %.1fs" % (name, results[name][0], status, took),
                          flush=True)
            else:
                log.write("\n==== %s n=%d\n" % (mode, n))
                log.flush()
                sel = ["test_torch.py"] + (["-k", args.k] if args.k else [])
                per_rank, status, took = run_job(run, n, args.servers, work, sel,
                                                 args.timeout or 1200, log)
                results = merge(per_rank, [t for t in names if not deselected(t, n)], status)
                statuses = {"job": (status, round(took, 1))}
            counts = {}
            for outcome, _ in results.values():
                counts[outcome] = counts.get(outcome, 0) + 1
            bad += counts.get("failed", 0) + counts.get("hang", 0)
            skips = sorted({m for o, m in results.values() if o == "skipped"})
            print("%s n=%d: %s; job status %s" % (
                mode, n, ", ".join("%d %s" % (v, k) for k, v in sorted(counts.items())),
                statuses.get("job", "per test")), flush=True)
            for name, (o, m) in sorted(results.items()):
                if o in ("failed", "hang"):
                    print("    %s %s: %s" % (o.upper(), name, m.splitlines()[0] if m else ""))
            for m in skips:
                print("    skip reason: %s (%d)" % (
                    m, sum(1 for o, mm in results.values() if o == "skipped" and mm == m)))
            report["%s-%d" % (mode, n)] = {"results": results, "jobs": statuses}
    log.close()
    print("job output: %s" % log_path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
