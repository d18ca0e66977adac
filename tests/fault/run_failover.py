#!/usr/bin/python3
"""Failover trials of gradlink: kill or hang one server of a running job; the job goes on.

Each trial starts real processes on loopback (run_fault.py's harness): gradlink-scheduler with
its defaults (failover on), SERVERS gradlink-server processes (2 to 4, drawn) and WORKERS
gl_fault_worker processes through the servers, each running ROUNDS rounds of
push_pull and checking every element of every round exactly (fp32 sums of small integers, so
a wrong or repeated round shows). Once the job is in the trial's phase, one server gets SIGKILL
or SIGSTOP, and the trial requires:

  * every worker completes all ROUNDS rounds, every element right (DONE, exit 0): no round is
    lost, repeated or wrong;
  * the surviving servers and the scheduler exit 0 once the workers are done;
  * a SIGSTOPped server, resumed once the others have gone on without it, is fenced: it exits
    by itself (it has lost the scheduler) and the sums stay exact; it must not crash;
  * recovery (signal -> every worker has completed the first round it issued after the
    signal) within KILL_BOUND s of a SIGKILL, STOP_BOUND s of a SIGSTOP (the scheduler's
    silence limit is 3 s). A round issued after the signal needs the servers left, so this is
    the failover plus one whole round (0.1-0.3 s here for the small tensors, 0.6-0.9 s for the
    first 32 MiB round of the declaration phase with 2 servers: one left).

Paths: half the trials run the workers on this host with the same-host path off
(--local-arena 0), every key flat; the other half on two emulated hosts (--host: workers 0 and 1
on one, worker 2 on the other), where every key is summed per host first (hierarchical
aggregation, checked from each worker's HIERARCHY line) and moves as host partials.

Every fourth trial (#1, #5, ...) also starts a standby server (gradlink-server --standby): it
must take over all of the victim's partitions (the scheduler says "all to standby"), and exit 0
with the others.

Phases: declare (the signal lands while the workers declare their tensors and the scheduler
plans them, right after they joined), push (mid-transfer of 4 MiB and 32 MiB tensors, round
>= 2), pull (one worker sleeps before issuing each round: the others wait for their pulls),
barrier (the same sleep before the barrier: the data path is idle, between rounds).

Restarts (the `restarts` case): the same job, but the scheduler gets SIGKILL in the trial's
phase and is started again on its port RESTART_DELAY s later, as gradlink-run
--restart-scheduler or a supervisor does. The members keep the data path running and rejoin it
(scheduler/restart.cc); the trial requires every round exact, every process but the killed
scheduler to exit 0 (the restarted one included), and reports the time from the restart to the
moment every worker has completed a round issued after it (the issue's target: 5 s).

Joins (the `joins` case): a new gradlink-server (no --standby) joins the running job in the
trial's phase and takes its share (scheduler: "took its share of the running job: N partitions
... moved to it"); in every other trial one of the first servers is then SIGKILLed as well. Every
round exact, every process not killed exits 0, and partitions moved (but in the declare phase,
where the keys may not be planned yet).

Usage: run_failover.py --bin-dir DIR --fault-worker EXE [--budget S] [--seed N] [--trials N]
                       [--slice A:B] [--results FILE] trials|restarts|joins
       run_failover.py summary --merge FILE...
"""

import argparse
import itertools
import json
import os
import random
import re
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_fault  # noqa: E402  (the harness: processes, logs, deadlines)
from run_fault import Failure, Harness  # noqa: E402

WORKERS = 3
ROUNDS = 7
KILL_BOUND, STOP_BOUND = 2.0, 5.0   # the targets: 2 s; the silence limit + 2 s
EXIT_GRACE = 8.0                    # after the last round, for every process to exit
STRAGGLE_MS = 300
PHASES = ("declare", "push", "pull", "barrier")
SIGNALS = ("KILL", "STOP")
SMALL, LARGE = "1024,4194304", "1024,4194304,33554432"
RESTART_DELAY, RESTART_BOUND = 0.3, 5.0


class Trial:
    def __init__(self, index, phase, sig, servers):
        self.index, self.phase, self.sig, self.servers = index, phase, sig, servers
        self.victim = 0
        self.straggler = None
        self.offset = 0.0
        self.standby = index % 4 == 1
        # Half the trials split the workers over two emulated hosts (GRADLINK_HOST: workers 0
        # and 1 on one, 2 on the other): their keys are summed per host first, the default on
        # such a job, and move as host partials. Standby trials take both paths in turn.
        self.path = ("servers", "hierarchical")[(index + index // 4) % 2]

    def label(self):
        victim = "the scheduler" if self.victim < 0 else "server %d" % self.victim
        return "#%02d SIG%-4s %-8s %-12s %s, %d servers%s" % (
            self.index, self.sig, self.phase, self.path, victim, self.servers,
            " +standby" if self.standby else "")


def plan(seed, n):
    rng = random.Random(seed)
    combos = list(itertools.product(PHASES, SIGNALS))
    reps, extra = divmod(n, len(combos))
    kinds = combos * reps + rng.sample(combos, extra)
    rng.shuffle(kinds)
    trials = []
    for i, (phase, sig) in enumerate(kinds):
        t = Trial(i, phase, sig, servers=2 + i % 3)
        t.victim = rng.randrange(t.servers)
        if phase in ("pull", "barrier"):
            t.straggler = rng.randrange(WORKERS)
            t.offset = rng.uniform(0.05, 0.2)
        elif phase == "push":
            t.offset = rng.uniform(0.0, 0.15)
        trials.append(t)
    return trials


def first_round_after(p, t_kill):
    """(k, completion time) of the first round this worker issued after the signal, once it
    has completed: one whole round through the servers left (a round in flight at the signal
    may have needed nothing more of the victim)."""
    issued = [int(l.split()[0]) for l in p.lines("ROUND") if float(l.split()[1]) > t_kill]
    if not issued:
        done = p.lines("DONE")
        return (ROUNDS, float(done[0].split()[1])) if done else None
    for line in p.lines("ROUNDOK"):
        k, ts = line.split()
        if int(k) == issued[0]:
            return int(k), float(ts)
    return None


def run_trial(h, t, results):
    t0 = time.monotonic()
    procs = []
    problems = []
    try:
        job = Job(h, t, "f", "failover-%d" % t.index, procs)
        sched, servers, workers = job.sched, job.servers, job.workers
        victim = servers[t.victim]
        survivors = [p for p in procs if p is not victim]
        note = wait_for_phase(h, t, workers, procs)
        t_kill = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL if t.sig == "KILL" else signal.SIGSTOP)
        recovery = job.recovery(h, t_kill, "signal", KILL_BOUND if t.sig == "KILL" else STOP_BOUND,
                                problems)
        if t.sig == "STOP":
            os.kill(victim.pid, signal.SIGCONT)  # back, replaced: it must be fenced
        job.check(survivors + [victim], [sched] + [s for s in servers if s is not victim],
                  problems)
        if t.sig == "STOP":
            rc = victim.poll()
            if rc is None:
                problems.append("%s still running after it was resumed" % victim.name)
            elif rc < 0 and rc != -signal.SIGKILL:
                problems.append("%s crashed after it was resumed (signal %d)" % (victim.name,
                                                                                 -rc))
        moved = re.findall(r"(\d+) partitions of (\d+) key", sched.err())
        if t.standby and moved and "all to standby server %d" % t.servers not in sched.err():
            problems.append("the standby did not take over the victim's partitions")
        verdict = "ok" if not problems else "FAIL"
        results.append({"trial": t.index, "phase": t.phase, "signal": t.sig,
                        "path": t.path,
                        "servers": t.servers, "recovery": recovery, "verdict": verdict,
                        "problems": problems, "note": note,
                        "moved": moved[0][0] if moved else None})
        print("%-4s %s  recovery %s  moved %s partitions  [%s]" % (
            verdict, t.label(), "%.3f s" % recovery if recovery is not None else "-",
            moved[0][0] if moved else "?", note))
        for x in problems:
            print("      problem: %s" % x[:400])
        sys.stdout.flush()
        if problems:
            raise Failure("%d problem(s)" % len(problems))
    except Failure:
        h.dump_logs(procs)
        raise
    finally:
        for p in procs:
            h.kill(p)
        if results and results[-1]["trial"] == t.index:
            results[-1]["seconds"] = round(time.monotonic() - t0, 2)


def scheduler_argv(h, job, servers, port):
    return [os.path.join(h.bin_dir, "gradlink-scheduler"), "--port", str(port),
            "-w", str(WORKERS), "-s", str(servers), "--job", job, "--join-timeout-ms", "30000"]


class Job:
    """One trial's job on loopback, started and in its first rounds: gradlink-scheduler,
    t.servers gradlink-server processes (and a standby when t.standby) and WORKERS fault
    workers, named PREFIX##-...; each process is appended to `procs` as it starts (the trial
    kills them all, whatever happens)."""

    def __init__(self, h, t, prefix, job, procs):
        self.name = job
        self.path = t.path
        self.procs = procs
        self.sched = h.spawn("%s%02d-scheduler" % (prefix, t.index), "scheduler", 0,
                             scheduler_argv(h, job, t.servers, 0))
        self.procs.append(self.sched)
        m = h.wait_for("the scheduler's port",
                       lambda: re.search(r"listening on (\S+):(\d+)", self.sched.out()), 15,
                       [self.sched])
        self.addr, self.port = "%s:%s" % (m.group(1), m.group(2)), int(m.group(2))
        self.server_argv = [os.path.join(h.bin_dir, "gradlink-server"), "--scheduler",
                            self.addr, "--job", job]
        self.servers = []
        for i in range(t.servers):
            self.servers.append(h.spawn("%s%02d-server%d" % (prefix, t.index, i), "server", i,
                                        self.server_argv))
            self.procs.append(self.servers[-1])
        if t.standby:
            self.servers.append(h.spawn("%s%02d-standby" % (prefix, t.index), "server",
                                        t.servers, self.server_argv + ["--standby"]))
            self.procs.append(self.servers[-1])
        h.wait_for("the servers to connect",
                   lambda: run_fault.established_to(self.port) >= len(self.servers), 10,
                   self.procs)
        self.workers = []
        for r in range(WORKERS):
            argv = [h.worker_exe, "--scheduler", self.addr, "--job", job, "--rank", str(r),
                    "--phase", "push" if t.phase == "declare" else t.phase,
                    "--sizes", LARGE if t.phase in ("push", "declare") else SMALL,
                    "--rounds", str(ROUNDS), "--wait-s", "30"]
            if t.path == "hierarchical":
                argv += ["--host", "fault-host-%s" % ("a" if r < 2 else "b")]
            else:
                argv += ["--local-arena", "0"]
            if r == t.straggler:
                argv += ["--straggle-ms", str(STRAGGLE_MS)]
            self.workers.append(h.spawn("%s%02d-worker%d" % (prefix, t.index, r), "worker", r,
                                        argv))
            self.procs.append(self.workers[-1])

    def recovery(self, h, since, what, bound, problems):
        """Seconds from `since` until every worker has completed the first round it issued
        after it (None, with a problem, if that took past bound + 10 s)."""
        try:
            after = h.wait_for("a round issued after the %s to complete on every worker" % what,
                               lambda: all(first_round_after(p, since) for p in self.workers)
                               and [first_round_after(p, since) for p in self.workers],
                               bound + 10, [])
        except Failure as e:
            problems.append(str(e))
            return None
        took = round(max(ts for _, ts in after) - since, 4)
        if took > bound:
            problems.append("recovery took %.3f s (bound %.1f s)" % (took, bound))
        return took

    def check(self, survivors, must_exit_zero, problems):
        """Waits (30 s + EXIT_GRACE) for `survivors` to end; every worker must have done every
        round right (DONE, exit 0) on the trial's path (hierarchical aggregation on or off), and
        every process of `must_exit_zero` exited 0."""
        end = time.monotonic() + 30 + EXIT_GRACE
        while time.monotonic() < end and any(p.poll() is None for p in survivors):
            time.sleep(0.01)
        for p in self.workers:
            rc = p.poll()
            wrong = p.lines("WRONG")
            if wrong:
                problems.append("%s: wrong element: %s" % (p.name, wrong[0]))
            if rc != 0:
                failed = p.lines("FAILED")
                problems.append("%s exited with %s%s" % (p.name, rc, ": " + failed[0][:300]
                                                         if failed else ""))
            elif not p.lines("DONE"):
                problems.append("%s exited 0 without DONE" % p.name)
            hierarchy = p.lines("HIERARCHY")
            on = bool(hierarchy) and hierarchy[0] != "off"
            if hierarchy and on != (self.path == "hierarchical"):
                problems.append("%s: hierarchical aggregation %s on the %s path" % (
                    p.name, hierarchy[0], self.path))
        for p in must_exit_zero:
            rc = p.poll()
            if rc != 0:
                problems.append("%s exited with %s (expected 0): %s" % (
                    p.name, rc, p.err().strip().splitlines()[-1:] or ""))


def run_restart_trial(h, t, results):
    """The scheduler is SIGKILLed in t.phase and started again on its port: the job goes on."""
    t0 = time.monotonic()
    procs = []
    problems = []
    try:
        job = Job(h, t, "r", "restart-%d" % t.index, procs)
        servers, workers = job.servers, job.workers
        note = wait_for_phase(h, t, workers, procs)
        old = job.sched
        os.kill(old.pid, signal.SIGKILL)
        time.sleep(RESTART_DELAY)
        t_restart = time.monotonic()
        sched = h.spawn("r%02d-scheduler-2" % t.index, "scheduler", 1,
                        scheduler_argv(h, job.name, t.servers, job.port))
        procs.append(sched)
        recovery = job.recovery(h, t_restart, "restart", RESTART_BOUND, problems)
        job.check([p for p in procs if p is not old], [sched] + servers, problems)
        resumed = re.search(r"resumed after a restart with .* in (\d+) ms", sched.err())
        if not resumed:
            problems.append("the restarted scheduler did not say it resumed the job")
        verdict = "ok" if not problems else "FAIL"
        results.append({"trial": t.index, "phase": t.phase, "signal": "KILL-scheduler",
                        "path": t.path, "servers": t.servers, "recovery": recovery, "verdict": verdict,
                        "problems": problems, "note": note,
                        "resume_ms": int(resumed.group(1)) if resumed else None})
        print("%-4s %s  restart -> rounds again %s, resumed in %s ms  [%s]" % (
            verdict, t.label(), "%.3f s" % recovery if recovery is not None else "-",
            resumed.group(1) if resumed else "?", note))
        for x in problems:
            print("      problem: %s" % x[:400])
        sys.stdout.flush()
        if problems:
            raise Failure("%d problem(s)" % len(problems))
    except Failure:
        h.dump_logs(procs)
        raise
    finally:
        for p in procs:
            h.kill(p)
        if results and results[-1]["trial"] == t.index:
            results[-1]["seconds"] = round(time.monotonic() - t0, 2)


def run_join_trial(h, t, results):
    """A new server joins the running job in t.phase and takes partitions from the others; with
    t.sig == "KILL", one of the first servers is killed once it has."""
    t0 = time.monotonic()
    procs = []
    problems = []
    try:
        job = Job(h, t, "j", "join-%d" % t.index, procs)
        sched, servers, workers = job.sched, job.servers, job.workers
        note = wait_for_phase(h, t, workers, procs)
        t_join = time.monotonic()
        joiner = h.spawn("j%02d-joiner" % t.index, "server", t.servers, job.server_argv)
        procs.append(joiner)
        share = h.wait_for("the new server to take its share",
                           lambda: re.search(r"took its share of the running job: (\d+) "
                                             r"partitions", sched.err()), 15, procs)
        moved = int(share.group(1))
        if moved == 0 and t.phase != "declare":
            problems.append("no partition moved to the new server")
        victim = None
        if t.sig == "KILL":
            victim = servers[t.victim]
            os.kill(victim.pid, signal.SIGKILL)
        recovery = job.recovery(h, t_join, "join", KILL_BOUND + 10, problems)
        job.check([p for p in procs if p is not victim],
                  [sched, joiner] + [s for s in servers if s is not victim], problems)
        verdict = "ok" if not problems else "FAIL"
        results.append({"trial": t.index, "phase": t.phase,
                        "signal": "join" + ("+KILL" if victim else ""), "path": t.path,
                        "servers": t.servers,
                        "recovery": recovery, "verdict": verdict, "problems": problems,
                        "note": note, "moved": moved})
        print("%-4s #%02d join %-8s %-12s %d servers + 1%s  %d partitions moved, a round after "
              "the join in %s  [%s]" % (verdict, t.index, t.phase, t.path, t.servers,
                                    ", then server %d killed" % t.victim if victim else "",
                                    moved, "%.3f s" % recovery if recovery is not None else "-",
                                    note))
        for x in problems:
            print("      problem: %s" % x[:400])
        sys.stdout.flush()
        if problems:
            raise Failure("%d problem(s)" % len(problems))
    except Failure:
        h.dump_logs(procs)
        raise
    finally:
        for p in procs:
            h.kill(p)
        if results and results[-1]["trial"] == t.index:
            results[-1]["seconds"] = round(time.monotonic() - t0, 2)


NORESTART_RECONNECT_S = 2


def run_norestart_trial(h, results):
    """The scheduler SIGKILLed mid-job and never started again: with GRADLINK_SCHEDULER_RECONNECT
    = NORESTART_RECONNECT_S, every worker fails within that (plus the time to notice) naming the
    scheduler, and every server ends by itself: nothing hangs."""
    job = "norestart"
    env = dict(os.environ, GRADLINK_SCHEDULER_RECONNECT=str(NORESTART_RECONNECT_S))
    sched = h.spawn("n-scheduler", "scheduler", 0, scheduler_argv(h, job, 2, 0))
    procs = [sched]
    problems = []
    try:
        m = h.wait_for("the scheduler's port",
                       lambda: re.search(r"listening on (\S+):(\d+)", sched.out()), 15, [sched])
        addr = "%s:%s" % (m.group(1), m.group(2))
        servers = [h.spawn("n-server%d" % i, "server", i,
                           [os.path.join(h.bin_dir, "gradlink-server"), "--scheduler", addr,
                            "--job", job], env=env) for i in range(2)]
        procs += servers
        workers = [h.spawn("n-worker%d" % r, "worker", r,
                           [h.worker_exe, "--scheduler", addr, "--job", job, "--rank", str(r),
                            "--phase", "push", "--sizes", SMALL, "--rounds", "100000",
                            "--local-arena", "0", "--wait-s", "30"], env=env)
                   for r in range(WORKERS)]
        procs += workers
        h.wait_for("round 2", lambda: all(any(l.startswith("2 ") for l in p.lines("ROUND"))
                                          for p in workers), 20, procs)
        t_kill = time.monotonic()
        os.kill(sched.pid, signal.SIGKILL)
        bound = NORESTART_RECONNECT_S + 3.0
        end = t_kill + bound + EXIT_GRACE
        while time.monotonic() < end and any(p.poll() is None for p in workers + servers):
            time.sleep(0.01)
        for p in workers:
            failed = p.lines("FAILED")
            if not failed:
                problems.append("%s did not fail (exit %s)" % (p.name, p.poll()))
                continue
            at, status = float(failed[0].split()[0]), failed[0].split(None, 1)[1]
            if at - t_kill > bound:
                problems.append("%s failed %.2f s after the kill (bound %.1f s)" % (
                    p.name, at - t_kill, bound))
            if "no scheduler took worker" not in status:
                problems.append("%s's error does not say the scheduler is gone: %s" % (
                    p.name, status[:300]))
        for p in workers + servers:
            if p.poll() is None:
                problems.append("%s still running %.0f s after the kill" % (
                    p.name, time.monotonic() - t_kill))
            elif p.poll() < 0:
                problems.append("%s died of signal %d" % (p.name, -p.poll()))
        verdict = "ok" if not problems else "FAIL"
        results.append({"trial": 99, "phase": "push", "signal": "KILL-scheduler-norestart",
                        "servers": 2, "recovery": None, "verdict": verdict,
                        "problems": problems, "note": "no restart"})
        print("%-4s the scheduler killed and never restarted: every worker failed naming it, "
              "every process ended" % verdict)
        for x in problems:
            print("      problem: %s" % x[:400])
        if problems:
            raise Failure("%d problem(s)" % len(problems))
    except Failure:
        h.dump_logs(procs)
        raise
    finally:
        for p in procs:
            h.kill(p)


def wait_for_phase(h, t, workers, procs):
    if t.phase == "declare":
        h.wait_for("every worker to join", lambda: all(p.lines("JOINED") for p in workers), 20,
                   procs)
        return "the workers joined; declarations and plans in flight"
    if t.phase == "push":
        h.wait_for("round 2", lambda: all(any(l.startswith("2 ") for l in p.lines("ROUND"))
                                          for p in workers), 20, procs)
        time.sleep(t.offset)
        return "round 2 + %.0f ms" % (t.offset * 1000)
    strag = workers[t.straggler]
    mark = "ROUND" if t.phase == "pull" else "BARRIER"

    def straggling():
        for l in strag.lines("STRAGGLE"):
            k, ts = l.split()
            if int(k) >= 2 and not any(x.startswith(k + " ") for x in strag.lines(mark)):
                return int(k), float(ts)
        return None
    k, ts = h.wait_for("the straggler's sleep", straggling, 20, procs)
    time.sleep(max(0.0, ts + t.offset - time.monotonic()))
    return "round %d, straggler asleep %.0f ms, the others in %s" % (
        k, (time.monotonic() - ts) * 1000, "Wait()" if t.phase == "pull" else "Barrier()")


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(results):
    print("\nrecovery: signal -> every worker has completed the first round it issued after it (s)")
    print("%-26s %4s %5s %8s %8s %8s %8s" % ("signal / phase", "n", "ok", "min", "median",
                                            "p99", "max"))
    rows = {}
    for r in results:
        for key in ((r["signal"], "all"), (r["signal"], r["phase"]),
                    (r["signal"], r.get("path", "servers"))):
            rows.setdefault(key, []).append(r)
    for key in sorted(rows):
        rs = rows[key]
        rec = [r["recovery"] for r in rs if r["recovery"] is not None]
        ok = sum(1 for r in rs if r["verdict"] == "ok")
        if rec:
            print("%-26s %4d %5d %8.3f %8.3f %8.3f %8.3f" % (
                " / ".join(key), len(rs), ok, min(rec), statistics.median(rec),
                percentile(rec, 0.99), max(rec)))
        else:
            print("%-26s %4d %5d %8s %8s %8s %8s" % (" / ".join(key), len(rs), ok, "-", "-", "-",
                                                    "-"))
    bad = [r for r in results if r["verdict"] != "ok"]
    print("verdicts: ok %d, FAIL %d" % (len(results) - len(bad), len(bad)))
    for r in bad:
        print("FAIL trial #%02d SIG%s %s (%d servers):" % (r["trial"], r["signal"], r["phase"],
                                                          r["servers"]))
        for x in r["problems"]:
            print("    " + x[:400])


def case_trials(h, args, restarts=False, joins=False):
    trials = plan(args.seed, args.trials)
    a, b = (int(x) for x in args.slice.split(":"))
    trials = trials[a:b]
    if args.only:  # debugging: PHASE,SIGNAL[,SERVERS], repeated over the slice
        kind = args.only.split(",")
        trials = [t for t in trials if (t.phase, t.sig) == (kind[0], kind[1])]
        for t in trials:
            if len(kind) > 2:
                t.servers = int(kind[2])
                t.victim %= t.servers
    print("seed %d, trials %d..%d of %d: %d workers, 2-4 servers, %d rounds; bounds: SIGKILL "
          "%.1f s, SIGSTOP %.1f s, scheduler restart %.1f s" % (
              args.seed, a, b - 1, args.trials, WORKERS, ROUNDS, KILL_BOUND, STOP_BOUND,
              RESTART_BOUND))
    results, failures = [], 0
    if restarts:  # the scheduler is the victim, always SIGKILL (a stopped one holds its port)
        for t in trials:
            t.sig, t.victim = "KILL", -1
    if joins:  # KILL: a server killed after the join; STOP: none
        for t in trials:
            t.standby = False
    for t in trials:
        try:
            run = run_restart_trial if restarts else run_join_trial if joins else run_trial
            run(h, t, results)
        except Failure as e:
            print("FAIL  %s: %s" % (t.label(), e))
            failures += 1
            if not results or results[-1]["trial"] != t.index:
                results.append({"trial": t.index, "phase": t.phase, "signal": t.sig,
                                "servers": t.servers, "recovery": None, "verdict": "FAIL",
                                "problems": [str(e)], "note": ""})
        if args.results:
            with open(args.results, "a") as f:
                f.write(json.dumps(results[-1]) + "\n")
        if h.left() < 25:
            print("FAIL: budget nearly spent after trial #%02d" % t.index)
            failures += 1
            break
    if restarts:
        try:
            run_norestart_trial(h, results)
        except Failure as e:
            print("FAIL  no restart: %s" % e)
            failures += 1
    report(results)
    if failures:
        raise Failure("%d of %d trials failed" % (failures, len(trials)))


def case_summary(_h, args):
    results = []
    for path in args.merge:
        if os.path.exists(path):
            with open(path) as f:
                results += [json.loads(l) for l in f if l.strip()]
    if not results:
        raise Failure("no results in %s" % " ".join(args.merge))
    report(results)
    if any(r["verdict"] != "ok" for r in results):
        raise Failure("failed trials")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir")
    ap.add_argument("--fault-worker")
    ap.add_argument("--budget", type=float, default=300)
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--slice", default="0:1000")
    ap.add_argument("--results")
    ap.add_argument("--only", help="PHASE,SIGNAL[,SERVERS]: only trials of this kind")
    ap.add_argument("--merge", nargs="*", default=[])
    ap.add_argument("case", choices=("trials", "restarts", "joins", "summary"))
    args = ap.parse_args()
    if args.case != "summary" and not (args.bin_dir and args.fault_worker):
        ap.error("--bin-dir and --fault-worker are required")
    # The harness's options that this script does not take.
    args.exit_grace, args.tolerate_known = EXIT_GRACE, False
    h = Harness(args)
    if args.results and args.case != "summary":
        open(args.results, "w").close()
    case = {"trials": case_trials, "summary": case_summary,
            "restarts": lambda h, a: case_trials(h, a, restarts=True),
            "joins": lambda h, a: case_trials(h, a, joins=True)}[args.case]
    return run_fault.run_case(h, "failover " + args.case, lambda: case(h, args))

if __name__ == "__main__":
    sys.exit(main())
