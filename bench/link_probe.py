#!/usr/bin/python3
"""bench/link_probe.py: what plain TCP reaches on bench/netcluster's emulated links, in the
traffic patterns of gradlink's operations: the ceiling an operation's "fraction of the link"
is measured against in bench/RESULTS.md (no gradlink, no UCX: kernel TCP between processes).

Patterns (every flow carries --bytes; H hosts as needed, one process per host):
  single     h0 -> h1: one stream on an otherwise idle link
  fan-in     4 senders -> h0: a receiver's downlink shared by 4 flows (a broadcast or allgather
             receiver fed by 4 servers)
  fan-out    h0 -> 4 receivers: a sender's uplink shared by 4 flows (a root pushing to 4
             servers)
  ps         4 workers <-> 4 servers, every pair both ways at once: a sum's pushes and pulls
  alltoall   4 hosts, each sends to the 3 others at once
The figure per pattern is the busiest link's rate, bytes over the time from its first to its
last byte, as a fraction of --rate. Every run prints one table; --repeats runs each pattern
that many times (min/median/max).

Usage (root): bench/link_probe.py [--rate 1gbit] [--bytes 64M] [--repeats 3]
"""
import argparse
import importlib.util
import os
import socket
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
BUF = 1 << 20


def load_netcluster():
    spec = importlib.util.spec_from_file_location("netcluster_tool",
                                                  os.path.join(BENCH, "netcluster.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- inside a host (ip netns exec) ------------------------------------------------------------

def receive(port, flows, nbytes):
    """Accepts `flows` connections on `port` and reads `nbytes` from each; prints, per flow, its
    sender, bytes, and first and last byte's times (CLOCK_MONOTONIC: one clock for every
    process of the machine)."""
    import selectors
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(flows)
    print("listening", flush=True)
    sel = selectors.DefaultSelector()
    seen = {}
    for _ in range(flows):
        c, peer = ls.accept()
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
        seen[c] = [peer[0], 0, None, None]
    buf = bytearray(BUF)
    left = len(seen)
    while left:
        for key, _ in sel.select():
            c = key.fileobj
            try:
                n = c.recv_into(buf)
            except BlockingIOError:
                continue
            now = time.monotonic()
            f = seen[c]
            if n:
                f[1] += n
                f[2] = now if f[2] is None else f[2]
                f[3] = now
            if n == 0 or f[1] >= nbytes:
                sel.unregister(c)
                c.sendall(b"k")
                left -= 1
    for peer, total, first, last in seen.values():
        print("flow %s %d %.6f %.6f" % (peer, total, first, last), flush=True)


def send(targets, nbytes):
    """Sends `nbytes` to each of `targets` (ip:port) at once, one thread per flow."""
    import threading
    data = memoryview(bytearray(BUF))

    def flow(target):
        ip, port = target.split(":")
        for _ in range(200):
            try:
                s = socket.create_connection((ip, int(port)))
                break
            except OSError:
                time.sleep(0.05)
        left = nbytes
        while left > 0:
            n = s.send(data[:min(BUF, left)])
            left -= n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        s.close()

    threads = [threading.Thread(target=flow, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- the harness --------------------------------------------------------------------------------

def patterns():
    """name -> list of (sender host, receiver host) flows."""
    ps = [(w, s) for w in range(4) for s in range(4, 8)] + [(s, w) for w in range(4)
                                                            for s in range(4, 8)]
    return {
        "single": [(0, 1)],
        "fan-in": [(h, 0) for h in range(1, 5)],
        "fan-out": [(0, h) for h in range(1, 5)],
        "ps": ps,
        "alltoall": [(a, b) for a in range(4) for b in range(4) if a != b],
    }


def run_pattern(nc, cl, flows, nbytes):
    port = 5301
    receivers = sorted({r for _, r in flows})
    senders = sorted({s for s, _ in flows})
    me = os.path.abspath(__file__)
    rx = {}
    for r in receivers:
        n = sum(1 for _, x in flows if x == r)
        rx[r] = cl.spawn(r, "rx%d" % r, [sys.executable, me, "--receive", str(port), str(n),
                                          str(nbytes)])
    deadline = time.monotonic() + 10
    while any("listening" not in p.out() for p in rx.values()):
        if time.monotonic() > deadline:
            raise RuntimeError("receivers did not start:\n" + "\n".join(p.tail() for p in rx.values()))
        time.sleep(0.02)
    tx = [cl.spawn(s, "tx%d" % s, [sys.executable, me, "--send", str(nbytes)] +
                   ["%s:%d" % (cl.ip(r), port) for x, r in flows if x == s]) for s in senders]
    deadline = time.monotonic() + 120
    for p in tx + list(rx.values()):
        while p.rc() is None:
            if time.monotonic() > deadline:
                raise RuntimeError("a flow did not end:\n" + p.tail())
            time.sleep(0.02)
        if p.rc() != 0:
            raise RuntimeError(p.tail())
    flows_seen = []  # (sender ip, receiver host, bytes, first, last)
    for r, p in rx.items():
        for line in p.out().splitlines():
            if line.startswith("flow "):
                _, ip, total, first, last = line.split()
                flows_seen.append((ip, r, int(total), float(first), float(last)))
    # The busiest link's bytes (a host's uplink: its flows out; downlink: its flows in) over the
    # whole pattern's time, first byte to last: what "of bound" measures for an operation.
    link = {}
    for ip, r, total, _, _ in flows_seen:
        link[("up", ip)] = link.get(("up", ip), 0) + total
        link[("down", r)] = link.get(("down", r), 0) + total
    span = max(f[4] for f in flows_seen) - min(f[3] for f in flows_seen)
    return max(link.values()) * 8 / span


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--receive", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--send", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--patterns", default="single,fan-in,fan-out,ps,alltoall")
    a = ap.parse_args()
    if a.receive:
        return receive(int(a.receive[0]), int(a.receive[1]), int(a.receive[2]))
    if a.send:
        return send(a.send[1:], int(a.send[0]))
    nc = load_netcluster()
    rate = nc.parse_rate(a.rate)
    nbytes = nc.parse_size(a.bytes)
    pats = patterns()
    chosen = a.patterns.split(",")
    results = {p: [] for p in chosen}
    with nc.Cluster(8, rate) as cl:
        for _ in range(a.repeats):
            for p in chosen:
                results[p].append(run_pattern(nc, cl, pats[p], nbytes) / rate)
    print("| pattern | flows | of link (median, min-max) |")
    print("|---|---|---|")
    for p in chosen:
        v = results[p]
        print("| %s | %d | %.3f (%.3f-%.3f) |" % (p, len(pats[p]), statistics.median(v), min(v),
                                                  max(v)))
    print("(plain TCP, %s per flow, %s links, %d repeats)" % (a.bytes, a.rate, a.repeats))


if __name__ == "__main__":
    sys.exit(main())
