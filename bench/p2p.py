#!/usr/bin/python3
"""bench/p2p.py: torch.distributed point-to-point, the gradlink backend beside Gloo, in the same
two processes (a gloo group of the same ranks), measured in turns.

  4 KiB round trip    rank 0 sends 4 KiB, rank 1 sends it back; the mean of --rtt-iters trips
  one-way bandwidth   rank 0 sends --count messages of SIZE with blocking send, rank 1 receives
                      each with blocking recv and answers the last with one element; bytes over
                      the time to that answer

Where:
  local       two processes on this host (a FileStore). gradlink's default (UCX picks shared
              memory between processes of one host) and, beside it, UCX_TLS=tcp (the transport
              Gloo has); Gloo over loopback TCP.
  netcluster  two emulated hosts of bench/netcluster.py (network namespaces, a veth link each,
              shaped to --rate), UCX and Gloo on that link; needs root (else skipped).

Every message is checked (its first and last elements name the message). Repeats alternate the
order of the systems; the table gives min / median / max over repeats of each repeat's figure,
and gradlink's median over Gloo's. Results: bench/RESULTS.md, "Point-to-point (issue 43)".
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if text[-1:] in "KMG" else text) * mult


def human(n):
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return "%d%s" % (n // m, unit)
    return str(n)


# ---- one rank ---------------------------------------------------------------------------------

def rank_main(a):
    import torch
    import torch.distributed as dist
    import gradlink.torch  # noqa: F401  (registers the backend)

    rank = a.rank
    dist.init_process_group("gradlink", init_method=a.init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    groups = {"gradlink": None, "gloo": dist.new_group(backend="gloo")}
    peer = 1 - rank
    rows = []

    def rtt(group, iters):
        buf = torch.zeros(1024, dtype=torch.float32)  # 4 KiB
        for i in range(-20, iters):  # 20 warm-up trips
            if i == 0:
                start = time.perf_counter()
            if rank == 0:
                buf[0] = i
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
                assert buf[0] == i + 1, (buf[0], i)
            else:
                dist.recv(buf, peer, group=group)
                buf[0] += 1
                dist.send(buf, peer, group=group)
        return (time.perf_counter() - start) / iters

    def one_way(group, size, count):
        n = size // 4
        buf = torch.zeros(n, dtype=torch.float32)
        done = torch.zeros(1)
        for i in range(-1, count):  # one warm-up message
            if i == 0:
                start = time.perf_counter()
            if rank == 0:
                buf[0] = buf[-1] = i
                dist.send(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                assert buf[0] == i and buf[-1] == i, (buf[0], buf[-1], i)
        if rank == 0:
            dist.recv(done, peer, group=group)
        else:
            dist.send(done, peer, group=group)
        return size * count / (time.perf_counter() - start)

    for rep in range(a.repeats):
        order = list(groups) if rep % 2 == 0 else list(reversed(list(groups)))
        for system in order:
            g = groups[system]
            rows.append({"system": system, "repeat": rep, "test": "rtt4K",
                         "value": rtt(g, a.rtt_iters)})
            for size in a.sizes:
                count = max(3, min(a.count, (256 << 20) // size))
                rows.append({"system": system, "repeat": rep, "test": "bw" + human(size),
                             "value": one_way(g, size, count)})
    dist.barrier()
    if rank == 0:
        with open(a.json, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


# ---- the harness ------------------------------------------------------------------------------

def job_env(build):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["GRADLINK_BUILD_DIR"] = build
    for k in list(env):
        if k.startswith("GRADLINK_") and k not in ("GRADLINK_BUILD_DIR", "GRADLINK_LOG_LEVEL"):
            del env[k]
    env.setdefault("GRADLINK_LOG_LEVEL", "warn")
    return env


def rank_argv(a, rank, init, out):
    return [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--init", init,
            "--json", out, "--repeats", str(a.repeats), "--rtt-iters", str(a.rtt_iters),
            "--count", str(a.count), "--sizes", ",".join(human(s) for s in a.sizes)]


def run_local(a, label, extra_env):
    with tempfile.TemporaryDirectory(prefix="p2p-") as tmp:
        out = os.path.join(tmp, "rows.json")
        env = job_env(a.build)
        env.update(extra_env)
        procs = [subprocess.Popen(rank_argv(a, r, "file://" + os.path.join(tmp, "store"), out),
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(2)]
        outs = [p.communicate(timeout=a.timeout)[0].decode(errors="replace") for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise SystemExit("%s: a rank failed:\n%s" % (label, "\n".join(outs)))
        return json.load(open(out))


def run_netcluster(a):
    sys.path.insert(0, HERE)
    import netcluster as nc
    try:
        nc.check_available()
    except nc.Unavailable as e:
        print("netcluster: skipped (%s)" % e)
        return None
    with nc.Cluster(2, a.rate) as cl:
        out = os.path.join(cl.tmp, "rows.json")
        env = job_env(a.build)
        env.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": nc.IFACE,
                    "GLOO_SOCKET_IFNAME": nc.IFACE, "MASTER_ADDR": cl.ip(0)})
        init = "tcp://%s:29533" % cl.ip(0)
        procs = [cl.spawn(r, "rank%d" % r, rank_argv(a, r, init, out), env=env)
                 for r in range(2)]
        cl.wait_all(procs, a.timeout, "p2p")
        return json.load(open(out))


def table(title, rows, bound=None):
    """min / median / max per (test, system), gradlink's median / Gloo's."""
    tests = list(dict.fromkeys(r["test"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    print("\n### %s\n" % title)
    head = "| test | " + " | ".join(systems) + " | " + " | ".join(
        "%s / gloo" % s for s in systems if s != "gloo")
    if bound:
        head += " | " + " | ".join("%s / link" % s for s in systems)
    print(head + " |")
    print("|" + " --- |" * (head.count("|")))
    for t in tests:
        med = {}
        cells = []
        for s in systems:
            v = sorted(r["value"] for r in rows if r["test"] == t and r["system"] == s)
            med[s] = statistics.median(v)
            if t.startswith("rtt"):
                cells.append("%.1f (%.1f-%.1f) us" % (med[s] * 1e6, v[0] * 1e6, v[-1] * 1e6))
            else:
                cells.append("%.2f (%.2f-%.2f) GB/s" % (med[s] / 1e9, v[0] / 1e9, v[-1] / 1e9))
        # Better is higher for bandwidth, lower for round trips: the ratio is "x Gloo's speed".
        ratios = ["%.2fx" % ((med["gloo"] / med[s]) if t.startswith("rtt") else
                             (med[s] / med["gloo"])) for s in systems if s != "gloo"]
        line = "| %s | %s | %s" % (t, " | ".join(cells), " | ".join(ratios))
        if bound:
            line += " | " + " | ".join(
                "-" if t.startswith("rtt") else "%.2f" % (med[s] * 8 / bound) for s in systems)
        print(line + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--where", default="local,netcluster")
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rtt-iters", type=int, default=500)
    p.add_argument("--count", type=int, default=16, help="messages per bandwidth figure (at "
                   "most 256 MiB of them, at least 3)")
    p.add_argument("--rate", default="10G", help="netcluster link rate (bit/s)")
    p.add_argument("--build", default=os.path.join(REPO, "build"))
    p.add_argument("--timeout", type=float, default=900)
    # one rank (the harness starts these)
    p.add_argument("--rank", type=int)
    p.add_argument("--init")
    p.add_argument("--json")
    a = p.parse_args()
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    if a.rank is not None:
        return rank_main(a)
    text = a.rate.upper().replace("BIT", "")
    a.rate = float(text[:-1]) * {"K": 1e3, "M": 1e6, "G": 1e9}[text[-1]] \
        if text[-1:] in "KMG" else float(text)
    where = a.where.split(",")
    commit = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    print("bench/p2p.py on %s: %d repeats, sizes %s" % (
        commit, a.repeats, ",".join(human(s) for s in a.sizes)))
    if "local" in where:
        rows = run_local(a, "local", {})
        tcp = run_local(a, "local tcp", {"UCX_TLS": "tcp"})
        rows += [dict(r, system="gradlink (UCX_TLS=tcp)") for r in tcp if r["system"] != "gloo"]
        table("one host, 2 processes (gradlink: its default, and UCX_TLS=tcp beside it; Gloo: "
              "loopback TCP; Gloo's figures from the first job)", rows)
    if "netcluster" in where:
        rows = run_netcluster(a)
        if rows is not None:
            table("two emulated hosts, a %.0f Gbit/s link each (UCX_TLS=tcp)" % (a.rate / 1e9),
                  rows, bound=a.rate)


if __name__ == "__main__":
    main()
