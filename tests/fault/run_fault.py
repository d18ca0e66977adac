#!/usr/bin/python3
# Over 600 lines on purpose: the fork-and-kill harness and its trials, in one file as ctest runs it.
"""Fault-injection tests of gradlink: kill or hang one process of a running job.

Each trial starts real processes on loopback: gradlink-scheduler (--port 0; the port is read from
its "listening on host:port" line), SERVERS gradlink-server processes and WORKERS gl_fault_worker
processes (built beside this file), waits until the job is in the trial's phase, then sends
SIGKILL or SIGSTOP to one victim (a worker, a server or the scheduler) and requires:

  * every surviving worker prints "FAILED <CLOCK_MONOTONIC> <status>" within KILL_BOUND s of a
    SIGKILL, STOP_BOUND s of a SIGSTOP (the control plane's silence limit is 3 s), measured
    from time.monotonic() just before the signal (the same clock on Linux);
  * its status names the lost peer ("worker 2 (", "server 1 (", "scheduler");
  * Shutdown() called after the failure returns within SHUTDOWN_BOUND s (every worker runs with
    --shutdown-after-failure and prints "SHUTDOWN <seconds> <status>");
  * every surviving process (workers, servers, scheduler) exits by itself, non-zero, within
    EXIT_GRACE s after the failure bound: nothing is left hanging.
Members run with GRADLINK_SCHEDULER_RECONNECT=0: a lost scheduler fails them at once too, instead
of their waiting to rejoin a restarted one (run_failover.py restarts).
The stopped victim gets SIGCONT and SIGKILL at the end of its trial; everything else that was
started is SIGKILLed too (each process runs in its own session with PR_SET_PDEATHSIG).

Phases (where the job is when the signal lands):
  push       all workers loop push_pull of 1 KiB, 4 MiB and 32 MiB tensors; the signal lands
             at a random moment of round >= 2, mostly mid-transfer.
  pull       1 KiB + 4 MiB; one worker (the victim itself when the victim is a worker) sleeps
             STRAGGLE_MS before issuing each round: the signal lands inside that sleep, while
             the other workers have pushed and wait in Wait() for their pulls.
  barrier    the same, with the straggler sleeping before Barrier(): the others wait in it.
  handshake  the last worker sleeps LATE_MS before Connect(); the signal lands once every
             other member has connected to the scheduler (they wait for the job to start),
             before the late worker connects. Member ids are not assigned yet, so a message
             may name "worker ?" / "server ?". When the victim was killed the job is gone
             before the late worker connects: it must fail by itself within its own connect
             timeout (LATE_CONNECT_TIMEOUT_S), naming nothing in particular.

The 50 trials of the suite are drawn from --seed: every (phase, role, signal) combination
twice, plus two drawn at random, shuffled; victim index, straggler and signal timing are drawn
too. A ctest test runs a slice of them (--slice A:B) and appends one JSON line per trial to
--results; the "summary" case merges those files and prints min/median/max detection times
per (signal, victim role) and per (signal, victim role, phase). Detection times leave out the
straggler (asleep in this test's code when the signal landed; its bound is still checked).
Trials take the three data paths in turn (trial index mod 3): through the servers (--local-arena
0); the same-host path, which is the default with every worker on one host; and hierarchical
aggregation, with workers 0 and 1 on one emulated host and worker 2 on another (GRADLINK_HOST):
a local worker's loss then meets a host channel at push, local sum and pull.
The "shutdown" case runs five fixed trials aimed at Shutdown() after a failure; the "hierarchy"
case six with a worker as the victim on the hierarchical path (push, pull, barrier; either host).

Problems that match an open bug (KNOWN_BUGS below) are tagged with its id. By default they fail
the trial like any other; with --tolerate-known (CMake: -DGRADLINK_FAULT_TOLERATE_KNOWN=ON) a
trial whose problems are all tagged passes and is reported as KNOWN.

Usage: run_fault.py --bin-dir DIR --fault-worker EXE [--budget S] [--seed N] [--slice A:B]
                    [--results FILE] [--only PHASE,ROLE,SIGNAL] [--tolerate-known] CASE
       run_fault.py --trials 50 summary --merge FILE...
CASE: trials | shutdown | summary | wireup | hierarchy
Standard library only: runs under Debian's /usr/bin/python3.
"""

import argparse
import ctypes
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

WORKERS, SERVERS = 3, 2
KILL_BOUND, STOP_BOUND = 2.0, 6.0
SHUTDOWN_BOUND = 2.0        # Shutdown() after a failure, with a 1.5 s deadline
SHUTDOWN_DEADLINE_MS = 1500
EXIT_GRACE = 5.0            # every survivor exits this long after the failure bound at most
STRAGGLE_MS = 600
LATE_MS = 1500
LATE_CONNECT_TIMEOUT_S = 2.0
SMALL = "1024,4194304"
LARGE = "1024,4194304,33554432"
PHASES = ("push", "pull", "barrier", "handshake")
ROLES = ("worker", "server", "scheduler")
SIGNALS = ("KILL", "STOP")
EXIT_FAILED, EXIT_CONNECT = 10, 11

# ---- process handling (as tests/integration/run_integration.py) ------------------------------


class Failure(Exception):
    pass


try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _child_setup():
    # Die with the harness, even if it is SIGKILLed (ctest's timeout). Runs between fork and
    # exec, so it only calls what was looked up before the fork.
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class Proc:
    def __init__(self, name, role, index, argv, popen, out_path, err_path, started):
        self.name, self.role, self.index, self.argv, self.popen = name, role, index, argv, popen
        self.out_path, self.err_path, self.started = out_path, err_path, started
        self.ended = None  # time.monotonic() when the exit was first seen

    @property
    def pid(self):
        return self.popen.pid

    def poll(self):
        rc = self.popen.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
        return rc

    def out(self):
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def err(self):
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def lines(self, tag):
        """The fields of every stdout line starting with `tag`."""
        return [l.split(" ", 1)[1] if " " in l else "" for l in self.out().splitlines()
                if l.split(" ", 1)[0] == tag]


class Harness:
    def __init__(self, args):
        self.bin_dir = args.bin_dir
        self.worker_exe = args.fault_worker
        self.deadline = time.monotonic() + args.budget
        self.tmp = tempfile.mkdtemp(prefix="gradlink-fault-")
        self.procs = []
        self.counter = 0
        self.exit_grace = args.exit_grace
        self.tolerate_known = args.tolerate_known

    def left(self):
        return self.deadline - time.monotonic()

    def check_budget(self):
        if self.left() <= 0:
            raise Failure("the case's budget is spent")

    def spawn(self, name, role, index, argv, env=None):
        self.counter += 1
        stem = os.path.join(self.tmp, "%04d-%s" % (self.counter, name))
        out_path, err_path = stem + ".out", stem + ".err"
        full_env = dict(os.environ)
        full_env.setdefault("GRADLINK_LOG_LEVEL", "warn")
        if env:
            full_env.update(env)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            popen = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                     env=full_env, start_new_session=True,
                                     preexec_fn=_child_setup)
        p = Proc(name, role, index, argv, popen, out_path, err_path, time.monotonic())
        self.procs.append(p)
        return p

    def kill(self, p):
        if p.popen.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print("warning: %s (pid %d) survived SIGKILL" % (p.name, p.pid))

    def kill_all(self):
        for p in self.procs:
            self.kill(p)

    def dump_logs(self, procs, lines=25):
        for p in procs:
            print("----- %s (pid %d, exit %s): %s" % (p.name, p.pid, p.popen.poll(),
                                                      " ".join(p.argv)))
            for label, text in (("stdout", p.out()), ("stderr", p.err())):
                # Progress lines (one per round) only as far as the last one.
                progress = ("ROUND ", "ROUNDOK ", "STRAGGLE ", "BARRIER ")
                all_lines = text.splitlines()
                last = max([i for i, l in enumerate(all_lines) if l.startswith(progress)],
                           default=-1)
                kept = [l for i, l in enumerate(all_lines)
                        if i == last or not l.startswith(progress)]
                tail = kept[-lines:]
                if tail:
                    print("  [%s]" % label)
                    for line in tail:
                        print("    " + line)

    def wait_for(self, what, cond, timeout, procs=()):
        """Polls cond() every 5 ms until it returns a true value (returned); fails after
        `timeout` s, or at once when one of `procs` has exited."""
        end = time.monotonic() + min(timeout, max(self.left(), 0.01))
        while True:
            v = cond()
            if v:
                return v
            for p in procs:
                if p.poll() is not None:
                    raise Failure("%s exited with %s while waiting for %s" % (p.name, p.poll(),
                                                                             what))
            if time.monotonic() > end:
                raise Failure("timed out after %.1f s waiting for %s" % (timeout, what))
            time.sleep(0.005)


def established_to(port):
    """Established TCP connections whose local port is `port` (the scheduler's side)."""
    n = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1].endswith(":%04X" % port) and fields[3] == "01":
                n += 1
    return n


# ---- trials --------------------------------------------------------------------------------


class Trial:
    def __init__(self, index, phase, role, sig):
        self.index, self.phase, self.role, self.sig = index, phase, role, sig
        self.victim = 0        # worker rank, server spawn index, or 0 for the scheduler
        self.straggler = None  # worker rank (pull, barrier)
        self.offset = 0.0      # seconds after the phase's marker at which the signal lands
        # Every worker is on this host, where the sums go through shared memory by default:
        # a third of the trials turn that off, a third split the workers over two emulated
        # hosts (hierarchical aggregation), so that every data path meets every fault.
        self.path = ("servers", "same-host", "hierarchical")[index % 3]

    def label(self):
        who = self.role if self.role == "scheduler" else "%s %d" % (self.role, self.victim)
        return "#%02d SIG%-4s %-9s %-11s %-12s" % (self.index, self.sig, self.phase, who,
                                                  self.path)


def draw(rng, t):
    if t.role == "worker":
        # In the handshake the last worker has not connected yet: the victim is another one.
        t.victim = rng.randrange(WORKERS - 1 if t.phase == "handshake" else WORKERS)
    elif t.role == "server":
        t.victim = rng.randrange(SERVERS)
    if t.phase in ("pull", "barrier"):
        t.straggler = t.victim if t.role == "worker" else rng.randrange(WORKERS)
        t.offset = rng.uniform(0.15, 0.4)
    elif t.phase == "push":
        t.offset = rng.uniform(0.0, 0.15)
    else:  # handshake: this long before the late worker's Connect()
        t.offset = rng.uniform(0.4, 0.8)
    return t


def plan(seed, n):
    rng = random.Random(seed)
    combos = list(itertools.product(PHASES, ROLES, SIGNALS))
    reps, extra = divmod(n, len(combos))
    kinds = combos * reps + rng.sample(combos, extra)
    rng.shuffle(kinds)
    return [draw(rng, Trial(i, *k)) for i, k in enumerate(kinds)]


def victim_pattern(t, procs_by_role):
    """The regex a survivor's message must match: it names the lost peer."""
    if t.role == "scheduler":
        return r"scheduler"
    if t.role == "worker":
        ids = r"(%d|\?)" % t.victim if t.phase == "handshake" else str(t.victim)
        return r"\bworker %s \(" % ids
    # Servers get their ids from the scheduler in join order: read them from the servers' logs.
    ids = {}
    for p in procs_by_role["server"]:
        m = re.search(r"server (\d+) joined", p.err())
        if m:
            ids[p.index] = int(m.group(1))
    victim_id = ids.get(t.victim)
    if victim_id is None and len(ids) == SERVERS - 1:
        victim_id = (set(range(SERVERS)) - set(ids.values())).pop()
    if victim_id is None:
        return r"\bserver (\d+|\?) \("
    return r"\bserver (%d|\?) \(" % victim_id


def run_trial(h, t, results):
    t0 = time.monotonic()
    job = "fault-%d" % t.index
    # A lost server's partitions move to the others by default (run_failover.py tries that);
    # here its loss must fail the job, naming it, as it does with failover off.
    sched = h.spawn("t%02d-scheduler" % t.index, "scheduler", 0,
                    [os.path.join(h.bin_dir, "gradlink-scheduler"), "--port", "0",
                     "-w", str(WORKERS), "-s", str(SERVERS), "--job", job,
                     "--join-timeout-ms", "30000"] +
                    (["--no-failover"] if t.role == "server" else []))
    trial_procs = [sched]
    try:
        m = h.wait_for("the scheduler's port",
                       lambda: re.search(r"listening on (\S+):(\d+)", sched.out()), 15, [sched])
        addr, port = "%s:%s" % (m.group(1), m.group(2)), int(m.group(2))
        servers = [h.spawn("t%02d-server%d" % (t.index, i), "server", i,
                           [os.path.join(h.bin_dir, "gradlink-server"), "--scheduler", addr,
                            "--job", job], env={"GRADLINK_LOG_LEVEL": "info"})
                   for i in range(SERVERS)]
        trial_procs += servers
        workers = []
        for r in range(WORKERS):
            argv = [h.worker_exe, "--scheduler", addr, "--job", job, "--rank", str(r),
                    "--phase", "push" if t.phase == "handshake" else t.phase,
                    "--sizes", LARGE if t.phase == "push" else SMALL, "--wait-s", "30",
                    "--shutdown-after-failure", "--shutdown-deadline-ms",
                    str(SHUTDOWN_DEADLINE_MS)]
            if t.path == "servers":
                argv += ["--local-arena", "0"]
            if t.path == "hierarchical":
                argv += ["--host", "fault-host-%s" % ("a" if r < 2 else "b")]
            if r == t.straggler:
                argv += ["--straggle-ms", str(STRAGGLE_MS)]
            if t.phase == "handshake" and r == WORKERS - 1:
                argv += ["--sleep-before-connect-ms", str(LATE_MS),
                         "--connect-timeout-s", str(LATE_CONNECT_TIMEOUT_S)]
            workers.append(h.spawn("t%02d-worker%d" % (t.index, r), "worker", r, argv))
        trial_procs += workers
        by_role = {"scheduler": [sched], "server": servers, "worker": workers}
        victim = by_role[t.role][t.victim]
        survivors = [p for p in trial_procs if p is not victim]
        phase_note = wait_for_phase(h, t, sched, servers, workers, port)
        h.check_budget()
        t_kill = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL if t.sig == "KILL" else signal.SIGSTOP)
        check_survivors(h, t, t_kill, victim, survivors, by_role, results, phase_note)
    except Failure:
        h.dump_logs(trial_procs)
        raise
    finally:
        for p in trial_procs:
            h.kill(p)
    results[-1]["seconds"] = round(time.monotonic() - t0, 2)


def wait_for_phase(h, t, sched, servers, workers, port):
    """Returns once the signal may land: the trial's phase is on, plus its offset."""
    everyone = [sched] + servers + workers
    if t.phase == "handshake":
        late = workers[-1]
        early = servers + workers[:-1]
        h.wait_for("the early members to connect to the scheduler",
                   lambda: established_to(port) >= len(early), 10, everyone)
        time.sleep(0.05)  # connected: their kRegister is on its way
        land = late.started + LATE_MS / 1000.0 - t.offset
        time.sleep(max(0.0, land - time.monotonic()))
        if late.lines("CONNECTING"):
            raise Failure("setup too slow: the late worker connected before the signal")
        return "early members connected; late worker joins %.2f s later" % (
            late.started + LATE_MS / 1000.0 - time.monotonic())
    # Servers log their id once they have joined; the trial's messages name servers by it.
    h.wait_for("the servers to join",
               lambda: all(re.search(r"server \d+ joined", p.err()) for p in servers), 20,
               everyone)
    if t.phase == "push":
        h.wait_for("round 2", lambda: all(any(l.startswith("2 ") for l in p.lines("ROUND"))
                                          for p in workers), 20, everyone)
        time.sleep(t.offset)
        return "round 2 + %.0f ms" % (t.offset * 1000)
    # pull / barrier: land inside one of the straggler's sleeps, round >= 2, while the others
    # wait (for their pulls, or in the barrier).
    strag = workers[t.straggler]
    others = [p for p in workers if p is not strag]
    mark = "ROUND" if t.phase == "pull" else "BARRIER"
    for _ in range(5):
        def straggling():
            for l in strag.lines("STRAGGLE"):
                k, ts = l.split()
                if int(k) >= 2 and not any(x.startswith(k + " ") for x in strag.lines(mark)):
                    return int(k), float(ts)
            return None
        k, ts = h.wait_for("the straggler's sleep", straggling, 20, everyone)
        land = ts + t.offset
        time.sleep(max(0.0, land - time.monotonic()))
        waiting = all(any(l.startswith("%d " % k) for l in p.lines(mark)) for p in others)
        still = not any(x.startswith("%d " % k) for x in strag.lines(mark))
        late_by = time.monotonic() - land
        if waiting and still and late_by < 0.1:
            return "round %d, straggler asleep %.0f ms, others in %s" % (
                k, (time.monotonic() - ts) * 1000, "Wait()" if t.phase == "pull" else "Barrier()")
        # Too late (a loaded machine): try the next round's sleep.
        h.wait_for("the straggler's next round",
                   lambda: any(x.startswith("%d " % k) for x in strag.lines(mark)), 20, everyone)
    raise Failure("could not land the signal inside the straggler's sleep in 5 rounds")


# Open bugs that these trials expose (see the fault-test report). A problem that matches one is
# tagged with its id; with --tolerate-known a trial whose problems are all tagged passes.
KNOWN_BUGS = {
    "B1": "after the job is aborted, a push_pull with a push or pull in flight to/from a hung "
          "(SIGSTOPped) server never completes: Wait() blocks until UCX lets go of the buffer",
    "B2": "a survivor reports the loss of a healthy server (which exited because the job had "
          "failed) instead of the peer that was lost",
    "B4": "a hung scheduler is not detected before the job starts: members wait for their "
          "connect timeout (30 s by default)",
    "B5": "stopping a lane while a rendezvous transfer with a hung peer is pending aborts the "
          "process (UCX assertion in ucp_worker_destroy)",
    "B6": "a process aborts in UCX when a peer dies while their connection is being set up: "
          "the TCP transport destroys a failed endpoint that UCP has taken over (tcp_ep.c "
          "uct_tcp_ep_destroy_progress assertion; in UCX 1.13.1, 1.18.1 and upstream master), "
          "or a wireup message is purged (ucp_request.c 'got REP message', openucx/ucx#8175)",
}
# The abort messages of B6 (the first UCX error line on the victim's stderr).
B6_PATTERN = re.compile(r"tcp_ep\.c:\d+ +Assertion `!\(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX\)'"
                        r"|ucp_request\.c:\d+ .*got \S+ message")


def known_bug(t, p, kind, detail=""):
    hung_server = t.sig == "STOP" and t.role == "server"
    if hung_server and p.role == "worker":
        if kind in ("missing", "late", "running") or (kind == "exit" and detail == 14):
            return "B1"
        if kind == "exit" and detail == -signal.SIGABRT:
            return "B5"
    if (t.sig == "STOP" and t.role == "scheduler" and t.phase == "handshake" and
            kind in ("missing", "late", "running")):
        return "B4"
    if kind == "name" and re.search(r"(connection to|receiving the sum from) server \d+ \(",
                                    detail):
        return "B2"
    return None


def check_survivors(h, t, t_kill, victim, survivors, by_role, results, phase_note):
    bound = KILL_BOUND if t.sig == "KILL" else STOP_BOUND
    workers = [p for p in survivors if p.role == "worker"]
    late = by_role["worker"][-1] if t.phase == "handshake" else None
    # The late worker of a handshake trial whose victim died: the job is gone before it
    # connects; it fails by itself once its connect timeout is up.
    late_alone = late is not None and t.sig == "KILL"
    limits = {}
    for p in workers:
        if p is late and late_alone:
            limits[p] = p.started + LATE_MS / 1000.0 + LATE_CONNECT_TIMEOUT_S + 1.0 - t_kill
        else:
            limits[p] = bound
    end = t_kill + max(limits.values()) + 0.05
    failed = {}
    while True:
        for p in workers:
            if p not in failed and p.lines("FAILED"):
                failed[p] = p.lines("FAILED")[0]
        if len(failed) == len(workers) or time.monotonic() > end:
            break
        time.sleep(0.005)
    problems = []  # (text, known bug id or None)

    def problem(p, kind, text, detail=""):
        problems.append((text, known_bug(t, p, kind, detail)))

    detections, asleep, missed = [], [], 0
    pattern = victim_pattern(t, by_role)
    for p in workers:
        if p not in failed:
            missed += 1
            problem(p, "missing", "%s printed no FAILED line within %.1f s" % (p.name, limits[p]))
            continue
        ts, status = failed[p].split(" ", 1)
        dt = float(ts) - t_kill
        if p is late and late_alone:
            if dt > limits[p]:
                problem(p, "late", "late %s failed %.2f s after the signal (limit %.2f s)" % (
                    p.name, dt, limits[p]))
            continue
        if t.phase in ("pull", "barrier") and p.index == t.straggler:
            # It was asleep in the test's own code when the signal landed: its delay says
            # nothing about gradlink. Its bound is checked; the statistics leave it out.
            asleep.append(round(dt, 4))
        else:
            detections.append(round(dt, 4))
        if dt > bound:
            problem(p, "late", "%s failed %.3f s after SIG%s of %s (bound %.1f s): %s" % (
                p.name, dt, t.sig, victim.name, bound, status))
        if not re.search(pattern, status):
            problem(p, "name", "%s: the status does not name %s (/%s/): %s" % (
                p.name, victim.name, pattern, status), status)
    # Every survivor exits by itself: workers after Shutdown(), servers and the scheduler once
    # the job has failed.
    exit_end = t_kill + max(limits.values()) + h.exit_grace
    while time.monotonic() < exit_end and any(p.poll() is None for p in survivors):
        time.sleep(0.01)
    exits = {}
    for p in survivors:
        rc = p.poll()
        if rc is None:
            problem(p, "running", "%s still running %.1f s after the signal" % (
                p.name, time.monotonic() - t_kill))
            continue
        exits[p.name] = round(p.ended - t_kill, 3)
        if p.role == "worker":
            if rc not in (EXIT_FAILED, EXIT_CONNECT):
                problem(p, "exit", "%s exited with %d (expected %d or %d)%s" % (
                    p.name, rc, EXIT_FAILED, EXIT_CONNECT,
                    ": " + " | ".join(p.lines("STUCK")) if p.lines("STUCK") else ""), rc)
        elif rc == 0:
            problem(p, "exit", "%s exited with 0 from a failed job" % p.name, rc)
    shutdowns = []
    for p in workers:
        for l in p.lines("SHUTDOWN"):
            secs = float(l.split()[0])
            shutdowns.append(round(secs, 4))
            if secs >= SHUTDOWN_BOUND:
                problem(p, "shutdown", "%s: Shutdown() after the failure took %.2f s: %s" % (
                    p.name, secs, l))
    example = ""
    if failed:
        example = sorted(failed.items(), key=lambda kv: kv[0].index)[0][1].split(" ", 1)[1]
    known = sorted({b for _, b in problems if b})
    verdict = "ok" if not problems else (
        "KNOWN" if all(b for _, b in problems) else "FAIL")
    results.append({"trial": t.index, "phase": t.phase, "role": t.role, "signal": t.sig,
                    "victim": victim.name, "detections": detections, "asleep": asleep,
                    "missed": missed,
                    "shutdowns": shutdowns, "exits": exits, "verdict": verdict,
                    "problems": ["%s%s" % ("[%s] " % b if b else "", x) for x, b in problems],
                    "known": known, "note": phase_note, "example": example})
    print("%-5s %s det %s  shutdown max %s  last exit %.2f s  [%s]" % (
        verdict, t.label(), " ".join("%.3f" % d for d in sorted(detections)) or "-",
        "%.3f" % max(shutdowns) if shutdowns else "-",
        max(exits.values()) if exits else float("nan"), phase_note))
    print("      %s" % example[:200])
    for x in results[-1]["problems"]:
        print("      problem: %s" % x[:400])
    sys.stdout.flush()
    if verdict == "FAIL" or (verdict == "KNOWN" and not h.tolerate_known):
        raise Failure("%d problem(s)%s" % (len(problems), " (known bugs %s)" % ", ".join(known)
                                           if known else ""))


# ---- reporting -----------------------------------------------------------------------------


def table(results, keys):
    rows = {}
    for r in results:
        d, m = rows.setdefault(tuple(r[k] for k in keys), ([], [0]))
        d.extend(r["detections"])
        m[0] += r.get("missed", 0)
    out = ["%-28s %4s %8s %8s %8s %7s" % (" / ".join(keys), "n", "min(s)", "median", "max(s)",
                                          "missed")]
    for k in sorted(rows):
        d, m = rows[k]
        if d:
            out.append("%-28s %4d %8.3f %8.3f %8.3f %7d" % (" / ".join(k), len(d), min(d),
                                                          statistics.median(d), max(d), m[0]))
        else:
            out.append("%-28s %4d %8s %8s %8s %7d" % (" / ".join(k), 0, "-", "-", "-", m[0]))
    return "\n".join(out)


def report(results):
    print("\ndetection time: signal -> FAILED in a surviving worker (time.monotonic() before the "
          "signal to the worker's CLOCK_MONOTONIC when Wait()/Barrier()/Connect() returned); "
          "missed: survivors with no FAILED line within the bound")
    print("%d trials, %d samples" % (len(results), sum(len(r["detections"]) for r in results)))
    print(table(results, ("signal", "role")))
    print()
    print(table(results, ("signal", "role", "phase")))
    sd = [s for r in results for s in r["shutdowns"]]
    ex = [e for r in results for e in r["exits"].values()]
    if sd:
        print("\nShutdown() after the failure: n %d, min %.3f s, median %.3f s, max %.3f s" % (
            len(sd), min(sd), statistics.median(sd), max(sd)))
    if ex:
        print("survivor exit after the signal: median %.2f s, max %.2f s" % (
            statistics.median(ex), max(ex)))
    verdicts = {}
    for r in results:
        verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
    print("verdicts: %s" % ", ".join("%s %d" % kv for kv in sorted(verdicts.items())))
    for bug in sorted(KNOWN_BUGS):
        hit = [r["trial"] for r in results if bug in r.get("known", [])]
        if hit:
            print("known bug %s in %d trial(s) %s: %s" % (bug, len(hit), hit, KNOWN_BUGS[bug]))
    for r in results:
        if r["verdict"] != "ok":
            print("%s trial #%02d SIG%s %s %s:" % (r["verdict"], r["trial"], r["signal"],
                                                  r["phase"], r["victim"]))
            for x in r["problems"]:
                print("    " + x[:400])


def run_list(h, trials, results_path):
    results, failures = [], 0
    for i, t in enumerate(trials):
        try:
            run_trial(h, t, results)
        except Failure as e:
            print("FAIL  %s: %s" % (t.label(), e))
            failures += 1
            if not results or results[-1]["trial"] != t.index:
                # Failed before its survivors were checked (setup, phase).
                results.append({"trial": t.index, "phase": t.phase, "role": t.role,
                                "signal": t.sig, "victim": "?", "detections": [], "missed": 0,
                                "shutdowns": [], "exits": {}, "verdict": "FAIL",
                                "problems": [str(e)], "known": [], "note": "", "example": ""})
        sys.stdout.flush()
        if results_path:
            with open(results_path, "a") as f:
                f.write(json.dumps(results[-1]) + "\n")
        if h.left() < 20 and i + 1 < len(trials):
            print("FAIL: budget nearly spent after trial #%02d; %d trials not run" % (
                t.index, len(trials) - i - 1))
            failures += 1
            break
    return results, failures


def case_trials(h, args):
    trials = plan(args.seed, args.trials)
    a, b = (int(x) for x in args.slice.split(":"))
    trials = trials[a:b]
    if args.only:
        phase, role, sig = args.only.split(",")
        trials = [t for t in trials if (t.phase, t.role, t.sig) == (phase, role, sig)]
    print("seed %d, trials %d..%d of %d: %d workers, %d servers; bounds: SIGKILL %.1f s, "
          "SIGSTOP %.1f s, Shutdown() %.1f s, exit +%.1f s%s" % (
              args.seed, a, b - 1, args.trials, WORKERS, SERVERS, KILL_BOUND, STOP_BOUND,
              SHUTDOWN_BOUND, h.exit_grace, "; known bugs tolerated" if h.tolerate_known else ""))
    results, failures = run_list(h, trials, args.results)
    report(results)
    if failures:
        raise Failure("%d of %d trials failed" % (failures, len(trials)))


def case_shutdown(h, args):
    """Shutdown() right after a failure returns within its deadline, in the cases where an
    endpoint is most likely to hold it up: a server hung (SIGSTOP) or killed while 32 MiB
    transfers are in flight to it, a server or the scheduler hung while the workers wait for
    their pulls, a worker killed in a barrier."""
    fixed = [("push", "server", "STOP", 0), ("push", "server", "KILL", 1),
             ("pull", "server", "STOP", 1), ("pull", "scheduler", "STOP", 0),
             ("barrier", "worker", "KILL", 0)]
    trials = []
    for i, (phase, role, sig, victim) in enumerate(fixed):
        t = Trial(100 + i, phase, role, sig)
        t.victim = victim
        if phase in ("pull", "barrier"):
            t.straggler = victim if role == "worker" else WORKERS - 1
            t.offset = 0.25
        else:
            t.offset = 0.05
        trials.append(t)
    results, failures = run_list(h, trials, args.results)
    sd = [s for r in results for s in r["shutdowns"]]
    if sd:
        print("Shutdown() after the failure: n %d, min %.3f s, median %.3f s, max %.3f s "
              "(bound %.1f s, deadline %d ms)" % (len(sd), min(sd), statistics.median(sd),
                                                   max(sd), SHUTDOWN_BOUND, SHUTDOWN_DEADLINE_MS))
    if failures:
        raise Failure("%d of %d trials failed" % (failures, len(trials)))


def case_hierarchy(h, args):
    """Hierarchical aggregation (workers 0 and 1 on one emulated host, worker 2 on another):
    a local worker killed or hung mid-push (its host's partials half posted, half summed) or
    while the others wait for their pulls, on the two-worker host and on the one-worker host.
    Every survivor, local or remote, must fail naming it, in the bounds of every trial."""
    fixed = [("push", "worker", "KILL", 1), ("push", "worker", "STOP", 0),
             ("push", "worker", "KILL", 2), ("pull", "worker", "KILL", 1),
             ("pull", "worker", "STOP", 2), ("barrier", "worker", "STOP", 1)]
    trials = []
    for i, (phase, role, sig, victim) in enumerate(fixed):
        t = Trial(200 + i, phase, role, sig)
        t.path = "hierarchical"
        t.victim = victim
        if phase in ("pull", "barrier"):
            t.straggler = victim
            t.offset = 0.25
        else:
            t.offset = 0.05
        trials.append(t)
    results, failures = run_list(h, trials, args.results)
    report(results)
    if failures:
        raise Failure("%d of %d trials failed" % (failures, len(trials)))


def case_summary(h, args):
    results = []
    missing = []
    for path in args.merge:
        if not os.path.exists(path):
            missing.append(path)
            continue
        print("%s: written %.0f s ago" % (path, time.time() - os.path.getmtime(path)))
        with open(path) as f:
            results += [json.loads(l) for l in f if l.strip()]
    results.sort(key=lambda r: r["trial"])
    report(results)
    if missing:
        raise Failure("no results in %s (run the fault.trials_* tests first)" % ", ".join(missing))
    if len(results) != args.trials:
        raise Failure("%d trial results, expected %d" % (len(results), args.trials))


# ---- wireup: workers that crash while the servers set up their connections -------------------

WIREUP_KINDS = ("one-after-join", "all-after-join", "one-during-join")
WIREUP_JOIN_TIMEOUT_MS = 5000
# Every survivor exits by itself this long after the last crash. A crash during the join fails
# the job before every member has connected: those that had not retry until their connect
# timeout (5 s here; failing fast on a scheduler that refuses is the hardening issue's).
WIREUP_EXIT_BOUND = 12.0


def wireup_trial(h, index, kind, rng, workers, servers):
    """One job whose worker(s) SIGKILL themselves microseconds after joining (or while joining).
    Returns (outcome, detail): 'ok' when every other process exits by itself, none of them by a
    signal, within WIREUP_EXIT_BOUND; else 'abort' (a survivor died on a signal: UCX's
    assertion), 'hang' or 'error'."""
    job = "wireup-%d" % index
    sched = h.spawn("w%02d-scheduler" % index, "scheduler", 0,
                    [os.path.join(h.bin_dir, "gradlink-scheduler"), "--port", "0",
                     "-w", str(workers), "-s", str(servers), "--job", job,
                     "--join-timeout-ms", str(WIREUP_JOIN_TIMEOUT_MS)])
    procs = [sched]
    try:
        m = h.wait_for("the scheduler's port",
                       lambda: re.search(r"listening on (\S+):(\d+)", sched.out()), 15, [sched])
        addr = "%s:%s" % (m.group(1), m.group(2))
        procs += [h.spawn("w%02d-server%d" % (index, i), "server", i,
                          [os.path.join(h.bin_dir, "gradlink-server"), "--scheduler", addr,
                           "--job", job], env={"GRADLINK_CONNECT_TIMEOUT": "5"})
                 for i in range(servers)]
        one = rng.randrange(workers)
        victims = []
        for r in range(workers):
            argv = [h.worker_exe, "--scheduler", addr, "--job", job, "--rank", str(r),
                    "--phase", "push", "--sizes", SMALL, "--wait-s", "10",
                    "--connect-timeout-s", "5"]
            if kind == "all-after-join" or (kind == "one-after-join" and r == one):
                argv += ["--die-after-join-us", str(rng.randrange(0, 3000))]
            elif kind == "one-during-join" and r == one:
                argv += ["--die-after-connect-us", str(rng.randrange(0, 30000))]
            p = h.spawn("w%02d-worker%d" % (index, r), "worker", r, argv)
            procs.append(p)
            if "--die-after-join-us" in argv or "--die-after-connect-us" in argv:
                victims.append(p)
        h.wait_for("the crash", lambda: all(v.poll() is not None for v in victims), 20, [])
        survivors = [p for p in procs if p not in victims]
        end = time.monotonic() + WIREUP_EXIT_BOUND
        while time.monotonic() < end and any(p.poll() is None for p in survivors):
            time.sleep(0.01)
        for p in survivors:
            rc = p.poll()
            if rc is None:
                return "hang", "%s still running %.0f s after the crash" % (p.name,
                                                                           WIREUP_EXIT_BOUND)
            if rc < 0:
                why = [l for l in p.err().splitlines() if "ssert" in l or "rror" in l]
                return "abort", "%s died on signal %d: %s" % (p.name, -rc,
                                                             (why or ["(no message)"])[0][:200])
        return "ok", ""
    except Failure as e:
        return "error", str(e)
    finally:
        for p in procs:
            h.kill(p)


def case_wireup(h, args):
    """Workers that crash (SIGKILL) within 3 ms of joining, or while joining: no other process
    may die on a signal, and each exits by itself. UCX itself aborts a server in a few percent
    of these trials (known bug B6, docs/operations.md "UCX"): with --tolerate-known such a
    trial is counted and reported as KNOWN, every other problem still fails."""
    rng = random.Random(args.seed)
    kinds = args.wireup_kinds.split(",") if args.wireup_kinds else WIREUP_KINDS
    if any(k not in WIREUP_KINDS for k in kinds):
        raise Failure("--wireup-kinds: each of %s" % ", ".join(WIREUP_KINDS))
    print("seed %d: %d trials of %d workers x %d servers, kinds %s" % (
        args.seed, args.wireup_trials, args.wireup_workers, SERVERS, ", ".join(kinds)))
    tally = {}
    failures, known = [], []
    for i in range(args.wireup_trials):
        h.check_budget()
        kind = kinds[i % len(kinds)]
        t0 = time.monotonic()
        outcome, detail = wireup_trial(h, i, kind, rng, args.wireup_workers, SERVERS)
        if outcome == "abort" and B6_PATTERN.search(detail):
            known.append(i)
            if h.tolerate_known:
                outcome = "KNOWN"
        print("#%02d %-16s %-5s %.1f s %s" % (i, kind, outcome, time.monotonic() - t0, detail))
        tally.setdefault(kind, {}).setdefault(outcome, 0)
        tally[kind][outcome] += 1
        if outcome not in ("ok", "KNOWN"):
            failures.append(i)
    for kind in WIREUP_KINDS:
        if kind in tally:
            print("%-16s %s" % (kind, ", ".join("%s %d" % kv for kv in sorted(tally[kind].items()))))
    if known:
        print("known bug B6 in %d trial(s) %s: %s" % (len(known), known, KNOWN_BUGS["B6"]))
    if failures:
        raise Failure("%d of %d wireup trials failed: %s" % (len(failures), args.wireup_trials,
                                                             failures))


CASES = {"trials": case_trials, "shutdown": case_shutdown, "summary": case_summary,
         "wireup": case_wireup, "hierarchy": case_hierarchy}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", help="where gradlink-scheduler and gradlink-server are")
    ap.add_argument("--fault-worker", help="gl_fault_worker")
    ap.add_argument("--budget", type=float, default=120, help="seconds for the whole case")
    ap.add_argument("--seed", type=int, default=20240611)
    ap.add_argument("--trials", type=int, default=50, help="trials in the whole suite")
    ap.add_argument("--slice", default="0:50", help="A:B: run trials A..B-1 of the suite")
    ap.add_argument("--only", help="PHASE,ROLE,SIGNAL: only trials of this kind (debugging)")
    ap.add_argument("--results", help="append one JSON line per trial to this file")
    ap.add_argument("--merge", nargs="*", default=[], help="summary: the results files")
    ap.add_argument("--tolerate-known", action="store_true",
                    help="a trial whose problems all match KNOWN_BUGS passes (reported as KNOWN)")
    ap.add_argument("--exit-grace", type=float, default=EXIT_GRACE,
                    help="seconds after the failure bound for survivors to exit (diagnosis)")
    ap.add_argument("--wireup-trials", type=int, default=9, help="wireup: jobs to run")
    ap.add_argument("--wireup-workers", type=int, default=8, help="wireup: workers per job")
    ap.add_argument("--wireup-kinds", help="wireup: comma-separated kinds (default: all)")
    ap.add_argument("case", choices=sorted(CASES))
    args = ap.parse_args()
    if args.case != "summary" and not (args.bin_dir and args.fault_worker):
        ap.error("--bin-dir and --fault-worker are required")
    # These trials hold members to failing fast: a lost scheduler too, so its members do not
    # wait to rejoin a restarted one (the default; run_failover.py's restarts test that).
    os.environ["GRADLINK_SCHEDULER_RECONNECT"] = "0"
    h = Harness(args)
    if args.results and args.case != "summary":
        open(args.results, "w").close()
    return run_case(h, args.case, lambda: CASES[args.case](h, args))


def run_case(h, label, fn):
    """Runs fn() with every process `h` started stopped at the end, whatever happens (SIGTERM,
    SIGINT, a Failure, an exception); prints PASS/FAIL with the time and the logs' place (kept
    on failure). Returns the exit code: 0, 1, or 128 + the signal."""
    def on_signal(signum, _frame):
        h.kill_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    rc = 0
    try:
        fn()
    except Failure as e:
        print("FAIL %s: %s" % (label, e))
        rc = 1
    except Exception:  # noqa: BLE001 - report and clean up
        import traceback
        traceback.print_exc()
        rc = 1
    finally:
        h.kill_all()
    print("%s %s in %.1f s (logs: %s)" % ("PASS" if rc == 0 else "FAIL", label,
                                           time.monotonic() - t0, h.tmp))
    if rc == 0:
        import shutil
        shutil.rmtree(h.tmp, ignore_errors=True)
    return rc

if __name__ == "__main__":
    sys.exit(main())
