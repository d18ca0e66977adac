"""The process-wide context of gradlink.torch: the worker this process joined (set by init(),
cleared by shutdown(): _init.py), its ranks and sizes, the per-job caches (declared tensors,
collective keys, the counter that names unnamed calls), and the observers that others register
to hear of finished operations and of shutdown (the timeline is one: _timeline.py).

This module imports no other module of gradlink.torch: the others import it.
Threads: any. `setting_lock` orders setting and clearing the context; Context.lock its caches.
"""

import threading

from gradlink import InvalidArgumentError

_ctx = None
setting_lock = threading.Lock()  # held while the context is set (init()) or cleared
_observers = ()  # replaced whole under _observers_lock; read without it


class Context:
    """One joined worker and what the front end keeps about it."""

    def __init__(self, worker, local_rank, local_size, timeout, joined_as=None):
        self.worker = worker
        self.rank = worker.rank
        self.size = worker.size
        self.local_rank = local_rank
        self.local_size = local_size
        self.timeout = timeout
        self.joined_as = joined_as  # (scheduler, job, rank) init() joined with
        self.tensors = {}  # name -> gradlink.Tensor
        self.collectives = {}  # key (name + spec) -> gradlink.Tensor
        self.unnamed = Unnamed()
        self.in_flight = {}  # name -> the handle of the last operation started under it
        # id(handle) -> (handle, the names it is in flight under): a group's handle has several
        self.in_flight_names = {}
        self.in_flight_sweep = 64  # its size that triggers the next sweep (_ops.track)
        self.lock = threading.Lock()
        self.completer = None  # _handles.Completer, made on first use
        self.stager = None  # _staging.Stager: device tensors (and GRADLINK_STAGE_HOST=1)

    def landed(self, name, handle):
        """`handle`, started under `name` (and the other names track() gave it), has been waited
        for: its names are free again."""
        with self.lock:
            _, names = self.in_flight_names.pop(id(handle), (handle, (name,)))
            for n in names:
                if self.in_flight.get(n) is handle:
                    del self.in_flight[n]

    def declare(self, name, dtype, count, shape=None):
        t = self.tensors.get(name)
        if t is not None and t.current and t.dtype == dtype and t.count == count and (
                shape is None or t.shape is None or t.shape == shape):
            return t
        # New, or a name back with another dtype or shape (Horovod's names are labels per call):
        # the worker retires the earlier declaration and plans this one.
        t = self.worker.declare(name, dtype, count, shape)
        self.tensors[name] = t
        return t


class Unnamed:
    """Numbers unnamed calls, per process set: the n-th unnamed call of a kind among the ranks
    of a set is named alike on each of them, whatever calls other sets made (a process set's
    calls are made by its members only, so one count for all would drift apart between ranks of
    different sets). Kept across init -> shutdown -> init (a name never comes back)."""

    def __init__(self):
        self._counts = {}
        self._lock = threading.Lock()

    def next(self, ranks=None):
        """The next number for calls over `ranks` (None: every worker)."""
        key = tuple(ranks) if ranks else None
        with self._lock:
            n = self._counts.get(key, 0)
            self._counts[key] = n + 1
        return n


def release(handle, name):
    """`handle` (tracked under `name`, and whatever other names) has been waited for, or failed:
    its names are free again (_ops.claim). Nothing without a context."""
    ctx = current()
    if ctx is not None:
        ctx.landed(name, handle)


def current():
    """The context, or None before init() and after shutdown()."""
    return _ctx


def install(ctx):
    """Sets the context (init(), holding `setting_lock`)."""
    global _ctx
    _ctx = ctx


def take():
    """Clears the context; returns what it was (shutdown())."""
    global _ctx
    with setting_lock:
        ctx, _ctx = _ctx, None
    return ctx


def _require():
    ctx = _ctx
    if ctx is None:
        raise InvalidArgumentError("gradlink.torch is not initialized: call gradlink.torch.init()")
    return ctx


def is_initialized():
    return _ctx is not None


def rank():
    """This worker's rank, 0 .. size()-1."""
    return _require().rank


def size():
    """Number of workers in the job."""
    return _require().size


def local_rank():
    """Rank among the workers on this machine (GRADLINK_LOCAL_RANK or torchrun's LOCAL_RANK)."""
    return _require().local_rank


def local_size():
    """Number of workers on this machine (GRADLINK_LOCAL_SIZE or LOCAL_WORLD_SIZE)."""
    return _require().local_size


def num_servers():
    return _require().worker.num_servers


# -- Observers ---------------------------------------------------------------------------------
#
# An observer has operation_done(name, started, timing): an operation this process waited for
# has finished (`started`: time.monotonic() when it was started; `timing`: its stages in
# seconds, as Handle.timing()), called on the thread that waited; and shutting_down(): the
# worker is about to leave the job (called before it does, while rank() still answers).

_observers_lock = threading.Lock()


def add_observer(observer):
    global _observers
    with _observers_lock:
        if observer not in _observers:
            _observers = _observers + (observer,)


def remove_observer(observer):
    global _observers
    with _observers_lock:
        _observers = tuple(o for o in _observers if o is not observer)


def observers():
    """The observers now (a tuple: empty, the common case, costs the caller one test)."""
    return _observers


def notify_shutdown():
    for o in _observers:
        o.shutting_down()
