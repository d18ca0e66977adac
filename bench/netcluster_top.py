#!/usr/bin/python3
"""gradlink-top on an emulated cluster: a job of 2 worker hosts and 2 server hosts (network
namespaces of bench/netcluster.py, links shaped to --rate) runs gradlink-bench while
gradlink-top --once, started in the scheduler's host, reads its metrics; prints the snapshot.

    sudo bench/netcluster_top.py [--build build] [--rate 1gbit] [--size 16M]
"""

import argparse
import os
import re
import secrets
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netcluster as nc  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--size", default="16M")
    a = ap.parse_args()
    try:
        nc.check_available()
    except nc.Unavailable as e:
        print("skipped: %s" % e)
        return 77
    nc.install_signal_handlers()
    bin_dir = os.path.join(a.build, "bin")
    with nc.Cluster(4, nc.parse_rate(a.rate)) as cl:
        env = nc.gradlink_env(secrets.token_hex(32))
        env["GRADLINK_METRICS_PORT"] = "0"  # the workers too
        sched = cl.spawn(0, "scheduler", [os.path.join(bin_dir, "gradlink-scheduler"), "--host",
                                          cl.ip(0), "--port", "0", "-w", "2", "-s", "2",
                                          "--job", "top"], env)
        addr = cl.wait_for(sched, r"listening on (\S+:\d+)", 15).group(1)
        procs = [sched]
        for host in (2, 3):
            procs.append(cl.spawn(host, "server%d" % host, [
                os.path.join(bin_dir, "gradlink-server"), "--scheduler", addr, "--job", "top"], env))
        for host in (0, 1):
            procs.append(cl.spawn(host, "worker%d" % host, [
                os.path.join(bin_dir, "gradlink-bench"), "--scheduler", addr, "--job", "top",
                "-b", a.size, "-e", a.size, "-n", "60", "--warmup", "2"], env))
        metrics = None
        end = time.monotonic() + 20
        while metrics is None and time.monotonic() < end:
            m = re.search(r"scheduler: metrics: http://(\S+)/metrics", sched.err())
            metrics = m.group(1) if m else None
            time.sleep(0.1)
        time.sleep(4)  # into the timed iterations
        top = cl.spawn(0, "gradlink-top", [os.path.join(ROOT, "tools", "gradlink-top"), "--once",
                                           metrics], {})
        cl.wait_all([top], 30, "gradlink-top")
        print("# gradlink-top --once on a netcluster job: 2 worker hosts, 2 server hosts, "
              "links %s, push_pull of %s" % (a.rate, a.size))
        print(top.out())
        cl.wait_all(procs, 300, "gradlink job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
