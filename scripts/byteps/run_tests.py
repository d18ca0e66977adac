#!/usr/bin/env python3
"""Runs BytePS's own PyTorch scripts (the example/pytorch/ programs, and tests/torch/ tests where
a checkout has them) from a fetched bytedance/byteps checkout on gradlink, as a BytePS user
would: every `byteps.torch` in their import lines becomes `gradlink.byteps.torch`, nothing else
changes. The scripts are copied into a temporary directory outside the project; nothing of
BytePS's is copied into the project.

    scripts/byteps/run_tests.py ~/byteps [-n 2 3] [-s 2] [-k benchmark] [--json out.json]

Each runnable script runs in its own `gradlink-run -n N -s S` job, with small sizes on the
command line (CATALOGUE below: a CPU and two cores are enough), and passes when the job exits 0
and the script printed the line that ends a successful run. A script that cannot run here is
reported as skipped with the reason (a GPU, a data set that is downloaded, elastic training),
as is one the catalogue does not know. Prints one line per script and one summary per N; exit
status 0 only when nothing failed.
"""

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The benchmarks' sizes: one image of 224x224 per batch, three steps, resnet18.
SMALL = ["--model", "resnet18", "--batch-size", "1", "--num-warmup-batches", "1",
         "--num-batches-per-iter", "1", "--num-iters", "2"]
TOTAL = r"Total img/sec on %(n)d CPU\(s\)"
# Two benchmarks call torch.autograd.profiler.profile(enabled, use_cuda) with use_cuda
# positional, which torch >= 1.6 refuses (TypeError): the one change besides the imports, to
# torch's API, not BytePS's; reported with the outcome.
PROFILE = (r"profiler\.profile\(enable_profiling, True\)",
           "profiler.profile(enable_profiling, use_cuda=True)",
           "profile(enabled, use_cuda=...) keyword for torch >= 1.6")

# path in the checkout -> how to run it: "argv" (after the script), "expect" (a regex the
# output must hold; %(n)d is the worker count), "env", "needs" (modules that must import),
# "torch_fixes" ((regex, replacement, why): a call to torch's own API made current), or "skip"
# (why it cannot run on gradlink here). Each variant is one job.
CATALOGUE = {
    "example/pytorch/benchmark_byteps.py": [
        {"variant": "optimizer", "argv": SMALL, "expect": TOTAL, "needs": ["torchvision"]},
        {"variant": "fp16", "argv": SMALL + ["--fp16-pushpull"], "expect": TOTAL,
         "needs": ["torchvision"]},
    ],
    "example/pytorch/benchmark_byteps_ddp.py": [
        {"argv": SMALL, "expect": TOTAL, "needs": ["torchvision"], "torch_fixes": [PROFILE]},
    ],
    "example/pytorch/benchmark_cross_barrier_byteps.py": [
        {"argv": SMALL, "expect": TOTAL, "needs": ["torchvision"], "torch_fixes": [PROFILE]},
    ],
    "example/pytorch/elastic_benchmark_byteps.py": [
        {"skip": "elastic training (bps.suspend()/bps.resume() change the job's workers): not "
                 "provided by gradlink, which raises naming it (docs/byteps_api.md)"},
    ],
    "example/pytorch/train_mnist_byteps.py": [
        {"argv": ["--epochs", "1"], "expect": r"Test set: Average loss", "needs": ["torchvision"],
         "data": "mnist"},
    ],
    "example/pytorch/train_imagenet_resnet50_byteps.py": [
        {"skip": "trains on an ImageNet directory tree (--train-dir, --val-dir) and imports "
                 "tensorboardX, which Debian 12 does not package"},
    ],
    "example/pytorch/train_imagenet_resnet_byteps_ddp.py": [
        {"skip": "needs CUDA devices (torch.cuda.device_count() GPUs per host) and ImageNet"},
    ],
    # bytedance/byteps branches that carry PyTorch tests (the released master has none).
    "tests/torch/test_torch.py": [
        {"argv": [], "env": {"TEST_GPU": "0"}, "expect": r"DONE test_byteps_push_pull gpu=False"},
    ],
    "tests/torch/test_torch_broadcast_object.py": [
        {"argv": [], "env": {"TEST_GPU": "0"}, "expect": None},
    ],
}

IMPORT = re.compile(r"^(\s*(?:import|from)\s+)byteps\.torch\b", re.M)


def scripts_of(checkout):
    """Every .py of the checkout's example/pytorch/ and tests/ that imports byteps.torch."""
    found = []
    for top in ("example/pytorch", "tests"):
        for root, _, files in os.walk(os.path.join(checkout, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    with open(path, errors="replace") as fh:
                        if IMPORT.search(fh.read()):
                            found.append(os.path.relpath(path, checkout))
    return sorted(found)


def rewrite(src, dst, torch_fixes=()):
    """Copies src to dst with its byteps.torch imports made gradlink.byteps.torch ones (and
    the torch_fixes applied); returns (import lines changed, the fixes' reasons applied)."""
    with open(src) as f:
        text = f.read()
    text, n = IMPORT.subn(r"\1gradlink.byteps.torch", text)
    applied = []
    for pattern, replacement, why in torch_fixes:
        text, k = re.subn(pattern, replacement, text)
        if k:
            applied.append(why)
    with open(dst, "w") as f:
        f.write(text)
    return n, applied


def synthetic_mnist(root, train=600, test=200):
    """Writes MNIST's four files (idx format, uncompressed, as torchvision finds them in
    <root>/MNIST/raw/ and then downloads nothing) with random images and labels: the script
    runs its whole loop; its accuracy means nothing."""
    import random
    rng = random.Random(42)
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, n in (("train", train), ("t10k", test)):
        with open(os.path.join(raw, prefix + "-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 0x803, n, 28, 28))
            f.write(bytes(rng.randrange(256) for _ in range(n * 28 * 28)))
        with open(os.path.join(raw, prefix + "-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 0x801, n))
            f.write(bytes(rng.randrange(10) for _ in range(n)))


def importable(modules):
    missing = []
    for m in modules:
        p = subprocess.run([sys.executable, "-c", "import " + m], capture_output=True)
        if p.returncode != 0:
            missing.append(m)
    return missing


def run_job(run, n, servers, workdir, script, spec, timeout, log):
    """One gradlink-run job; returns (outcome, reason, seconds)."""
    argv = list(spec.get("argv", []))
    cmd = run + ["-n", str(n), "-s", str(servers), "--timeout", str(int(timeout)), "--",
           sys.executable, script] + argv
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    env["PYTHONUNBUFFERED"] = "1"
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout + 30,
                           start_new_session=True)
        out, rc = p.stdout.decode(errors="replace"), p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace"), "hang"
    took = time.monotonic() - start
    log.write("\n==== n=%d %s %s\n$ %s\n%s" % (n, script, spec.get("variant", ""),
                                             " ".join(cmd), out))
    log.flush()
    if rc == "hang":
        return "failed", "no end within %d s" % (timeout + 30), took
    expect = spec.get("expect")
    if rc != 0:
        # The exception that ended a worker (not the launcher's lines about it).
        errors = [line for line in out.splitlines()
                  if re.search(r"\w(Error|Exception)\b: ", line) and "uncaught" not in line]
        tail = (errors or out.strip().splitlines() or [""])[-1]
        return "failed", "exit %s: %s" % (rc, tail.strip()[:240]), took
    if expect and not re.search(expect % {"n": n}, out):
        return "failed", "exit 0 but no line matching %r" % (expect % {"n": n}), took
    return "passed", "", took


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="a fetched bytedance/byteps checkout")
    ap.add_argument("-n", type=int, nargs="+", default=[2, 3], help="worker counts")
    ap.add_argument("-s", "--servers", type=int, default=2)
    ap.add_argument("-k", help="only scripts whose path contains this")
    ap.add_argument("--mnist", help="a directory holding MNIST/raw/ for train_mnist_byteps.py "
                    "(default: random data in MNIST's format, made in the temp directory)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds a job may take")
    ap.add_argument("--json", help="write every outcome here")
    ap.add_argument("--log", help="the jobs' output (default: a file in the temp directory)")
    args = ap.parse_args()

    checkout = os.path.abspath(args.checkout)
    if not os.path.isdir(checkout):
        sys.exit("run_tests: %s is not a directory" % checkout)
    # This checkout's launcher (which puts this checkout's python/ first on the workers' path)
    # with the binaries of $GRADLINK_BUILD_DIR, else of build/.
    bin_dir = os.path.join(os.environ.get("GRADLINK_BUILD_DIR", os.path.join(REPO, "build")),
                           "bin")
    if not os.access(os.path.join(bin_dir, "gradlink-scheduler"), os.X_OK):
        sys.exit("run_tests: no gradlink-scheduler in %s (make build)" % bin_dir)
    run = [sys.executable, os.path.join(REPO, "tools", "gradlink-run"), "--bin-dir", bin_dir]
    work = tempfile.mkdtemp(prefix="gradlink-byteps-")
    log_path = args.log or os.path.join(work, "jobs.log")
    log = open(log_path, "w")
    scripts = scripts_of(checkout)
    if args.k:
        scripts = [s for s in scripts if args.k in s]
    if not scripts:
        sys.exit("run_tests: no script importing byteps.torch under %s" % checkout)
    report, bad = {}, 0
    for n in args.n:
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for rel in scripts:
            specs = CATALOGUE.get(rel, [{"skip": "not in the runner's catalogue, which has "
                                                 "every CPU-capable script it knows: this one "
                                                 "uses CUDA or names of an unreleased branch"}])
            for spec in specs:
                label = rel + (" [%s]" % spec["variant"] if "variant" in spec else "")
                outcome, reason, took = "skipped", spec.get("skip", ""), 0.0
                missing = importable(spec.get("needs", [])) if not reason else []
                if missing:
                    reason = "needs %s (Debian: python3-%s)" % (", ".join(missing), missing[0])
                jobdir = os.path.join(work, "n%d" % n, re.sub(r"\W", "_", label))
                if not reason and spec.get("data") == "mnist":
                    mnist = os.path.abspath(args.mnist) if args.mnist else \
                        os.path.join(work, "mnist")
                    if not args.mnist and not os.path.isdir(mnist):
                        synthetic_mnist(mnist)
                    os.makedirs(jobdir, exist_ok=True)
                    for r in range(n):  # the script reads data-<rank>/
                        os.symlink(mnist, os.path.join(jobdir, "data-%d" % r))
                    label += "" if args.mnist else " [synthetic MNIST]"
                if not reason:
                    os.makedirs(jobdir, exist_ok=True)
                    script = os.path.join(jobdir, os.path.basename(rel))
                    changed, applied = rewrite(os.path.join(checkout, rel), script,
                                               spec.get("torch_fixes", ()))
                    if changed == 0:
                        outcome, reason = "failed", "no byteps.torch import line to change"
                    else:
                        outcome, reason, took = run_job(run, n, args.servers, jobdir, script,
                                                        spec, args.timeout, log)
                        if applied:
                            reason = ("(also: %s) " % "; ".join(applied) + reason).strip()
                counts[outcome] += 1
                print("  n=%d %-62s %-7s %5.1fs %s" % (n, label, outcome, took, reason),
                      flush=True)
                report["%d:%s" % (n, label)] = {"outcome": outcome, "reason": reason,
                                                "seconds": round(took, 1)}
        bad += counts["failed"]
        print("n=%d: %d passed, %d failed, %d skipped" % (
            n, counts["passed"], counts["failed"], counts["skipped"]), flush=True)
    log.close()
    print("job output: %s" % log_path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
