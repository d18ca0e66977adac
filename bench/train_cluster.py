#!/usr/bin/python3
"""bench/train_cluster: end-to-end training on an emulated cluster (bench/netcluster's hosts and
links): what users run, not a collective in a loop.

n worker hosts and k server hosts (network namespaces, every host link shaped by tc; needs root).
Each method trains the same communication-bound model (bench/train_step.py: dense layers,
small batch, fp32, SGD with momentum) from the same initial parameters on the same data:

  gloo-ddp             torch DDP over Gloo (the baseline)
  gradlink-opt         gradlink.torch.DistributedOptimizer, no tuning flags
  gradlink-hook        DDP with gradlink.torch.ddp_hook, no tuning flags
  gradlink-ddp         DDP over init_process_group("gradlink"), the k server hosts as its pool
  gradlink-ddp-colocated  the same with the backend's default servers (one per worker host)
  gradlink-opt-tuned   DistributedOptimizer with the best hand-tuned settings of bench/netcluster
                       (GRADLINK_PARTITION_BYTES=128K, GRADLINK_MAX_BYTES_IN_FLIGHT=1M,
                       GRADLINK_MAX_BYTES_AHEAD=256K, UCX_TCP_RCVBUF=64k, UCX_TCP_TX_SEG_SIZE=64k)

Reported per method (median of --repeats runs, interleaved; each run's time per step is rank
0's median over --steps timed steps after --warmup): steps/s with min / max, the ratio to
gloo-ddp, and the bound: compute (each rank's passes with no communication, timed with every
rank computing at once) plus the communication bound of M = the model's bytes at the link rate,
max(M/B, nM/(kB)) for the servers, 2(n-1)/n M/B for Gloo's ring (no overlap assumed, so a
method that overlaps can beat it).

--keep-heap (not a gradlink setting: the same for every method, Gloo's included) runs every rank
with glibc's malloc keeping freed memory (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=16G). On a
VM whose freed pages go back to the hypervisor (virtio-balloon free page reporting, as on the
dev VMs of 2026-12-06), every fresh 64 MiB tensor (autograd's weight gradients, each step)
faults its pages in again at about 0.35 GB/s: 190 ms each, so a forward and backward pass of
0.05 s took 0.41 s. With it the step is the communication it is meant to measure.

Checked, or the run fails: every rank of a run ends with bit-identical parameters (sha256 of
every parameter's bytes), and every method's final parameters agree with gloo-ddp's within
--tolerance (max |a - b| / max |b|: the sums run in another order).

  bench/train_cluster [-n 4] [-k 4] [--rate 1gbit] [--mtu 1500] [--width 4096] [--layers 2]
                      [--batch 2] [--steps 5] [--warmup 2] [--repeats 3] [--methods a,b,...]
                      [--keep-heap]
                      [--results bench/RESULTS.md | --results -] [--plot FILE]

The summary replaces the `<!-- train_cluster:begin -->` section of --results (bench/results_md.py);
the full output is appended to its history file.
"""

import argparse
import datetime
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import netcluster as nc  # noqa: E402
import placement_model as pm  # noqa: E402
import results_md  # noqa: E402

TUNED = {"GRADLINK_PARTITION_BYTES": str(128 << 10), "GRADLINK_MAX_BYTES_IN_FLIGHT": str(1 << 20),
         "GRADLINK_MAX_BYTES_AHEAD": str(256 << 10), "UCX_TCP_RCVBUF": "64k",
         "UCX_TCP_TX_SEG_SIZE": "64k"}
KEEP_HEAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}  # --keep-heap
KEEP_HEAP_TEXT = " ".join("%s=%s" % kv for kv in KEEP_HEAP.items())
METHODS = {  # name: (train_step.py --method, extra environment, extra arguments)
    "gloo-ddp": ("gloo-ddp", {}, []),
    "gradlink-opt": ("gradlink-opt", {}, []),
    "gradlink-hook": ("gradlink-hook", {}, []),
    "gradlink-opt-tuned": ("gradlink-opt", TUNED, []),
    # DDP over the torch.distributed backend: with the k server hosts (an external pool named
    # by GRADLINK_SCHEDULER), and with the backend's default servers, one per worker host.
    "gradlink-ddp": ("gradlink-ddp", {}, []),
    "gradlink-ddp-colocated": ("gradlink-ddp", {}, []),
    # Not run unless asked: DDP with its gradients as views of its buckets (no copy in or out).
    "gloo-ddp-view": ("gloo-ddp", {}, ["--bucket-view"]),
    "gradlink-hook-view": ("gradlink-hook", {}, ["--bucket-view"]),
    "gradlink-ddp-view": ("gradlink-ddp", {}, ["--bucket-view"]),
    # The tuned settings split in two: gradlink's options alone, UCX's variables alone.
    "gradlink-opt-tuned-gl": ("gradlink-opt", {k: v for k, v in TUNED.items() if k.startswith("GRADLINK")}, []),
    "gradlink-opt-tuned-ucx": ("gradlink-opt", {k: v for k, v in TUNED.items() if k.startswith("UCX")}, []),
}
DEFAULT_METHODS = ("gloo-ddp", "gradlink-opt", "gradlink-hook", "gradlink-opt-tuned")


def model_bytes(width, layers):
    return 4 * (layers * (width * width + width) + 10 * width + 10)


def run_method(cl, a, name, run_index, save_dir):
    """One training job; returns rank 0's JSON record (and checks the ranks agree)."""
    method, extra, args = METHODS[name]
    n, k = a.workers, a.servers
    py = nc.python_with_torch()
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": nc.IFACE,
           "PYTHONPATH": os.path.join(REPO, "python"), "PYTHONUNBUFFERED": "1"}
    if a.keep_heap:
        env.update(KEEP_HEAP)
    procs = []
    if name == "gradlink-ddp-colocated":
        # Nothing started here: rank 0 hosts the scheduler, each worker host a server.
        env = dict(nc.gradlink_env(secrets.token_hex(32)), **env)
        env.pop("GRADLINK_SECRET", None)  # the backend makes the job's own
    elif method.startswith("gradlink"):
        genv = dict(nc.gradlink_env(secrets.token_hex(32)), **env)
        genv.update(extra)
        job = "tc%d" % run_index
        sched = cl.spawn(0, "scheduler", [
            os.path.join(a.bin, "gradlink-scheduler"), "--host", cl.ip(0), "--port", "0",
            "-w", str(n), "-s", str(k), "--job", job], genv)
        addr = cl.wait_for(sched, r"listening on (\S+:\d+)", 15).group(1)
        procs.append(sched)
        for s in range(k):
            procs.append(cl.spawn(n + s, "server%d" % s, [
                os.path.join(a.bin, "gradlink-server"), "--scheduler", addr, "--job", job,
                "--id", str(s)], genv))
        env = dict(genv, GRADLINK_SCHEDULER=addr, GRADLINK_JOB=job, GRADLINK_WORKERS=str(n),
                   GRADLINK_SERVERS=str(k))
    port = 21000 + run_index % 9000
    workers = []
    for r in range(n):
        argv = [py, os.path.join(BENCH, "train_step.py"), "--method", method, "--rank", str(r),
                "--world-size", str(n), "--master-addr", cl.ip(0), "--master-port", str(port),
                "--width", str(a.width), "--layers", str(a.layers), "--batch", str(a.batch),
                "--steps", str(a.steps), "--warmup", str(a.warmup)] + args
        if r == 0:
            argv += ["--save", os.path.join(save_dir, "%s.pt" % name)]
        workers.append(cl.spawn(r, "%s-worker%d" % (name, r), argv,
                                dict(env, GRADLINK_RANK=str(r))))
    procs += workers
    m = model_bytes(a.width, a.layers)
    limit = 120 + 20 * (a.steps + a.warmup) * (m / (a.rate / 8))
    cl.wait_all(procs, limit, name)
    recs = []
    for w in workers:
        lines = [ln for ln in w.out().splitlines() if ln.startswith("{")]
        if not lines:
            raise nc.RunError("%s: %s printed no result\n%s" % (name, w.name, w.tail()))
        recs.append(json.loads(lines[-1]))
    digests = {r["digest"] for r in recs}
    if len(digests) != 1:
        raise nc.RunError("%s: the ranks' final parameters differ: %s" % (
            name, [r["digest"][:12] for r in recs]))
    rec = recs[0]
    if os.environ.get("TRAIN_CLUSTER_STEPS"):
        print("steps %s: %s" % (name, [round(t, 3) for t in rec["step_s"]]))
        print("cpu %s: %s" % (name, [round(t, 3) for t in rec["cpu_s"]]))
    rec["compute_all"] = [c for r in recs for c in r["compute_s"]]
    return rec


def compare_params(save_dir, names, tolerance):
    """{name: max |p - p_gloo| / max |p_gloo|} over every parameter; raises past tolerance."""
    import torch
    ref = torch.load(os.path.join(save_dir, "gloo-ddp.pt"))
    out = {}
    for name in names:
        if name == "gloo-ddp":
            continue
        got = torch.load(os.path.join(save_dir, "%s.pt" % name))
        worst = 0.0
        for key, b in ref.items():
            scale = max(b.abs().max().item(), 1e-30)
            worst = max(worst, (got[key] - b).abs().max().item() / scale)
        out[name] = worst
        if worst > tolerance:
            raise nc.RunError("%s's final parameters differ from gloo-ddp's by %.3g (relative), "
                              "more than --tolerance %.3g" % (name, worst, tolerance))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--workers", type=int, default=4)
    ap.add_argument("-k", "--servers", type=int, default=4)
    ap.add_argument("--rate", type=nc.parse_rate, default=nc.parse_rate("1gbit"))
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--latency-ms", type=float, default=10.0, help="tbf queue limit (default 10)")
    # Communication-bound: 134 MB of gradients, 2 rows a rank (the compute of 4 ranks sharing
    # this VM's 2 cores stays well under the transfer: 0.99 s against 0.54-0.81 s at 16 rows
    # of 4 x 2048 x 2048).
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    # Two: DDP rebuilds its buckets in its second iteration, so for every DDP method (Gloo's
    # included) that step runs new buckets, and for gradlink new keys, whose first round
    # faults in their memory (the hook's 5.4-5.9 s against 1.5-1.7 s after, e020c4c).
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma-separated, of %s (default %s)" % (", ".join(METHODS),
                                                                  ",".join(DEFAULT_METHODS)))
    ap.add_argument("--keep-heap", action="store_true",
                    help="every rank of every method keeps freed memory (glibc malloc: %s)" %
                    KEEP_HEAP_TEXT)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--results", default=os.path.join(BENCH, "RESULTS.md"))
    ap.add_argument("--plot", default=os.path.join(BENCH, "train_cluster.png"))
    a = ap.parse_args(argv)
    names = [x.strip() for x in a.methods.split(",") if x.strip()]
    bad = [x for x in names if x not in METHODS]
    if bad or "gloo-ddp" not in names:
        ap.error("--methods: unknown %s (gloo-ddp is required: the reference)" % bad if bad else
                 "--methods must include gloo-ddp (the reference)")
    if a.workers < 2 or a.servers < 1:
        ap.error("-n >= 2 and -k >= 1")
    try:
        nc.check_available()
    except nc.Unavailable as e:
        print("train_cluster: cannot run here: %s" % e, file=sys.stderr)
        return 2
    if not nc.python_with_torch():
        print("train_cluster: no python with torch", file=sys.stderr)
        return 2
    nc.install_signal_handlers()
    nc.cleanup_leftovers(quiet=True)
    n, k = a.workers, a.servers
    m = model_bytes(a.width, a.layers)
    byte_s = a.rate / 8
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    command = "bench/train_cluster " + " ".join(argv if argv is not None else sys.argv[1:])
    times = {x: [] for x in names}
    cpus = {x: [] for x in names}  # rank 0's CPU seconds a step, all its threads
    compute = []
    in_force = {}  # name: rank 0's settings in force (gradlink methods)
    runs = 0
    save_dir = tempfile.mkdtemp(prefix="train-cluster-")  # each method's final parameters
    try:
        with nc.Cluster(n + k, a.rate, latency_ms=a.latency_ms, mtu=a.mtu) as cl:
            for rep in range(a.repeats):
                for name in names:
                    runs += 1
                    t0 = time.monotonic()
                    rec = run_method(cl, a, name, os.getpid() % 1000 * 100 + runs, save_dir)
                    step = statistics.median(rec["step_s"])
                    times[name].append(step)
                    cpus[name].append(statistics.median(rec["cpu_s"]))
                    compute += rec["compute_all"]
                    if "in_force" in rec:
                        in_force[name] = rec["in_force"]
                    print("train_cluster: repeat %d %-19s %.3f s/step (%.2f steps/s), loss %.4f, "
                          "run %.0f s" % (rep + 1, name, step, 1 / step, rec["loss"],
                                          time.monotonic() - t0), flush=True)
            diffs = compare_params(save_dir, names, a.tolerance)
    except nc.RunError as e:
        print("train_cluster: FAILED: %s" % e, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)  # a state_dict per method, 134 MB each
    comp = statistics.median(compute)
    ps = pm.ps_bound_time(n, k, m, byte_s)
    ring = nc.ring_bound_time(n, m, byte_s)
    ref = statistics.median(times["gloo-ddp"])
    lines = [
        "### %s — train_cluster, n=%d, k=%d, %s links, MTU %d (%s)" % (
            nc.commit_id(), n, k, nc.fmt_rate(a.rate), a.mtu, started),
        "Command: `%s`. Model: %d dense layers of %d x %d and a 10-way head, fp32, M = %.1f MiB "
        "of gradients; batch %d a rank; SGD, momentum 0.9; %d timed steps after %d warm-up, "
        "rank 0's median per run, %d repeats interleaved.%s Compute alone (every rank at once): "
        "%.3f s a step. Bound without overlap: compute + the communication bound at %s, "
        "max(M/B, nM/(kB)) = %.3f s for the servers, 2(n-1)/n M/B = %.3f s for Gloo's ring." % (
            command, a.layers, a.width, a.width, m / 2**20, a.batch, a.steps, a.warmup,
            a.repeats, " Every rank with %s (--keep-heap)." % KEEP_HEAP_TEXT if a.keep_heap else "",
            comp, nc.fmt_rate(a.rate), ps, ring),
        "",
        "| method | steps/s min / median / max | ÷ gloo-ddp | bound steps/s | of bound | "
        "rank 0's CPU s a step | final parameters vs gloo-ddp |",
        "|---|---|---|---|---|---|---|"]
    plot = []
    for name in names:
        t = times[name]
        med = statistics.median(t)
        # Servers on the worker hosts move what the ring moves: the same bound.
        bound = comp + (ring if name in ("gloo-ddp", "gradlink-ddp-colocated") else ps)
        diff = "reference" if name == "gloo-ddp" else "%.1e (relative)" % diffs[name]
        lines.append("| %s | %.3f / %.3f / %.3f | %.2fx | %.3f | %.2f | %.2f | %s |" % (
            name, 1 / max(t), 1 / med, 1 / min(t), ref / med, 1 / bound, bound / med,
            statistics.median(cpus[name]), diff))
        plot.append((name, 1 / med, 1 / max(t), 1 / min(t)))
    lines += ["", "Every rank of every run ended with bit-identical parameters (sha256). In force "
              "on rank 0: " + "; ".join(
                  "%s P=%s F=%s A=%s%s" % (name, nc.human(f["partition_bytes"]),
                                           nc.human(f["max_bytes_in_flight"]),
                                           nc.human(f["max_bytes_ahead"]),
                                           " (%s)" % f["chosen"] if f["chosen"] else " (all set)")
                  for name, f in in_force.items()) + "."]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if a.results != "-":
        hist = results_md.history_path(a.results)
        results_md.append_history(hist, "\n" + text, os.path.basename(a.results))
        results_md.update_section(a.results, "train_cluster", text)
        print("train_cluster: section train_cluster of %s replaced" % a.results)
    if a.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(6, 3.2))
            xs = range(len(plot))
            ax.bar(xs, [p[1] for p in plot],
                   yerr=[[p[1] - p[2] for p in plot], [p[3] - p[1] for p in plot]], capsize=4)
            ax.set_xticks(list(xs), [p[0] for p in plot], rotation=15)
            ax.set_ylabel("steps/s")
            ax.set_title("n=%d, k=%d, %s, MTU %d" % (n, k, nc.fmt_rate(a.rate), a.mtu))
            fig.tight_layout()
            fig.savefig(a.plot, dpi=100)
            print("train_cluster: plot %s" % a.plot)
        except ImportError:
            print("train_cluster: no matplotlib, no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
