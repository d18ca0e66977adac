#!/usr/bin/env python3
"""Runs gradlink-bench side by side in several configurations, several times each, and prints
one table of busbw (GB/s) per size: min / median / max over the repeats.

  bench/core_sweep.py --bin build/bin --repeats 3 [-w 2 -s 2 -b 4K -e 64M]

Configurations: UCX default (peer error handling: TCP loopback), UCX with
GRADLINK_UCX_ERROR_MODE=none (shared memory), and single-lane mode. Every run checks every
element; a wrong value fails the sweep.
"""
import argparse
import os
import statistics
import subprocess
import sys

CONFIGS = [
    ("ucx-peer (tcp lo)", {}, []),
    ("ucx-none (shm)", {"GRADLINK_UCX_ERROR_MODE": "none"}, []),
    ("ucx-none single-lane", {"GRADLINK_UCX_ERROR_MODE": "none"}, ["--single-lane"]),
]


def run(bin_dir, args, env_extra):
    env = dict(os.environ, **env_extra)
    out = subprocess.run([os.path.join(bin_dir, "gradlink-bench")] + args, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit("gradlink-bench failed (%d):\n%s%s" % (out.returncode, out.stdout, out.stderr))
    rows = {}
    for line in out.stdout.splitlines():
        f = line.split()
        if len(f) == 8 and f[0].isdigit():
            if f[7] != "OK":
                sys.exit("wrong values: " + line)
            rows[int(f[0])] = (float(f[3]), float(f[6]))  # time us, busbw
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-w", default="2")
    ap.add_argument("-s", default="2")
    ap.add_argument("-b", default="4K")
    ap.add_argument("-e", default="64M")
    ap.add_argument("-n", default="10")
    a = ap.parse_args()
    base = ["-w", a.w, "-s", a.s, "-b", a.b, "-e", a.e, "-f", "4", "-n", a.n]
    results = {}
    for rep in range(a.repeats):
        for name, env, extra in CONFIGS:  # interleaved: noise hits every config alike
            for size, v in run(a.bin, base + extra, env).items():
                results.setdefault((name, size), []).append(v)
    sizes = sorted({s for (_, s) in results})
    print("%d workers, %d servers, fp32 sum, %d repeats (interleaved); busbw GB/s min/median/max;"
          " time = median us" % (int(a.w), int(a.s), a.repeats))
    header = "| size |" + "|".join(" %s " % n for n, _, _ in CONFIGS) + "|"
    print(header)
    print("|" + "---|" * (len(CONFIGS) + 1))
    for size in sizes:
        cells = []
        for name, _, _ in CONFIGS:
            v = results[(name, size)]
            bw = sorted(x[1] for x in v)
            t = statistics.median(x[0] for x in v)
            cells.append(" %.3f / %.3f / %.3f (%.0f us) " % (bw[0], statistics.median(bw), bw[-1], t))
        print("| %s |%s|" % (size, "|".join(cells)))


if __name__ == "__main__":
    main()
