#!/usr/bin/python3
"""Failover's cost to training: a server killed (or hung) mid-run, and the rounds around it.

A local job on loopback: gradlink-scheduler, SERVERS gradlink-server processes and WORKERS
gl_fault_worker processes through the servers (--local-arena 0), every option at gradlink's
default, each looping push_pull of one TENSOR-byte fp32 tensor and checking every element of
every round. At round KILL_AT one server gets SIGKILL (or SIGSTOP; it is resumed at the end).
From each worker's ROUNDOK times (CLOCK_MONOTONIC): the round time before the loss (median of
the rounds before it), the hiccup (the longest round from the loss on, minus that median), and
the round time after (median of the last half), against the bound for one server fewer: when
the servers' links bound a round, after / before <= SERVERS / (SERVERS - 1). With --standby a
standby server (gradlink-server --standby) joins too and takes over the lost server's
partitions: the bound after is then the one before, SERVERS servers. With --victim scheduler
the scheduler gets SIGKILL instead and is started again on its port --restart-delay s later
(scheduler restart): the members rejoin it and the rounds go on; the bound after is the one
before.

Usage: bench/failover.py [--build build] [--servers 3] [--workers 3] [--tensor 32M]
                         [--rounds 60] [--kill-at 20] [--signal KILL|STOP] [--repeats 3]
                         [--standby] [--victim server|scheduler] [--restart-delay 0.3]
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import parse_size  # noqa: E402


def run_once(a, bin_dir, worker_exe, tmp, sig):
    job = "bench-failover-%d" % os.getpid()
    procs = []

    def spawn(name, argv):
        out = open(os.path.join(tmp, name + ".out"), "w")
        err = open(os.path.join(tmp, name + ".err"), "w")
        p = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True)
        procs.append(p)
        return p, out.name, err.name

    def scheduler_argv(port):
        return [os.path.join(bin_dir, "gradlink-scheduler"), "--port", str(port), "-w",
                str(a.workers), "-s", str(a.servers), "--job", job]

    try:
        sched, sched_out, sched_err = spawn("scheduler", scheduler_argv(0))
        for _ in range(500):
            m = re.search(r"listening on (\S+)", open(sched_out).read())
            if m:
                break
            time.sleep(0.01)
        else:
            sys.exit("the scheduler did not start")
        servers = [spawn("server%d" % i, [os.path.join(bin_dir, "gradlink-server"), "--scheduler",
                                           m.group(1), "--job", job])[0]
                   for i in range(a.servers)]
        if a.standby:
            spawn("standby", [os.path.join(bin_dir, "gradlink-server"), "--scheduler",
                              m.group(1), "--job", job, "--standby"])
        workers = [spawn("worker%d" % r, [
            worker_exe, "--scheduler", m.group(1), "--job", job, "--rank", str(r),
            "--phase", "push", "--sizes", str(a.tensor), "--rounds", str(a.rounds),
            "--local-arena", "0", "--partition-bytes", "0", "--max-in-flight", "0",
            "--wait-s", "60"]) for r in range(a.workers)]
        victim = sched if a.victim == "scheduler" else servers[-1]
        out0 = workers[0][1]
        t_kill = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            text = open(out0).read()
            if t_kill is None and re.search(r"^ROUNDOK %d " % (a.kill_at - 1), text, re.M):
                t_kill = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL if sig == "KILL" else signal.SIGSTOP)
                if a.victim == "scheduler":
                    time.sleep(a.restart_delay)
                    sched, _, sched_err = spawn("scheduler-2", scheduler_argv(
                        m.group(1).rsplit(":", 1)[1]))
            if all(p.poll() is not None for p, _, _ in workers):
                break
            time.sleep(0.002)
        if sig == "STOP":
            os.kill(victim.pid, signal.SIGCONT)
        for p, out, _ in workers:
            if p.wait(timeout=60) != 0:
                sys.exit("worker failed (%s): %s" % (p.returncode, open(out).read()[-2000:]))
        moved = re.search(r"(\d+) partitions of (\d+) key", open(sched_err).read())
        if a.victim == "scheduler":
            sched.wait(timeout=30)
            resumed = re.search(r"resumed after a restart .* in (\d+) ms", open(sched_err).read())
            if sched.returncode != 0 or not resumed:
                sys.exit("the restarted scheduler did not resume the job (exit %s): %s" % (
                    sched.returncode, open(sched_err).read()[-2000:]))
            moved = None  # nothing moves
        rounds = []
        for _, out, _ in workers:
            times = [float(l.split()[2]) for l in open(out) if l.startswith("ROUNDOK ")]
            rounds.append([b - a_ for a_, b in zip(times, times[1:])])  # round k+1's time
        # A round's time on the job: the slowest worker's.
        per_round = [max(r[k] for r in rounds) for k in range(len(rounds[0]))]
        before = statistics.median(per_round[1:a.kill_at - 1])
        around = per_round[a.kill_at - 1:a.kill_at + 5]
        after = statistics.median(per_round[len(per_round) // 2:])
        return before, max(around) - before, after, (moved.group(1) if moved else
                                                "0" if a.victim == "scheduler" else "?")
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--tensor", default="32M")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=20)
    ap.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--standby", action="store_true", help="a standby server takes over")
    ap.add_argument("--victim", choices=("server", "scheduler"), default="server")
    ap.add_argument("--restart-delay", type=float, default=0.3,
                    help="--victim scheduler: seconds before it is started again")
    a = ap.parse_args()
    a.tensor = parse_size(a.tensor)
    bin_dir = os.path.join(a.build, "bin")
    worker_exe = os.path.join(a.build, "tests", "fault", "gl_fault_worker")
    if a.victim == "scheduler" and a.signal != "KILL":
        sys.exit("--victim scheduler: only SIGKILL (a stopped scheduler holds its port)")
    # Servers carrying the job after the loss.
    left = a.servers if a.standby or a.victim == "scheduler" else a.servers - 1
    bound = a.servers / left
    print("%d workers, %d servers%s (one SIG%s of %s at round %d of %d), one %d-byte fp32 "
          "tensor, defaults; per repeat:" % (
              a.workers, a.servers, " + a standby" if a.standby else "", a.signal,
              "the scheduler, restarted %.1f s later" % a.restart_delay
              if a.victim == "scheduler" else "a server", a.kill_at, a.rounds, a.tensor))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            before, hiccup, after, moved = run_once(a, bin_dir, worker_exe, tmp, a.signal)
            rows.append((before, hiccup, after))
            print("  round before %.1f ms, hiccup +%.0f ms, round after %.1f ms (after/before "
                  "%.2f; bound for %d servers %.2f); %s partitions moved" % (
                      before * 1e3, hiccup * 1e3, after * 1e3, after / before, left,
                      bound, moved))
    col = list(zip(*rows))

    def mmm(xs, scale=1e3, fmt="%.1f"):
        return " / ".join(fmt % (x * scale) for x in (min(xs), statistics.median(xs), max(xs)))
    print("min / median / max over %d repeats: round before %s ms, hiccup %s ms, round after "
          "%s ms, after/before %s" % (a.repeats, mmm(col[0]), mmm(col[1], fmt="%.0f"),
                                      mmm(col[2]),
                                      mmm([r[2] / r[0] for r in rows], 1, "%.2f")))


if __name__ == "__main__":
    main()
