"""horovod.torch's start_timeline / stop_timeline: a Chrome-trace JSON (chrome://tracing,
Perfetto) of every push_pull this worker waited for, one row per tensor, its stages as measured
by the worker (queue: to the first partition handed to the transport; push: to every push sent;
reduce: to the last sum back, with the servers' own time on it nested inside as "server sum",
from their clocks; pull: to every sum written; pack and unpack for fused groups). Times are this
process's monotonic clock, in microseconds.

While it records, the timeline is an observer of the context (_context.py): finished operations
reach record(), and shutdown writes it. The core never imports this module."""

import json
import threading

from gradlink import InvalidArgumentError

from . import _context

_STAGES = ("pack", "queue", "push", "reduce", "pull", "unpack")
_lock = threading.Lock()
_active = None  # {"path", "events", "rows"} while a timeline is being recorded


def start_timeline(file_path, mark_cycles=False):
    """Starts recording; stop_timeline() (or shutdown) writes `file_path`. `mark_cycles` is
    accepted for Horovod's signature (gradlink has no cycles to mark)."""
    global _active
    _context._require()
    with _lock:
        if _active is not None:
            raise InvalidArgumentError("start_timeline: a timeline is already being recorded to "
                                       "%s" % _active["path"])
        _active = {"path": str(file_path), "events": [], "rows": {}}
        _context.add_observer(_OBSERVER)


def stop_timeline():
    """Writes the timeline started by start_timeline() and stops recording; no-op if none."""
    global _active
    with _lock:
        t, _active = _active, None
        _context.remove_observer(_OBSERVER)
    if t is None:
        return
    rank = _context.rank() if _context.is_initialized() else 0
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": "rank %d" % rank}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": n}}
             for n, tid in t["rows"].items()]
    with open(t["path"], "w") as f:
        json.dump({"traceEvents": meta + t["events"], "displayTimeUnit": "ms"}, f)


def record(name, started, timing):
    """One finished operation: `started` (time.monotonic() at the call), its stage seconds."""
    with _lock:
        t = _active
        if t is None:
            return
        tid = t["rows"].setdefault(name, len(t["rows"]))
        rank = _context.rank()
        t["ops"] = op = t.get("ops", 0) + 1  # the spans of one operation share args["op"]
        at = started * 1e6
        push_start = arrived = None
        for stage in _STAGES:
            d = timing.get(stage, 0.0) * 1e6
            if stage == "push":
                push_start = at
            if d > 0:
                t["events"].append({"name": stage, "cat": "push_pull", "ph": "X", "ts": at,
                                    "dur": d, "pid": rank, "tid": tid,
                                    "args": {"tensor": name, "op": op}})
                at += d
            if stage == "reduce":
                arrived = at
        # The servers' own time (their clocks), nested at the end of reduce: what is left before
        # it is the slowest worker's pushes and the network. When this worker saw its pushes
        # complete only after the sum was back (reduce 0: a busy machine), it ends the push.
        server = min(timing.get("server", 0.0) * 1e6, arrived - push_start)
        if server > 0:
            t["events"].append({"name": "server sum", "cat": "server", "ph": "X",
                                "ts": arrived - server, "dur": server, "pid": rank, "tid": tid,
                                "args": {"tensor": name, "op": op}})


def active():
    return _active is not None


class _Observer:
    """What the context calls while a timeline records."""

    def operation_done(self, name, started, timing):
        record(name, started, timing)

    def shutting_down(self):
        stop_timeline()  # a timeline still recording is written, as Horovod does


_OBSERVER = _Observer()
