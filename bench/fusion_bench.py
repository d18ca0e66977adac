#!/usr/bin/env python3
"""Tensor fusion and the stage breakdown, measured with gradlink-bench (local jobs).

1. 1,000 tensors of 4 KiB in one group (fused, and --no-fusion) against one tensor of the same
   4,096,000 bytes; the configurations run interleaved, `--repeats` times, so that noise hits
   them alike; min/median/max over the repeats of each run's mean time per round and of its
   fastest round (less sensitive to other processes on a shared machine), and of the
   fused/single ratios.
2. Where the fusion threshold pays: 4 MiB as T tensors of 16 KiB .. 1 MiB, fused and not.
3. gradlink-bench --verbose at 4 KiB and 4 MiB (one tensor) and for the fused group.

Prints markdown (bench/RESULTS.md holds a run). Every element is checked by
gradlink-bench itself (a wrong value fails the run).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

ROW = re.compile(r"\s*(\d+)\s+(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*$")


def run(args, bin_dir, base):
    cmd = [os.path.join(bin_dir, "gradlink-bench")] + base + args
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit("gradlink-bench failed (%d): %s\n%s%s" % (out.returncode, " ".join(cmd),
                                                           out.stdout, out.stderr))
    rows, copies, stages = [], [], []
    for line in out.stdout.splitlines():
        m = ROW.match(line)
        if m:
            if m.group(8) != "OK":
                sys.exit("wrong values: " + line)
            rows.append((int(m.group(1)), float(m.group(4)), float(m.group(5))))
        elif line.startswith("# bytes copied per byte reduced:"):
            copies.append(line[2:].strip())
        elif line.startswith("# stages(us)"):
            stages.append(line[2:].strip())
    return rows, copies, stages


def mmm(xs, fmt="%.0f"):
    return "%s / %s / %s" % (fmt % min(xs), fmt % statistics.median(xs), fmt % max(xs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-w", default="2")
    ap.add_argument("-s", default="1")
    ap.add_argument("-n", default="20")
    a = ap.parse_args()
    base = ["-w", a.w, "-s", a.s, "-n", a.n, "--warmup", "3"]

    print("## 1,000 x 4 KiB vs 1 x 4,096,000 B (%s workers, %s servers, %s iterations, %d "
          "repeats)\n" % (a.w, a.s, a.n, a.repeats))
    configs = [("1 tensor of 4,096,000 B", ["--tensors", "1"]),
               ("1,000 x 4 KiB, fused (one group)", ["--tensors", "1000"]),
               ("1,000 x 4 KiB, not fused (--no-fusion)", ["--tensors", "1000", "--no-fusion"])]
    times = {name: [] for name, _ in configs}
    fastest = {name: [] for name, _ in configs}
    copies = {}
    for _ in range(a.repeats):
        for name, extra in configs:
            rows, cp, _ = run(["-b", "4000K", "-e", "4000K"] + extra, a.bin, base)
            times[name].append(rows[0][1])
            fastest[name].append(rows[0][2])
            copies[name] = cp[0]
    print("| configuration | mean round, us | fastest round, us | copies |")
    print("| --- | --- | --- | --- |")
    for name, _ in configs:
        print("| %s | %s | %s | %s |" % (name, mmm(times[name]), mmm(fastest[name]),
                                         copies[name]))
    print("\n(min / median / max over the repeats)\n")
    for label, i in (("fused / single", 1), ("not fused / single", 2)):
        r = [x / y for x, y in zip(times[configs[i][0]], times[configs[0][0]])]
        rf = [x / y for x, y in zip(fastest[configs[i][0]], fastest[configs[0][0]])]
        print("- %s: mean rounds %s, fastest rounds %s" % (label, mmm(r, "%.2f"),
                                                            mmm(rf, "%.2f")))
    print("")

    print("## Where fusion pays: 4 MiB as T tensors of X bytes (median of %d)\n" % a.repeats)
    print("| X | T | fused, us (mean / fastest) | not fused, us (mean / fastest) | "
          "not fused / fused (mean / fastest) |")
    print("| --- | --- | --- | --- | --- |")
    for x in (16 << 10, 64 << 10, 256 << 10, 1 << 20):
        tcount = (4 << 20) // x
        f, nf = [], []
        for _ in range(a.repeats):
            common = ["-b", "4M", "-e", "4M", "--tensors", str(tcount),
                      "--fusion-threshold", str(8 << 20)]
            f.append(run(common, a.bin, base)[0][0][1:])
            nf.append(run(common + ["--no-fusion"], a.bin, base)[0][0][1:])
        fm, nm = [statistics.median(v[0] for v in f), statistics.median(v[1] for v in f)], \
            [statistics.median(v[0] for v in nf), statistics.median(v[1] for v in nf)]
        print("| %d KiB | %d | %.0f / %.0f | %.0f / %.0f | %.2f / %.2f |"
              % (x >> 10, tcount, fm[0], fm[1], nm[0], nm[1], nm[0] / fm[0], nm[1] / fm[1]))

    print("\n## Stage breakdown (--verbose, rank 0, mean of %s iterations)\n" % a.n)
    rows, cp, st = run(["-b", "4K", "-e", "4M", "-f", "1024", "--verbose"], a.bin, base)
    for (size, us, _), c, s in zip(rows, cp, st):
        print("- 1 x %d B: %.1f us; %s; %s" % (size, us, s, c))
    rows, cp, st = run(["-b", "4000K", "-e", "4000K", "--tensors", "1000", "--verbose"], a.bin,
                       base)
    print("- 1,000 x 4 KiB fused: %.1f us; %s; %s" % (rows[0][1], st[0], cp[0]))


if __name__ == "__main__":
    main()
