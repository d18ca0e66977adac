#!/usr/bin/python3
"""bench/collectives.py: broadcast, allgather, reduce-scatter and all-to-all through gradlink's
servers vs Gloo (torch.distributed), on bench/netcluster's emulated cluster (network
namespaces, every link shaped to --rate). gradlink runs with no tuning flags.

n worker hosts (-n, default 4) and k server hosts (-k, default 4); the scheduler on worker host
0. Each op runs one job per system (every size in it) per repeat; each rank times every
iteration between barriers, and reads its own link's byte counters (nc0, in its namespace)
around each size's timed iterations. S (the size column) is:
  broadcast      the tensor (root 0; every other rank receives S)
  allgather      the output (each rank gives S/n)
  reducescatter  each rank's input (each rank receives S/n of the sum)
  alltoall       each rank's input (S/n to every rank, its own block kept)
The bound is the least time the busiest worker link allows at --rate, for each system's own
traffic: broadcast S (a receiver's downlink), allgather (n-1)/n S, alltoall (n-1)/n S,
reduce-scatter S for gradlink (every rank pushes its whole input to the servers) and
(n-1)/n S for a ring. Gloo in torch 1.13 has no reduce_scatter: its row is all_reduce followed
by a slice, what a Gloo user runs instead (bound 2(n-1)/n S). Every result is checked against
a reference computed locally; a wrong value fails the run.

Usage (root):
  bench/collectives.py [-n 4] [-k 4] [--sizes 1M,16M,64M] [--iters 3] [--repeats 3]
                       [--ops broadcast,allgather,reducescatter,alltoall] [--results FILE]
"""
import argparse
import json
import os
import secrets
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
OPS = ("broadcast", "allgather", "reducescatter", "alltoall")


# ---- one rank (runs inside a host's namespace) -------------------------------------------------

def link_counters(iface):
    base = "/sys/class/net/%s/statistics/" % iface
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def rank_main(a):
    import torch
    torch.set_num_threads(1)
    r, n = a.rank, a.world
    if a.backend == "gradlink":
        import gradlink.torch as hvd
        hvd.init()
        barrier = hvd.barrier
    else:
        import datetime
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://%s:%d" % (a.master_addr, a.master_port),
                                rank=r, world_size=n, timeout=datetime.timedelta(seconds=300))
        barrier = dist.barrier

    def vals(rank, count, salt):
        return (torch.arange(count, dtype=torch.float32) * 7 + rank * 3 + salt) % 13 - 6

    for size in a.sizes:
        count = size // 4
        per = count // n
        # What an iteration needs that is not the operation (an in-place op's fresh input) is
        # made before the barrier and the clock; an out-of-place op's new output is its own.
        prepare = lambda: None
        if a.op == "broadcast":
            want = vals(0, count, 1)
            mine = vals(r, count, 1)

            def prepare():  # in place: a fresh copy each iteration, made before the clock
                return mine.clone()

            def run(t):
                if a.backend == "gradlink":
                    hvd.broadcast_(t, 0, name="b%d" % size)
                else:
                    dist.broadcast(t, 0)
                return t
        elif a.op == "allgather":
            want = torch.cat([vals(q, per, 2) for q in range(n)])
            mine = vals(r, per, 2)

            def run(_):
                if a.backend == "gradlink":
                    return hvd.allgather(mine, name="g%d" % size)
                out = [torch.empty(per) for _ in range(n)]
                dist.all_gather(out, mine)
                return out
        elif a.op == "reducescatter":
            full = sum(vals(q, per * n, 3) for q in range(n))
            want = full[r * per:(r + 1) * per]
            mine = vals(r, per * n, 3)

            def prepare():  # Gloo's all_reduce works in place
                return None if a.backend == "gradlink" else mine.clone()

            def run(t):
                if a.backend == "gradlink":
                    return hvd.reducescatter(mine, op=hvd.Sum, name="rs%d" % size)
                dist.all_reduce(t)
                return t[r * per:(r + 1) * per]
        else:  # alltoall: block j of rank q's input goes to rank j
            b = count // n
            want = torch.cat([vals(q, b * n, 4)[r * b:(r + 1) * b] for q in range(n)])
            mine = vals(r, b * n, 4)

            def run(_):
                if a.backend == "gradlink":
                    return hvd.alltoall(mine, name="a%d" % size)
                out = torch.empty(b * n)
                dist.all_to_all_single(out, mine)
                return out
        times = []
        moved = [0, 0]
        for it in range(a.warmup + a.iters):
            arg = prepare()
            barrier()
            before = link_counters(a.iface)
            t0 = time.perf_counter()
            got = run(arg)
            dt = time.perf_counter() - t0
            after = link_counters(a.iface)
            if isinstance(got, list):
                got = torch.cat(got)
            if not torch.equal(got, want):
                print(json.dumps({"op": a.op, "bytes": size, "check": "WRONG", "rank": r}))
                sys.stdout.flush()
                sys.exit(3)
            if it >= a.warmup:
                times.append(dt)
                moved[0] += after[0] - before[0]
                moved[1] += after[1] - before[1]
        print(json.dumps({"op": a.op, "bytes": size, "rank": r, "check": "OK", "times_s": times,
                          "tx": moved[0] / a.iters, "rx": moved[1] / a.iters}))
        sys.stdout.flush()
    barrier()
    if a.backend == "gradlink":
        hvd.shutdown()
    else:
        dist.destroy_process_group()


# ---- the driver -------------------------------------------------------------------------------

def bound_bytes(op, backend, size, n):
    """The busiest worker link's bytes for one op of `size` (module doc)."""
    share = (n - 1) / n * size
    if op == "broadcast":
        return size
    if op == "reducescatter":
        return size if backend == "gradlink" else 2 * share
    return share


def run_job(nc, cl, backend, op, a, n, k):
    py = nc.python_with_torch()
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO, "python"),
           "GLOO_SOCKET_IFNAME": nc.IFACE}
    procs = []
    if backend == "gradlink":
        env.update(nc.gradlink_env(secrets.token_hex(32)))
        job = "coll%d" % cl._n
        sched = cl.spawn(0, "scheduler", [
            os.path.join(a.bin, "gradlink-scheduler"), "--host", cl.ip(0), "--port", "0",
            "-w", str(n), "-s", str(k), "--job", job], env)
        addr = cl.wait_for(sched, r"listening on (\S+:\d+)", 15).group(1)
        procs.append(sched)
        for i in range(k):
            procs.append(cl.spawn(n + i, "server%d" % i, [
                os.path.join(a.bin, "gradlink-server"), "--scheduler", addr, "--job", job], env))
        env.update({"GRADLINK_SCHEDULER": addr, "GRADLINK_JOB": job,
                    "GRADLINK_WORKERS": str(n)})
    port = 21000 + cl._n % 10000
    ranks = []
    for r in range(n):
        argv = [py, os.path.abspath(__file__), "--rank-of", backend, "--op", op, "--rank", str(r),
                "--world", str(n), "--master-addr", cl.ip(0), "--master-port", str(port),
                "--sizes", ",".join(str(s) for s in a.sizes), "--iters", str(a.iters),
                "--warmup", str(a.warmup)]
        ranks.append(cl.spawn(r, "%s-%s-%d" % (backend, op, r),
                              argv, dict(env, GRADLINK_RANK=str(r))))
    procs += ranks
    limit = 120 + 40 * sum(s / (a.rate / 8) for s in a.sizes) * (a.iters + a.warmup)
    cl.wait_all(procs, limit, "%s %s" % (backend, op))
    rows = {}
    for p in ranks:
        for line in p.out().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                rows.setdefault(row["bytes"], []).append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank-of", choices=("gradlink", "gloo"), help=argparse.SUPPRESS)
    ap.add_argument("--op", choices=OPS)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--master-addr")
    ap.add_argument("--master-port", type=int)
    ap.add_argument("--iface", default="nc0")
    ap.add_argument("-n", "--workers", type=int, default=4)
    ap.add_argument("-k", "--servers", type=int, default=4)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--results", default="", help="also write the table (markdown) here")
    a = ap.parse_args(argv)
    sys.path.insert(0, BENCH)
    import netcluster as nc
    a.sizes = [nc.parse_size(s) for s in (a.sizes.split(",") if isinstance(a.sizes, str) else a.sizes)]
    if a.rank_of:
        a.backend = a.rank_of
        rank_main(a)
        return 0
    a.rate = nc.parse_rate(a.rate)
    try:
        nc.check_available()
    except nc.Unavailable as e:
        print("skipped: %s" % e)
        return 77
    nc.install_signal_handlers()
    n, k = a.workers, a.servers
    ops = a.ops.split(",")
    results = {}  # (op, backend, size) -> [(time_s, busiest_link_bytes)]
    with nc.Cluster(n + k, a.rate) as cl:
        for rep in range(a.repeats):
            for op in ops:
                for backend in ("gradlink", "gloo"):
                    rows = run_job(nc, cl, backend, op, a, n, k)
                    for size, per_rank in rows.items():
                        if len(per_rank) != n:
                            raise nc.RunError("%s %s %d: %d ranks reported" % (
                                backend, op, size, len(per_rank)))
                        # An iteration ends when its slowest rank is done.
                        t = statistics.mean(max(x["times_s"][i] for x in per_rank)
                                            for i in range(a.iters))
                        busiest = max(max(x["tx"], x["rx"]) for x in per_rank)
                        results.setdefault((op, backend, size), []).append((t, busiest))
                    print("repeat %d %s %s done" % (rep + 1, op, backend), flush=True)
    byte_s = a.rate / 8
    lines = ["| op | S | system | time ms (median, min-max) | of bound (median, min-max) | "
             "busiest link bytes / S (model) | gradlink / Gloo |",
             "|---|---|---|---|---|---|---|"]
    for op in ops:
        for size in a.sizes:
            med = {}
            for backend in ("gradlink", "gloo"):
                runs = results[(op, backend, size)]
                ts = sorted(t for t, _ in runs)
                bound = bound_bytes(op, backend, size, n) / byte_s
                frac = sorted(bound / t for t in ts)
                link = statistics.median(b for _, b in runs) / size
                med[backend] = statistics.median(ts)
                name = backend if backend == "gradlink" or op != "reducescatter" else \
                    "gloo (all_reduce + slice)"
                lines.append("| %s | %s | %s | %.1f (%.1f-%.1f) | %.3f (%.3f-%.3f) | %.3f (%.3f) | %s |" % (
                    op, nc.human(size), name, 1e3 * statistics.median(ts), 1e3 * ts[0],
                    1e3 * ts[-1], statistics.median(frac), frac[0], frac[-1], link,
                    bound_bytes(op, backend, size, n) / size,
                    "%.2fx" % (med["gloo"] / med["gradlink"]) if backend == "gloo" else ""))
    table = "\n".join(lines)
    print(table)
    if a.results:
        with open(a.results, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
