#!/usr/bin/python3
"""gloo_allreduce: Gloo all_reduce (fp32 sum, in place) through torch.distributed, timed like
gradlink-bench, every element of every result checked against the exact expected sum. A baseline
for bench/compare and for any other launcher (e.g. ranks in network namespaces).

Usage (Debian's python, which has torch: /usr/bin/python3 or .venv/bin/python):
  gloo_allreduce.py --local N [SIZES]
      starts N ranks on 127.0.0.1 (a free port; GLOO_SOCKET_IFNAME=lo unless set) and waits for
      them; rank 0's output is this process's output; exit status: the first failing rank's.
  gloo_allreduce.py --rank R --world-size W --master-addr A --master-port P [SIZES]
      one rank of a job started by another launcher; rank 0 listens on A:P (TCP store). Gloo picks
      its interface from GLOO_SOCKET_IFNAME (e.g. the namespace's veth) or the hostname.
  SIZES (like gradlink-bench and mpi_allreduce):
    -b, --minbytes   smallest size in bytes, K/M/G suffixes (default 4K)
    -e, --maxbytes   largest size (default 64M)
    -f, --stepfactor size multiplier between rows, > 1 (default 4)
    -n, --iters      timed iterations per size (default 20)
    --warmup         untimed iterations per size (default 3)
    --timeout        seconds for the rendezvous and for each collective (default 120)
    --corrupt        self-test of the checker: rank 0 changes one element of its result after
                     the collective, so the check must report it (and the exit status is 3)

Sizes run like gradlink-bench: bytes = max(b, 4), then bytes = max(bytes + 4, bytes * f) while
bytes <= e; count = bytes // 4 fp32 elements.

Each iteration: refill the tensor with rank r's values v(i, r) = ((7i + 3r) mod 13) - 6 (small
integers: every sum is exact in fp32), barrier, time dist.all_reduce (SUM, synchronous) on each
rank, then compare every element with the sum over r of v(i, r) (computed once per size, without
any collective). The reported time of an iteration is rank 0's, as in gradlink-bench. torch runs
with one intra-op thread (idle OpenMP threads spinning would steal the CPU from Gloo).

Output (stdout of rank 0): comment lines starting with '#', and one JSON object per size:
  {"system": "gloo", "ranks": N, "bytes": B, "count": C, "dtype": "fp32", "iters": I,
   "warmup": W, "time_us": MEAN, "min_us": MIN, "max_us": MAX, "algbw": GB/s, "busbw": GB/s,
   "wrong": WRONG_ELEMENTS_ALL_RANKS, "check": "OK" | "WRONG:n", "times_us": [each iteration]}
algbw = bytes / mean time, busbw = algbw * 2(N-1)/N (nccl-tests' all-reduce definitions).
Exit status: 0 when every element of every iteration on every rank was right, 3 when any was
wrong, 2 on bad arguments, 1 on any other error (a rank that fails, a timeout).
"""
import argparse
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time


def parse_size(text):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError("bad size '%s' (e.g. 4096, 4K, 64M)" % text)
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def sizes(begin, end, factor):
    b = max(begin, 4)
    while b <= end:
        yield b
        b = max(b + 4, int(b * factor))


def positive_int(text):
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0, got %s" % text)
    return v


def nonneg_int(text):
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0, got %s" % text)
    return v


def factor_arg(text):
    v = float(text)
    if not v > 1:
        raise argparse.ArgumentTypeError("must be > 1, got %s" % text)
    return v


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=positive_int, metavar="N", help="start N ranks on 127.0.0.1")
    ap.add_argument("--rank", type=nonneg_int)
    ap.add_argument("--world-size", type=positive_int)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=positive_int)
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    ap.add_argument("-f", "--stepfactor", type=factor_arg, default=4.0)
    ap.add_argument("-n", "--iters", type=positive_int, default=20)
    ap.add_argument("--warmup", type=nonneg_int, default=3)
    ap.add_argument("--timeout", type=positive_int, default=120)
    ap.add_argument("--corrupt", action="store_true")
    return ap


def size_args(a):
    out = ["-b", str(a.minbytes), "-e", str(a.maxbytes), "-f", repr(a.stepfactor), "-n", str(a.iters),
           "--warmup", str(a.warmup), "--timeout", str(a.timeout)]
    return out + (["--corrupt"] if a.corrupt else [])


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(a):
    """Starts a.local ranks of this script on 127.0.0.1; returns the exit status."""
    port = a.master_port or free_port()
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = []
    for r in range(a.local):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(r), "--world-size", str(a.local),
               "--master-addr", "127.0.0.1", "--master-port", str(port)] + size_args(a)
        # The ranks stay in this process's group: a launcher that stops the group stops them.
        procs.append(subprocess.Popen(cmd, env=env, stdout=None if r == 0 else subprocess.DEVNULL))
    # Every rank has its own deadlines (rendezvous, each collective); this one bounds the whole job.
    n_sizes = len(list(sizes(a.minbytes, a.maxbytes, a.stepfactor)))
    deadline = time.monotonic() + a.timeout * (2 + n_sizes * (a.iters + a.warmup))
    status = 0
    try:
        pending = list(enumerate(procs))
        while pending:
            if time.monotonic() > deadline:
                print("gloo_allreduce: ranks %s did not finish in time" % [r for r, _ in pending],
                      file=sys.stderr)
                return 1
            for r, p in list(pending):
                rc = p.poll()
                if rc is None:
                    continue
                pending.remove((r, p))
                if rc != 0 and status == 0:
                    status = rc if rc > 0 else 1
                    print("gloo_allreduce: rank %d exited with status %d" % (r, rc), file=sys.stderr)
                    # A rank that fails makes its peers fail at their next collective; give them
                    # a moment to say so, then stop them.
                    grace = time.monotonic() + 10
                    deadline = min(deadline, grace)
            time.sleep(0.02)
        return status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_rank(a):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (a.master_addr, a.master_port),
                            rank=a.rank, world_size=a.world_size,
                            timeout=datetime.timedelta(seconds=a.timeout))
    n = a.world_size
    if a.rank == 0:
        print("# gloo_allreduce: %d ranks, torch %s, fp32 sum in place, %d iters, %d warmup"
              % (n, torch.__version__, a.iters, a.warmup))
        print("# busbw = algbw * 2(n-1)/n, as nccl-tests reports all-reduce", flush=True)
    all_ok = True
    for nbytes in sizes(a.minbytes, a.maxbytes, a.stepfactor):
        count = nbytes // 4
        i = torch.arange(count, dtype=torch.int64)
        mine = (((i * 7 + a.rank * 3) % 13) - 6).to(torch.float32)
        expected = torch.zeros(count, dtype=torch.int64)
        for r in range(n):
            expected += ((i * 7 + r * 3) % 13) - 6
        expected = expected.to(torch.float32)
        del i
        buf = torch.empty(count, dtype=torch.float32)
        times = []
        wrong = 0
        for it in range(a.warmup + a.iters):
            buf.copy_(mine)
            dist.barrier()
            t0 = time.perf_counter_ns()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            us = (time.perf_counter_ns() - t0) / 1e3
            if a.corrupt and a.rank == 0 and it == a.warmup:
                buf[count // 2] += 1.0
            wrong += int((buf != expected).sum().item())
            if it >= a.warmup:
                times.append(us)
        if wrong:
            print("gloo_allreduce rank %d: %d wrong elements at %d bytes" % (a.rank, wrong, count * 4),
                  file=sys.stderr, flush=True)
        total = torch.tensor([wrong], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        wrong_all = int(total.item())
        all_ok = all_ok and wrong_all == 0
        if a.rank == 0:
            mean = sum(times) / len(times)
            algbw = count * 4 / (mean * 1e3)
            print(json.dumps({
                "system": "gloo", "ranks": n, "bytes": count * 4, "count": count, "dtype": "fp32",
                "iters": a.iters, "warmup": a.warmup, "time_us": round(mean, 3),
                "min_us": round(min(times), 3), "max_us": round(max(times), 3),
                "algbw": round(algbw, 6), "busbw": round(algbw * 2 * (n - 1) / n, 6),
                "wrong": wrong_all, "check": "OK" if wrong_all == 0 else "WRONG:%d" % wrong_all,
                "times_us": [round(t, 3) for t in times]}), flush=True)
    dist.destroy_process_group()
    return 0 if all_ok else 3


def main():
    ap = parser()
    a = ap.parse_args()
    if a.maxbytes < a.minbytes:
        ap.error("-e (%d) is smaller than -b (%d)" % (a.maxbytes, a.minbytes))
    if a.local is not None:
        if a.rank is not None or a.world_size is not None:
            ap.error("--local starts its own ranks: do not give --rank/--world-size with it")
        # SIGTERM unwinds through run_local's finally, which stops the ranks.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        return run_local(a)
    missing = [o for o, v in (("--rank", a.rank), ("--world-size", a.world_size),
                              ("--master-port", a.master_port)) if v is None]
    if missing:
        ap.error("give --local N, or all of --rank, --world-size, --master-addr, --master-port "
                 "(missing: %s)" % ", ".join(missing))
    if a.rank >= a.world_size:
        ap.error("--rank %d is not below --world-size %d" % (a.rank, a.world_size))
    return run_rank(a)


if __name__ == "__main__":
    sys.exit(main())
