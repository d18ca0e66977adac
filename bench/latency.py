#!/usr/bin/env python3
"""Small-tensor push_pull latency from C++ and from Python, side by side.

    bench/latency.py [--bin build/bin] [--bytes 4096] [--repeats 5] [-n 500] [-s 1]
                     [--paths servers,same-host] [--bind]

Each repeat runs, one after the other (interleaved, so load hits all alike), for each path
(`servers`: through the servers; `same-host`: the same-host path, a 64 MiB arena):
  * C++:    gradlink-bench -w 2 -s S -b BYTES -e BYTES -n N   (its own local job),
  * Python: gradlink-run -n 2 -s S -- python bench/latency.py --worker ... : gradlink.torch
            push_pull(t, average=False) on a float32 torch tensor, N timed calls after warm-up.
--bind pins each worker to one CPU (gradlink-bench --bind, gradlink-run --bind). Both check
every element of every result. Prints min/median/max over the repeats of each run's
mean and fastest call (us), and the Python/C++ ratio.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(a):
    import torch
    import gradlink.torch as gl
    gl.init()
    count = a.bytes // 4
    t = torch.empty(count, dtype=torch.float32)
    base = torch.arange(count, dtype=torch.float32) % 13
    want = base * gl.size() + sum(range(gl.size()))  # the sum over ranks r of (base + r)
    times = []
    for i in range(a.warmup + a.n):
        t.copy_(base).add_(gl.rank())
        t0 = time.perf_counter()
        gl.push_pull(t, average=False, name="latency")
        dt = time.perf_counter() - t0
        if not torch.equal(t, want):
            sys.exit("rank %d: wrong sum at call %d" % (gl.rank(), i))
        if i >= a.warmup:
            times.append(dt)
    if gl.rank() == 0:
        print("PYLAT mean_us=%.2f min_us=%.2f" % (1e6 * statistics.mean(times), 1e6 * min(times)))
    gl.shutdown()


ARENA = 64 << 20  # the same-host path's shared memory


def run_cpp(a, path):
    cmd = [os.path.join(a.bin, "gradlink-bench"), "-w", "2", "-s", str(a.servers), "-b",
           str(a.bytes), "-e", str(a.bytes), "-n", str(a.n), "--warmup", str(a.warmup)]
    # The same-host path is the default on one host; the servers' path is asked for.
    cmd += ["--local-arena", str(ARENA) if path == "same-host" else "0"]
    if a.bind:
        cmd.append("--bind")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        sys.exit("gradlink-bench failed:\n" + out.stdout + out.stderr)
    header = None
    for line in out.stdout.splitlines():
        f = line.split()
        if f and f[0] == "size(B)":
            header = f
        elif header and f and f[0].isdigit():
            row = dict(zip(header, f))
            if row.get("check", f[-1]) != "OK":
                sys.exit("gradlink-bench: wrong values: " + line)
            mean = float(row["time(us)"])
            fastest = float(row["min(us)"]) if "min(us)" in row else mean
            return mean, fastest
    sys.exit("no result row in gradlink-bench output:\n" + out.stdout)


def run_python(a, path):
    py = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.path.exists(py):
        py = "/usr/bin/python3"
    cmd = [os.path.join(a.bin, "gradlink-run"), "-n", "2", "-s", str(a.servers)]
    cmd += ["--bind"] if a.bind else []
    cmd += ["--", py,
           os.path.abspath(__file__), "--worker", "--bytes", str(a.bytes), "-n", str(a.n),
           "--warmup", str(a.warmup)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    env["GRADLINK_LOCAL_ARENA_BYTES"] = str(ARENA) if path == "same-host" else "0"
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if out.returncode != 0:
        sys.exit("python run failed:\n" + out.stdout + out.stderr)
    for line in out.stdout.splitlines():
        if "PYLAT" in line:
            kv = dict(x.split("=") for x in line.split("PYLAT", 1)[1].split())
            return float(kv["mean_us"]), float(kv["min_us"])
    sys.exit("no PYLAT line:\n" + out.stdout + out.stderr)


def mmm(xs, fmt="%.1f"):
    return " / ".join(fmt % v for v in (min(xs), statistics.median(xs), max(xs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-n", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("-s", "--servers", type=int, default=1)
    ap.add_argument("--paths", default="servers,same-host",
                    help="comma-separated: servers, same-host")
    ap.add_argument("--bind", action="store_true", help="pin each worker to one CPU")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    paths = a.paths.split(",")
    if not paths or any(p not in ("servers", "same-host") for p in paths):
        sys.exit("--paths takes servers and/or same-host")
    if a.bytes <= 0 or a.bytes % 4:
        sys.exit("--bytes must be a positive multiple of 4 (float32 elements)")
    if a.worker:
        return worker(a)
    cpp = {p: [] for p in paths}
    py = {p: [] for p in paths}
    for _ in range(a.repeats):
        for p in paths:
            cpp[p].append(run_cpp(a, p))
            py[p].append(run_python(a, p))
    print("push_pull of %d bytes (fp32), 2 workers, %d server(s), %d calls x %d repeats; "
          "min / median / max over repeats (us)" % (a.bytes, a.servers, a.n, a.repeats))
    print("| path | from | mean per call | fastest call |")
    print("|---|---|---|---|")
    for p in paths:
        print("| %s | C++ (gradlink-bench) | %s | %s |"
              % (p, mmm([c[0] for c in cpp[p]]), mmm([c[1] for c in cpp[p]])))
        print("| %s | Python (gradlink.torch.push_pull) | %s | %s |"
              % (p, mmm([x[0] for x in py[p]]), mmm([x[1] for x in py[p]])))
    for p in paths:
        ratio = [x[0] / c[0] for x, c in zip(py[p], cpp[p])]
        print("%s: Python / C++ (mean, per repeat): %s" % (p, mmm(ratio, "%.2f")))


if __name__ == "__main__":
    main()
