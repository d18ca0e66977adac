#!/usr/bin/env python3
"""bench/ab_builds.py: two builds of gradlink side by side, alternating, on the same machine.

    bench/ab_builds.py --before DIR --after DIR [--repeats 5] [--sizes 4K,1M,16M]
                       [--netcluster] [--nc-sizes 16M,64M] [-n 4] [-k 4]

DIR is a build's bin/ folder (gradlink-bench, gradlink-scheduler, gradlink-server). Each repeat
runs the same job from the `before` build, then from the `after` build (the order flips every
repeat, so drift hits both alike), and the table gives, per job and size, each build's median,
min and max of the mean operation time (rank 0's table; every element checked by
gradlink-bench) and after/before as a speed ratio of the medians (> 1: `after` is faster).

Jobs:
  one host, defaults    gradlink-bench -w 2 -s 2 with no flags (what a user gets: the same-host
                        path, bench/compare's gradlink-default)
  one host, servers     the same with --local-arena 0 (the servers' path over UCX, as
                        bench/compare's gradlink-tcp-2s)
  netcluster ps         (--netcluster; needs root) n worker hosts and k server hosts as network
                        namespaces on 1 Gbit/s tbf links (bench/netcluster.py's Cluster and
                        run_gradlink, set up once for both builds)
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = re.compile(r"^\s*(\d+)\s+\d+\s+\w+\s+([\d.]+)\s+([\d.]+)\s")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def bench_rows(text):
    """{size: mean_us} from gradlink-bench's table."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            rows[int(m.group(1))] = float(m.group(2))
    return rows


def one_host(bin_dir, size, extra, iters):
    argv = [os.path.join(bin_dir, "gradlink-bench"), "-w", "2", "-s", "2", "-b", str(size),
            "-e", str(size), "-n", str(iters), "--warmup", "3"] + extra
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    rows = bench_rows(p.stdout)
    if p.returncode != 0 or size not in rows:
        raise RuntimeError("%s failed (%d):\n%s%s" % (" ".join(argv), p.returncode,
                                                    p.stdout[-2000:], p.stderr[-2000:]))
    return rows[size]


def fmt_row(job, size, before, after):
    def cell(v):
        return "%.1f (%.1f-%.1f)" % (statistics.median(v), min(v), max(v))
    ratio = statistics.median(before) / statistics.median(after)
    return "| %s | %s | %s | %s | %.3f |" % (job, human(size), cell(before), cell(after), ratio)


def human(n):
    for unit, f in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= f and n % f == 0:
            return "%d%s" % (n // f, unit)
    return str(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", required=True, help="the first build's bin/")
    ap.add_argument("--after", required=True, help="the second build's bin/")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="4K,1M,16M", help="one-host sizes")
    ap.add_argument("--iters", type=int, default=50, help="one-host timed iterations per run")
    ap.add_argument("--netcluster", action="store_true", help="also the netcluster ps job (root)")
    ap.add_argument("--nc-sizes", default="16M,64M")
    ap.add_argument("-n", "--workers", type=int, default=4)
    ap.add_argument("-k", "--servers", type=int, default=4)
    ap.add_argument("--skip-one-host", action="store_true")
    ap.add_argument("--jobs", default="defaults,servers", help="one-host jobs to run")
    a = ap.parse_args()
    builds = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    times = {}  # (job, size, build) -> [mean_us]

    def order(r):
        return ("before", "after") if r % 2 == 0 else ("after", "before")

    if not a.skip_one_host:
        jobs = [(name, extra) for name, extra in
                (("one host, defaults", []), ("one host, servers", ["--local-arena", "0"]))
                if name.split(", ")[1] in a.jobs.split(",")]
        for r in range(a.repeats):
            for job, extra in jobs:
                for size in map(parse_size, a.sizes.split(",")):
                    iters = a.iters if size <= (1 << 20) else max(5, a.iters // 5)
                    for b in order(r):
                        times.setdefault((job, size, b), []).append(
                            one_host(builds[b], size, extra, iters))
            print("repeat %d/%d one-host done" % (r + 1, a.repeats), flush=True)
    if a.netcluster:
        sys.path.insert(0, HERE)
        import netcluster as nc
        sizes = [parse_size(s) for s in a.nc_sizes.split(",")]
        rate = nc.parse_rate("1gbit")
        with nc.Cluster(a.workers + a.servers, rate, log=lambda m: print(m, flush=True)) as cl:
            workers = list(range(a.workers))
            servers = [(a.workers + i, None) for i in range(a.servers)]
            for r in range(a.repeats):
                for b in order(r):
                    for size in sizes:
                        rows = nc.run_gradlink(cl, builds[b], workers, servers, [size], 5, 1)
                        times.setdefault(("netcluster ps n=%d k=%d" % (a.workers, a.servers),
                                          size, b), []).append(rows[size][0])
                print("repeat %d/%d netcluster done" % (r + 1, a.repeats), flush=True)
    print()
    print("Mean time per operation, us: median (min-max) over %d alternating repeats; "
          "ratio = before/after of the medians (> 1: after is faster)" % a.repeats)
    print()
    print("| job | size | before | after | speed ratio |")
    print("| --- | --- | --- | --- | --- |")
    seen = []
    for (job, size, b) in times:
        if (job, size) not in seen:
            seen.append((job, size))
    for job, size in seen:
        print(fmt_row(job, size, times[(job, size, "before")], times[(job, size, "after")]))


if __name__ == "__main__":
    main()
