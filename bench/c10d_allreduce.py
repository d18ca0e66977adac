#!/usr/bin/python3
"""bench/c10d_allreduce: plain torch.distributed.all_reduce on one host, the "gradlink" backend
against Gloo in the same processes (a gloo group of the same ranks), no tuning flags.

    bench/c10d_allreduce.py [-n 2] [-b 4K] [-e 64M] [--iters 20] [--repeats 3]
                            [--results bench/RESULTS.md | --results -]

-n processes on this machine, started with a FileStore; the backend makes its own job (the
scheduler in rank 0, one server on this host, every worker on one host so sums take the
same-host path). For each size (fp32, factors of 4) the two backends alternate, --repeats
times; each repeat times --iters all_reduces after 3 warm-up ones, and the time per call is
rank 0's mean over them. Then Gloo alone, in processes without gradlink. Reported: min /
median / max over repeats, the ratio of Gloo alone to gradlink, and algorithm bandwidth
(bytes / time). Every result is checked against the exact sum.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def human(n):
    for unit, f in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= f and n % f == 0:
            return "%d%s" % (n // f, unit)
    return str(n)


def worker(rank, size, store_dir, sizes, iters, repeats, alone):
    import torch
    import torch.distributed as dist
    store = "file://" + os.path.join(store_dir, "store")
    timeout = datetime.timedelta(seconds=120)
    if alone:  # Gloo in processes without gradlink (whose threads share these 2 cores)
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=size,
                                timeout=timeout)
        gloo = None
    else:
        import gradlink.torch  # noqa: F401  (registers the backend)
        dist.init_process_group("gradlink", init_method=store, rank=rank, world_size=size,
                                timeout=timeout)
        gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        base = torch.arange(n, dtype=torch.float32) % 1000
        want = base * sum(r + 1 for r in range(size))
        per = {"gradlink": [], "gloo": []}
        for _ in range(repeats):
            for name, group in (() if alone else (("gradlink", None),)) + (("gloo", gloo),):
                t = base * (rank + 1)
                for _ in range(3):
                    dist.all_reduce(t.copy_(base * (rank + 1)), group=group)
                dist.barrier(group=gloo)
                spent = 0.0
                for _ in range(iters):
                    t.copy_(base * (rank + 1))
                    t0 = time.perf_counter()
                    dist.all_reduce(t, group=group)
                    spent += time.perf_counter() - t0
                if not torch.equal(t, want):
                    raise SystemExit("%s: wrong sum at %d bytes" % (name, nbytes))
                per[name].append(spent / iters)
        rows.append({"bytes": nbytes, "gradlink": per["gradlink"], "gloo": per["gloo"]})
    if rank == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def table(rows, alone):
    out = ["| size | gradlink µs min / median / max | Gloo beside it µs | Gloo alone µs | "
           "Gloo alone ÷ gradlink (median) | gradlink GB/s | Gloo alone GB/s |",
           "|---|---|---|---|---|---|---|"]
    for r, a in zip(rows, alone):
        g, o, s = r["gradlink"], r["gloo"], a["gloo"]
        gm, om, sm = statistics.median(g), statistics.median(o), statistics.median(s)
        span = lambda v, m: "%.0f / %.0f / %.0f" % (min(v) * 1e6, m * 1e6, max(v) * 1e6)
        out.append("| %s | %s | %s | %s | %.2fx | %.2f | %.2f |" % (
            human(r["bytes"]), span(g, gm), span(o, om), span(s, sm), sm / gm,
            r["bytes"] / gm / 1e9, r["bytes"] / sm / 1e9))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("-b", default="4K")
    ap.add_argument("-e", default="64M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", default=os.path.join(BENCH, "RESULTS.md"))
    ap.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes, s = [], parse_size(a.b)
    while s <= parse_size(a.e):
        sizes.append(s)
        s *= 4
    if a.worker:
        worker(a.worker[0], a.worker[1], a.store, sizes, a.iters, a.repeats, a.alone)
        return 0
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1")
    for k in [k for k in env if k.startswith("GRADLINK_") and k != "GRADLINK_BUILD_DIR"]:
        del env[k]
    def job(alone):
        with tempfile.TemporaryDirectory() as tmp:
            procs = [subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", str(r), str(a.n),
                 "--store", tmp, "-b", a.b, "-e", a.e, "--iters", str(a.iters), "--repeats",
                 str(a.repeats)] + (["--alone"] if alone else []),
                stdout=subprocess.PIPE, env=env) for r in range(a.n)]
            outs = [p.communicate()[0].decode() for p in procs]
        if any(p.returncode for p in procs):
            sys.exit("c10d_allreduce: a worker failed: %s" % [p.returncode for p in procs])
        return json.loads([ln for ln in outs[0].splitlines() if ln.startswith("[")][-1])

    rows, alone = job(False), job(True)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    cmd = "bench/c10d_allreduce.py " + " ".join(sys.argv[1:])
    body = ("### %s — torch.distributed all_reduce on one host, %d processes, fp32 (%s)\n"
            "Command: `%s`. The \"gradlink\" backend with no tuning (its own scheduler and "
            "server; every worker on this host, so the same-host path) against Gloo in the same "
            "processes (alternating), and Gloo alone in a job of its own (gradlink's threads "
            "share the 2 cores with Gloo's beside it); %d calls a repeat after 3 warm-up ones, "
            "rank 0's mean; %d repeats.\n\n%s\n" % (
                commit, a.n, datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), cmd.strip(),
                a.iters, a.repeats, table(rows, alone)))
    print(body)
    if a.results != "-":
        sys.path.insert(0, BENCH)
        import results_md
        results_md.update_section(a.results, "c10d_allreduce", body)
        results_md.append_history(results_md.history_path(a.results), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
