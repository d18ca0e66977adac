#!/usr/bin/python3
# Over 600 lines on purpose: the harness and its cases, one case per function, run as one ctest each.
"""Multi-process integration tests of gradlink, one case per ctest test.

Each case starts real processes on loopback: gradlink-scheduler (--port 0; the port is read
from its "listening on host:port" line), gradlink-server processes and worker processes
(gradlink-bench --scheduler, which checks every element, or the test programs gl_probe_worker
and gl_rogue_worker built beside this file). Every process runs in its own session (process
group) with PR_SET_PDEATHSIG, every wait is bounded by the case's --budget, and everything that
was started is killed (SIGKILL to its process group) when the case ends, passes or fails.

Usage: run_integration.py --bin-dir DIR --probe EXE --rogue EXE [--budget S] CASE
Standard library only: runs under Debian's /usr/bin/python3.
"""

import argparse
import ctypes
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

# ---- process handling ----------------------------------------------------------------------


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
    def __init__(self, name, argv, popen, out_path, err_path, started):
        self.name, self.argv, self.popen = name, argv, popen
        self.out_path, self.err_path, self.started = out_path, err_path, started
        self.ended = None

    @property
    def pid(self):
        return self.popen.pid

    def rc(self):
        return self.popen.poll()

    def out(self):
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def err(self):
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def seconds(self):
        return (self.ended or time.monotonic()) - self.started


class Harness:
    def __init__(self, args):
        self.bin_dir = args.bin_dir
        self.probe = args.probe
        self.rogue = args.rogue
        self.deadline = time.monotonic() + args.budget
        self.tmp = tempfile.mkdtemp(prefix="gradlink-integration-")
        self.procs = []
        self.lock = threading.Lock()
        self.counter = 0

    def bin(self, name):
        return os.path.join(self.bin_dir, name)

    def left(self):
        return self.deadline - time.monotonic()

    def spawn(self, name, argv, env=None):
        if threading.active_count() != 1:
            # PDEATHSIG follows the forking thread, and forking while other threads run is unsafe.
            raise Failure("spawn() must run while the main thread is the only thread")
        with self.lock:
            self.counter += 1
            stem = os.path.join(self.tmp, "%03d-%s" % (self.counter, name))
        out_path, err_path = stem + ".out", stem + ".err"
        full_env = dict(os.environ)
        full_env.setdefault("GRADLINK_LOG_LEVEL", "warn")
        # Every job here is on one host, where the workers would sum through shared memory by
        # default: these cases test the servers' path (tests/python tests both).
        full_env.setdefault("GRADLINK_LOCAL_ARENA_BYTES", "0")
        if env:
            full_env.update(env)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            popen = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                     env=full_env, start_new_session=True,
                                     preexec_fn=_child_setup)
        p = Proc(name, argv, popen, out_path, err_path, time.monotonic())
        self.procs.append(p)
        return p

    def wait(self, p, timeout):
        """Waits for p to exit within min(timeout, the budget); returns its exit code."""
        limit = min(timeout, self.left())
        try:
            rc = p.popen.wait(timeout=max(limit, 0.01))
        except subprocess.TimeoutExpired:
            raise Failure("%s (pid %d) still running after %.1f s" % (p.name, p.pid, limit))
        if p.ended is None:
            p.ended = time.monotonic()
        return rc

    def wait_all(self, procs, want, timeout, label):
        """Waits for every process of `procs` to exit with its code in `want`; fails as soon as
        one exits otherwise, or when `timeout` (bounded by the budget) is up."""
        end = time.monotonic() + min(timeout, self.left())
        pending = list(zip(procs, want))
        while pending:
            for p, w in list(pending):
                rc = p.popen.poll()
                if rc is None:
                    continue
                p.ended = p.ended or time.monotonic()
                pending.remove((p, w))
                if rc != w:
                    raise Failure("%s: %s exited with %d, expected %d" % (label, p.name, rc, w))
            if pending and time.monotonic() > end:
                raise Failure("%s: %s still running after %.1f s" % (
                    label, ", ".join(p.name for p, _ in pending), timeout))
            time.sleep(0.01)

    def kill(self, p):
        if p.popen.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print("warning: %s (pid %d) survived SIGKILL" % (p.name, p.pid))

    def kill_all(self):
        for p in self.procs:
            self.kill(p)

    def dump_logs(self, procs=None, lines=40):
        for p in procs if procs is not None else self.procs:
            print("----- %s (pid %d, exit %s): %s" % (p.name, p.pid, p.popen.poll(),
                                                      " ".join(p.argv)))
            for label, text in (("stdout", p.out()), ("stderr", p.err())):
                tail = text.splitlines()[-lines:]
                if tail:
                    print("  [%s]" % label)
                    for line in tail:
                        print("    " + line)

    # ---- the three roles -------------------------------------------------------------------

    def start_scheduler(self, workers, servers, extra=(), port=0, name="scheduler", env=None):
        p = self.spawn(name, [self.bin("gradlink-scheduler"), "--port", str(port), "-w",
                              str(workers), "-s", str(servers)] + list(extra), env=env)
        limit = time.monotonic() + min(15, self.left())
        while time.monotonic() < limit:
            m = re.search(r"listening on (\S+):(\d+)", p.out())
            if m:
                return p, "%s:%s" % (m.group(1), m.group(2))
            if p.rc() is not None:
                raise Failure("gradlink-scheduler exited with %d before listening:\n%s" %
                              (p.rc(), p.err()))
            time.sleep(0.02)
        raise Failure("gradlink-scheduler printed no 'listening on' line within 15 s")

    def start_servers(self, addr, n, extra=(), env=None):
        return [self.spawn("server%d" % i, [self.bin("gradlink-server"), "--scheduler", addr] +
                           list(extra), env=env) for i in range(n)]


# ---- jobs ----------------------------------------------------------------------------------


def run_job(h, label, workers, servers, worker_argv, server_args=(), env=None, timeout=60,
            expect_worker_rc=0, sched_args=(), server_env=None):
    """Runs one job: a scheduler, `servers` servers and `workers` processes whose argv is
    worker_argv(rank, addr). Requires every worker to exit with expect_worker_rc (an int or a
    function of the rank) and the servers and the scheduler with 0, all within `timeout`.
    `env` is every process's; `server_env`, the servers' besides it."""
    t0 = time.monotonic()
    sched, addr = h.start_scheduler(workers, servers, extra=sched_args)
    srv = h.start_servers(addr, servers, server_args, env=dict(env or {}, **(server_env or {})))
    wk = [h.spawn("worker%d" % r, worker_argv(r, addr), env=env) for r in range(workers)]
    job = srv + wk + [sched]
    try:
        end = time.monotonic() + timeout
        want = [expect_worker_rc(r) if callable(expect_worker_rc) else expect_worker_rc
                for r in range(workers)]
        h.wait_all(wk, want, timeout, label)
        # Once the workers are gone the job is over: the rest must follow promptly.
        for p in srv + [sched]:
            rc = h.wait(p, min(15, end - time.monotonic() + 15))
            if rc != 0:
                raise Failure("%s: %s exited with %d, expected 0" % (label, p.name, rc))
    except Failure:
        h.dump_logs(job)
        raise
    finally:
        for p in job:
            h.kill(p)
    print("ok   %-58s %6.2f s" % (label, time.monotonic() - t0))
    sys.stdout.flush()
    return sched, srv, wk


def bench_rows(worker_procs):
    """The result table that rank 0 of gradlink-bench printed: [(bytes, count, dtype, check)]."""
    tables = [p.out() for p in worker_procs if "# gradlink-bench:" in p.out()]
    if len(tables) != 1:
        raise Failure("expected one gradlink-bench table, found %d" % len(tables))
    rows = []
    for line in tables[0].splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+(\w+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\S+)\s*$",
                     line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)))
    return rows


DTYPE_SIZE = {"fp32": 4, "fp64": 8, "fp16": 2, "bf16": 2, "int32": 4, "int64": 8}


def parse_size(s):
    mult = {"k": 1024, "m": 1 << 20, "g": 1 << 30}
    if s[-1].lower() in mult:
        return int(float(s[:-1]) * mult[s[-1].lower()])
    return int(float(s))


def bench_sizes(begin, end, factor, dtype):
    """The sizes gradlink-bench sweeps, computed as tools/gradlink_bench.cc does."""
    sz = DTYPE_SIZE[dtype]
    b, e = max(parse_size(begin), sz), parse_size(end)
    out = []
    while b <= e:
        out.append((b // sz) * sz)
        b = max(b + sz, int(b * factor))
    return out


def bench_job(h, workers, servers, begin, end, factor=4.0, dtype="fp32", iters=5, warmup=1,
              extra=(), server_args=(), env=None, timeout=90, label=None):
    """A gradlink-bench sweep over a real scheduler and servers; every element of every
    iteration is checked by every worker (exit 3 otherwise); the table must list every size."""
    # gradlink-bench's default job name is "bench", the scheduler's and the servers' is
    # "default": name the job for every process.
    extra = list(extra)
    shown = list(extra)
    if "--job" in extra:
        job = extra[extra.index("--job") + 1]
    else:
        job = "it-bench"
        extra += ["--job", job]
    args = ["-b", begin, "-e", end, "-f", str(factor), "-d", dtype, "-n", str(iters),
            "--warmup", str(warmup)] + extra
    server_args = list(server_args) + ["--job", job]
    sched_args = ["--job", job]
    label = label or "bench w%d s%d %s %s..%s x%s %s" % (workers, servers, dtype, begin, end,
                                                        factor, " ".join(shown))

    def argv(rank, addr):
        return [h.bin("gradlink-bench"), "--scheduler", addr] + args

    _, _, wk = run_job(h, label, workers, servers, argv, server_args=server_args, env=env,
                       timeout=timeout, sched_args=sched_args)
    rows = bench_rows(wk)
    want = bench_sizes(begin, end, factor, dtype)
    got = [r[0] for r in rows]
    if got != want:
        raise Failure("%s: table lists sizes %s, expected %s" % (label, got, want))
    bad = [r for r in rows if r[3] != "OK" or r[2] != dtype]
    if bad:
        raise Failure("%s: rows not OK: %s" % (label, bad))
    return rows


# ---- wire format (src/wire/frame.cc) -------------------------------------------------------

HEADER = struct.Struct("<IBBHIIQIBBHQQQQ")
assert HEADER.size == 64
MAGIC, VERSION = 0x314B4C47, 2
T_REGISTER, T_WELCOME, T_DECLARE, T_BARRIER, T_ABORT, T_PUSH, T_DATA_ERROR = 1, 2, 3, 6, 10, 32, 34


def job_hash(job):
    h = 2166136261
    for c in job.encode():
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h


def header(type_, job="default", payload=0, magic=MAGIC, version=VERSION, flags=0, sender=0,
           key=0, partition=0, dtype=0, code=0, reserved=0, round_=0, count=0, cookie=0):
    return HEADER.pack(magic, version, type_, flags, job_hash(job) if isinstance(job, str) else job,
                       sender, key, partition, dtype, code, reserved, round_, count, payload,
                       cookie)


def register_payload(role=1, rank=-1, host="intruder", push=b"", pull=b"", weight=1.0,
                     standby=0, metrics_port=0):
    def blob(b):
        return struct.pack("<I", len(b)) + b
    return (struct.pack("<Bi", role, rank) + blob(host.encode()) + blob(push) + blob(pull) +
            struct.pack("<dQQBH", weight, 0, 0, standby, metrics_port))


def frame(type_, payload=b"", **kw):
    return header(type_, payload=len(payload), **kw) + payload


def scheduler_bad_inputs():
    """(what, bytes to send, how long the scheduler may take to close). Each goes on a fresh
    connection; the scheduler must close it."""
    reg = register_payload()
    quick = 5.0
    cases = [
        ("bad magic", frame(T_REGISTER, reg, magic=0x12345678), quick),
        ("magic all ones", frame(T_REGISTER, reg, magic=0xFFFFFFFF), quick),
        ("version 0", frame(T_REGISTER, reg, version=0), quick),
        ("version 1 (before server weights)", frame(T_REGISTER, reg, version=1), quick),
        ("version 3", frame(T_REGISTER, reg, version=3), quick),
        ("version 255", frame(T_REGISTER, reg, version=255), quick),
    ]
    for t in (0, 11, 31, 35, 200, 255):
        cases.append(("message type %d" % t, frame(t, reg), quick))
    cases += [
        ("unknown flag", frame(T_REGISTER, reg, flags=0x8000), quick),
        ("reserved bytes set", frame(T_REGISTER, reg, reserved=1), quick),
        ("status code out of range", frame(T_REGISTER, reg, code=200), quick),
        ("control payload of 1 MiB + 1", header(T_REGISTER, payload=(1 << 20) + 1), quick),
        ("control payload of 2^32", header(T_REGISTER, payload=1 << 32), quick),
        ("control payload of 2^64-1", header(T_REGISTER, payload=(1 << 64) - 1), quick),
        ("data frame (kPush) on the control connection",
         frame(T_PUSH, b"\0" * 16, dtype=1, count=4), quick),
        ("kDataError as the first frame", frame(T_DATA_ERROR, struct.pack("<I", 2) + b"hi"), quick),
        ("kBarrier before kRegister", frame(T_BARRIER), quick),
        ("kDeclare before kRegister", frame(T_DECLARE, b"\0" * 12, dtype=1, count=1), quick),
        ("kRegister of another job", frame(T_REGISTER, reg, job="another-job"), quick),
        ("kRegister with a garbage payload", frame(T_REGISTER, b"\x07" * 10), quick),
        ("kRegister with role 3", frame(T_REGISTER, register_payload(role=3)), quick),
        ("kRegister with rank -5", frame(T_REGISTER, register_payload(rank=-5)), quick),
        ("kRegister of a worker as a standby", frame(T_REGISTER, register_payload(standby=1)),
         quick),
        ("kRegister with standby flag 2", frame(T_REGISTER, register_payload(role=2, standby=2)),
         quick),
        ("kRegister with server weight 0", frame(T_REGISTER, register_payload(role=2, weight=0.0)),
         quick),
        ("kRegister with server weight NaN",
         frame(T_REGISTER, register_payload(role=2, weight=float("nan"))), quick),
        ("kRegister with server weight 1e300",
         frame(T_REGISTER, register_payload(role=2, weight=1e300)), quick),
        ("kRegister without a weight", frame(T_REGISTER, register_payload()[:-8]), quick),
        ("kRegister whose strings overrun",
         frame(T_REGISTER, struct.pack("<Bi", 1, -1) + struct.pack("<I", 0xFFFFFFF0) + b"ab"),
         quick),
        ("kRegister with trailing bytes", frame(T_REGISTER, reg + b"xx"), quick),
        ("64 KiB of garbage", bytes((i * 37) & 0xFF for i in range(65536)), quick),
        # A frame cut short: the scheduler must not wait for the rest for ever.
        # (a frame once begun gets 5 s to finish: a late TCP segment is not an attack)
        ("header cut after 30 bytes", frame(T_REGISTER, reg)[:30], 12.0),
        ("payload cut short (100 announced, 10 sent)", header(T_REGISTER, payload=100) + reg[:10],
         12.0),
    ]
    return cases


def expect_closed(sock, seconds):
    """True when the peer closes `sock` (EOF or reset) within `seconds`; data is discarded."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except socket.timeout:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True
        if not data:
            return True


def read_frame(sock, seconds):
    """Reads one frame; returns (type, code, payload) or None on EOF/timeout."""
    end = time.monotonic() + seconds
    buf = b""
    need = 64
    hdr = None
    while True:
        while len(buf) < need:
            left = end - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
            try:
                chunk = sock.recv(need - len(buf))
            except (socket.timeout, ConnectionResetError):
                return None
            if not chunk:
                return None
            buf += chunk
        if hdr is None:
            hdr = HEADER.unpack(buf[:64])
            need = 64 + hdr[13]
            if hdr[13] > (1 << 20):
                return None
            continue
        return hdr[2], hdr[9], buf[64:need]


def send_bad(addr, data, close_within):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return True  # closed while we were still sending: also a close
        return expect_closed(s, close_within)
    finally:
        s.close()


# ---- cases ---------------------------------------------------------------------------------


def case_matrix(h, workers):
    """1, 2 or 4 workers x 1, 2 and 3 servers: fp32 from 1 element up, many rounds."""
    partition = {1: "4194304", 2: "65536", 3: "16384"}
    end = {1: "4M", 2: "16M", 4: "16M"}[workers]
    for servers in (1, 2, 3):
        bench_job(h, workers, servers, "4", end, factor=4, iters=20, warmup=2,
                  extra=["--partition-bytes", partition[servers]])
    # Uneven sizes (-f 3 from 3 elements), partitions of 1025 elements, a small credit budget.
    bench_job(h, workers, 2, "12", "300K", factor=3, iters=5,
              extra=["--partition-bytes", "4100", "--max-in-flight", "65536"])


def case_matrix_64mib(h):
    """The largest size, in two configurations only (time and memory)."""
    bench_job(h, 2, 2, "64M", "64M", iters=5, warmup=1, timeout=100)
    bench_job(h, 4, 3, "64M", "64M", iters=3, warmup=1, timeout=100,
              extra=["--partition-bytes", "1048576"])


def case_dtypes(h):
    """Every dtype, summed and averaged (3 workers: a non-trivial divisor)."""
    for dtype in ("fp16", "bf16", "fp64", "int32", "int64", "fp32"):
        sz = str(DTYPE_SIZE[dtype])
        bench_job(h, 2, 3, sz, "256K", factor=8, dtype=dtype, iters=4,
                  extra=["--partition-bytes", "8192"])
        bench_job(h, 3, 2, sz, "256K", factor=8, dtype=dtype, iters=4,
                  extra=["--average", "--partition-bytes", "20000"])


def case_lanes_and_tcp(h):
    """Single-lane comparison mode, UCX forced onto TCP (as in emulated clusters), a job name."""
    bench_job(h, 2, 2, "4", "4M", factor=16, iters=5, extra=["--single-lane"],
              server_args=["--single-lane"])
    bench_job(h, 3, 2, "4", "4M", factor=16, iters=5, env={"UCX_TLS": "tcp"},
              extra=["--partition-bytes", "262144"], label="bench w3 s2 fp32 UCX_TLS=tcp")
    bench_job(h, 2, 1, "4", "64K", factor=16, iters=3, extra=["--job", "resnet-50/run 7"],
              label="bench w2 s1 job 'resnet-50/run 7'")


def case_many_keys_bench(h):
    """gradlink-bench with -f 1.1: one tensor per size, ~90 of them, several rounds each."""
    rows = bench_job(h, 2, 2, "4", "64K", factor=1.1, iters=3, warmup=1,
                     extra=["--partition-bytes", "4096"])
    if len(rows) < 80:
        raise Failure("only %d tensors" % len(rows))
    bench_job(h, 3, 3, "8", "16K", factor=1.1, dtype="int64", iters=3, warmup=1,
              extra=["--partition-bytes", "1024", "--average"])


def probe_argv(h, mode, *extra):
    def argv(rank, addr):
        return [h.probe, "--scheduler", addr, "--mode", mode, "--rank", str(rank)] + list(extra)
    return argv


def case_many_keys_api(h):
    """~500 tensors of every dtype declared and issued in a different order by every rank,
    two rounds in flight per tensor, every element checked."""
    run_job(h, "probe many-keys w3 s2 500 tensors x 6 rounds", 3, 2,
            probe_argv(h, "many-keys", "--tensors", "500", "--rounds", "6",
                       "--max-in-flight", str(32 << 20)), timeout=100)
    run_job(h, "probe many-keys w2 s3 500 tensors x 4 rounds, 1 KiB partitions", 2, 3,
            probe_argv(h, "many-keys", "--tensors", "500", "--rounds", "4",
                       "--partition-bytes", "1024", "--max-in-flight", str(64 << 20)),
            timeout=100)
    # The checks check: one rank pushes one wrong element, and every rank must notice (exit 3).
    _, _, wk = run_job(h, "probe many-keys w2 s1, rank 1 pushes one wrong element", 2, 1,
                       lambda r, addr: probe_argv(h, "many-keys", "--tensors", "20",
                                                  *(["--corrupt"] if r == 1 else []))(r, addr),
                       expect_worker_rc=3, timeout=60)
    for p in wk:
        if "1 wrong elements" not in p.out():
            raise Failure("%s should have counted exactly 1 wrong element:\n%s" % (p.name, p.out()))


def case_rank_order(h):
    """Inexact fp32/fp64 sums arriving in varying orders are bit-identical to the rank-order sum
    (and that divided by n when averaging), on 1, 2 and 3 servers."""
    for workers, servers, part in ((4, 1, "4194304"), (3, 2, "65536"), (4, 3, "40000")):
        run_job(h, "probe rank-order w%d s%d partitions %s" % (workers, servers, part), workers,
                servers, probe_argv(h, "rank-order", "--rounds", "8", "--partition-bytes", part),
                timeout=60)


def case_credits_order(h):
    """Regression test: with a bytes-in-flight budget smaller than one round of all tensors,
    ranks that issue their push_pulls in different orders must not deadlock (each holding its
    credit on partitions that the other has not pushed yet)."""
    run_job(h, "probe many-keys w2 s2 500 tensors, 256 KiB in flight", 2, 2,
            probe_argv(h, "many-keys", "--tensors", "500", "--rounds", "3",
                       "--max-in-flight", str(256 << 10), "--wait-s", "30"), timeout=60)


def case_bad_frames_scheduler(h):
    """Malformed frames to the scheduler close their connection; the job is unharmed."""
    workers, servers = 2, 2
    sched, addr = h.start_scheduler(workers, servers)
    host, port = addr.rsplit(":", 1)
    # A connection that never says anything: closed after the registration timeout (10 s),
    # and it must not hold up the job meanwhile.
    idle = socket.create_connection((host, int(port)), timeout=5)
    idle_opened = time.monotonic()
    failures = []
    for what, data, within in scheduler_bad_inputs():
        if not send_bad(addr, data, within):
            failures.append(what)
    # A connection closed by us mid-frame, and a connect-then-close: nothing to observe but
    # that the scheduler survives.
    for data in (header(T_REGISTER, payload=100)[:10], b""):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(data)
        s.close()
    if failures:
        raise Failure("the scheduler kept these connections open: %s" % failures)
    print("ok   %-58s" % ("%d kinds of bad frame: connection closed each time" %
                          len(scheduler_bad_inputs())))
    if sched.rc() is not None:
        raise Failure("the scheduler exited (%d) after the bad frames" % sched.rc())

    # The honest job, while a thread keeps sending bad frames.
    stop = threading.Event()
    spam_failures, spam_count = [], [0]
    cases = scheduler_bad_inputs()

    def spam():
        i = 0
        while not stop.is_set() and spam_count[0] < 400:
            what, data, within = cases[i % len(cases)]
            i += 1
            if within > 5:
                continue
            try:
                if not send_bad(addr, data, within):
                    spam_failures.append(what)
            except ConnectionRefusedError:
                return  # the job is over and the scheduler gone (its exit code is checked)
            except OSError as e:
                if not stop.is_set():
                    spam_failures.append("%s: %s" % (what, e))
            spam_count[0] += 1

    # Processes first: spawn() forks, and forking is only safe while no other thread runs.
    srv = h.start_servers(addr, servers)
    args = ["-b", "4", "-e", "4M", "-f", "4", "-n", "20", "--warmup", "2",
            "--partition-bytes", "262144", "--job", "default"]
    wk = [h.spawn("worker%d" % r, [h.bin("gradlink-bench"), "--scheduler", addr] + args)
          for r in range(workers)]
    t = threading.Thread(target=spam, daemon=True)
    t.start()
    job = srv + wk + [sched]
    try:
        # Once the job runs, a late worker is refused (kAbort), and so is a late server that
        # claims one of the job's server ids; a late server claiming none joins as a standby
        # (kWelcome, the first id after the job's servers). It then closes without a word: a
        # standby lost. The job goes on through all of it.
        end = time.monotonic() + 30
        while not any("# gradlink-bench:" in p.out() for p in wk):
            if time.monotonic() > end or any(p.rc() is not None for p in wk):
                raise Failure("the honest job did not start")
            time.sleep(0.02)
        for role, rank in ((1, -1), (2, 0)):
            what = "worker" if role == 1 else "server claiming id 0"
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(frame(T_REGISTER, register_payload(role=role, rank=rank, host="late")))
            f = read_frame(s, 5)
            closed = expect_closed(s, 5)
            s.close()
            if f is None or f[0] != T_ABORT or not closed:
                raise Failure("a late %s was not refused with kAbort and closed (got %r)" %
                              (what, f))
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(frame(T_REGISTER, register_payload(role=2, host="late")))
        f = read_frame(s, 5)
        s.close()
        if f is None or f[0] != T_WELCOME or struct.unpack("<I", f[2][:4])[0] != servers:
            raise Failure("a late server was not welcomed as standby server %d (got %r)" %
                          (servers, f and f[:2]))
        for p in wk:
            rc = h.wait(p, 60)
            if rc != 0:
                raise Failure("%s exited with %d" % (p.name, rc))
        stop.set()
        t.join(timeout=30)
        for p in srv + [sched]:
            rc = h.wait(p, 15)
            if rc != 0:
                raise Failure("%s exited with %d" % (p.name, rc))
        rows = bench_rows(wk)
        if not rows or any(r[3] != "OK" for r in rows):
            raise Failure("bench rows: %s" % rows)
        if spam_failures:
            raise Failure("during the job the scheduler kept bad connections open: %s" %
                          spam_failures[:10])
        if not expect_closed(idle, max(0.1, idle_opened + 14 - time.monotonic())):
            raise Failure("a connection that never registered was not closed within 14 s")
        idle.close()
    except Failure:
        stop.set()
        h.dump_logs(job)
        raise
    finally:
        stop.set()
        for p in job:
            h.kill(p)
    print("ok   %-58s" % ("honest job w2 s2 exact with %d bad connections alongside; late "
                          "members refused or standing by" % spam_count[0]))


def case_bad_frames_server(h):
    """A worker that also sends malformed and unexpected frames to every server lane; the
    servers keep serving, every sum stays exact, every process exits 0."""
    count, part, rounds = "300000", "262144", "5"

    def argv(n):
        def f(rank, addr):
            if rank == n - 1:
                return [h.rogue, "--scheduler", addr, "--rank", str(rank), "--count", count,
                        "--partition-bytes", part, "--rounds", rounds]
            return [h.probe, "--scheduler", addr, "--mode", "honest", "--rank", str(rank),
                    "--count", count, "--partition-bytes", part, "--rounds", rounds]
        return f

    for workers, servers, server_args in ((2, 2, []), (3, 1, ["--single-lane"])):
        _, srv, wk = run_job(h, "rogue w%d s%d %s" % (workers, servers, " ".join(server_args)),
                             workers, servers, argv(workers), server_args=server_args,
                             timeout=100)
        rogue_out = wk[-1].out()
        m = re.search(r"(\d+) bad frames sent", rogue_out)
        if not m or int(m.group(1)) == 0:
            raise Failure("the rogue worker sent no bad frames:\n" + rogue_out)
        for p in srv:
            m = re.search(r"(\d+) protocol errors", p.err())
            if not m or int(m.group(1)) == 0:
                h.dump_logs([p])
                raise Failure("%s counted no protocol errors" % p.name)
            print("     %s counted %s protocol errors" % (p.name, m.group(1)))


def case_barrage(h):
    """While an honest job runs (2 honest workers and the rogue as rank 2, 2 servers, many
    rounds, every element of every sum checked by every worker), the rogue sends >= 10,000
    deterministic bad frames to both lanes of both servers: headers truncated at every length,
    boundary values of every field, payload lies, and good headers the servers must refuse.
    Both servers must keep serving and exit 0, and each server's protocol-error total must equal
    the number of bad frames the rogue sent it."""
    workers, servers, rounds, want = 3, 2, 24, 10000
    count, part = "200000", "65536"

    def argv(rank, addr):
        if rank == workers - 1:
            return [h.rogue, "--scheduler", addr, "--rank", str(rank), "--count", count,
                    "--partition-bytes", part, "--rounds", str(rounds), "--barrage", str(want),
                    "--wait-s", "90"]
        return [h.probe, "--scheduler", addr, "--mode", "honest", "--rank", str(rank),
                "--count", count, "--partition-bytes", part, "--rounds", str(rounds),
                "--wait-s", "90"]

    t0 = time.monotonic()
    _, srv, wk = run_job(h, "barrage w%d s%d, %d rounds, >= %d bad frames" % (
        workers, servers, rounds, want), workers, servers, argv, timeout=min(200, h.left() - 20))
    elapsed = time.monotonic() - t0
    rogue_out = wk[-1].out()
    m = re.search(r"barrage: (\d+) bad frames sent in ([\d.]+) s \((\d+) on fresh", rogue_out)
    if not m:
        raise Failure("the rogue printed no barrage summary:\n" + rogue_out)
    sent, secs, closing = int(m.group(1)), float(m.group(2)), int(m.group(3))
    if sent < want:
        raise Failure("the rogue sent only %d bad frames" % sent)
    for line in rogue_out.splitlines():
        if line.startswith("rogue: barrage kind "):
            print("     " + line[len("rogue: "):])
    print("     %d bad frames (%d closing their connection, %d refused) in %.1f s of sending, "
          "job %.1f s" % (sent, closing, sent - closing, secs, elapsed))
    for p in wk[:-1]:
        if not re.search(r"%d rounds of \d+ elements, 0 wrong" % rounds, p.out()):
            raise Failure("%s did not report %d exact rounds:\n%s" % (p.name, rounds, p.out()))
    if not re.search(r"%d rounds, 0 wrong elements" % rounds, rogue_out):
        raise Failure("the rogue did not report %d exact rounds:\n%s" % (rounds, rogue_out))
    to_server = {int(a): int(b) for a, b in
                 re.findall(r"rogue: barrage to server (\d+): (\d+)", rogue_out)}
    total = 0
    for p in srv:
        m = re.search(r"gradlink-server (\d+): (\d+) protocol errors", p.err())
        if not m:
            h.dump_logs([p], lines=5)
            raise Failure("%s printed no protocol-error total" % p.name)
        sid, errors = int(m.group(1)), int(m.group(2))
        total += errors
        print("     server %d: %d protocol errors for %d bad frames sent to it" % (
            sid, errors, to_server.get(sid, -1)))
        if errors != to_server.get(sid, -1):
            h.dump_logs([p], lines=20)
            raise Failure("server %d counted %d protocol errors, the rogue sent it %d bad frames" % (
                sid, errors, to_server.get(sid, -1)))
    print("     servers' protocol errors: %d in all, for %d bad frames" % (total, sent))


def case_port_in_use(h):
    """gradlink-scheduler on a port that another socket holds exits non-zero, naming it."""
    for listening in (True, False):
        blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            blocker.bind(("127.0.0.1", 0))
            if listening:
                blocker.listen(1)
            port = blocker.getsockname()[1]
            t0 = time.monotonic()
            p = h.spawn("scheduler-port-%d" % port, [h.bin("gradlink-scheduler"), "--port",
                                                     str(port), "-w", "1", "-s", "1"])
            try:
                rc = h.wait(p, 10)
            except Failure:
                h.dump_logs([p])
                raise
            secs = time.monotonic() - t0
            err = p.err()
            if rc == 0:
                raise Failure("gradlink-scheduler on a taken port exited 0")
            if str(port) not in err:
                raise Failure("the error does not name port %d: %r" % (port, err))
            if secs > 5:
                raise Failure("gradlink-scheduler took %.1f s to give up" % secs)
            print("ok   %-58s %6.2f s  rc %d: %s" % ("port %d %s" % (
                port, "listening" if listening else "bound"), secs, rc, err.strip()))
        finally:
            blocker.close()


def case_mismatch(h):
    """Rank 0 declares 't' fp32[100], rank 1 fp32[101] (then: int32[100]): both get kMismatch
    naming the key and both ranks within 10 s and exit 5; an agreed tensor still works."""
    for variant in ([], ["--dtype-mismatch"]):
        t0 = time.monotonic()
        _, _, wk = run_job(h, "mismatch w2 s1 %s" % " ".join(variant), 2, 1,
                           probe_argv(h, "mismatch", *variant), expect_worker_rc=5, timeout=20)
        for p in wk:
            out = p.out()
            line = [l for l in out.splitlines() if "push_pull of 't'" in l]
            if not line or "kMismatch" not in line[0]:
                raise Failure("%s did not print kMismatch:\n%s" % (p.name, out))
            want = "int32" if variant else "fp32[101]"
            if want not in line[0] or "'t'" not in line[0]:
                raise Failure("%s: message does not say what differs: %s" % (p.name, line[0]))
            if p.seconds() > 10:
                raise Failure("%s took %.1f s" % (p.name, p.seconds()))
            print("     %s: %s" % (p.name, line[0]))
        if time.monotonic() - t0 > 20:
            raise Failure("the mismatch job took too long")


def case_ucx_segments_differ(h):
    """A server whose UCX TCP segments are smaller than the workers' (64 KiB against gradlink's
    68 KiB) would be aborted by UCX on their first push (tcp_ep.c's rx_seg_size assertion). The
    workers refuse to connect to it instead, naming both settings, and exit 1; the server is
    not hurt and ends with the job (exit 0)."""
    _, _, wk = run_job(
        h, "ucx segments differ: refused, nobody aborted", 2, 1,
        lambda r, addr: [h.bin("gradlink-bench"), "--scheduler", addr, "-b", "64K", "-e", "64K",
                         "-n", "3"],
        server_env={"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_RX_SEG_SIZE": "64k"},
        expect_worker_rc=1, timeout=30)
    for p in wk:
        said = p.out() + p.err()
        if "UCX TCP segments differ" not in said or \
                "receives segments of at most 64 KiB" not in said:
            raise Failure("%s did not say why:\n%s" % (p.name, said))


def case_timeout(h):
    """Wait(deadline) returns kTimeout while the peer has not pushed; the op then completes
    (or, if the worker shuts down instead, fails promptly)."""
    _, _, wk = run_job(h, "timeout w2 s1 (late push completes)", 2, 1,
                       probe_argv(h, "timeout"), timeout=30)
    if "kTimeout" not in wk[0].out():
        raise Failure("rank 0 did not report kTimeout:\n" + wk[0].out())
    print("     " + [l for l in wk[0].out().splitlines() if "kTimeout" in l][0])
    _, _, wk = run_job(h, "timeout w2 s2 (peer never pushes, shutdown)", 2, 2,
                       probe_argv(h, "abandon"), timeout=30)
    print("     " + [l for l in wk[0].out().splitlines() if "after shutdown" in l][0])


def case_refusals(h):
    """Members the scheduler must turn away, promptly and without hurting the job: a worker of
    another job, a rank out of range; and two workers claiming one rank fail the whole job
    (every process exits non-zero, none hangs)."""
    sched, addr = h.start_scheduler(2, 1, extra=["--job", "it-refusals"])
    srv = h.start_servers(addr, 1, ["--job", "it-refusals"])
    job = srv + [sched]
    try:
        for label, extra, want in (("worker of another job", ["--job", "not-it-refusals"], None),
                                   ("rank 7 of 2", ["--job", "it-refusals", "--rank", "7"],
                                    "out of range")):
            argv = [h.probe, "--scheduler", addr, "--mode", "honest", "--count", "10",
                    "--wait-s", "10"] + extra
            if "--rank" not in extra:
                argv += ["--rank", "0"]
            p = h.spawn("refused", argv)
            job.append(p)
            rc = h.wait(p, 10)
            if rc == 0 or p.seconds() > 10 or (want and want not in p.err()):
                raise Failure("%s: exit %d after %.1f s: %s" % (label, rc, p.seconds(), p.err()))
            print("ok   %-58s %6.2f s  %s" % ("refused: " + label, p.seconds(),
                                              p.err().strip().splitlines()[-1]))
        wk = [h.spawn("worker%d" % r, [h.probe, "--scheduler", addr, "--mode", "honest",
                                       "--rank", str(r), "--job", "it-refusals", "--count",
                                       "100000", "--rounds", "10"]) for r in range(2)]
        job += wk
        for p in wk + srv + [sched]:
            rc = h.wait(p, 30)
            if rc != 0:
                raise Failure("%s exited with %d" % (p.name, rc))
        print("ok   %-58s" % "the job of the right members completes")
    except Failure:
        h.dump_logs(job)
        raise
    finally:
        for p in job:
            h.kill(p)

    t0 = time.monotonic()
    sched, addr = h.start_scheduler(2, 1)
    srv = h.start_servers(addr, 1)
    wk = [h.spawn("worker%d" % r, [h.probe, "--scheduler", addr, "--mode", "honest", "--rank",
                                   "0", "--wait-s", "20"]) for r in range(2)]
    job = srv + wk + [sched]
    try:
        for p in job:
            rc = h.wait(p, 10)
            if rc == 0:
                raise Failure("%s exited 0 in a job where two workers claim rank 0" % p.name)
        for p in wk:
            if "rank 0" not in p.err():
                raise Failure("%s does not say why: %s" % (p.name, p.err()))
    except Failure:
        h.dump_logs(job)
        raise
    finally:
        for p in job:
            h.kill(p)
    print("ok   %-58s %6.2f s  %s" % ("two workers claim rank 0: all exit non-zero",
                                      time.monotonic() - t0, wk[0].err().strip().splitlines()[-1]))


def case_server_weights(h):
    """gradlink-server --weight / GRADLINK_SERVER_WEIGHT: bad values are refused before joining;
    a job on servers of weights 0.5, 3 and 1 is exact, and the scheduler numbers them heaviest
    first whatever order they connect in."""
    t0 = time.monotonic()
    refused = [(["--weight", "0"], {}), (["--weight", "-1"], {}), (["--weight", "inf"], {}),
               (["--weight", "nan"], {}), (["--weight", "2e6"], {}), (["--weight", "x"], {}),
               ([], {"GRADLINK_SERVER_WEIGHT": "abc"}), ([], {"GRADLINK_SERVER_WEIGHT": ""}),
               ([], {"GRADLINK_SERVER_WEIGHT": "0"})]
    for args, env in refused:
        p = h.spawn("bad-weight", [h.bin("gradlink-server"), "--scheduler", "127.0.0.1:1"] + args,
                    env=env)
        rc = h.wait(p, 10)
        err = p.err()
        if rc == 0 or "weight" not in err.lower():
            raise Failure("gradlink-server %s %s: exit %d, stderr %r (expected a refusal naming "
                          "the weight)" % (" ".join(args), env, rc, err))
    print("ok   %-58s" % ("%d bad weights refused before joining" % len(refused)))

    job = "weights"
    sched, addr = h.start_scheduler(2, 3, extra=["--job", job], env={"GRADLINK_LOG_LEVEL": "info"})
    base = [h.bin("gradlink-server"), "--scheduler", addr, "--job", job]
    srv = []
    # Lightest first, so that connection order and weight order differ.
    for name, args, env in [("server-w0.5", ["--weight", "0.5"], {}),
                            ("server-w3", [], {"GRADLINK_SERVER_WEIGHT": "3"}),
                            ("server-w1", ["--weight", "1"], {"GRADLINK_SERVER_WEIGHT": "9"})]:
        srv.append(h.spawn(name, base + args, env=env))
        time.sleep(0.2)
    args = ["--scheduler", addr, "--job", job, "-b", "4", "-e", "1M", "-f", "8", "-n", "3",
            "--warmup", "1", "--partition-bytes", "16384"]
    wk = [h.spawn("worker%d" % r, [h.bin("gradlink-bench")] + args) for r in range(2)]
    procs = srv + wk + [sched]
    try:
        h.wait_all(wk, [0, 0], 60, "weighted bench")
        for p in srv + [sched]:
            rc = h.wait(p, 15)
            if rc != 0:
                raise Failure("%s exited with %d" % (p.name, rc))
        rows = bench_rows(wk)
        if not rows or any(r[3] != "OK" for r in rows):
            raise Failure("bench rows: %s" % rows)
        m = re.search(r"placement weights: server 0 \(\S+\) 3, server 1 \(\S+\) 1, "
                      r"server 2 \(\S+\) 0\.5", sched.err())
        if not m:
            raise Failure("the scheduler did not number the servers by weight (3, 1, 0.5):\n%s" %
                          sched.err())
    except Failure:
        h.dump_logs(procs)
        raise
    print("ok   %-58s %6.2f s" % ("bench w2 s3 weights 0.5/3/1: exact, ids by weight",
                                  time.monotonic() - t0))


def case_split_header(h):
    """Regression test: a frame header that reaches the scheduler in two pieces 300 ms apart
    (a TCP segment retransmitted) must not cost the member its connection."""
    sched, addr = h.start_scheduler(1, 1, extra=["--join-timeout-ms", "20000"])
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    try:
        f = frame(T_REGISTER, register_payload(role=2, host="slow-link"))
        s.sendall(f[:40])
        time.sleep(0.3)
        s.sendall(f[40:])
        # Our registration as the server is in; a worker completes the job's membership.
        wk = h.spawn("worker0", [h.probe, "--scheduler", addr, "--mode", "honest", "--rank", "0",
                                 "--count", "10", "--wait-s", "10"])
        got = read_frame(s, 10)
        if got is None or got[0] != T_WELCOME:
            h.dump_logs([sched, wk])
            raise Failure("the scheduler dropped a member whose header came in two pieces "
                          "(got %r instead of kWelcome)" % (got,))
        print("ok   %-58s" % "header in two pieces 300 ms apart: member welcomed")
    finally:
        s.close()
        h.kill_all()


def case_scheduler_reaps_connections(h):
    """Regression test: connections that the scheduler closed (bad frames) must not keep a file
    descriptor and a thread stack each until the job ends (a port scan would exhaust it)."""
    sched, addr = h.start_scheduler(1, 1)

    def usage():
        fds = len(os.listdir("/proc/%d/fd" % sched.pid))
        with open("/proc/%d/status" % sched.pid) as f:
            vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0]
        return fds, vm

    fds0, vm0 = usage()
    n = 300
    for i in range(n):
        if not send_bad(addr, frame(T_BARRIER), 5):
            raise Failure("bad connection %d was not closed" % i)
    time.sleep(1)
    fds1, vm1 = usage()
    print("     %d bad connections: scheduler fds %d -> %d, VmSize %d -> %d MiB" %
          (n, fds0, fds1, vm0 >> 10, vm1 >> 10))
    if fds1 - fds0 > 32 or (vm1 - vm0) >> 10 > 512:
        raise Failure("the scheduler keeps closed connections: +%d fds, +%d MiB of address "
                      "space after %d connections" % (fds1 - fds0, (vm1 - vm0) >> 10, n))


def case_bench_sizes(h):
    """gradlink-bench asked for more than the machine holds (-e 1T), or for a size it cannot
    read, exits 2 within 5 s naming the size and the memory available: no uncaught exception,
    and as a worker of a job (--scheduler) before it tries to join (the address given here has
    no scheduler: the error must be about the size, not the connection)."""
    runs = [("local job, -e 1T", ["-b", "1T", "-e", "1T"], r"1T needs a 1024G buffer .* GiB available"),
            ("worker, -e 1T", ["--scheduler", "127.0.0.1:1", "-b", "4K", "-e", "1T"],
             r"1T needs a 1024G buffer in each of 1 worker.* GiB available"),
            ("bad size", ["-b", "4K", "-e", "64X"], r"bad size '64X'")]
    for label, argv, want in runs:
        t0 = time.monotonic()
        p = h.spawn("bench-" + label.replace(" ", "-").replace(",", ""),
                    [h.bin("gradlink-bench")] + argv)
        rc = h.wait(p, 10)
        secs = time.monotonic() - t0
        err = p.err()
        if rc != 2 or not re.search(want, err) or "terminate" in err or "bad_alloc" in err:
            h.dump_logs([p])
            raise Failure("%s: rc %s (want 2), stderr %r (want /%s/)" % (label, rc, err, want))
        if secs > 5:
            raise Failure("%s: took %.1f s" % (label, secs))
        print("ok   %-30s %5.2f s  %s" % (label, secs, err.strip()))


def case_bad_settings(h):
    """Settings that cannot work are refused by name before anything connects (the address
    given has no scheduler: the error must be about the setting): a malformed UCX size (UCX's
    own error says only "Invalid parameter"), a malformed GRADLINK_* byte count, a window that
    cannot hold one partition."""
    runs = [("UCX_TCP_RCVBUF=64q", {"UCX_TCP_RCVBUF": "64q"}, [],
             r"kInvalidArgument: .*UCX refused its configuration; set in the environment: "
             r".*UCX_TCP_RCVBUF='64q'"),
            ("GRADLINK_MAX_BYTES_AHEAD=1 MiB", {"GRADLINK_MAX_BYTES_AHEAD": "1 MiB"}, [],
             r"GRADLINK_MAX_BYTES_AHEAD='1 MiB' is not a byte count"),
            ("window below a partition", {}, ["--partition-bytes", str(8 << 20), "--max-in-flight", str(1 << 20)],
             r"max_bytes_in_flight \(GRADLINK_MAX_BYTES_IN_FLIGHT\) of 1048576 bytes cannot "
             r"hold one partition of 8388608 bytes")]
    for label, env, extra, want in runs:
        t0 = time.monotonic()
        p = h.spawn("bench-" + re.sub(r"[^A-Za-z0-9]+", "-", label),
                    [h.bin("gradlink-bench"), "--scheduler", "127.0.0.1:1", "-b", "4K", "-e", "4K"]
                    + extra, env=env)
        rc = h.wait(p, 10)
        secs = time.monotonic() - t0
        err = p.err()
        if rc == 0 or not re.search(want, err):
            h.dump_logs([p])
            raise Failure("%s: rc %s, stderr %r (want /%s/)" % (label, rc, err, want))
        if secs > 5:
            raise Failure("%s: took %.1f s" % (label, secs))
        print("ok   %-32s %5.2f s  %s" % (label, secs, err.strip().splitlines()[-1][:150]))


def _stranger(port, source, garbage):
    """A connection to the scheduler from `source` (another loopback address); with `garbage`,
    it sends bytes that are no frame. None when the connection could not be made."""
    sk = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sk.bind((source, 0))
        sk.settimeout(2)
        sk.connect(("127.0.0.1", port))
        if garbage:
            sk.sendall(bytes((i * 37 + len(source)) % 251 for i in range(64)))
        return sk
    except OSError:
        sk.close()
        return None


def case_strangers(h):
    """Strangers that only connect (1,000 idle connections: 500 from one address, 127.0.0.2,
    and 2 from each of 250 others, 127.0.1.x) or send garbage (1,000 from ten addresses,
    127.0.0.3 to .12, while the members join) cannot shut members out: a job of 2 workers and 1
    server from 127.0.0.1 joins and sums exactly. (The scheduler held 256 slots for connections
    that had not registered and refused members once strangers held them all.)"""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2600:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    t0 = time.monotonic()
    job = "strangers"
    sched, addr = h.start_scheduler(2, 1, extra=["--job", job, "--join-timeout-ms", "60000"])
    port = int(addr.rsplit(":", 1)[1])
    idle = [_stranger(port, "127.0.0.2", False) for _ in range(500)]
    idle += [_stranger(port, "127.0.1.%d" % (1 + i // 2), False) for i in range(500)]
    opened = sum(1 for s in idle if s is not None)
    if opened < 900:
        raise Failure("only %d of 1000 idle stranger connections could be made" % opened)
    garbage_sent = [0]
    stop = [False]

    def garbage():
        for i in range(1000):
            if stop[0]:
                return
            sk = _stranger(port, "127.0.0.%d" % (3 + i % 10), True)
            if sk is not None:
                garbage_sent[0] += 1
                sk.close()
    import threading
    args = ["-b", "4K", "-e", "256K", "-n", "3", "--job", job]
    srv = h.start_servers(addr, 1, ["--job", job])
    wk = [h.spawn("worker%d" % r, [h.bin("gradlink-bench"), "--scheduler", addr] + args)
          for r in range(2)]
    th = threading.Thread(target=garbage)  # after the spawns (the harness forks)
    th.start()
    procs = srv + wk + [sched]
    try:
        h.wait_all(wk, [0, 0], 60, "strangers")
        for p in srv + [sched]:
            if h.wait(p, 15) != 0:
                raise Failure("%s exited with %d" % (p.name, p.rc()))
    except Failure:
        h.dump_logs(procs)
        raise
    finally:
        stop[0] = True
        th.join()
        for sk in idle:
            if sk is not None:
                sk.close()
        for p in procs:
            h.kill(p)
    rows = bench_rows(wk)
    bad = [r for r in rows if r[3] != "OK"]
    if not rows or bad:
        raise Failure("rows not OK: %s" % (bad or "none"))
    print("ok   %d idle + %d garbage stranger connections; job of 2 workers joined and summed "
          "exactly (%d rows) in %.1f s" % (opened, garbage_sent[0], len(rows),
                                           time.monotonic() - t0))


def case_scale_128(h):
    """128 gradlink-bench workers and 4 gradlink-server processes, all real, in one job: it joins
    (every server connects to 128 workers while heartbeating), and every element of every round
    of 4K..64K is exact on every worker. (192 workers x 4 failed when a server connected to
    every worker before it heartbeat; bench/scale_job.sh runs 256 x 4.)"""
    bench_job(h, 128, 4, "4K", "64K", factor=4.0, iters=2, warmup=1, timeout=150,
              label="128 workers x 4 servers, 4K..64K, every element checked")


def _rss(pid):
    """Resident bytes of process `pid` (VmRSS), 0 once it is gone."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _bench_under_rss(h, job, server_args, bench_args, want_rc, timeout, label):
    """One server (its own gradlink-server, `server_args`) and 2 gradlink-bench workers
    (`bench_args`), each worker expected to exit with `want_rc` (and, when 0, the server and the
    scheduler with 0 too). The server's RSS is sampled every 5 ms from once it has joined (its
    idle RSS) to the end. Returns (idle bytes, peak growth over idle, the worker processes)."""
    import threading
    sched, addr = h.start_scheduler(2, 1, extra=["--job", job])
    srv = h.start_servers(addr, 1, ["--job", job] + list(server_args))
    # Idle: joined UCX and the scheduler, before any worker exists.
    time.sleep(1.0)
    idle = _rss(srv[0].pid)
    peak = [idle]
    done = [False]

    def sample():
        while not done[0]:
            peak[0] = max(peak[0], _rss(srv[0].pid))
            time.sleep(0.005)
    args = list(bench_args) + ["--job", job]
    wk = [h.spawn("worker%d" % r, [h.bin("gradlink-bench"), "--scheduler", addr] + args)
          for r in range(2)]
    th = threading.Thread(target=sample)
    th.start()
    procs = srv + wk + [sched]
    try:
        h.wait_all(wk, [want_rc, want_rc], timeout, label)
        if want_rc == 0:
            for p in srv + [sched]:
                if h.wait(p, 15) != 0:
                    raise Failure("%s exited with %d" % (p.name, p.rc()))
    except Failure:
        h.dump_logs(procs)
        raise
    finally:
        done[0] = True
        th.join()
        for p in procs:
            h.kill(p)
    if want_rc == 0:
        rows = bench_rows(wk)
        if len(rows) != 1 or rows[0][3] != "OK":
            raise Failure("%s: rows %s" % (label, rows))
    return idle, peak[0] - idle, wk


def case_server_memory(h):
    """Admission control against the servers' memory budgets, with the real binaries.
    (1) gradlink-server --memory-budget 96M, 2 workers of gradlink-bench pushing 16 MiB fp32
    tensors as fast as they can (a server holds at most 4 bytes per byte there, 64 MiB, and
    usually 3): every element exact, and the server's RSS above its idle RSS, sampled every
    5 ms, stays under 96 MiB. (2) The same server asked for 32 MiB (up to 128 MiB): both fail with
    kResourceExhausted naming the tensor, its bytes and the budget, and the server's RSS does
    not grow by even one tensor (no data moved). (3) Two servers on one host with no budget set:
    the scheduler gives each 3/8 of the memory available (3/4, split between the two)."""
    budget = 96 << 20
    for label, size, want_rc in (("16M under a 96M budget", "16M", 0),
                                 ("32M over a 96M budget", "32M", 1)):
        idle, grew, wk = _bench_under_rss(
            h, "it-memory", ["--memory-budget", "96M"],
            ["-b", size, "-e", size, "-n", "60", "--warmup", "2"], want_rc, 90, label)
        if want_rc == 0:
            if grew >= budget:
                raise Failure("%s: server RSS grew %.1f MiB over idle (%.1f MiB), budget 96 MiB"
                              % (label, grew / 2**20, idle / 2**20))
        else:
            want = (r"kResourceExhausted: key 0x[0-9a-f]+ '[^']+': fp32\[8388608\] "
                    r"\(33554432 bytes\) needs 134217728 bytes on server 0 .* of its "
                    r"100663296-byte memory budget")
            for p in wk:
                if not re.search(want, p.err()):
                    h.dump_logs(wk)
                    raise Failure("%s: %s said %r, want /%s/" % (label, p.name, p.err(), want))
            if grew >= 32 << 20:
                raise Failure("%s: server RSS grew %.1f MiB: data moved" % (label, grew / 2**20))
        print("ok   %-26s server RSS idle %6.1f MiB, peak +%5.1f MiB (budget 96 MiB)"
              % (label, idle / 2**20, grew / 2**20))

    # (3) The default budget: 3/4 of MemAvailable, split between the servers of one host.
    os_env = {"GRADLINK_LOG_LEVEL": "info"}
    sched, addr = h.start_scheduler(1, 2, extra=["--job", "it-default-budget"], env=os_env)
    avail = _mem_available()
    srv = h.start_servers(addr, 2, ["--job", "it-default-budget"])
    wk = [h.spawn("worker0", [h.bin("gradlink-bench"), "--scheduler", addr, "-b", "4K", "-e",
                              "4K", "-n", "2", "--job", "it-default-budget"])]
    try:
        h.wait_all(wk, [0], 60, "default budget")
        h.wait(sched, 15)
    finally:
        for p in srv + wk + [sched]:
            h.kill(p)
    m = re.search(r"memory budgets: server 0 (\d+) MiB, server 1 (\d+) MiB", sched.err())
    if not m:
        h.dump_logs([sched])
        raise Failure("the scheduler logged no memory budgets")
    want = avail * 3 / 8 / 2**20
    for got in (int(m.group(1)), int(m.group(2))):
        if abs(got - want) > 0.1 * want:
            raise Failure("default budget %d MiB, want about %.0f MiB (3/8 of %.0f MiB available)"
                          % (got, want, avail / 2**20))
    print("ok   default budgets %s MiB and %s MiB: 3/8 of %.0f MiB available each"
          % (m.group(1), m.group(2), avail / 2**20))


def case_server_memory_in_flight(h):
    """What a server holds follows the rounds in flight, not what it was given: 2 gradlink-bench
    workers push 1 GiB fp32 tensors through one gradlink-server (no tuning flags, the default
    budget): every element exact, and the server's RSS, sampled every 5 ms, grows by less than
    512 MiB over idle (its pool keeps up to 256 MiB free, and each worker leads by 32 MiB on one
    machine), where keeping every partition's buffers for the job grew it by 3 GiB."""
    idle, grew, _ = _bench_under_rss(
        h, "it-memory-flight", [],
        ["-b", "1G", "-e", "1G", "-n", "2", "--warmup", "1", "--local-arena", "0"], 0, 150,
        "1 GiB through one server")
    if grew >= 512 << 20:
        raise Failure("server RSS grew %.1f MiB over idle (%.1f MiB) for 1 GiB tensors"
                      % (grew / 2**20, idle / 2**20))
    print("ok   1 GiB tensors: server RSS idle %.1f MiB, peak +%.1f MiB (3076.5 MiB before the "
          "pool)" % (idle / 2**20, grew / 2**20))


CASES = {
    "matrix_w1": lambda h: case_matrix(h, 1),
    "matrix_w2": lambda h: case_matrix(h, 2),
    "matrix_w4": lambda h: case_matrix(h, 4),
    "matrix_64mib": case_matrix_64mib,
    "dtypes": case_dtypes,
    "lanes_and_tcp": case_lanes_and_tcp,
    "many_keys_bench": case_many_keys_bench,
    "many_keys_api": case_many_keys_api,
    "rank_order": case_rank_order,
    "credits_order": case_credits_order,
    "bad_frames_scheduler": case_bad_frames_scheduler,
    "bad_frames_server": case_bad_frames_server,
    "barrage": case_barrage,
    "port_in_use": case_port_in_use,
    "mismatch": case_mismatch,
    "ucx_segments_differ": case_ucx_segments_differ,
    "timeout": case_timeout,
    "refusals": case_refusals,
    "server_weights": case_server_weights,
    "split_header": case_split_header,
    "scheduler_reaps_connections": case_scheduler_reaps_connections,
    "bench_sizes": case_bench_sizes,
    "strangers": case_strangers,
    "server_memory": case_server_memory,
    "server_memory_in_flight": case_server_memory_in_flight,
    "scale_128": case_scale_128,
    "bad_settings": case_bad_settings,
}


def main(cases=None, doc=None):
    cases = cases or CASES
    ap = argparse.ArgumentParser(description=doc or __doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True, help="where gradlink-scheduler/-server/-bench are")
    ap.add_argument("--probe", required=True, help="gl_probe_worker")
    ap.add_argument("--rogue", required=True, help="gl_rogue_worker")
    ap.add_argument("--budget", type=float, default=120, help="seconds for the whole case")
    ap.add_argument("case", choices=sorted(cases))
    args = ap.parse_args()
    h = Harness(args)

    def on_signal(signum, _frame):
        h.kill_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    rc = 0
    try:
        cases[args.case](h)
    except Failure as e:
        print("FAIL %s: %s" % (args.case, e))
        rc = 1
    except Exception:  # noqa: BLE001 - report and clean up
        import traceback
        traceback.print_exc()
        rc = 1
    finally:
        h.kill_all()
    print("%s %s in %.1f s (logs: %s)" % ("PASS" if rc == 0 else "FAIL", args.case,
                                           time.monotonic() - t0, h.tmp))
    if rc == 0:
        import shutil
        shutil.rmtree(h.tmp, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
