#!/usr/bin/python3
"""What serving metrics costs: push_pull at 4 KiB and 16 MiB with metrics off everywhere,
against metrics on everywhere (scheduler, 2 servers, 2 workers) and scraped every second,
side by side in one run (the variants alternate, each job a fresh set of processes).

    bench/metrics_overhead.py [--build build] [--repeats 5]

Each job: gradlink-scheduler, 2 gradlink-server and 2 gradlink-bench workers on loopback, the
same-host path off (the servers do the work, as on a network). "on": GRADLINK_METRICS_PORT=0
for every process and a scraper that reads /targets and every member's /metrics each second.
A third variant serves metrics and nobody scrapes them (what the data path's counters cost,
apart from the scrapes). Prints min/median/max of gradlink-bench's mean time per push_pull and
the ratios of medians to "off".
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

SIZES = (("4K", 40000), ("16M", 200))  # about 5 s each: 4 or 5 scrapes of every member


def run_job(build, size, iters, metrics_on, scraped=True):
    env = dict(os.environ, GRADLINK_LOCAL_ARENA_BYTES="0",
               GRADLINK_METRICS_PORT="0" if metrics_on else "off")
    bin_dir = os.path.join(build, "bin")
    sched = subprocess.Popen([os.path.join(bin_dir, "gradlink-scheduler"), "-w", "2", "-s", "2",
                              "--job", "mo"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = sched.stdout.readline()
    addr = re.search(r"listening on (\S+)", line).group(1)
    metrics = None
    if metrics_on:
        while metrics is None:
            m = re.search(r"metrics: http://(\S+)/metrics", sched.stderr.readline())
            metrics = m.group(1) if m else None
    procs = [subprocess.Popen([os.path.join(bin_dir, "gradlink-server"), "--scheduler", addr,
                               "--job", "mo"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(2)]
    workers = [subprocess.Popen([os.path.join(bin_dir, "gradlink-bench"), "--scheduler", addr,
                                 "--job", "mo", "-b", size, "-e", size, "-n", str(iters),
                                 "--warmup", str(max(1, iters // 10))],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True) for _ in range(2)]
    stop = threading.Event()
    scrapes = [0]

    def scrape():
        while not stop.wait(1.0):
            try:
                with urllib.request.urlopen("http://%s/targets" % metrics, timeout=2) as r:
                    groups = json.loads(r.read())
                for g in groups:
                    for t in g["targets"]:
                        with urllib.request.urlopen("http://%s/metrics" % t, timeout=2) as r:
                            r.read()
                        scrapes[0] += 1
            except OSError:
                pass
    scraper = threading.Thread(target=scrape) if metrics_on and scraped else None
    if scraper:
        scraper.start()
    outs = [w.communicate(timeout=600)[0] for w in workers]
    stop.set()
    if scraper:
        scraper.join()
    for p in procs + [sched]:
        p.wait(timeout=30)
    for out in outs:
        for line in out.splitlines():
            m = re.match(r"\s*(\d+)\s+\d+\s+\w+\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\S+)", line)
            if m:
                if m.group(3) != "OK":
                    sys.exit("wrong sums: %s" % line)
                return float(m.group(2)), scrapes[0]
    sys.exit("no gradlink-bench row")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print("# metrics overhead: 2 workers, 2 servers, loopback, %d repeats per variant "
          "(alternating); gradlink-bench mean us per push_pull" % a.repeats)
    print("%6s %26s %26s %26s %7s %7s %8s" % (
        "size", "off: min/median/max", "on, unscraped", "on, scraped 1/s", "ratio", "ratio",
        "scrapes"))
    variants = (("off", False, False), ("on", True, False), ("scraped", True, True))
    for size, iters in SIZES:
        times = {v[0]: [] for v in variants}
        scrapes = 0
        for _ in range(a.repeats):
            for name, on, scraped in variants:
                t, n = run_job(a.build, size, iters, on, scraped)
                times[name].append(t)
                scrapes += n
        fmt = lambda v: "%.1f/%.1f/%.1f" % (min(v), statistics.median(v), max(v))
        med = {k: statistics.median(v) for k, v in times.items()}
        print("%6s %26s %26s %26s %7.3f %7.3f %8d" % (
            size, fmt(times["off"]), fmt(times["on"]), fmt(times["scraped"]),
            med["on"] / med["off"], med["scraped"] / med["off"], scrapes))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
