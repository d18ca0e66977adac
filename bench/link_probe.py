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
and, through relays (4 workers h0-h3, 4 relay hosts h4-h7, each a process that forwards every
byte it receives to its destinations as it arrives: the two hops, the bytes on every link and
the processes of gradlink's routed collectives, n = k = 4; --bytes is then the operation's S):
  relay-broadcast  h0 sends S/4 to each relay, which forwards it to h1-h3
  relay-allgather  each worker sends S/16 to each relay, which forwards it to the 3 others
  relay-alltoall   each worker sends S/16 per receiver to each relay, which forwards it there
The figure per pattern is the busiest link's rate, bytes over the time from its first to its
last byte, as a fraction of --rate. Every run prints one table; --repeats runs each pattern
that many times (min/median/max).

Usage (root): bench/link_probe.py [--rate 1gbit] [--bytes 64M] [--repeats 3] [--patterns ...]
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


def connect(target):
    ip, port = target.split(":")
    for _ in range(200):
        try:
            return socket.create_connection((ip, int(port)))
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("could not connect to " + target)


def send(targets, nbytes):
    """Sends `nbytes` to each of `targets` at once, one thread per flow. A target is ip:port,
    or relay-ip:port/dest-ip:port+dest-ip:port...: the relay forwards the flow to each dest."""
    import threading
    data = memoryview(bytearray(BUF))

    def flow(target):
        relay, _, dests = target.partition("/")
        s = connect(relay)
        if dests:
            s.sendall((dests + "\n").encode())
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


def relay(port, flows):
    """Accepts `flows` connections on `port`; each names its destinations in a first line and
    is forwarded to each of them (a connection per destination) as its bytes arrive."""
    import threading
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(flows)
    print("listening", flush=True)

    def forward(c):
        line = b""
        while not line.endswith(b"\n"):
            byte = c.recv(1)
            if not byte:
                raise RuntimeError("a flow closed before naming its destinations")
            line += byte
        outs = [connect(d) for d in line.decode().strip().split("+")]
        buf = bytearray(BUF)
        view = memoryview(buf)
        while True:
            n = c.recv_into(buf)
            if n == 0:
                break
            for o in outs:
                o.sendall(view[:n])
        for o in outs:
            o.shutdown(socket.SHUT_WR)
        for o in outs:
            o.recv(1)
            o.close()
        c.sendall(b"k")
        c.close()

    threads = []
    for _ in range(flows):
        c, _ = ls.accept()
        threads.append(threading.Thread(target=forward, args=(c,)))
        threads[-1].start()
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


def relay_patterns():
    """name -> (list of (worker, relay, [destination workers]), each stream's share of S)."""
    workers, relays = range(4), range(4, 8)
    return {
        "relay-broadcast": ([(0, r, [1, 2, 3]) for r in relays], 1 / 4),
        "relay-allgather": ([(w, r, [d for d in workers if d != w]) for w in workers
                             for r in relays], 1 / 16),
        "relay-alltoall": ([(w, r, [d]) for w in workers for r in relays for d in workers
                            if d != w], 1 / 16),
    }


def run_relay(nc, cl, streams, nbytes):
    """The streams through relays: each worker's flows to the relays, each relay's forwarded
    on to the destinations; the busiest link's rate, measured at the receivers (a relay's
    uplink or a worker's downlink: what the routed collectives' bound counts)."""
    port, relay_port = 5301, 5302
    me = os.path.abspath(__file__)
    inbound = {}
    for _, _, dests in streams:
        for d in dests:
            inbound[d] = inbound.get(d, 0) + 1
    rx = {d: cl.spawn(d, "rx%d" % d, [sys.executable, me, "--receive", str(port), str(n),
                                         str(nbytes)]) for d, n in inbound.items()}
    per_relay = {}
    for _, r, _ in streams:
        per_relay[r] = per_relay.get(r, 0) + 1
    relays = [cl.spawn(r, "relay%d" % r, [sys.executable, me, "--relay", str(relay_port), str(n)])
              for r, n in per_relay.items()]
    deadline = time.monotonic() + 10
    while any("listening" not in p.out() for p in list(rx.values()) + relays):
        if time.monotonic() > deadline:
            raise RuntimeError("receivers or relays did not start")
        time.sleep(0.02)
    senders = sorted({w for w, _, _ in streams})
    tx = [cl.spawn(w, "tx%d" % w, [sys.executable, me, "--send", str(nbytes)] +
                   ["%s:%d/%s" % (cl.ip(r), relay_port, "+".join("%s:%d" % (cl.ip(d), port)
                                                                  for d in dests))
                    for x, r, dests in streams if x == w]) for w in senders]
    return collect(cl, tx + relays, rx)


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
    return collect(cl, tx, rx)


def collect(cl, others, rx):
    """Waits for every process; the busiest link's rate in bits/s, from the receivers' flows."""
    deadline = time.monotonic() + 120
    for p in others + list(rx.values()):
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
    ap.add_argument("--relay", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--patterns", default="single,fan-in,fan-out,ps,alltoall")
    a = ap.parse_args()
    if a.receive:
        return receive(int(a.receive[0]), int(a.receive[1]), int(a.receive[2]))
    if a.send:
        return send(a.send[1:], int(a.send[0]))
    if a.relay:
        return relay(int(a.relay[0]), int(a.relay[1]))
    nc = load_netcluster()
    rate = nc.parse_rate(a.rate)
    nbytes = nc.parse_size(a.bytes)
    pats = patterns()
    relayed = relay_patterns()
    chosen = a.patterns.split(",")
    unknown = [p for p in chosen if p not in pats and p not in relayed]
    if unknown:
        ap.error("unknown pattern(s) %s; known: %s" % (", ".join(unknown),
                                                     ", ".join(list(pats) + list(relayed))))
    results = {p: [] for p in chosen}
    with nc.Cluster(8, rate) as cl:
        for _ in range(a.repeats):
            for p in chosen:
                if p in relayed:
                    streams, share = relayed[p]
                    results[p].append(run_relay(nc, cl, streams, int(nbytes * share)) / rate)
                else:
                    results[p].append(run_pattern(nc, cl, pats[p], nbytes) / rate)
    print("| pattern | flows | of link (median, min-max) |")
    print("|---|---|---|")
    for p in chosen:
        v = results[p]
        flows = (sum(1 + len(d) for _, _, d in relayed[p][0]) if p in relayed else len(pats[p]))
        print("| %s | %d | %.3f (%.3f-%.3f) |" % (p, flows, statistics.median(v), min(v),
                                                  max(v)))
    print("(plain TCP, %s per flow, %s links, %d repeats)" % (a.bytes, a.rate, a.repeats))


if __name__ == "__main__":
    sys.exit(main())
