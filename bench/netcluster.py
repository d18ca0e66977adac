#!/usr/bin/python3
# Over 600 lines on purpose: one benchmark tool (the emulated cluster, the scenarios, the tables).
"""bench/netcluster: gradlink, Gloo and Open MPI on an emulated cluster of network namespaces.

The cluster: H hosts, each a network namespace with one interface `nc0` (a veth pair whose
other end is a port of the bridge br0, which lives in a namespace of its own), addresses
10.213.0.1 ... only inside those namespaces, and every host link shaped with tc tbf to --rate in
both directions (tbf on the host end's egress shapes host -> bridge, on the bridge end's egress
bridge -> host). UCX is forced onto TCP over nc0 (UCX_TLS=tcp, UCX_NET_DEVICES=nc0): shared
memory would bypass the shaped links. Gloo uses GLOO_SOCKET_IFNAME=nc0, Open MPI btl tcp over
nc0 (mpirun starts its daemons through `ip netns exec`, the namespace name is the host name,
and each daemon gets that host name in a UTS namespace of its own).
Everything the harness creates is named glnc<pid>-..., and is removed afterwards, also on
Ctrl-C, SIGTERM or failure; `--cleanup` removes what a killed run left (namespaces whose
owning harness process is gone, and the processes inside them).

Needs root, iproute2 (ip, tc) and network namespaces; where they are missing it says so and
exits with status 77 (skipped).

Scenarios (n = --workers worker hosts, k = each of --servers):
  ps         gradlink with n worker hosts and k dedicated server hosts, for each k, beside the
             baselines (--baselines) on the same n worker hosts. Model: the PS bound
             max(M/B, nM/(kB)).
  mixed      fewer server hosts than worker hosts: every worker host also runs a server shard,
             with the BytePS split (bench/placement_model.py: mixed_shares / mixed_time);
             k = 0 means servers only on the worker hosts. Model: 2n(n-1)M/((n^2+kn-2k)B).
  lanes      the ps runs with separate push/pull lanes and with --single-lane, side by side.
  baselines  Gloo ring all-reduce (torch.distributed) and Open MPI (TCP) on the n worker hosts.
             Model: the ring bound 2(n-1)/n * M/B.
  hier       workers sharing hosts: --hosts H worker hosts x --local L workers each (the L in
             one namespace: one host; ranks host-major, host h has ranks hL .. hL+L-1), k server
             hosts (-k, default H). gradlink-hier (gradlink's defaults: the workers of a host sum
             through shared memory, a host moves M each way), gradlink-flat
             (GRADLINK_HIERARCHICAL=0: each worker moves M, a host L x M), and the baselines
             with the same placement (L ranks per namespace). Every system runs one job per size
             and the table adds the busiest worker host's NIC bytes per step per tensor byte (tx
             and rx, from the nc0 counters over that size's job) against the model's: hier 1.0,
             flat L, ring 2(N-1)/N. Model: max(M/B, HM/(kB)), times L for flat. Default sizes
             16M-64M.
  all        ps, mixed, lanes (one table each; the baselines are run once, in ps).
  hold       (for tests) set up the cluster, start an idle process on every host, print
             "ready PREFIX" and wait for a signal.

gradlink runs with no tuning flags unless told otherwise: what it chooses for the job itself
(docs/operations.md, "What gradlink tunes"; over these links, 64K partitions, 128K ahead per
server, a 1M window, UCX_TCP_RCVBUF and UCX_TCP_TX_SEG_SIZE 64k). --partition-bytes, --max-in-flight and
--max-ahead set them (comma-separated: a sweep; 0: gradlink's choice); --grid runs gradlink's
choice beside the fixed tuned grid the defaults are held against (P 64K/128K/1M x lead
128K/256K/512K per server, F = 1M, the UCX settings above).
Small partitions let the pull stream start early (a server answers a partition only once all
n workers pushed it); a small window keeps the n workers' push streams in step, so every
server's partitions complete at the rate they arrive (with a 32 MiB window and no lead limit a
worker's flows to the k servers drift apart and the pulls trail the pushes).

Every run checks every element of every result (gradlink-bench, gloo_allreduce.py and
mpi_allreduce all do); a wrong value fails the benchmark. Repeats (--repeats) are interleaved
(repeat 1 of every system, then repeat 2, ...); the tables give the median over repeats of each
run's mean time, with min / max. A table per size gives per system: time, algbw (GB/s, Gbit/s),
the fraction of the link rate, the model's time and measured/model, gradlink's speedup over
Gloo and over MPI; and per system the busiest link's bytes per model byte against the model's
(byte counters of the veths: placement and routing checked apart from timing). In --results
(bench/RESULTS.md) each scenario run replaces its own section, between the lines
`<!-- netcluster-SCENARIO:begin -->` and `<!-- netcluster-SCENARIO:end -->` (added at the end if
missing; nothing else in the file changes), with one table per scenario (of model and the
speedups per system and size, the commit, the command, the options that differ from the
defaults); the full tables are appended to --history (default: history/RESULTS-YYYY-MM.md beside
--results; bench/results_md.py). A system whose run fails is reported as FAILED and not run
again; the others go on; the exit status is then 1.

  bench/netcluster --scenario ps --workers 4 --servers 4,2 --results /tmp/nc.md
  bench/netcluster --scenario mixed --workers 4 --servers 0,1,2,4
  bench/netcluster --scenario ps --servers 4 --partition-bytes 64K,256K,1M --baselines none
  bench/netcluster --scenario hier --hosts 2 --local 4 -k 2 --mtu 9000
  bench/netcluster --cleanup
"""

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
SKIP = 77  # exit status when root / iproute2 / network namespaces are unavailable (ctest skip)

PREFIX_RE = re.compile(r"^glnc(\d+)-")
IFACE = "nc0"          # the host's interface, in every host namespace
BRIDGE = "br0"         # the bridge, in the bridge namespace
SUBNET = "10.213.0"    # host i has SUBNET.(i+1)/24, only inside the cluster's namespaces
MAX_HOSTS = 250
MIB = 1 << 20


class Unavailable(Exception):
    """Root, iproute2 or network namespaces are missing; the message says which."""


class RunError(Exception):
    """A command or a benchmark run failed; the message carries what it printed."""


# ---- small helpers ----------------------------------------------------------------------------


def sh(argv, timeout=30, check=True, input_text=None):
    """Runs argv (no shell), returns its stdout; raises RunError naming the command otherwise."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input_text)
    except FileNotFoundError:
        raise RunError("%s: command not found" % argv[0])
    except subprocess.TimeoutExpired:
        raise RunError("%s: no answer within %d s" % (" ".join(argv), timeout))
    if check and p.returncode != 0:
        raise RunError("`%s` failed (%d): %s" % (" ".join(argv), p.returncode,
                                                 (p.stderr or p.stdout).strip()))
    return p.stdout


def parse_size(text):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError("bad size '%s' (e.g. 65536, 64K, 4M)" % text)
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def human(nbytes):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return "%d%s" % (nbytes // div, unit)
    return str(nbytes)


def parse_rate(text):
    """tc's rate syntax (SI units, bits per second): 1gbit, 500mbit, 100kbit, 1000000bit."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError("bad rate '%s' (e.g. 1gbit, 500mbit)" % text)
    bps = float(m.group(1)) * {None: 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
                               "tbit": 1e12}[m.group(2)]
    if bps < 1e6:
        raise argparse.ArgumentTypeError("rate %s is below 1 mbit" % text)
    return bps


def fmt_rate(bps):
    return "%g Gbit/s" % (bps / 1e9) if bps >= 1e9 else "%g Mbit/s" % (bps / 1e6)


def sizes_of(begin, end, factor, elem=4):
    """The sizes gradlink-bench, gloo_allreduce.py and mpi_allreduce run for -b/-e/-f."""
    b = max(begin, elem)
    while b <= end:
        yield b - b % elem
        b = max(b + elem, int(b * factor))


try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent():
    # Runs between fork and exec: only what was looked up before the fork.
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def pid_is_harness(pid):
    """True when `pid` is a live process running this harness (or a test that imports it)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return b"netcluster" in f.read()
    except OSError:
        return False


class signals_blocked:
    """Keeps SIGINT/SIGTERM/SIGHUP pending while the body runs (teardown is not interrupted)."""
    SIGS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def __enter__(self):
        self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGS)

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self.old)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def install_signal_handlers():
    """SIGTERM and SIGHUP end the harness like Ctrl-C does: through every finally block. SIGINT
    is set explicitly: a shell starts background jobs with it ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGHUP, _raise_exit)


# ---- availability and leftovers ---------------------------------------------------------------


def check_available():
    """Raises Unavailable with the reason when this machine cannot run the emulated cluster."""
    if not sys.platform.startswith("linux"):
        raise Unavailable("network namespaces need Linux (this is %s)" % sys.platform)
    if os.geteuid() != 0:
        raise Unavailable("needs root to create network namespaces and tc qdiscs "
                          "(running as uid %d)" % os.geteuid())
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise Unavailable("`%s` not found: install iproute2" % tool)
    a, b = "glnc%d-probe-a" % os.getpid(), "glnc%d-probe-b" % os.getpid()
    made = []
    try:
        for ns in (a, b):
            sh(["ip", "netns", "add", ns])
            made.append(ns)
        sh(["ip", "link", "add", IFACE, "netns", a, "type", "veth", "peer", "name", "p0",
            "netns", b])
        sh(["tc", "-n", a, "qdisc", "add", "dev", IFACE, "root", "tbf", "rate", "1gbit",
            "burst", "128kb", "latency", "10ms"])
        sh(["ip", "-n", b, "link", "add", BRIDGE, "type", "bridge"])
    except RunError as e:
        raise Unavailable("network namespaces, veth, bridge or tbf unavailable here: %s" % e)
    finally:
        for ns in made:
            sh(["ip", "netns", "del", ns], check=False)


def list_namespaces():
    out = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_namespace(ns):
    """Kills every process inside `ns` (only harness-made namespaces come here), then deletes it.
    Returns an error string, or None."""
    for _ in range(3):
        pids = [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).split() if p.isdigit()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    try:
        sh(["ip", "netns", "del", ns])
    except RunError as e:
        return str(e)
    # What a test put in /etc/netns/NS (files ip netns exec mounts over /etc: an emulated
    # host's /etc/hosts) goes with it.
    shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
    return None


def cleanup_leftovers(include_live=False, quiet=False):
    """Removes namespaces named glnc<pid>-... whose harness process <pid> is gone (all of them
    with include_live). Returns the names removed."""
    removed, errors = [], []
    for ns in list_namespaces():
        m = PREFIX_RE.match(ns)
        if not m:
            continue
        owner = int(m.group(1))
        if owner == os.getpid() or (pid_is_harness(owner) and not include_live):
            continue
        err = remove_namespace(ns)
        (errors.append("%s: %s" % (ns, err)) if err else removed.append(ns))
    if not quiet:
        for ns in removed:
            print("netcluster: removed leftover namespace %s" % ns)
    if errors:
        raise RunError("could not remove: " + "; ".join(errors))
    return removed


# ---- the cluster ------------------------------------------------------------------------------


class Proc:
    def __init__(self, name, host, argv, popen, out_path, err_path):
        self.name, self.host, self.argv, self.popen = name, host, argv, popen
        self.out_path, self.err_path = out_path, err_path

    def rc(self):
        return self.popen.poll()

    def out(self):
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def err(self):
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def tail(self, lines=25):
        text = []
        for label, body in (("stdout", self.out()), ("stderr", self.err())):
            rows = body.splitlines()[-lines:]
            if rows:
                text.append("  [%s]\n" % label + "\n".join("    " + r for r in rows))
        return "----- %s on host %d (exit %s): %s\n%s" % (
            self.name, self.host, self.rc(), " ".join(self.argv), "\n".join(text))


class Cluster:
    """H emulated hosts. Use as a context manager: `with Cluster(...) as cl:`; everything made
    (namespaces, links, qdiscs, processes) is removed on exit, whatever the exit."""

    _count = 0

    def __init__(self, hosts, rate_bps, burst=None, latency_ms=10.0, mtu=1500, workdir=None,
                 log=print):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError("hosts must be in [1, %d], got %d" % (MAX_HOSTS, hosts))
        Cluster._count += 1
        self.prefix = "glnc%d-c%d-" % (os.getpid(), Cluster._count)
        self.hosts, self.rate_bps, self.mtu, self.latency_ms = hosts, rate_bps, mtu, latency_ms
        # The bucket must hold a whole GSO packet (64 KiB; veth offloads are on) or tbf splits
        # every one of them; a larger one lets an idle link send that much at memory speed.
        # 1 ms of the rate, at least 128 KiB: a single TCP stream reaches 0.95 of 1 Gbit/s.
        self.burst = burst or max(128 << 10, int(rate_bps / 8 / 1000))
        self.log = log
        self.namespaces = []
        self.procs = []
        self._own_tmp = workdir is None
        self.tmp = workdir or tempfile.mkdtemp(prefix="netcluster-")
        self._n = 0

    # names and addresses
    def ns(self, host):
        return "%sh%d" % (self.prefix, host)

    @property
    def bridge_ns(self):
        return self.prefix + "br"

    def ip(self, host):
        return "%s.%d" % (SUBNET, host + 1)

    def tbf(self, ns, dev):
        return ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                "%dbit" % int(self.rate_bps), "burst", str(self.burst), "latency",
                "%gms" % self.latency_ms]

    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc):
        self.down()
        return False

    def _add_ns(self, ns):
        sh(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        # No IPv6 autoconfiguration chatter on the shaped links.
        sh(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
           check=False)

    def up(self):
        t0 = time.monotonic()
        br = self.bridge_ns
        self._add_ns(br)
        sh(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        sh(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        for h in range(self.hosts):
            ns, port = self.ns(h), "p%d" % h
            self._add_ns(ns)
            # Created directly inside the namespaces: no name ever exists in the caller's one.
            sh(["ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", br])
            sh(["ip", "-n", br, "link", "set", port, "mtu", str(self.mtu), "master", BRIDGE])
            sh(["ip", "-n", br, "link", "set", port, "up"])
            sh(["ip", "-n", ns, "link", "set", IFACE, "mtu", str(self.mtu)])
            sh(["ip", "-n", ns, "addr", "add", self.ip(h) + "/24", "dev", IFACE])
            sh(["ip", "-n", ns, "link", "set", IFACE, "up"])
            sh(self.tbf(ns, IFACE))        # host -> bridge
            sh(self.tbf(br, port))         # bridge -> host
        self.log("netcluster: %d hosts %s..h%d (%s), links %s (tbf burst %d B, latency %g ms, "
                 "mtu %d), set up in %.1f s" % (self.hosts, self.ns(0), self.hosts - 1, self.ip(0),
                                                 fmt_rate(self.rate_bps), self.burst,
                                                 self.latency_ms, self.mtu, time.monotonic() - t0))

    def down(self):
        with signals_blocked():
            for p in self.procs:
                if p.popen.poll() is None:
                    try:
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            errors = []
            for ns in reversed(self.namespaces):
                err = remove_namespace(ns)
                if err:
                    errors.append(err)
            self.namespaces = []
            if self._own_tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
            if errors:
                print("netcluster: could not remove everything (run bench/netcluster --cleanup): "
                      + "; ".join(errors), file=sys.stderr)

    # processes
    def spawn(self, host, name, argv, env=None):
        self._n += 1
        stem = os.path.join(self.tmp, "%04d-%s" % (self._n, name))
        full_env = dict(os.environ)
        full_env.update(env or {})
        with open(stem + ".out", "wb") as out, open(stem + ".err", "wb") as err:
            popen = subprocess.Popen(["ip", "netns", "exec", self.ns(host)] + list(argv),
                                     stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                     env=full_env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        p = Proc(name, host, list(argv), popen, stem + ".out", stem + ".err")
        self.procs.append(p)
        return p

    def kill(self, procs):
        for p in procs:
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.popen.wait(timeout=10)

    def describe(self, hosts):
        """The processes inside these hosts' namespaces, one line per host (for diagnostics)."""
        lines = []
        for h in hosts:
            pids = sh(["ip", "netns", "pids", self.ns(h)], check=False).split()
            ps = sh(["ps", "-o", "pid=,stat=,args=", "-p", ",".join(pids)], check=False) if pids else ""
            lines.append("host %d: %s" % (h, "; ".join(" ".join(x.split()[:3]) for x in ps.splitlines())))
        return "\n".join(lines)

    def kill_inside(self, hosts):
        """Kills every process left inside these hosts' namespaces (all of them were started
        by this harness: a daemon that detached from the process it was started by)."""
        for h in hosts:
            for pid in sh(["ip", "netns", "pids", self.ns(h)], check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def wait_all(self, procs, timeout, label):
        """Waits until every process exited 0; raises RunError (with their output) as soon as
        one exits otherwise or when `timeout` seconds are up. Kills them all on any failure."""
        end = time.monotonic() + timeout
        pending = list(procs)
        try:
            while pending:
                for p in list(pending):
                    rc = p.popen.poll()
                    if rc is None:
                        continue
                    pending.remove(p)
                    if rc != 0:
                        time.sleep(0.5)  # let the others say what they saw
                        raise RunError("%s: %s exited with %d\n%s" % (
                            label, p.name, rc, "\n".join(q.tail() for q in procs)))
                if pending and time.monotonic() > end:
                    raise RunError("%s: %s still running after %.0f s\n%s" % (
                        label, ", ".join(p.name for p in pending), timeout,
                        "\n".join(q.tail() for q in procs)))
                time.sleep(0.02)
        finally:
            self.kill(procs)

    def wait_for(self, proc, pattern, timeout):
        """Waits for `pattern` in proc's stdout; returns the match."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, proc.out())
            if m:
                return m
            if proc.rc() is not None:
                raise RunError("%s exited with %d before printing /%s/\n%s" % (
                    proc.name, proc.rc(), pattern, proc.tail()))
            time.sleep(0.02)
        raise RunError("%s printed no /%s/ within %d s\n%s" % (proc.name, pattern, timeout,
                                                               proc.tail()))

    def link_bytes(self, host):
        """(tx, rx) byte counters of the host's interface."""
        out = sh(["ip", "-n", self.ns(host), "-s", "-j", "link", "show", "dev", IFACE])
        st = json.loads(out)[0]["stats64"]
        return st["tx"]["bytes"], st["rx"]["bytes"]

    @contextlib.contextmanager
    def timeline(self, period_s=0.002):
        """Samples every host link's byte counters (at its bridge port) every `period_s` while
        the block runs. Yields a list that afterwards holds rows (t_s, [up_0, down_0, up_1, ...]):
        the bytes each host sent (up) and received (down) since the previous row."""
        code = r"""
import signal, sys, time
ports, period, out = sys.argv[1].split(","), float(sys.argv[2]), sys.argv[3]
files = [open("/sys/class/net/%s/statistics/%s" % (p, c)) for p in ports
         for c in ("rx_bytes", "tx_bytes")]  # the port receives what its host sends (up)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
rows = []
print("sampling", flush=True)
while not stop:
    row = [time.monotonic()]
    for f in files:
        f.seek(0)
        row.append(int(f.read()))
    rows.append(row)
    time.sleep(period)
with open(out, "w") as f:
    f.write("\n".join(" ".join(str(x) for x in r) for r in rows))
"""
        out = os.path.join(self.tmp, "timeline-%d.txt" % time.monotonic_ns())
        ports = ",".join("p%d" % h for h in range(self.hosts))
        p = subprocess.Popen(["ip", "netns", "exec", self.bridge_ns, sys.executable, "-c", code,
                              ports, repr(period_s), out], stdout=subprocess.PIPE, text=True,
                             preexec_fn=_die_with_parent)
        rows = []
        try:
            if p.stdout.readline().strip() != "sampling":
                raise RunError("the link sampler did not start")
            yield rows
        finally:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with open(out) as f:
            raw = [[float(x) for x in line.split()] for line in f if line.strip()]
        os.unlink(out)
        for prev, cur in zip(raw, raw[1:]):
            rows.append((cur[0] - raw[0][0], [int(c - b) for c, b in zip(cur[1:], prev[1:])]))

    def tcp_check(self, src, dst, seconds=1.0, port=5201):
        """One TCP stream src -> dst for `seconds`; returns the receiver's goodput in bit/s."""
        code = r"""
import socket, sys, time
if sys.argv[1] == "recv":
    s = socket.socket(); s.bind((sys.argv[2], int(sys.argv[3]))); s.listen(1)
    print("listening", flush=True)
    s.settimeout(30); c, _ = s.accept(); c.settimeout(30)
    buf = bytearray(1 << 20); n = 0; t0 = None
    while True:
        k = c.recv_into(buf)
        if not k: break
        if t0 is None: t0 = time.monotonic()
        else: n += k
    print("bps %f" % (n * 8 / (time.monotonic() - t0)), flush=True)
else:
    s = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=30)
    b = bytes(1 << 20); end = time.monotonic() + float(sys.argv[4])
    while time.monotonic() < end: s.sendall(b)
    s.close()
"""
        py = "/usr/bin/python3"
        rx = self.spawn(dst, "tcp-recv", [py, "-c", code, "recv", self.ip(dst), str(port)])
        self.wait_for(rx, r"listening", 15)
        tx = self.spawn(src, "tcp-send", [py, "-c", code, "send", self.ip(dst), str(port),
                                         str(seconds)])
        self.wait_all([tx, rx], seconds + 30, "tcp check")
        return float(re.search(r"bps (\S+)", rx.out()).group(1))


# ---- the systems ------------------------------------------------------------------------------


# The tuned grid (--grid) the defaults are held against (issue 16): partition x lead per server,
# with a 1 MiB window and the UCX settings of the hand-tuned runs (which gradlink now sets by
# itself where the user does not).
GRID_PARTITIONS = (64 << 10, 128 << 10, 1 << 20)
GRID_LEADS = (128 << 10, 256 << 10, 512 << 10)
GRID_IN_FLIGHT = 1 << 20
GRID_UCX = {"UCX_TCP_RCVBUF": "64k", "UCX_TCP_TX_SEG_SIZE": "64k"}


def gradlink_env(secret):
    return {"GRADLINK_SECRET": secret, "UCX_TLS": "tcp", "UCX_NET_DEVICES": IFACE,
            "GRADLINK_LOG_LEVEL": os.environ.get("GRADLINK_LOG_LEVEL", "warn")}


def run_time_limit(sizes, iters, warmup, rate_bps, slack=16.0, extra=60.0):
    """A generous deadline for one run: `slack` times M/B per iteration, plus a minute to start."""
    byte_s = rate_bps / 8
    return extra + slack * sum(s / byte_s * (iters + warmup) for s in sizes)


def parse_gradlink_table(text):
    """Rows of gradlink-bench's table: {size: (mean_us, min_us)}; raises on a wrong value."""
    rows = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) == 8 and f[0].isdigit():
            if f[7] != "OK":
                raise RunError("gradlink-bench found wrong values: " + line)
            rows[int(f[0])] = (float(f[3]), float(f[4]))
    return rows


def run_gradlink(cl, bin_dir, workers, servers, sizes, iters, warmup, partition=None,
                 max_in_flight=None, single_lane=False, timeout=None, extra_env=None,
                 max_ahead=None, worker_args=(), worker_procs=None, ranks=False):
    """One gradlink job: gradlink-bench workers on the hosts `workers` (list of host indices; a
    host listed L times runs L workers), gradlink-servers at `servers` (list of (host, weight or
    None)), the scheduler on workers[0]. `worker_args` go to every gradlink-bench; `worker_procs`,
    a list, gets the workers' Procs. With `ranks`, worker i claims rank i (GRADLINK_RANK=i), so
    the ranks follow `workers` (otherwise they go in the order the workers join).
    Returns {size: (mean_us, min_us)} from rank 0's table (every element checked)."""
    b, e = sizes[0], sizes[-1]
    f = sizes[1] / sizes[0] if len(sizes) > 1 else 2.0
    env = gradlink_env(secrets.token_hex(32))
    env.update(extra_env or {})
    job = "nc%d" % cl._n
    sched = cl.spawn(workers[0], "scheduler", [
        os.path.join(bin_dir, "gradlink-scheduler"), "--host", cl.ip(workers[0]), "--port", "0",
        "-w", str(len(workers)), "-s", str(len(servers)), "--job", job], env)
    m = cl.wait_for(sched, r"listening on (\S+:\d+)", 15)
    addr = m.group(1)
    procs = [sched]
    for i, (host, weight) in enumerate(servers):
        argv = [os.path.join(bin_dir, "gradlink-server"), "--scheduler", addr, "--job", job]
        if weight is not None:
            argv += ["--weight", "%.9g" % weight]
        if single_lane:
            argv.append("--single-lane")
        procs.append(cl.spawn(host, "server%d" % i, argv, env))
    wk = []
    for i, host in enumerate(workers):
        argv = [os.path.join(bin_dir, "gradlink-bench"), "--scheduler", addr, "--job", job,
                "-b", str(b), "-e", str(e), "-f", repr(f), "-n", str(iters), "--warmup", str(warmup)]
        if partition:
            argv += ["--partition-bytes", str(partition)]
        if max_in_flight:
            argv += ["--max-in-flight", str(max_in_flight)]
        if max_ahead:
            argv += ["--max-ahead", str(max_ahead)]
        if single_lane:
            argv.append("--single-lane")
        argv += list(worker_args)
        wk.append(cl.spawn(host, "worker%d" % i, argv,
                           dict(env, GRADLINK_RANK=str(i)) if ranks else env))
    procs += wk
    if worker_procs is not None:
        worker_procs.extend(wk)
    cl.wait_all(procs, timeout or run_time_limit(sizes, iters, warmup, cl.rate_bps), "gradlink job")
    rows = {}
    for p in wk:
        rows.update(parse_gradlink_table(p.out()))
    missing = [s for s in sizes if s not in rows]
    if missing:
        raise RunError("gradlink-bench printed no row for %s\n%s" % (
            missing, "\n".join(p.tail() for p in wk)))
    return rows


def parse_json_rows(text, who):
    rows = {}
    for line in text.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("check") != "OK":
                raise RunError("%s found wrong values: %s" % (who, line))
            rows[int(r["bytes"])] = (float(r["time_us"]), float(r["min_us"]))
    return rows


def python_with_torch():
    for py in (os.path.join(REPO, ".venv", "bin", "python"), "/usr/bin/python3"):
        if os.access(py, os.X_OK):
            if subprocess.run([py, "-c", "import torch.distributed"], capture_output=True).returncode == 0:
                return py
    return None


def gloo_unavailable():
    if not os.path.exists(os.path.join(BENCH, "baselines", "gloo_allreduce.py")):
        return "bench/baselines/gloo_allreduce.py is missing"
    if not python_with_torch():
        return "no python with torch.distributed (.venv/bin/python or /usr/bin/python3)"
    return None


def run_gloo(cl, workers, sizes, iters, warmup):
    py = python_with_torch()
    port = 20000 + cl._n % 10000  # a fresh port per run: no wait for the last run's TIME_WAIT
    b, e = sizes[0], sizes[-1]
    f = sizes[1] / sizes[0] if len(sizes) > 1 else 2.0
    limit = run_time_limit(sizes, iters, warmup, cl.rate_bps)
    env = {"GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1"}
    procs = []
    for r, host in enumerate(workers):
        procs.append(cl.spawn(host, "gloo%d" % r, [
            py, os.path.join(BENCH, "baselines", "gloo_allreduce.py"), "--rank", str(r),
            "--world-size", str(len(workers)), "--master-addr", cl.ip(workers[0]),
            "--master-port", str(port), "-b", str(b), "-e", str(e), "-f", repr(f),
            "-n", str(iters), "--warmup", str(warmup), "--timeout", "%d" % max(120, limit / 4)],
            env))
    cl.wait_all(procs, limit, "gloo job")
    rows = parse_json_rows(procs[0].out(), "gloo_allreduce")
    if sorted(rows) != sorted(sizes):
        raise RunError("gloo_allreduce printed sizes %s, expected %s\n%s" % (
            sorted(rows), sizes, procs[0].tail()))
    return rows


def mpi_unavailable(bin_dir):
    if not shutil.which("mpirun"):
        return "mpirun not found (apt-get install openmpi-bin)"
    if not os.access(os.path.join(bin_dir, "mpi_allreduce"), os.X_OK):
        return "%s/mpi_allreduce not built (needs libopenmpi-dev)" % bin_dir
    return None


def run_mpi(cl, bin_dir, workers, sizes, iters, warmup, log=print):
    """Open MPI across the namespaces: mpirun on workers[0] starts one orted per host through
    a launch agent instead of ssh (the host name is the namespace's name).

    Network namespaces share the host name (one UTS namespace), and Open MPI 4.1 keys its
    session directories and its daemons' identities by host name: with every daemon called
    "vm", about 1 start in 10 hung or failed (an orted segfaulting in
    hwloc_shmem_topology_write, "ORTE does not know how to route a message to the specified
    daemon", "unable to complete a TCP connection ... Local host: vm, Remote host: vm"). So the
    agent gives every daemon a UTS namespace whose host name is its network namespace's, and
    mpirun one of its own: 150 of 150 starts worked. A start that still fails (mpirun exits, or
    prints nothing within 60 s) is retried once. No binding: every rank of every "host" would
    be put on core 0.
    """
    agent = os.path.join(cl.tmp, "netns-agent.sh")
    with open(agent, "w") as f:
        f.write('#!/bin/sh\n# mpirun launch agent: $1 is a network namespace, the rest a command\n'
                'host="$1"; shift\nexec ip netns exec "$host" unshare --uts '
                '/bin/sh -c "hostname $host; $*"\n')
    os.chmod(agent, 0o755)
    b, e = sizes[0], sizes[-1]
    f = sizes[1] / sizes[0] if len(sizes) > 1 else 2.0
    # One slot per rank a host runs: a host listed L times in `workers` gets L ranks, filled in
    # order (--map-by slot), so rank r runs on workers[r] when `workers` lists each host's ranks
    # together (host-major).
    slots = {}
    for h in workers:
        slots[h] = slots.get(h, 0) + 1
    if any(workers[i] != workers[i + 1] and workers[i] in workers[i + 1:]
           for i in range(len(workers) - 1)):
        raise ValueError("run_mpi: each host's ranks must be listed together, got %s" % workers)
    hosts = ",".join("%s:%d" % (cl.ns(h), c) for h, c in slots.items())
    mapping = ["--map-by", "slot"] if max(slots.values()) > 1 else []
    argv = [shutil.which("mpirun"), "--allow-run-as-root", "-np", str(len(workers)), "-H", hosts,
            "--bind-to", "none"] + mapping + ["--mca", "plm_rsh_agent", agent, "--mca",
            "plm_rsh_no_tree_spawn", "1", "--mca", "pml", "ob1",
            "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", IFACE,
            "--mca", "oob_tcp_if_include", IFACE,
            os.path.join(bin_dir, "mpi_allreduce"), "-b", str(b), "-e", str(e), "-f", repr(f),
            "-n", str(iters), "--warmup", str(warmup)]
    for attempt in (1, 2):
        p = cl.spawn(workers[0], "mpirun", ["unshare", "--uts", "/bin/sh", "-c",
                                            'hostname "$0"-mpirun; exec "$@"',
                                            cl.ns(workers[0])] + argv,
                     {"OMPI_MCA_plm_rsh_disable_qrsh": "1"})
        try:
            try:
                cl.wait_for(p, r"(?m)^# mpi_allreduce", 60)
            except RunError as err:
                if attempt == 2:
                    raise
                log("netcluster: mpirun did not start its ranks (within 60 s); retrying once\n"
                    "%s\n%s" % (err, cl.describe(list(slots))))
                continue
            cl.wait_all([p], run_time_limit(sizes, iters, warmup, cl.rate_bps), "mpi job")
        finally:
            cl.kill([p])
            cl.kill_inside(list(slots))  # orteds and ranks that outlived a failed mpirun
        break
    rows = parse_json_rows(p.out(), "mpi_allreduce")
    if sorted(rows) != sorted(sizes):
        raise RunError("mpi_allreduce printed sizes %s, expected %s\n%s" % (
            sorted(rows), sizes, p.tail()))
    return rows


# ---- hierarchical aggregation (scenario hier) -------------------------------------------------

# What a gradlink worker logs (GRADLINK_LOG_LEVEL=info) when the job aggregates hierarchically:
# the workers of a host sum through shared memory, one host's sum goes to the servers.
HIER_ON = re.compile(r"hierarchical on\b")
# gradlink-bench (rank 0), after each size's row: the time its threads spent copying and summing
# in shared memory per push_pull, and its share of the mean time.
HOST_STAGE = re.compile(r"# same-host stage: ([\d.]+) us .*?, ([\d.]+)% of the mean time")


def hier_workers(hosts, local):
    """Host-major placement, the host of each rank: host h runs ranks h*L .. h*L+L-1."""
    return [h for h in range(hosts) for _ in range(local)]


def host_bytes(cl, hosts, run, nbytes, steps):
    """Runs `run()` (one job of `steps` operations on `nbytes` bytes) and returns (what it
    returned, [(tx, rx) per host]): the bytes each of `hosts`' interfaces (nc0) sent and received
    while it ran, per step and per byte of the tensor. Everything the job sent is counted: its
    start (rendezvous, connections), barriers and the warmup steps too, so these are upper
    bounds on a timed step's bytes, close to it when steps * nbytes is large."""
    before = [cl.link_bytes(h) for h in hosts]
    out = run()
    after = [cl.link_bytes(h) for h in hosts]
    unit = float(nbytes * steps)
    return out, [((x[0] - y[0]) / unit, (x[1] - y[1]) / unit) for x, y in zip(after, before)]


def per_size_jobs(cl, hosts, sizes, steps, run_sizes, record):
    """One job per size (`run_sizes([size])` returns its rows), so that each size's bytes are
    counted apart: record[size] gets, for this run, [(tx/M, rx/M) per host in `hosts`] per step
    (host_bytes). Returns the rows of all the jobs."""
    rows = {}
    for size in sizes:
        r, per_host = host_bytes(cl, hosts, lambda: run_sizes([size]), size, steps)
        rows.update(r)
        record.setdefault(size, []).append(per_host)
    return rows


def hier_host_bytes(s, size):
    """(tx/M, rx/M) of system `s` at `size`: over repeats, the median of the busiest worker
    host's bytes per step per tensor byte (host_bytes); None when not measured."""
    v = s.hostbytes.get(size)
    if not v:
        return None
    return (statistics.median(max(tx for tx, _ in rep) for rep in v),
            statistics.median(max(rx for _, rx in rep) for rep in v))


# ---- models -----------------------------------------------------------------------------------


def load_placement_model():
    """bench/placement_model.py: ps_bound_time, mixed_shares, mixed_time."""
    sys.path.insert(0, BENCH)
    try:
        import placement_model
        return placement_model
    finally:
        sys.path.remove(BENCH)


def ring_bound_time(n, nbytes, byte_s):
    return 2 * (n - 1) / n * nbytes / byte_s


class System:
    """One thing measured: a name, how to run it (returns {size: (mean_us, min_us)}), and the
    model time for `size` bytes in seconds."""

    def __init__(self, name, kind, run, model, model_name, note=None):
        self.name, self.kind, self.run, self.model, self.model_name = name, kind, run, model, model_name
        self.note = note
        self.failed = None  # the first line of its error, once a run failed
        # Scenario hier: {size: [per run: [(tx/M, rx/M) per worker host]]} (per_size_jobs), the
        # model's bytes per host and step per tensor byte (each way), and per gradlink job
        # whether its workers logged "hierarchical on".
        self.hostbytes, self.bytes_model, self.hier_log = {}, None, []
        # Scenario hier, gradlink: {size: [per run: (us, % of the mean time) of rank 0's
        # same-host stage]} (gradlink-bench's "# same-host stage" line).
        self.stage = {}


# ---- report -----------------------------------------------------------------------------------


def report(title, systems, results, sizes, rate_bps, out, extra=(), notes=()):
    """Tables per size; results[(system name, size)] = list of mean times (us) over repeats.
    `extra`: more columns, (header, fn(system, size, median us) -> cell text); `notes`: more
    lines of explanation, after the tables."""
    byte_s = rate_bps / 8
    lines = ["### " + title, ""]
    base = {}
    for s in systems:
        if s.kind in ("gloo", "mpi"):
            base.setdefault(s.kind, s.name)
    for size in sizes:
        lines.append("**%s** (%d B)" % (human(size), size))
        lines.append("")
        head = ["system", "time ms (min-max)", "algbw GB/s", "Gbit/s", "of link", "model ms",
                "of model"]
        head += ["x %s" % k for k in ("gloo", "mpi") if k in base]
        head += [h for h, _ in extra]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for s in systems:
            v = results.get((s.name, size))
            if not v:
                continue
            med = statistics.median(v)
            algbw = size / (med * 1e-6)
            row = [s.name, "%.2f (%.2f-%.2f)" % (med / 1e3, min(v) / 1e3, max(v) / 1e3),
                   "%.4f" % (algbw / 1e9), "%.3f" % (algbw * 8 / 1e9),
                   "%.3f" % (algbw / byte_s)]
            mt = s.model(size) if s.model else None
            row += ["%.2f" % (mt * 1e3), "%.3f" % (mt / (med * 1e-6))] if mt else ["-", "-"]
            for k in ("gloo", "mpi"):
                if k not in base:
                    continue
                bv = results.get((base[k], size))
                row.append("%.2f" % (statistics.median(bv) / med) if (s.kind == "gradlink" and bv)
                           else "")
            row += [fn(s, size, med) for _, fn in extra]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines.append("Link traffic: the busiest host link's bytes in its busier direction, per byte "
                 "of the model summed (median over repeats; frames as the veth counts them, "
                 "control messages included), against the model's:")
    lines.append("")
    lines.append("| system | busiest link, bytes per model byte | model |")
    lines.append("|---|---|---|")
    for s in systems:
        v = results.get((s.name, "traffic"))
        if v:
            m = s.model(MIB) * byte_s / MIB if s.model else None
            lines.append("| %s | %.3f | %s |" % (s.name, statistics.median(v),
                                                  "%.3f" % m if m else "-"))
    lines.append("")
    for s in systems:
        if s.note:
            lines.append("- %s: %s" % (s.name, s.note))
        if s.failed:
            lines.append("- %s: **FAILED**: %s" % (s.name, s.failed))
    lines += list(notes)
    lines.append("time: median over repeats of each run's mean time per operation; algbw = size / "
                 "median time; of link = algbw / link rate (%s); model: %s; of model = model time / "
                 "measured time; x gloo / x mpi = that system's median time / gradlink's." % (
                     fmt_rate(rate_bps),
                     "; ".join(sorted({"%s: %s" % (s.kind, s.model_name) for s in systems}))))
    lines.append("")
    text = "\n".join(lines)
    print(text, flush=True)
    out.append(text)


def write_timeline(path, hosts, rows):
    with open(path, "w") as f:
        f.write("t_ms," + ",".join("h%d_up,h%d_down" % (h, h) for h in range(hosts)) + "\n")
        for t, v in rows:
            f.write("%.3f,%s\n" % (t * 1e3, ",".join(str(x) for x in v)))


def measure(cl, systems, repeats, unit, log, timeline_dir=None):
    """Runs every system `repeats` times, interleaved; returns {(name, size): [mean_us, ...]}
    and {(name, "traffic"): [busiest link's bytes each way / unit, ...]}, where unit is the
    payload of one run (sum over sizes of size * (iters + warmup)). With `timeline_dir`, each
    run's link timeline (Cluster.timeline) goes to a CSV file there."""
    results = {}
    for rep in range(repeats):
        for s in systems:
            if s.failed:
                continue
            t0 = time.monotonic()
            before = [cl.link_bytes(h) for h in range(cl.hosts)]
            try:
                if timeline_dir:
                    with cl.timeline() as tl:
                        rows = s.run()
                    path = os.path.join(timeline_dir, "%s-r%d.csv" % (
                        re.sub(r"[^A-Za-z0-9=.]+", "_", s.name), rep + 1))
                    write_timeline(path, cl.hosts, tl)
                else:
                    rows = s.run()
            except RunError as e:
                # One system failing (a wrong value, a hang, a crash) fails the benchmark (exit
                # status 1), but the others are still measured and reported.
                s.failed = str(e).splitlines()[0]
                log("netcluster: %s FAILED (not run again): %s" % (s.name, e))
                continue
            after = [cl.link_bytes(h) for h in range(cl.hosts)]
            busiest = max(max(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before))
            results.setdefault((s.name, "traffic"), []).append(busiest / unit)
            log("  repeat %d/%d %-32s %s (%.0f s)" % (
                rep + 1, repeats, s.name,
                " ".join("%s:%.1fms" % (human(k), v[0] / 1e3) for k, v in sorted(rows.items())),
                time.monotonic() - t0))
            for size, (mean_us, _) in rows.items():
                results.setdefault((s.name, size), []).append(mean_us)
    return results


# ---- scenarios --------------------------------------------------------------------------------


def commit_id():
    try:
        head = sh(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).strip()
        dirty = sh(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"]).strip()
        return head + ("-dirty" if dirty else "")
    except RunError:
        return "unknown"


def server_weight_supported(bin_dir):
    out = subprocess.run([os.path.join(bin_dir, "gradlink-server"), "--help"], capture_output=True,
                         text=True).stdout
    return "--weight" in out


def build_systems(a, cl, scenario, n, ks, sizes, pm, log):
    byte_s = a.rate / 8
    workers = list(range(n))
    systems = []

    def gradlink(name, servers, variant, single_lane, model, model_name, note=None):
        _, partition, inflight, ahead, env = variant
        run = lambda: run_gradlink(cl, a.bin, workers, servers, sizes, a.iters, a.warmup,
                                   partition, inflight, single_lane,
                                   extra_env=dict(env, **a.gradlink_env), max_ahead=ahead)
        systems.append(System(name, "gradlink", run, model, model_name, note))

    def variants():
        """(name tag, P, F, A, environment); 0: gradlink's choice."""
        show = lambda v: human(v) if v else "auto"
        if a.grid:
            yield " defaults", 0, 0, 0, {}
            for p in a.grid_partitions:
                for ahead in GRID_LEADS:
                    yield (" P=%s A=%s" % (human(p), human(ahead)), p, GRID_IN_FLIGHT, ahead,
                           GRID_UCX)
            return
        for p in a.partition_bytes:
            for m in a.max_in_flight:
                for ahead in a.max_ahead:
                    tag = ""
                    if len(a.partition_bytes) > 1 or p:
                        tag += " P=%s" % show(p)
                    if len(a.max_in_flight) > 1 or m:
                        tag += " F=%s" % show(m)
                    if len(a.max_ahead) > 1 or ahead:
                        tag += " A=%s" % show(ahead)
                    yield tag, p, m, ahead, {}

    if scenario in ("ps", "lanes"):
        lanes = [False, True] if scenario == "lanes" else [a.single_lane]
        for k in ks:
            servers = [(n + i, None) for i in range(k)]
            for v in variants():
                for single in lanes:
                    name = "gradlink n=%d k=%d%s%s" % (n, k, v[0], " 1-lane" if single else "")
                    gradlink(name, servers, v, single,
                             lambda M, k=k: pm.ps_bound_time(n, k, M, byte_s),
                             "PS bound max(M/B, nM/(kB))")
    elif scenario == "mixed":
        if not server_weight_supported(a.bin):
            raise RunError("scenario mixed needs gradlink-server --weight (branch placement); "
                           "%s/gradlink-server has none" % a.bin)
        for k in ks:
            dedicated, colocated = pm.mixed_shares(n, k)
            servers = [(h, colocated) for h in workers if colocated > 0]
            servers += [(n + i, dedicated) for i in range(k)]
            if k == 0:
                note = "servers only on the %d worker hosts (weight %.4f each)" % (n, colocated)
            elif colocated == 0:
                note = "servers only on the %d server hosts (weight %.4f each)" % (k, dedicated)
            else:
                note = ("server weights %.4f on each of the %d worker hosts, %.4f on each of the "
                        "%d server hosts" % (colocated, n, dedicated, k))
            for v in variants():
                gradlink("gradlink mixed n=%d k=%d%s" % (n, k, v[0]), servers, v, a.single_lane,
                         lambda M, k=k: pm.mixed_time(n, k, M, byte_s),
                         "mixed placement 2n(n-1)M/((n^2+kn-2k)B)", note)
    elif scenario == "hier":
        hier_systems(a, cl, ks[0], sizes, pm, log, variants, systems)
    if scenario in ("ps", "mixed", "baselines") and a.baselines:
        ring = lambda M: ring_bound_time(n, M, byte_s)
        for base in a.baselines:
            if base == "gloo":
                why = gloo_unavailable()
                if why:
                    log("netcluster: skipping Gloo: " + why)
                    continue
                systems.append(System("gloo ring n=%d" % n, "gloo",
                                      lambda: run_gloo(cl, workers, sizes, a.iters, a.warmup),
                                      ring, "ring bound 2(n-1)M/(nB)"))
            elif base == "mpi":
                why = mpi_unavailable(a.bin)
                if why:
                    log("netcluster: skipping Open MPI: " + why)
                    continue
                systems.append(System("mpi tcp n=%d" % n, "mpi",
                                      lambda: run_mpi(cl, a.bin, workers, sizes, a.iters, a.warmup,
                                                      log),
                                      ring, "ring bound 2(n-1)M/(nB)"))
    return systems


def hier_systems(a, cl, k, sizes, pm, log, variants, systems):
    """Scenario hier: a.hosts worker hosts x a.local workers each (ranks host-major), k server
    hosts after them. gradlink-hier (gradlink's defaults: hierarchical where workers share a
    host), gradlink-flat (GRADLINK_HIERARCHICAL=0), and the baselines with the same placement.
    Every system runs one job per size (per_size_jobs) so each size's host bytes are apart."""
    H, L = a.hosts, a.local
    n = H * L
    byte_s = a.rate / 8
    workers = hier_workers(H, L)
    worker_hosts = list(range(H))
    servers = [(H + i, None) for i in range(k)]
    steps = a.iters + a.warmup

    def gradlink(mode, variant):
        tag, partition, inflight, ahead, venv = variant
        env = dict(venv, **a.gradlink_env)
        if mode == "flat":
            env["GRADLINK_HIERARCHICAL"] = "0"
        # Info: the workers say whether the job is hierarchical (the report shows it).
        env.setdefault("GRADLINK_LOG_LEVEL", os.environ.get("GRADLINK_LOG_LEVEL", "info"))
        if mode == "hier":
            model = lambda M: pm.ps_bound_time(H, k, M, byte_s)
            model_name = "hier, PS bound per host max(M/B, HM/(kB))"
        else:
            model = lambda M: L * pm.ps_bound_time(H, k, M, byte_s)
            model_name = "flat, PS bound of L workers per host max(LM/B, HLM/(kB))"
        s = System("gradlink-%s%s" % (mode, tag), "gradlink", None, model, model_name)
        s.bytes_model = 1.0 if mode == "hier" else float(L)

        def one(sz):
            wk = []
            rows = run_gradlink(cl, a.bin, workers, servers, sz, a.iters, a.warmup, partition,
                                inflight, a.single_lane, extra_env=env, max_ahead=ahead,
                                worker_procs=wk, ranks=True)
            s.hier_log.append(any(HIER_ON.search(p.err()) for p in wk))
            for p in wk:
                m = HOST_STAGE.search(p.out())
                if m:
                    s.stage.setdefault(sz[0], []).append((float(m.group(1)), float(m.group(2))))
            return rows

        s.run = lambda: per_size_jobs(cl, worker_hosts, sizes, steps, one, s.hostbytes)
        systems.append(s)

    for v in variants():
        gradlink("hier", v)
        gradlink("flat", v)
    ring = lambda M: ring_bound_time(n, M, byte_s)
    for base in a.baselines:
        if base == "gloo":
            why = gloo_unavailable()
            if why:
                log("netcluster: skipping Gloo: " + why)
                continue
            s = System("gloo ring N=%d" % n, "gloo", None, ring, "ring bound 2(N-1)M/(NB)")
            s.run = (lambda s: lambda: per_size_jobs(
                cl, worker_hosts, sizes, steps,
                lambda sz: run_gloo(cl, workers, sz, a.iters, a.warmup), s.hostbytes))(s)
        elif base == "mpi":
            why = mpi_unavailable(a.bin)
            if why:
                log("netcluster: skipping Open MPI: " + why)
                continue
            s = System("mpi tcp N=%d" % n, "mpi", None, ring, "ring bound 2(N-1)M/(NB)")
            s.run = (lambda s: lambda: per_size_jobs(
                cl, worker_hosts, sizes, steps,
                lambda sz: run_mpi(cl, a.bin, workers, sz, a.iters, a.warmup, log),
                s.hostbytes))(s)
        else:
            continue
        if base == "gloo":
            # A ring through the ranks in host-major order: each host's last rank sends its
            # 2(N-1)/N M to the next host's first, each host's first receives as much. Open MPI
            # picks its algorithm by size and ranks (coll tuned): no one byte model.
            s.bytes_model = 2.0 * (n - 1) / n
        systems.append(s)


def hier_columns(systems, results, rate_bps):
    """report() columns of scenario hier: the bound as a fraction of the link, hier vs flat,
    and the busiest worker host's NIC bytes per step per tensor byte, tx and rx."""
    by_name = {s.name: s for s in systems}

    def bound(s, size, med):
        return "%.3f" % (size / s.model(size) / (rate_bps / 8)) if s.model else "-"

    def vs_flat(s, size, med):
        if not s.name.startswith("gradlink-hier"):
            return ""
        flat = by_name.get(s.name.replace("gradlink-hier", "gradlink-flat", 1))
        v = flat and results.get((flat.name, size))
        return "%.2f" % (statistics.median(v) / med) if v else "-"

    def nic(i):
        def cell(s, size, med):
            hb = hier_host_bytes(s, size)
            return "%.3f" % hb[i] if hb else "-"
        return cell

    def model(s, size, med):
        return "%.3f" % s.bytes_model if s.bytes_model else "-"

    def stage(s, size, med):
        v = s.stage.get(size)
        if not v:
            return "-"
        return "%.1f ms, %.1f%%" % (statistics.median(us for us, _ in v) / 1e3,
                                    statistics.median(p for _, p in v))

    return [("bound of link", bound), ("x flat", vs_flat), ("host tx/M", nic(0)),
            ("host rx/M", nic(1)), ("model tx,rx/M", model), ("host stage (rank 0)", stage)]


def hier_notes(a, systems, k):
    L = a.local
    notes = ["- placement: %d worker hosts x %d workers (ranks host-major: host h has ranks "
             "%d*h .. %d*h+%d; GRADLINK_RANK for gradlink, the rank order for Gloo, mpirun "
             "--map-by slot), %d server hosts; every system runs one job per size." % (
                 a.hosts, L, L, L, L - 1, k)]
    for s in systems:
        if s.kind == "gradlink" and s.hier_log:
            on = sum(s.hier_log)
            flat = s.name.startswith("gradlink-flat")
            if flat:
                why = (" (as asked: GRADLINK_HIERARCHICAL=0)" if not on else
                       " (**hierarchical although GRADLINK_HIERARCHICAL=0**)")
            else:
                why = "" if on else (" (these binaries aggregate flat, or log at a level above "
                                     "info: hierarchy not active)")
            notes.append("- %s: workers logged \"hierarchical on\" in %d of %d jobs%s" % (
                s.name, on, len(s.hier_log), why))
    notes.append(
        "host tx/M, rx/M: NIC bytes per step of the busiest worker host (nc0 counters, frames "
        "with their TCP/IP headers, ACKs included) per byte of the tensor M, median over "
        "repeats; counted over the whole job of that one size and divided by its %d steps "
        "(%d timed + %d warmup: every step moves the same bytes), so the job's start, barriers "
        "and aligning push_pulls are counted too (an upper bound, within a few %% at MiB sizes)."
        " Model: hier 1.0 each way, flat L = %d, Gloo's ring 2(N-1)/N (Open MPI chooses its "
        "algorithm by size and ranks: none); bound of link = M / model time "
        "/ link rate (hier: min(1, k/H); flat: that / L); x flat = gradlink-flat's median time / "
        "gradlink-hier's; host stage (rank 0) = the time rank 0's threads spent copying and "
        "summing in its host's shared memory per push_pull (WorkerStats::local_busy_ns, every "
        "step of the job) and its share of the mean time, median over repeats: the same-host "
        "stage's cost on one worker, overlapped with the network or not." % (
            a.iters + a.warmup, a.iters, a.warmup, L))
    return notes


HIER_CELL_TEXT = (" Scenario hier: then, for gradlink-hier, its speedup over gradlink-flat (flat's "
                  "median time ÷ hier's); last, the busiest worker host's NIC bytes per step "
                  "per tensor byte, tx/rx (model: hier 1.0, flat L, ring 2(N-1)/N; counted over "
                  "the job of that size, start and warmup included).")


def hier_cell(systems, results):
    """render_summary's extra text of a cell in scenario hier: x flat, then host tx/rx per M."""
    by_name = {s.name: s for s in systems}

    def cell(s, size, med):
        text = ""
        if s.name.startswith("gradlink-hier"):
            flat = by_name.get(s.name.replace("gradlink-hier", "gradlink-flat", 1))
            v = flat and results.get((flat.name, size))
            text += " · %.2fx flat" % (statistics.median(v) / med) if v else " · -"
        hb = hier_host_bytes(s, size)
        if hb:
            text += " · %.2f/%.2f" % hb
        return text
    return cell


def hold(cl):
    for h in range(cl.hosts):
        cl.spawn(h, "idle%d" % h, ["sleep", "3600"])
    print("ready %s" % cl.prefix, flush=True)
    while True:
        time.sleep(1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="ps",
                    choices=["ps", "mixed", "lanes", "baselines", "all", "hold", "hier"])
    ap.add_argument("--workers", "-n", type=int, default=None, help="worker hosts n (default 4)")
    ap.add_argument("--hosts", type=int, default=None,
                    help="hier: worker hosts H (default: --workers if given, else 2)")
    ap.add_argument("--local", type=int, default=2,
                    help="hier: workers per worker host L, in one namespace (default 2)")
    ap.add_argument("--servers", "-k", default=None,
                    help="server hosts k, comma-separated (default: 4,2 for ps and lanes; "
                         "0,1,2,4 for mixed; H for hier, one value)")
    ap.add_argument("--rate", type=parse_rate, default=parse_rate("1gbit"),
                    help="link rate in tc syntax (default 1gbit)")
    ap.add_argument("--burst", type=parse_size, default=None,
                    help="tbf bucket (default: 1 ms of the rate, at least 128K)")
    ap.add_argument("--latency-ms", type=float, default=10.0, help="tbf queue, in ms (default 10)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("-b", "--minbytes", type=parse_size, default=None,
                    help="smallest size (default 4M; 16M for hier)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=None,
                    help="largest size (default 256M; 64M for hier)")
    ap.add_argument("-f", "--stepfactor", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per size (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations per size (default 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--partition-bytes", default="0",
                    help="gradlink partition size(s), comma-separated: a sweep (default 0: "
                         "gradlink's choice)")
    ap.add_argument("--max-in-flight", default="0",
                    help="gradlink bytes in flight per worker, comma-separated: a sweep "
                         "(default 0: gradlink's choice)")
    ap.add_argument("--max-ahead", default="0",
                    help="gradlink bytes per server an operation may have pushed whose sums are "
                         "not back (gradlink-bench --max-ahead), comma-separated: a sweep "
                         "(default 0: gradlink's choice)")
    ap.add_argument("--grid", action="store_true",
                    help="gradlink with no flags beside the tuned grid: P 64K/128K/1M x lead "
                         "128K/256K/512K per server, F = 1M, UCX_TCP_RCVBUF=64k "
                         "UCX_TCP_TX_SEG_SIZE=64k (overrides the three options above)")
    ap.add_argument("--grid-partitions", default=",".join(human(p) for p in GRID_PARTITIONS),
                    help="the grid's partition sizes (default %(default)s)")
    ap.add_argument("--single-lane", action="store_true", help="gradlink on one lane (ps, mixed)")
    ap.add_argument("--gradlink-env", action="append", default=[], metavar="VAR=VALUE",
                    help="extra environment of the gradlink processes (repeatable), e.g. "
                         "UCX_RNDV_THRESH=1m, or UCX_TCP_RCVBUF=auto for the kernel's autotuning "
                         "instead of the 64k gradlink sets")
    ap.add_argument("--baselines", default="gloo,mpi", help="gloo, mpi, or none (default gloo,mpi)")
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--results", default=os.path.join(BENCH, "RESULTS.md"),
                    help="replace this file's netcluster-SCENARIO sections with the run's summary "
                         "(default bench/RESULTS.md); '-' for none (and no --history)")
    ap.add_argument("--history", default="", metavar="FILE",
                    help="append the full tables here (default: history/RESULTS-YYYY-MM.md beside "
                         "--results); '-' for none")
    ap.add_argument("--link-check", type=float, default=2.0,
                    help="seconds of one TCP stream host 0 -> host 1 before the runs (0: none)")
    ap.add_argument("--timeline", metavar="DIR",
                    help="write each run's link timeline here: CSV, one row per 2 ms, the bytes "
                         "each host sent (up) and received (down) at its bridge port")
    ap.add_argument("--cleanup", action="store_true",
                    help="remove leftovers of killed runs (namespaces glnc<pid>-* whose harness is "
                         "gone, and their processes), then exit")
    ap.add_argument("--cleanup-all", action="store_true",
                    help="like --cleanup, but also the namespaces of running harnesses")
    a = ap.parse_args(argv)
    given = changed_options(ap, a)  # before the values below are parsed further
    install_signal_handlers()
    try:
        check_available()
    except Unavailable as e:
        print("netcluster: skipped: %s" % e, file=sys.stderr)
        return SKIP
    if a.cleanup or a.cleanup_all:
        removed = cleanup_leftovers(include_live=a.cleanup_all)
        print("netcluster: %d leftover namespace(s) removed" % len(removed))
        return 0

    def ints(text, what, allow_zero=True):
        try:
            v = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            ap.error("%s: '%s' is not a comma-separated list of integers" % (what, text))
        if not v or any(x < (0 if allow_zero else 1) for x in v):
            ap.error("%s: '%s' must list integers >= %d" % (what, text, 0 if allow_zero else 1))
        return v

    if a.scenario == "hier":
        a.hosts = a.hosts if a.hosts is not None else (a.workers or 2)
        a.workers = a.hosts
        if a.hosts < 2:
            ap.error("--hosts: scenario hier needs >= 2 worker hosts (on one host every sum "
                     "stays on the host)")
        if a.local < 1:
            ap.error("--local must be >= 1")
    elif a.hosts is not None:
        ap.error("--hosts is for scenario hier (the others: --workers)")
    a.workers = 4 if a.workers is None else a.workers
    if a.minbytes is None:
        a.minbytes = parse_size("16M" if a.scenario == "hier" else "4M")
    if a.maxbytes is None:
        a.maxbytes = max(a.minbytes, parse_size("64M" if a.scenario == "hier" else "256M"))
    if a.workers < 1:
        ap.error("--workers must be >= 1")
    if a.stepfactor <= 1:
        ap.error("--stepfactor must be > 1")
    if a.maxbytes < a.minbytes:
        ap.error("-e is smaller than -b")
    if a.iters < 1 or a.warmup < 0 or a.repeats < 1:
        ap.error("--iters and --repeats must be >= 1, --warmup >= 0")
    try:
        a.partition_bytes = [parse_size(x) for x in a.partition_bytes.split(",") if x.strip()] or [0]
        a.max_in_flight = [parse_size(x) for x in a.max_in_flight.split(",") if x.strip()] or [0]
        a.max_ahead = [parse_size(x) for x in a.max_ahead.split(",") if x.strip()] or [0]
        a.grid_partitions = [parse_size(x) for x in a.grid_partitions.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if a.timeline:
        os.makedirs(a.timeline, exist_ok=True)
    bad = [x for x in a.gradlink_env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", x)]
    if bad:
        ap.error("--gradlink-env wants VAR=VALUE, got %s" % ", ".join(bad))
    a.gradlink_env = dict(x.split("=", 1) for x in a.gradlink_env)
    a.baselines = [] if a.baselines.strip() in ("", "none") else [x.strip() for x in a.baselines.split(",")]
    bad = [x for x in a.baselines if x not in ("gloo", "mpi")]
    if bad:
        ap.error("--baselines: unknown %s (gloo, mpi or none)" % ",".join(bad))
    for tool in ("gradlink-scheduler", "gradlink-server", "gradlink-bench"):
        if a.scenario != "hold" and not os.access(os.path.join(a.bin, tool), os.X_OK):
            ap.error("%s not found in --bin %s (build first: make build)" % (tool, a.bin))

    scenarios = ["ps", "mixed", "lanes"] if a.scenario == "all" else [a.scenario]
    plan = []
    for sc in scenarios:
        default = {"mixed": "0,1,2,4", "baselines": "0", "hold": "0",
                   "hier": str(a.workers)}.get(sc, "4,2")
        ks = ints(a.servers if a.servers is not None else default, "--servers")
        if a.scenario == "all" and sc in ("ps", "lanes"):
            ks = [k for k in ks if k >= 1][:1 if sc == "lanes" else None]
            if not ks:
                ap.error("--servers: scenario %s needs a k >= 1" % sc)
        if sc in ("ps", "lanes") and min(ks) < 1:
            ap.error("--servers: scenario %s needs k >= 1 dedicated server hosts" % sc)
        if sc == "hier" and (len(ks) != 1 or ks[0] < 1):
            ap.error("--servers: scenario hier takes one k >= 1 (default H)")
        if sc == "mixed" and max(ks) > a.workers:
            ap.error("--servers: mixed placement needs k <= n (%d)" % a.workers)
        plan.append((sc, ks))
    hosts = a.workers + max(max(ks) for _, ks in plan)
    if a.scenario == "hold":
        hosts = max(2, hosts)
    if hosts > MAX_HOSTS:
        ap.error("%d hosts: at most %d" % (hosts, MAX_HOSTS))
    sizes = list(sizes_of(a.minbytes, a.maxbytes, a.stepfactor))
    pm = load_placement_model()
    out = []
    log = lambda msg: print(msg, flush=True)
    removed = cleanup_leftovers(quiet=True)
    if removed:
        log("netcluster: removed %d leftover namespace(s) of killed runs: %s" % (
            len(removed), " ".join(removed)))
    command = "bench/netcluster " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    summaries = []  # (scenario, summary section) per scenario reported
    try:
        with Cluster(hosts, a.rate, a.burst, a.latency_ms, a.mtu, log=log) as cl:
            if a.scenario == "hold":
                hold(cl)
            shape = ("H=%d x L=%d" % (a.hosts, a.local) if a.scenario == "hier"
                     else "n=%d" % a.workers)
            header = ["## %s — netcluster %s, %s, %s links (%s)" % (
                commit_id(), a.scenario, shape, fmt_rate(a.rate), started), "",
                "Command: `%s`" % command, "",
                "%d hosts (namespaces; bridge in its own), tbf burst %d B, latency %g ms, MTU %d; "
                "gradlink with UCX_TLS=tcp UCX_NET_DEVICES=%s%s; fp32 sum, every element "
                "checked; %d iters + %d warmup per run, %d repeats interleaved." % (
                    hosts, cl.burst, cl.latency_ms, cl.mtu, IFACE,
                    "".join(" %s=%s" % kv for kv in sorted(a.gradlink_env.items())),
                    a.iters, a.warmup, a.repeats)]
            if a.link_check > 0 and hosts >= 2:
                bps = cl.tcp_check(0, 1, a.link_check)
                header.append("Link check: one TCP stream host 0 -> host 1: %.3f Gbit/s goodput "
                              "(%.3f of the rate)." % (bps / 1e9, bps / a.rate))
            header.append("")
            text = "\n".join(header)
            print(text, flush=True)
            out.append(text)
            failed = []
            cache = {}  # baselines are measured once per invocation (ps), shown again after
            for sc, ks in plan:
                systems = build_systems(a, cl, sc, a.workers, ks, sizes, pm, log)
                todo = [s for s in systems if s.kind == "gradlink" or (s.name, sizes[0]) not in cache]
                log("netcluster: scenario %s: %d systems x %d repeats" % (sc, len(todo), a.repeats))
                results = measure(cl, todo, a.repeats, sum(sizes) * (a.iters + a.warmup), log,
                                  a.timeline)
                for s in systems:
                    if s.kind != "gradlink":
                        for size in sizes + ["traffic"]:
                            if (s.name, size) in results:
                                cache[(s.name, size)] = results[(s.name, size)]
                            elif (s.name, size) in cache:
                                results[(s.name, size)] = cache[(s.name, size)]
                title = {"ps": "Dedicated servers (PS)", "mixed": "Mixed placement",
                         "lanes": "Separate push/pull lanes vs one lane",
                         "baselines": "Baselines",
                         "hier": "Hierarchical vs flat, workers sharing hosts"}[sc]
                extra, notes, cell, cell_text = (), (), None, ""
                if sc == "hier":
                    extra = hier_columns(systems, results, a.rate)
                    notes = hier_notes(a, systems, ks[0])
                    cell, cell_text = hier_cell(systems, results), HIER_CELL_TEXT
                report("%s: %s, k=%s" % (title, shape, ",".join(map(str, ks))), systems,
                       results, sizes, a.rate, out, extra, notes)
                summaries.append((sc, render_summary(
                    "%s — netcluster %s, %s, k=%s, %s links, MTU %d (%s)" % (
                        commit_id(), sc, shape, ",".join(map(str, ks)), fmt_rate(a.rate),
                        cl.mtu, started),
                    command, given, tuned_defaults(ap), systems, results, sizes, a.rate,
                    cell, cell_text)))
                if sc == "lanes":
                    out.append(lanes_summary(systems, results, sizes, a.rate))
                    print(out[-1], flush=True)
                failed += [s.name for s in systems if s.failed]
    except RunError as e:
        print("netcluster: FAILED: %s" % e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netcluster: interrupted; everything it set up was removed", file=sys.stderr)
        return 130
    finally:
        if out and a.results != "-":
            write_results(a, out, summaries)
    if failed:
        print("netcluster: FAILED: %s" % ", ".join(sorted(set(failed))), file=sys.stderr)
        return 1
    return 0


# ---- bench/RESULTS.md: a section per scenario (replaced in place), the history (appended) ------

# Options that change what is measured (the network, gradlink's settings); the summary names
# those a run set to other than netcluster's defaults.
TUNING = ("rate", "burst", "latency_ms", "mtu", "partition_bytes", "max_in_flight", "max_ahead",
          "grid", "grid_partitions", "single_lane", "gradlink_env")


def load_results_md():
    """bench/results_md.py (imported from bench/, however this file was loaded)."""
    sys.path.insert(0, BENCH)
    try:
        import results_md
        return results_md
    finally:
        sys.path.remove(BENCH)


def option_text(dest, value):
    flag = "--" + dest.replace("_", "-")
    if value is True:
        return flag
    if dest == "rate":
        return "%s %gmbit" % (flag, value / 1e6)
    if dest == "burst" and isinstance(value, int):
        return "%s %s" % (flag, human(value))
    if isinstance(value, list):
        return " ".join("%s %s" % (flag, v) for v in value)
    return "%s %s" % (flag, value)


def changed_options(ap, a):
    """The TUNING options a run set to other than their defaults, as command-line text (called
    before main() parses the values further: they are still the command line's text)."""
    return [option_text(d, getattr(a, d)) for d in TUNING if getattr(a, d) != ap.get_default(d)]


def tuned_defaults(ap):
    """What gradlink gets unless told otherwise: nothing (its own choice for the job)."""
    return "no tuning flags: gradlink chooses partitions, window and lead for the job itself"


def render_summary(heading, command, given, defaults, systems, results, sizes, rate_bps,
                   extra_cell=None, extra_text=""):
    """The netcluster-SCENARIO section of bench/RESULTS.md (a string): per system and size, the
    fraction of its model's bound reached and gradlink's speedups over the baselines.
    `extra_cell(system, size, median us)` adds text to a cell; `extra_text` says what it is."""
    base = {}
    for s in systems:
        if s.kind in ("gloo", "mpi"):
            base.setdefault(s.kind, s.name)
    out = ["### " + heading,
           "Command: `%s`. " % command
           + ("Set on the command line, not netcluster's defaults: %s. " % ", ".join(given)
              if given else "netcluster's defaults for the network and gradlink. ")
           + "gradlink by default: %s (docs/operations.md, \"What gradlink tunes\")." % defaults,
           "",
           "| system | " + " | ".join(human(z) for z in sizes) + " |",
           "|---|" + "---|" * len(sizes)]
    for s in systems:
        cells = []
        for z in sizes:
            v = results.get((s.name, z))
            if not v:
                cells.append("FAILED" if s.failed else "-")
                continue
            med = statistics.median(v)
            mt = s.model(z) if s.model else None
            cell = "%.3f" % (mt / (med * 1e-6)) if mt else "-"
            if s.kind == "gradlink":
                for k in ("gloo", "mpi"):
                    if k in base:
                        bv = results.get((base[k], z))
                        cell += " · %.2fx" % (statistics.median(bv) / med) if bv else " · -"
            if extra_cell:
                cell += extra_cell(s, z, med)
            cells.append(cell)
        out.append("| %s | %s |" % (s.name, " | ".join(cells)))
    models = "; ".join(sorted({"%s: %s" % (s.kind, s.model_name) for s in systems}))
    out += ["", "Cells: model time ÷ measured median time (of the bound reached; %s)%s. Link rate "
            "%s; medians over repeats; every element checked." % (
                models, "; then gradlink's speedup over " + " and over ".join(
                    {"gloo": "Gloo", "mpi": "Open MPI"}[k] for k in ("gloo", "mpi") if k in base)
                + " (their median time ÷ gradlink's)" if base else "", fmt_rate(rate_bps))
            + extra_text]
    traffic = []
    for s in systems:
        v = results.get((s.name, "traffic"))
        if v:
            m = s.model(MIB) * (rate_bps / 8) / MIB if s.model else None
            traffic.append("%s %.3f%s" % (s.name, statistics.median(v), " (%.3f)" % m if m else ""))
    if traffic:
        out[-1] += " Busiest link, bytes per model byte (the model's): " + "; ".join(traffic) + "."
    failed = ["%s: %s" % (s.name, s.failed) for s in systems if s.failed]
    if failed:
        out += ["", "**FAILED**: " + "; ".join(failed) + "."]
    return "\n".join(out) + "\n"


def write_results(a, out, summaries):
    """Appends the full tables to --history, then replaces the section of every scenario that
    was reported in --results."""
    rmd = load_results_md()
    history = None if a.history == "-" else (a.history or rmd.history_path(a.results))
    if history:
        rmd.append_history(history, "\n" + "\n".join(out) + "\n", os.path.basename(a.results))
        print("netcluster: appended to %s" % history)
    link = history and os.path.relpath(os.path.abspath(history),
                                       os.path.dirname(os.path.abspath(a.results)))
    for sc, body in summaries:
        if link:
            body = body[:-1] + " The full tables: [%s](%s).\n" % (link, link)
        try:
            rmd.update_section(a.results, "netcluster-" + sc, body)
        except (ValueError, OSError) as e:  # the history has the tables; say why, go on
            print("netcluster: section netcluster-%s of %s NOT replaced: %s" % (sc, a.results, e),
                  file=sys.stderr)
            continue
        print("netcluster: section netcluster-%s of %s replaced" % (sc, a.results))


def lanes_summary(systems, results, sizes, rate_bps):
    """Per size: link utilisation (algbw / rate) with separate lanes minus with one lane."""
    byte_s = rate_bps / 8
    lines = ["Lanes: link utilisation (algbw / rate) with separate push/pull lanes minus one lane:",
             ""]
    for s in systems:
        if s.name.endswith(" 1-lane"):
            continue
        single = s.name + " 1-lane"
        parts = []
        for size in sizes:
            a, b = results.get((s.name, size)), results.get((single, size))
            if a and b:
                ua = size / (statistics.median(a) * 1e-6) / byte_s
                ub = size / (statistics.median(b) * 1e-6) / byte_s
                parts.append("%s %+.3f (%.3f vs %.3f)" % (human(size), ua - ub, ua, ub))
        if parts:
            lines.append("- %s: %s" % (s.name, "; ".join(parts)))
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
