#!/usr/bin/python3
"""Steps of a `bench/netcluster --timeline` CSV: how long each step's pushes took, and when each
server host sent its sums, measured from the step's first and last push.

    bench/timeline_steps.py CSV --workers N --servers K [--threshold BYTES]

Hosts 0..N-1 are the workers and N..N+K-1 the dedicated servers (netcluster's ps and lanes
scenarios). A step is a run of samples in which the workers together sent more than
--threshold bytes, ended by two quieter samples in a row; its pulls are what each server host
sent from the step's first sample up to the next step's. Per server the script prints
`first/last`: its first active sample after the step's first push, and its last after the
step's last push (ms; a server whose first sums leave n x P / B after the first push and whose
last leave that long after the last push is as early as the pipeline allows). A sample is
counted at its end time, so every figure is good to one sampling period (about 2 ms), and two
steps less than two samples apart count as one.
"""
import argparse
import csv
import sys


def read(path):
    """(times in ms, {column: [bytes per sample]}) of a timeline CSV."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or header[0] != "t_ms":
            raise ValueError("%s: not a netcluster timeline (the first column must be t_ms)" %
                             path)
        t, cols = [], {c: [] for c in header[1:]}
        for line, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise ValueError("%s:%d: %d fields, the header has %d" %
                                 (path, line, len(row), len(header)))
            try:
                t.append(float(row[0]))
                for c, x in zip(header[1:], row[1:]):
                    cols[c].append(int(x))
            except ValueError as e:
                raise ValueError("%s:%d: %s" % (path, line, e)) from None
    if not t:
        raise ValueError("%s: no samples" % path)
    return t, cols


def find_steps(active, gap=2):
    """[(first, last)] sample indices of the runs of True in `active`, a run ending at `gap`
    False samples in a row."""
    steps, start, last, quiet = [], None, None, 0
    for i, on in enumerate(active):
        if on:
            if start is None:
                start = i
            last, quiet = i, 0
        elif start is not None:
            quiet += 1
            if quiet >= gap:
                steps.append((start, last))
                start = None
    if start is not None:
        steps.append((start, last))
    return steps


def analyse(t, cols, workers, servers, threshold=20000):
    """One dict per step: start_ms, push_ms, servers, a list with (first, last) in ms per server
    host (None: it sent nothing above the threshold in that step), and cut, true for a step the
    timeline's end cuts off (no two quiet samples after it; its figures may be short)."""
    for h in range(workers + servers):
        if "h%d_up" % h not in cols:
            raise ValueError("no column h%d_up: the timeline has fewer than %d hosts" %
                             (h, workers + servers))
    pushed = [sum(cols["h%d_up" % h][i] for h in range(workers)) for i in range(len(t))]
    steps = find_steps([x > threshold for x in pushed])
    out = []
    for j, (a, b) in enumerate(steps):
        end = steps[j + 1][0] if j + 1 < len(steps) else len(t)
        per_server = []
        for s in range(servers):
            sent = cols["h%d_up" % (workers + s)]
            act = [i for i in range(a, end) if sent[i] > threshold]
            per_server.append((t[act[0]] - t[a], t[act[-1]] - t[b]) if act else None)
        out.append({"start_ms": t[a], "push_ms": t[b] - t[a], "servers": per_server,
                    "cut": b + 2 >= len(t)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--workers", "-n", type=int, required=True)
    ap.add_argument("--servers", "-k", type=int, required=True)
    ap.add_argument("--threshold", type=int, default=20000,
                    help="bytes per sample that count as sending (default 20000)")
    a = ap.parse_args(argv)
    try:
        t, cols = read(a.csv)
        steps = analyse(t, cols, a.workers, a.servers, a.threshold)
    except (OSError, ValueError, KeyError) as e:
        sys.exit("timeline_steps: %s" % e)
    print("step start ms  pushes ms  per server: first sums after first push / last after last "
          "push (ms)")
    for s in steps:
        print("%13.1f  %9.1f  %s%s" % (s["start_ms"], s["push_ms"], "  ".join(
            "%5.1f/%5.1f" % x if x else "    -/-    " for x in s["servers"]),
            "  (cut off by the timeline's end)" if s["cut"] else ""))


if __name__ == "__main__":
    main()
