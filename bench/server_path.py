#!/usr/bin/env python3
"""bench/server_path.py: the servers' data path on one host, as real processes.

For each shape (workers x servers) and size, one job: gradlink-scheduler, the servers as
gradlink-server processes, the workers as gradlink-bench processes with the same-host path
off (--local-arena 0: every sum through the servers), no tuning flags. Reported per row:

- busbw (gradlink-bench, rank 0's median time);
- server CPU per GB of pushes and allocations per message, in the steady state: a probe job
  gives the time per round, then a job of about --window seconds of rounds is sampled from 30%
  to 80% of them: the servers' CPU time (/proc/PID/stat, utime + stime) over the bytes pushed
  to them meanwhile (workers x size x rounds), and their allocations (each runs under
  bench/tools/alloc_count.c, LD_PRELOAD, read by SIGUSR1) over the messages meanwhile (each
  worker's pushes and the servers' replies: 2 x workers x partitions per round), with the
  count and the messages beside the ratio (a count of 0 is no allocation at all); and the
  same for the workers (gradlink-bench processes, under the same counter, signalled at the same
  marks), whose pushes and replies are as many as the servers';
- beside it, ucx_perftest's UCP active-message bandwidth on the same transport (TCP loopback)
  at the row's partition size, one pair of processes.

Run with --server-bin to measure another gradlink-server (an older build) beside this one.
Standard library only; prints a Markdown table.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare import human, parse_size  # noqa: E402  (bench/compare.py's size helpers)


def cpu_seconds(pid):
    """utime + stime of a process (its threads included), in seconds; None once it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def build_alloc_counter(tmp):
    so = os.path.join(tmp, "alloc_count.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so,
                    os.path.join(HERE, "tools", "alloc_count.c"), "-ldl"], check=True)
    return so


def summed_counts(paths):
    """Per mark, the allocations of every process together (a mark a process outlived is
    missing from its file)."""
    per_proc = []
    for path in paths:
        with open(path) as f:
            per_proc.append([int(x) for x in f.read().split()])
    return [sum(v[i] for v in per_proc) for i in range(min(map(len, per_proc)))] \
        if per_proc else []


class Job:
    """One job; returns rank 0's bench row, the servers' CPU seconds and allocation counts."""

    def __init__(self, a, server_bin, workers, servers, size, iters, tmp, preload, marks=()):
        self.a, self.server_bin, self.workers, self.servers = a, server_bin, workers, servers
        self.size, self.iters, self.tmp, self.preload = size, iters, tmp, preload
        self.marks = list(marks)  # seconds after the workers start: snapshots of CPU and allocations

    def run(self):
        a = self.a
        procs = []
        env = dict(os.environ)
        env.setdefault("GRADLINK_LOG_LEVEL", "warn")
        try:
            sched = subprocess.Popen([os.path.join(a.bin_dir, "gradlink-scheduler"), "--port", "0",
                                      "-w", str(self.workers), "-s", str(self.servers)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env)
            procs.append(sched)
            m, seen = None, ""
            while m is None:
                line = sched.stdout.readline()
                if not line:
                    raise RuntimeError("scheduler said: %r" % seen)
                seen += line
                m = re.search(r"listening on (\S+):(\d+)", line)
            # Drained from here on, so that its log never fills the pipe.
            threading.Thread(target=sched.stdout.read, daemon=True).start()
            addr = "%s:%s" % (m.group(1), m.group(2))
            counts, wcounts = [], []  # the allocation counters' files: servers', workers'

            def counted(files, name):
                # The environment of a process whose allocations are counted into tmp/name.
                penv = dict(env)
                if self.preload:
                    files.append(os.path.join(self.tmp, name))
                    penv["LD_PRELOAD"] = self.preload
                    penv["ALLOC_COUNT_FILE"] = files[-1]
                return penv

            servers = []
            for i in range(self.servers):
                p = subprocess.Popen([self.server_bin, "--scheduler", addr],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=counted(counts, "allocs.%d" % i))
                servers.append(p)
                procs.append(p)
            cpu = {p.pid: 0.0 for p in servers}
            bench = [os.path.join(a.bin_dir, "gradlink-bench"), "--scheduler", addr,
                     "--local-arena", "0", "-b", str(self.size), "-e", str(self.size),
                     "-n", str(self.iters), "--warmup", "1"]
            workers = [subprocess.Popen(bench, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=counted(wcounts, "allocs.w%d" % i))
                       for i in range(self.workers)]
            procs += workers
            outs = []
            started = time.monotonic()
            deadline = started + a.timeout
            marks = list(self.marks)
            snaps = []  # per mark: the servers' CPU seconds then
            while any(w.poll() is None for w in workers) or any(s.poll() is None for s in servers):
                for s in servers:
                    c = cpu_seconds(s.pid)
                    if c is not None:
                        cpu[s.pid] = c
                if marks and time.monotonic() - started >= marks[0]:
                    marks.pop(0)
                    snaps.append(sum(cpu_seconds(s.pid) or 0.0 for s in servers))
                    for p in servers + workers:
                        if p.poll() is None:
                            os.kill(p.pid, signal.SIGUSR1)
                if time.monotonic() > deadline:
                    raise RuntimeError("job of %s timed out" % human(self.size))
                time.sleep(0.002)
            wall = time.monotonic() - started
            for w in workers:
                out, err = w.communicate()
                if w.returncode != 0:
                    raise RuntimeError("gradlink-bench exited %d: %s" % (w.returncode, err[-2000:]))
                outs.append(out)
            row = None
            partition = None
            for out in outs:
                pm = re.search(r"partitions (\d+[KMG]?)", out)
                if pm:
                    partition = parse_size(pm.group(1))
                for ln in out.splitlines():
                    f = ln.split()
                    if len(f) == 8 and f[0] == str(self.size):
                        if f[7] != "OK":
                            raise RuntimeError("wrong sum: %s" % ln)
                        row = {"time_us": float(f[3]), "busbw": float(f[6])}
            if row is None:
                raise RuntimeError("no result row:\n%s" % outs[0][-2000:])
            return {"row": row, "cpu": snaps, "allocs": summed_counts(counts),
                    "worker_allocs": summed_counts(wcounts), "partition": partition, "wall": wall}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def perftest_bw(size, iters):
    """ucx_perftest ucp_am_bw on TCP loopback at `size`: MB/s, or None."""
    if not shutil.which("ucx_perftest"):
        return None
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    port = "13337"
    srv = subprocess.Popen(["ucx_perftest", "-p", port], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
    try:
        time.sleep(0.5)
        out = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", port, "-t", "ucp_am_bw", "-s",
                              str(size), "-n", str(iters), "-w", str(max(1, iters // 10))],
                             capture_output=True, text=True, env=env, timeout=120).stdout
    finally:
        srv.kill()
        srv.wait()
    # The final line: "Final: <iters> <typ lat> <avg lat> <overall lat> <avg bw> <overall bw> ..."
    for ln in out.splitlines():
        if ln.strip().startswith("Final:"):
            f = ln.split()
            return float(f[6])  # overall bandwidth, MB/s
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--server-bin", action="append", default=[],
                    help="LABEL=PATH of a gradlink-server to measure (repeatable; default: "
                         "this build's)")
    ap.add_argument("--shapes", default="2x1,4x1,2x2,4x2", help="workers x servers, comma-separated")
    ap.add_argument("--sizes", default="4K,64K,1M,4M,16M,64M,256M")
    ap.add_argument("--iters", type=int, default=10, help="timed rounds per job, at least (sizes "
                    "under 64 MiB get up to 64 MiB / size, at most 2000)")
    ap.add_argument("--window", type=float, default=3.0,
                    help="seconds of rounds the measured job runs for, about")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--no-perftest", action="store_true")
    a = ap.parse_args()
    bins = [tuple(s.split("=", 1)) for s in a.server_bin] or [
        ("this build", os.path.join(a.bin_dir, "gradlink-server"))]
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    tmp = tempfile.mkdtemp(prefix="server-path-")
    preload = build_alloc_counter(tmp)
    print("| server | workers x servers | size | busbw GB/s | server CPU s per GB pushed | "
          "allocations per message | allocations / messages in the window | "
          "workers' allocations / their messages | "
          "ucx_perftest AM MB/s at the partition size |")
    print("|---|---|---|---|---|---|---|---|---|")
    perf = {}
    for label, server_bin in bins:
        for workers, servers in shapes:
            for size in sizes:
                # A probe job gives the time per round; the measured job runs long enough for
                # a window in its middle (from 30% to 80% of its rounds), where the servers' CPU
                # and allocations are read: the steady state, without joining or the ends.
                # The measured job runs twice the rounds the window needs, so that a job
                # faster than its probe (a probe's start is the slower: CI once saw the window
                # outlive a 64K job) still holds the window; one that ends before it anyway is
                # run again, sized by its own timing.
                sizing = Job(a, server_bin, workers, servers, size, a.iters, tmp, None).run()
                sized_rounds = a.iters
                for attempt in range(3):
                    t_op = sizing["row"]["time_us"] / 1e6
                    startup = max(0.0, sizing["wall"] - (sized_rounds + 1) * t_op)
                    rounds = max(a.iters, min(20000, int(a.window / t_op) + 1))
                    marks = (startup + 0.3 * rounds * t_op, startup + 0.8 * rounds * t_op)
                    job = Job(a, server_bin, workers, servers, size, 2 * rounds, tmp, preload,
                              marks).run()
                    if len(job["cpu"]) >= 2 and len(job["allocs"]) >= 2 and \
                            len(job["worker_allocs"]) >= 2:
                        break
                    sizing, sized_rounds = job, 2 * rounds
                else:
                    raise RuntimeError("%s: the job ended before its window, 3 times" %
                                       human(size))
                row, partition = job["row"], job["partition"]
                window = marks[1] - marks[0]
                in_window = window / (row["time_us"] / 1e6)  # rounds
                per_gb = (job["cpu"][1] - job["cpu"][0]) / (workers * size * in_window / 1e9)
                parts = max(1, -(-size // partition)) if partition else 1
                allocs = job["allocs"][1] - job["allocs"][0]
                messages = 2 * workers * parts * in_window  # pushes in and replies out
                per_msg = allocs / messages
                # Each worker's own pushes and replies: together, as many as the servers'.
                wallocs = job["worker_allocs"][1] - job["worker_allocs"][0]
                key = min(size, partition or size)
                if not a.no_perftest and key not in perf:
                    perf[key] = perftest_bw(key, 2000 if key <= (1 << 20) else 200)
                pt = perf.get(key)
                print("| %s | %d x %d | %s | %.3f | %.2f | %.3f | %d / %.0f | %d / %.0f | %s |" % (
                    label, workers, servers, human(size), row["busbw"], per_gb, per_msg,
                    allocs, messages, wallocs, messages, "%.0f" % pt if pt else "-"))
                sys.stdout.flush()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
