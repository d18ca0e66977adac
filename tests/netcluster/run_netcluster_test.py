#!/usr/bin/python3
"""Tests of the emulated-cluster harness bench/netcluster.py (one case per ctest test).

  smoke    two hosts (network namespaces behind a bridge, 1 Gbit/s tbf links), each running a
           gradlink-bench worker and a gradlink-server shard: every partition lives on one host,
           so the other host's worker pushes and pulls it across the shaped links. Checks: the
           qdiscs are there in both directions, a TCP stream is held to the rate, every element
           of every result is exact (gradlink-bench checks against the closed-form sum), the
           links carried at least the bytes that had to cross them (UCX really went over TCP on
           the veth, not shared memory), and nothing is left afterwards.
  hosts    which workers share a host: two namespaces of one machine are two hosts (the
           same-host path stays off, and the bytes cross the shaped links), two workers in one
           namespace are one (the same-host path is on, nothing goes to the servers), and
           GRADLINK_HOST groups workers deliberately (two namespaces named alike are one host).
  train    bench/train_cluster at its smallest (2 worker hosts, 1 server host, a 256-wide MLP,
           one timed step): every method trains, the ranks end bit-identical, the methods agree
           with DDP over Gloo, the table has a row per method; and with --tolerance -1 (any
           difference too large) the run fails naming the method, so the check is live.
  hier     workers sharing hosts (bench/netcluster --scenario hier at its smallest): 2 worker
           hosts x 2 workers (ranks host-major) and 2 server hosts, gradlink-hier (the defaults)
           and gradlink-flat (GRADLINK_HIERARCHICAL=0), 64K - 1M. Checks: every element of every
           result is exact, rank r runs on host r // 2, flat's hosts each send and receive 2 x M
           per step (the link counters see every worker's pushes and pulls), flat never says
           "hierarchical on"; and where the binaries say "hierarchical on" (worker log, info),
           a hier host sends and receives at most 1.3 x M per timed step (counted from the
           difference of two jobs that differ only in their number of timed steps); otherwise
           it says the byte bound was not checked. Then the scenario's table from the command
           line has both systems and the host bytes columns.
  cleanup  everything is removed when the body fails, on SIGTERM and on SIGINT of a running
           harness (namespaces and the processes inside), and `--cleanup` removes the leftovers
           of a killed run but not the namespaces of a running one.

Exit status: 0 passed, 1 failed, 77 skipped (not root, no iproute2 or no network namespaces:
the reason is printed). Standard library only (Debian's /usr/bin/python3).

Usage: run_netcluster_test.py --bin-dir DIR [--budget S] CASE
"""

import argparse
import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HARNESS = os.path.join(REPO, "bench", "netcluster.py")

spec = importlib.util.spec_from_file_location("netcluster", HARNESS)
nc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nc)


class Failure(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise Failure(msg)


def ours(prefix):
    return [ns for ns in nc.list_namespaces() if ns.startswith(prefix)]


def qdisc_rate(ns, dev):
    import json
    q = json.loads(nc.sh(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev]))
    tbf = [x for x in q if x.get("kind") == "tbf"]
    expect(tbf, "no tbf qdisc on %s in %s: %s" % (dev, ns, q))
    return tbf[0]["options"]["rate"]


def case_smoke(a):
    rate = 1e9
    sizes = list(nc.sizes_of(4 << 10, 4 << 20, 4))  # 4K 16K 64K 256K 1M 4M
    iters, warmup = 3, 1
    with nc.Cluster(2, rate) as cl:
        prefix = cl.prefix
        expect(len(ours(prefix)) == 3, "expected 3 namespaces %s*, found %s" % (prefix, ours(prefix)))
        # tbf on both ends of both links (host -> bridge and bridge -> host).
        for h in range(2):
            for ns, dev in ((cl.ns(h), nc.IFACE), (cl.bridge_ns, "p%d" % h)):
                r = qdisc_rate(ns, dev)
                expect(abs(r * 8 - rate) / rate < 0.01 or abs(r - rate) / rate < 0.01,
                       "tbf rate on %s/%s is %s, expected %g bit/s" % (ns, dev, r, rate))
        # The links are shaped: an unshaped veth carries several Gbit/s here.
        counters = [cl.link_bytes(h) for h in range(2)]
        with cl.timeline() as tl:
            bps = cl.tcp_check(0, 1, 1.0)
            sent0 = cl.link_bytes(0)[0] - counters[0][0]
        print("TCP stream host 0 -> host 1: %.3f Gbit/s" % (bps / 1e9))
        # The timeline tells a host's sending from its receiving: host 0 sent the stream, host 1
        # only its acks.
        up0, down0 = sum(v[0] for _, v in tl), sum(v[1] for _, v in tl)
        print("timeline of the stream: host 0 sent %d bytes, received %d" % (up0, down0))
        expect(up0 >= sent0 and up0 > 10 * down0,
               "timeline: host 0 sent %d bytes and received %d during a stream it sent" % (
                   up0, down0))
        expect(bps <= rate * 1.02, "a TCP stream ran at %.3f Gbit/s over a %.1f Gbit/s link: "
               "the link is not shaped" % (bps / 1e9, rate / 1e9))
        expect(bps >= rate * 0.2, "a TCP stream reached only %.3f Gbit/s of %.1f" % (
            bps / 1e9, rate / 1e9))

        before = [cl.link_bytes(h)[0] for h in range(2)]
        t0 = time.monotonic()
        servers = [(0, None), (1, None)]
        with cl.timeline() as tl:
            rows = nc.run_gradlink(cl, a.bin_dir, [0, 1], servers, sizes, iters, warmup,
                                   partition=64 << 10, timeout=60)
            inside = [cl.link_bytes(h)[0] for h in range(2)]
        # The timeline (bridge-port counters) saw every byte each host sent while it ran.
        expect(len(tl) >= 10, "the link timeline has only %d samples" % len(tl))
        for h in range(2):
            up = sum(v[2 * h] for _, v in tl)
            print("timeline: host %d sent %d bytes in %d samples (its own counter: %d)" % (
                h, up, len(tl), inside[h] - before[h]))
            expect(inside[h] - before[h] <= up <= inside[h] - before[h] + (1 << 20),
                   "host %d: the timeline counted %d bytes sent, its interface %d" % (
                       h, up, inside[h] - before[h]))
        print("gradlink, 2 hosts x (worker + server), separate lanes: %s (%.1f s)" % (
            " ".join("%s:%.1fms" % (nc.human(s), rows[s][0] / 1e3) for s in sizes),
            time.monotonic() - t0))
        # One size that is not a multiple of the partition or of 4 KiB, on one lane.
        odd = [4 * 250007]
        rows1 = nc.run_gradlink(cl, a.bin_dir, [0, 1], servers, odd, iters, warmup,
                                partition=64 << 10, single_lane=True, timeout=60)
        print("gradlink, single lane, %d B: %.1f ms" % (odd[0], rows1[odd[0]][0] / 1e3))
        after = [cl.link_bytes(h)[0] for h in range(2)]
        # Every partition lives on one of the two hosts; the other host's worker pushes it
        # across and pulls the sum back: 2 * size payload bytes cross per iteration.
        need = 2 * (sum(sizes) + sum(odd)) * (iters + warmup)
        sent = sum(after) - sum(before)
        print("bytes sent on the two links: %d (at least %d of payload had to cross)" % (sent, need))
        expect(sent >= need, "the links carried %d bytes, less than the %d that had to cross: "
               "traffic bypassed the shaped links" % (sent, need))
        expect(sent <= 1.5 * need + (4 << 20), "the links carried %d bytes, far more than the "
               "%d needed" % (sent, need))
    left = ours(prefix)
    expect(not left, "namespaces left after the cluster closed: %s" % left)


def case_hosts(a):
    sizes = [1 << 20, 4 << 20]
    iters, warmup = 3, 1
    payload = sum(sizes) * (iters + warmup)  # what a worker pushes (sends) in a job
    env = {"GRADLINK_LOG_LEVEL": "info"}
    arena = ["--local-arena", str(64 << 20)]
    with nc.Cluster(2, 1e9) as cl:
        def job(label, workers, server_host, extra_env=None):
            wk = []
            before = [cl.link_bytes(h)[0] for h in range(2)]
            e = dict(env)
            e.update(extra_env or {})
            nc.run_gradlink(cl, a.bin_dir, workers, [(server_host, None)], sizes, iters, warmup,
                            worker_args=arena, worker_procs=wk, extra_env=e, timeout=60)
            sent = [cl.link_bytes(h)[0] - before[h] for h in range(2)]
            logs = [p.err() for p in wk]
            print("%s: links sent %s bytes" % (label, sent))
            return sent, logs

        # Two namespaces, one host name: two hosts. Worker 1's pushes cross to the server.
        sent, logs = job("workers in two namespaces", [0, 1], 0)
        for i, log in enumerate(logs):
            expect("same-host path off (workers on several hosts)" in log,
                   "worker %d in namespace %d did not say the same-host path is off:\n%s" % (
                       i, i, log[-2000:]))
        expect(sent[1] >= payload, "host 1 sent %d bytes, less than its %d of pushes: the "
               "workers summed through shared memory across namespaces" % (sent[1], payload))
        # Two workers in one namespace: one host, summed through shared memory.
        sent, logs = job("two workers in one namespace", [0, 0], 1)
        for i, log in enumerate(logs):
            expect("same-host path on (2 workers on host" in log,
                   "worker %d did not take the same-host path:\n%s" % (i, log[-2000:]))
        expect(sent[0] < payload // 10, "host 0 sent %d bytes with the same-host path on "
               "(the pushes are %d)" % (sent[0], payload))
        # GRADLINK_HOST groups deliberately: two namespaces named alike are one host.
        sent, logs = job("two namespaces, GRADLINK_HOST=box", [0, 1], 0, {"GRADLINK_HOST": "box"})
        for i, log in enumerate(logs):
            expect("same-host path on (2 workers on host box" in log,
                   "worker %d with GRADLINK_HOST=box did not take the same-host path:\n%s" % (
                       i, log[-2000:]))
        expect(sent[1] < payload // 10, "host 1 sent %d bytes with the same-host path on" % sent[1])


def case_hier(a):
    H, L, k = 2, 2, 2
    sizes = list(nc.sizes_of(64 << 10, 1 << 20, 4))  # 64K 256K 1M
    big = sizes[-1]
    iters, warmup = 3, 1
    workers = nc.hier_workers(H, L)
    expect(workers == [0, 0, 1, 1], "host-major placement of 2 x 2 is %s" % workers)
    servers = [(H + i, None) for i in range(k)]
    worker_hosts = list(range(H))
    in_force = re.compile(r"worker (\d+) in force: .*?\bhost (\S+?)/\d+")
    t0 = time.monotonic()
    with nc.Cluster(H + k, 1e9) as cl:
        def job(mode, sz, n_iters, logs):
            env = {"GRADLINK_LOG_LEVEL": "info"}
            if mode == "flat":
                env["GRADLINK_HIERARCHICAL"] = "0"
            wk = []
            # Every element of every result is checked by gradlink-bench (a wrong one fails it).
            rows = nc.run_gradlink(cl, a.bin_dir, workers, servers, sz, n_iters, warmup,
                                   extra_env=env, worker_procs=wk, ranks=True, timeout=60)
            logs.append([p.err() for p in wk])
            return rows

        measured = {}
        for mode in ("hier", "flat"):
            logs, record = [], {}
            rows = nc.per_size_jobs(cl, worker_hosts, sizes, iters + warmup,
                                    lambda sz: job(mode, sz, iters, logs), record)
            # Bytes of the timed steps alone: two jobs of the largest size that differ only in
            # their number of timed steps; their difference has no start, no warmup.
            extra = 4
            _, short = nc.host_bytes(cl, worker_hosts, lambda: job(mode, [big], iters, logs),
                                     1, 1)
            _, long_ = nc.host_bytes(cl, worker_hosts,
                                     lambda: job(mode, [big], iters + extra, logs), 1, 1)
            timed = [((l[0] - s_[0]) / (extra * big), (l[1] - s_[1]) / (extra * big))
                     for s_, l in zip(short, long_)]
            on = [any(nc.HIER_ON.search(x) for x in j) for j in logs]
            measured[mode] = (timed, on)
            print("gradlink-%s: %s" % (mode, " ".join(
                "%s:%.1fms" % (nc.human(z), rows[z][0] / 1e3) for z in sizes)))
            for z in sizes:
                print("  %s: per host per step (job of that size, start and warmup included): %s"
                      % (nc.human(z), " ".join("h%d tx %.3f rx %.3f M" % (h, tx, rx)
                                                for h, (tx, rx) in enumerate(record[z][0]))))
            print("  %s, timed steps only (difference of %d and %d timed steps): %s" % (
                nc.human(big), iters, iters + extra,
                " ".join("h%d tx %.3f rx %.3f M" % (h, tx, rx) for h, (tx, rx) in enumerate(timed))))
            print("  workers logged \"hierarchical on\" in %d of %d jobs" % (sum(on), len(on)))
            # Rank r on host r // L: the workers name their host in their "in force" line.
            for j in logs:
                hosts = {}
                for text in j:
                    m = in_force.search(text)
                    if m:
                        hosts[int(m.group(1))] = m.group(2)
                if len(hosts) != len(workers):
                    print("  (no \"in force\" line naming each worker's host: placement by "
                          "rank not checked)")
                    break
                for r in range(len(workers)):
                    same = [q for q in range(len(workers)) if hosts[q] == hosts[r]]
                    expect(same == [q for q in range(len(workers)) if workers[q] == workers[r]],
                           "%s: rank %d shares its host %s with ranks %s, expected host-major "
                           "placement %s" % (mode, r, hosts[r], same, workers))

        timed, on = measured["flat"]
        expect(not any(on), "gradlink-flat (GRADLINK_HIERARCHICAL=0) said \"hierarchical on\"")
        # Flat: every worker pushes M and pulls M through its host's link.
        for h, (tx, rx) in enumerate(timed):
            expect(0.95 * L <= tx <= 1.3 * L and 0.95 * L <= rx <= 1.3 * L,
                   "gradlink-flat: host %d moved tx %.3f rx %.3f x M per step, expected about "
                   "%d (L workers' pushes and pulls)" % (h, tx, rx, L))
        timed, on = measured["hier"]
        if any(on) and not all(on):
            raise Failure("gradlink-hier said \"hierarchical on\" in %d of %d jobs only" % (
                sum(on), len(on)))
        if all(on):
            for h, (tx, rx) in enumerate(timed):
                expect(tx <= 1.3 and rx <= 1.3,
                       "gradlink-hier: host %d moved tx %.3f rx %.3f x M per timed step, more "
                       "than 1.3 x M: the host's workers did not sum among themselves first" % (
                           h, tx, rx))
            expect(all(tx >= 0.9 for tx, _ in timed),
                   "gradlink-hier: a host sent less than its M per step: %s" % timed)
            print("hierarchy on: every host moved <= 1.3 x M each way per timed step")
        else:
            print("hierarchy not active in these binaries: byte bound not checked")
    print("library runs: %.1f s" % (time.monotonic() - t0))

    # The scenario from the command line: its table has both systems and the host bytes.
    # A harness that runs past the budget gets SIGTERM: it removes its namespaces and exits.
    p = subprocess.Popen(harness_cmd("--scenario", "hier", "--hosts", "2", "--local", "2", "-k", "2",
                                     "-b", "64K", "-e", "256K", "--iters", "2", "--warmup", "1",
                                     "--repeats", "1", "--baselines", "none", "--link-check", "0",
                                     "--results", "-", "--bin", a.bin_dir),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=max(20, a.budget - 10 - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        raise Failure("netcluster --scenario hier ran past the budget (stopped: %s):\n%s\n%s" % (
            p.returncode, out[-3000:], err[-3000:]))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    expect(p.returncode == 0, "netcluster --scenario hier failed (%d):\n%s\n%s" % (
        p.returncode, out[-3000:], err[-3000:]))
    head = [ln for ln in out.splitlines() if ln.startswith("| system |")]
    expect(head and "host tx/M" in head[0] and "host rx/M" in head[0] and "x flat" in head[0],
           "no host bytes columns in:\n" + out)
    width = head[0].count("|")
    for name in ("gradlink-hier", "gradlink-flat"):
        rows = [ln for ln in out.splitlines()
                if ln.startswith("| %s |" % name) and ln.count("|") == width]
        expect(len(rows) == 2, "expected a %s row per size (2) in:\n%s" % (name, out))
        # ... | host tx/M | host rx/M | model tx,rx/M | host stage (rank 0) |
        expect(all(re.search(r"\| \d+\.\d{3} \| \d+\.\d{3} \| \d+\.\d{3} \| [^|]+ \|$", ln)
                   for ln in rows), "%s: no host tx/M, rx/M and model in its rows:\n%s" % (
                       name, "\n".join(rows)))
    print("netcluster --scenario hier: a table per size with gradlink-hier and gradlink-flat")


def harness_cmd(*args):
    return [sys.executable, HARNESS] + list(args)


def start_hold(budget_end):
    p = subprocess.Popen(harness_cmd("--scenario", "hold", "--workers", "2", "--link-check", "0",
                                     "--results", "-"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    line = ""
    while time.monotonic() < budget_end:
        line = p.stdout.readline()
        if not line or line.startswith("ready "):
            break
    expect(line.startswith("ready "), "the hold harness did not get ready: %r (exit %s)" % (
        line, p.poll()))
    return p, line.split()[1]


def idle_pids(prefix):
    pids = []
    for ns in ours(prefix):
        pids += [int(x) for x in nc.sh(["ip", "netns", "pids", ns], check=False).split()]
    return pids


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie of ours is gone too.
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ")[1].startswith("Z")
    except OSError:
        return True


def case_cleanup(a):
    end = time.monotonic() + a.budget - 5
    # 1. The body fails: everything goes, the processes inside too.
    prefix, sleepers = None, []
    try:
        with nc.Cluster(3, 1e9, log=lambda m: None) as cl:
            prefix = cl.prefix
            sleepers = [cl.spawn(h, "idle", ["sleep", "600"]) for h in range(3)]
            expect(len(ours(prefix)) == 4, "expected 4 namespaces, found %s" % ours(prefix))
            raise RuntimeError("deliberate failure")
    except RuntimeError:
        pass
    expect(not ours(prefix), "namespaces left after a failure: %s" % ours(prefix))
    expect(all(p.popen.poll() is not None for p in sleepers), "processes left after a failure")
    print("failure inside the cluster: everything removed")

    # 2. SIGTERM and SIGINT of a running harness.
    for sig, want in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)):
        p, prefix = start_hold(end)
        try:
            expect(len(ours(prefix)) == 3, "hold: expected 3 namespaces %s*, found %s" % (
                prefix, ours(prefix)))
            pids = idle_pids(prefix)
            expect(len(pids) == 2, "hold: expected one idle process per host, found %s" % pids)
            # --cleanup leaves a running harness alone.
            out = subprocess.run(harness_cmd("--cleanup"), capture_output=True, text=True,
                                 timeout=60)
            expect(out.returncode == 0, "--cleanup failed: %s" % out.stderr)
            expect(len(ours(prefix)) == 3, "--cleanup removed a running harness's namespaces")
            p.send_signal(sig)
            rc = p.wait(timeout=30)
            expect(rc == want, "%s: harness exited with %d, expected %d" % (sig.name, rc, want))
            expect(not ours(prefix), "%s: namespaces left: %s" % (sig.name, ours(prefix)))
            time.sleep(0.2)
            expect(all(gone(x) for x in pids), "%s: idle processes survived: %s" % (
                sig.name, [x for x in pids if not gone(x)]))
            print("%s: harness exited %d, everything removed" % (sig.name, rc))
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            p.stdout.close()
            for ns in ours(prefix):
                nc.remove_namespace(ns)

    # 3. --cleanup removes what a killed harness left: a namespace named after a dead pid,
    #    with a process inside.
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = "glnc%d-c1-h0" % dead.pid
    expect(not nc.pid_is_harness(dead.pid), "pid %d was reused" % dead.pid)
    nc.sh(["ip", "netns", "add", ns])
    sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"], start_new_session=True)
    try:
        time.sleep(0.2)
        out = subprocess.run(harness_cmd("--cleanup"), capture_output=True, text=True, timeout=60)
        expect(out.returncode == 0, "--cleanup failed: %s%s" % (out.stdout, out.stderr))
        expect(ns not in nc.list_namespaces(), "--cleanup left %s: %s" % (ns, out.stdout))
        expect(sleeper.wait(timeout=10) is not None, "--cleanup left the process inside")
        print("--cleanup removed %s and its process" % ns)
    finally:
        if sleeper.poll() is None:
            os.killpg(sleeper.pid, signal.SIGKILL)
            sleeper.wait()
        if ns in nc.list_namespaces():
            nc.remove_namespace(ns)


def case_train(a):
    script = os.path.join(os.path.dirname(HARNESS), "train_cluster.py")
    if not nc.python_with_torch():
        print("SKIPPED: no python with torch")
        sys.exit(nc.SKIP)
    small = [nc.python_with_torch(), script, "--bin", a.bin_dir, "-n", "2", "-k", "1",
             "--width", "256", "--layers", "2", "--steps", "1", "--warmup", "1", "--repeats", "1",
             "--results", "-", "--plot", ""]
    p = subprocess.run(small + ["--keep-heap"], capture_output=True, text=True,
                       timeout=a.budget / 2)
    expect(p.returncode == 0, "train_cluster failed (%d):\n%s\n%s" % (p.returncode, p.stdout, p.stderr))
    for method in ("gloo-ddp", "gradlink-opt", "gradlink-hook", "gradlink-opt-tuned"):
        rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| %s |" % method)]
        expect(len(rows) == 1, "no row for %s in:\n%s" % (method, p.stdout))
    expect("bit-identical parameters" in p.stdout, p.stdout)
    expect("MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184 (--keep-heap)" in p.stdout,
           "--keep-heap is not reported:\n" + p.stdout)
    expect("gradlink-opt P=64K F=1M A=128K (partition_bytes max_bytes_in_flight max_bytes_ahead "
           "chosen by gradlink" in p.stdout, "the tuner's choice is not reported:\n" + p.stdout)
    p = subprocess.run(small + ["--methods", "gloo-ddp,gradlink-opt", "--tolerance", "-1"],
                       capture_output=True, text=True, timeout=a.budget / 2)
    expect(p.returncode == 1 and "gradlink-opt's final parameters differ from gloo-ddp's" in p.stderr,
           "a tolerance no run can meet did not fail the run (%d):\n%s\n%s" % (
               p.returncode, p.stdout, p.stderr))


class EmulatedHostNames:
    """A host name for each of the cluster's hosts, resolvable inside every namespace
    (/etc/netns/NS/hosts, removed on exit)."""

    def __init__(self, cl):
        self.cl = cl
        self.names = ["%sh%d" % (cl.prefix, h) for h in range(cl.hosts)]
        self.dirs = []

    def __enter__(self):
        lines = ["127.0.0.1 localhost"] + ["%s %s" % (self.cl.ip(h), n)
                                          for h, n in enumerate(self.names)]
        for h in range(self.cl.hosts):
            d = os.path.join("/etc/netns", self.cl.ns(h))
            os.makedirs(d, exist_ok=True)
            self.dirs.append(d)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")
        return self.names

    def __exit__(self, *exc):
        import shutil
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def case_torchrun(a):
    """Two hosts of two workers each, started the torch way with nothing gradlink-specific:
    `torchrun --nnodes 2 --node_rank R --nproc_per_node 2 --master_addr H0 --master_port P`
    on each host (and with `--rdzv_backend c10d --rdzv_endpoint H0:P` instead), DDP over init_process_group("gradlink") (the backend's rendezvous makes the
    job: a scheduler on rank 0, a server on each host); then gradlink-run with torchrun's flags
    on each host, a Horovod-style script (gradlink.torch.init())."""
    py = nc.python_with_torch()
    if not py:
        print("SKIPPED: no python with torch")
        sys.exit(nc.SKIP)
    script = os.path.join(REPO, "tests", "python", "jobs", "c10d_torchrun.py")
    build = os.path.dirname(os.path.abspath(a.bin_dir))
    env = {"PYTHONPATH": os.path.join(REPO, "python"), "GRADLINK_BUILD_DIR": build,
           "UCX_TLS": "tcp", "UCX_NET_DEVICES": nc.IFACE, "GLOO_SOCKET_IFNAME": nc.IFACE,
           "OMP_NUM_THREADS": "1", "GRADLINK_SECRET": "%064x" % random.getrandbits(256)}
    with nc.Cluster(2, 1e9) as cl, EmulatedHostNames(cl) as names:
        torchrun = [py, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1"]
        for label, launcher, mode in (
                ("torchrun", torchrun, "backend"),
                ("torchrun --rdzv_backend c10d", torchrun, "backend"),
                ("gradlink-run", [py, os.path.join(REPO, "tools", "gradlink-run"),
                                  "--bin-dir", a.bin_dir], "init")):
            port = random.randint(20000, 40000)
            procs = []
            for node in range(2):
                if "rdzv" in label:
                    # Elastic rendezvous: no node ranks; the agent whose host name is the
                    # endpoint's hosts the store. The namespaces share the machine's host name,
                    # so each emulated host gets its own (a UTS namespace) and an /etc/hosts
                    # naming both (ip netns exec mounts /etc/netns/NS/hosts over it).
                    argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                            names[node]] + launcher + [
                                "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
                                "--rdzv_id", "job%d" % port,
                                "--rdzv_endpoint", "%s:%d" % (names[0], port)]
                else:
                    argv = launcher + ["--nnodes", "2", "--node_rank", str(node),
                                       "--nproc_per_node", "2", "--master_addr", cl.ip(0),
                                       "--master_port", str(port)]
                argv += (["--", py] if label == "gradlink-run" else []) + [script, mode]
                procs.append(cl.spawn(node, "%s-node%d" % (label.split()[0], node), argv, env))
            cl.wait_all(procs, a.budget / 3, label)
            text = "".join(p.out() + p.err() for p in procs)
            for r in range(4):
                expect("C10D TORCHRUN OK rank %d mode %s" % (r, mode) in text,
                       "%s: rank %d did not finish:\n%s" % (label, r, text[-4000:]))
            print("%s: 2 nodes x 2 workers, every rank OK" % label)
        # tcp:// with no MASTER_ADDR: rank 1 finds which of rank 0's addresses reaches it.
        port = random.randint(20000, 40000)
        procs = [cl.spawn(r, "tcp-rank%d" % r, [py, script, "tcp",
                                                "tcp://%s:%d" % (cl.ip(0), port)],
                          dict(env, RANK=str(r), WORLD_SIZE="2", C10D_EXPECT_SERVERS="2"))
                 for r in range(2)]
        cl.wait_all(procs, a.budget / 4, "tcp://")
        text = "".join(p.out() + p.err() for p in procs)
        for r in range(2):
            expect("C10D TORCHRUN OK rank %d mode tcp" % r in text,
                   "tcp://: rank %d did not finish:\n%s" % (r, text[-4000:]))
        print("tcp:// without MASTER_ADDR: 2 hosts, a server on each, every rank OK")


CASES = {"smoke": case_smoke, "hosts": case_hosts, "cleanup": case_cleanup, "train": case_train,
         "hier": case_hier, "torchrun": case_torchrun}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--budget", type=float, default=60)
    ap.add_argument("case", choices=sorted(CASES))
    a = ap.parse_args()
    try:
        nc.check_available()
    except nc.Unavailable as e:
        print("SKIPPED: %s" % e)
        return nc.SKIP
    nc.install_signal_handlers()
    t0 = time.monotonic()
    try:
        CASES[a.case](a)
    except (Failure, nc.RunError) as e:
        print("FAILED: %s" % e)
        return 1
    print("PASSED (%.1f s)" % (time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
