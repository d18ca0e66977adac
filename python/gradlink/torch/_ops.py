"""Starting operations on torch tensors: push_pull and grouped_push_pull (sync and async), and
the three ways in that the other front ends (_gather.py, _horovod.py, _broadcast.py) start
theirs: start() (one tensor's sum), start_group() (a fused group) and start_collective() (any
collective key). Here too: how a call's name becomes its key (unnamed calls, collective keys with
their shared counts), the hand-off of CUDA tensors to the staging pipeline (_staging.py), and
the table of names in flight: a second operation under the name of one this process started
and has not seen finish is refused at once (claim(), track()), as Horovod refuses it.

Threads: any; the context's lock guards its caches (the C++ worker is thread-safe).
"""

import zlib

import torch

from gradlink import InvalidArgumentError

from . import _context, _staging
from ._handles import GroupedPushPullHandle, PushPullHandle, synchronize
from ._tensors import _check_summable, _check_tensor, _staged, summable_dtype


# The in-flight table is swept of finished operations when it grows past this many names (or
# twice what the last sweep left), so unnamed calls, each under a new name, do not keep their
# tensors alive; waited-for operations leave it at once (_handles.py).
_IN_FLIGHT_SWEEP = 64


def claim(name, what):
    """Refuses a second operation under `name` while this process's last one under it is still
    in flight: InvalidArgumentError (a ValueError, as Horovod raises it), at once and on this
    rank only, before anything is sent. Horovod matches operations across ranks by name, so two
    in flight under one name could not be told apart. In flight means: not yet waited for
    (synchronize(), or the handle's wait, whether it raised or not), as Horovod's handle map
    keeps an operation until it is synchronized. Not "not yet finished": an operation can
    finish the moment this rank starts it (the same-host path sums inline when the last rank
    arrives), and whether a second start under its name is refused must not depend on that."""
    ctx = _context._require()
    with ctx.lock:
        h = ctx.in_flight.get(name)
    if h is not None:
        raise InvalidArgumentError(
            "%s: an operation named '%s' is still in flight on rank %d; operations in flight "
            "at the same time need different names" % (what, name, ctx.rank))


def track(name, handle):
    """Records `handle` as the operation in flight under `name` (see claim()); returns it."""
    ctx = _context._require()
    with ctx.lock:
        table = ctx.in_flight
        table[name] = handle
        ctx.in_flight_names.setdefault(id(handle), (handle, []))[1].append(name)
        entries = list(table.items()) if len(table) > ctx.in_flight_sweep else None
    if entries is not None:
        # Polled outside the lock (a handle's poll may take locks of its own).
        done = [(n, h) for n, h in entries if h.poll()]
        with ctx.lock:
            for n, h in done:
                if table.get(n) is h:
                    del table[n]
                ctx.in_flight_names.pop(id(h), None)
            ctx.in_flight_sweep = max(_IN_FLIGHT_SWEEP, 2 * len(table))
    return handle


def _stage(tensor, name, average, priority):
    """Starts a staged push_pull of `tensor` in place (_staging.py)."""
    ctx = _context._require()
    _check_summable(tensor, "push_pull", name)
    with ctx.lock:
        if ctx.stager is None:
            ctx.stager = _staging.Stager()
        stager = ctx.stager
    d = tensor.detach()
    buf = d if d.is_contiguous() else d.contiguous()
    op = _staging.StagedOp(tensor, buf.reshape(-1), name, average, priority,
                           stager.engine(tensor), stager.pool, start, ctx.timeout,
                           finish=None if buf is d else (lambda: d.copy_(buf)))
    stager.submit(op)
    return op


def start(tensor, buf, name, average, priority, finish=None):
    """Declares `name` for buf's dtype/shape and starts summing buf in place."""
    ctx = _context._require()
    dtype = summable_dtype(buf.dtype, "push_pull", name)
    t = ctx.declare(name, dtype, buf.numel(), tuple(buf.shape))
    h = ctx.worker.push_pull(t, buf.data_ptr(), buf.numel(), dtype, average, priority, buf)
    return PushPullHandle(h, tensor, finish, ctx.timeout, name)


def collective_key(name, counts, shared_counts):
    """The key of a collective called `name`. Counts every rank learned from the others
    (allgather, alltoall: `shared_counts`) are the same on every rank: they join the key, so
    that calls with other splits get their own. What a rank derives from its own tensor (a
    reduce-scatter's split, a root, an op) stays out of it: ranks that disagree then meet on one
    key and get MismatchError naming them."""
    if not shared_counts:
        return name
    return "%s|%x" % (name, zlib.crc32(",".join(str(c) for c in counts).encode()))


def start_collective(kind, tensor, inp, out, name, dtype=None, op="sum", root=0, counts=(),
                     shared_counts=False, average=False, priority=0, finish=None, group=(),
                     claimed=False):
    """Declares `name` for the collective and starts it from `inp` into `out` (contiguous; the
    same tensor for in-place allreduce and broadcast). synchronize() returns `tensor`.
    `claimed`: the caller has claimed `name` and tracks the operation itself (an operation
    of two steps, whose second step this is); otherwise a `name` in flight is refused."""
    ctx = _context._require()
    if not claimed:
        claim(name, kind)
    if dtype is None:
        dtype = summable_dtype(inp.dtype, kind, name, verb="reduced")
    counts = [int(c) for c in counts]
    total = sum(counts) if counts else out.numel()
    key = collective_key(name, counts, shared_counts)
    group = [int(r) for r in group]
    spec = (dtype, total, kind, op, root, tuple(counts), tuple(group))
    with ctx.lock:
        known = ctx.collectives.get(key)
    if known is not None and known[1] == spec and known[0].current:
        t = known[0]
    else:  # new, or back with another spec: the worker retires the earlier declaration
        # Outside the lock: declaring sends to the scheduler. Two threads declaring one key
        # get the same handle from the worker.
        t = ctx.worker.declare_collective(key, dtype, total, kind, op, root, counts, group)
        with ctx.lock:
            if len(ctx.collectives) > 4096:
                ctx.collectives.clear()  # the worker keeps its declarations; this is a cache
            ctx.collectives[key] = (t, spec)
    h = ctx.worker.run(t, inp.data_ptr(), inp.numel(), out.data_ptr(), out.numel(), dtype,
                       average, priority, (inp, out))
    handle = PushPullHandle(h, tensor, finish, ctx.timeout, name)
    return handle if claimed else track(name, handle)


def push_pull_async(tensor, average=True, name=None, priority=0):
    """Starts summing (average=True: averaging) `tensor` over all workers, in place.

    `tensor` must be a CPU tensor of float32/64, float16, bfloat16, int32 or int64 (a
    non-contiguous one is summed through a contiguous copy and written back by synchronize()).
    Do not touch it until synchronize() returns. `name` identifies the tensor across workers
    (the key is a hash of it): give every tensor a unique name, the same on every worker. Without
    a name the n-th unnamed call of this process is named "push_pull.noname.<n>", so unnamed
    calls must be made in the same order on every worker, and each one creates a new key: pass
    a name for anything called every step. Higher `priority` is sent first.
    """
    _check_tensor(tensor, "push_pull", device_ok=True)
    ctx = _context._require()
    if name is None:
        name = "push_pull.noname.%d" % ctx.unnamed.next()
    claim(name, "push_pull")
    if _staged(tensor):
        with torch.no_grad():
            return track(name, _stage(tensor, name, average, priority))
    with torch.no_grad():
        if tensor.is_contiguous():
            return track(name, start(tensor, tensor.detach(), name, average, priority))
        t = tensor.detach()
        buf = t.contiguous()
        return track(name, start(tensor, buf, name, average, priority,
                                 finish=lambda: t.copy_(buf)))


def push_pull(tensor, average=True, name=None, priority=0):
    """Sums (average=True: averages) `tensor` over all workers, in place; returns it."""
    return synchronize(push_pull_async(tensor, average=average, name=name, priority=priority))


def start_group(tensors, bufs, names, average, priority, finish=()):
    """Declares names[i] for bufs[i] and starts summing all of them in place as one group."""
    ctx = _context._require()
    handles, ptrs, counts, dtypes = [], [], [], []
    for buf, name in zip(bufs, names):
        dtype = summable_dtype(buf.dtype, "grouped_push_pull", name)
        handles.append(ctx.declare(name, dtype, buf.numel(), tuple(buf.shape)))
        ptrs.append(buf.data_ptr())
        counts.append(buf.numel())
        dtypes.append(dtype)
    h = ctx.worker.push_pull_group(handles, ptrs, counts, dtypes, average, priority, list(bufs))
    what = "group of %d tensors" % len(bufs)
    return GroupedPushPullHandle(h, tensors, list(finish), ctx.timeout, what)


def grouped_push_pull_async(tensors, average=True, name=None, priority=0, names=None):
    """Starts summing (average=True: averaging) every tensor of `tensors` over all workers, in
    place, as one operation (like Horovod's grouped_allreduce): small tensors of one dtype are
    packed into fusion buffers and sent as one message each, which costs far less than one
    push_pull per tensor. Large ones (fusion_threshold_bytes and up) go on their own, without a
    copy.

    Every worker must group the same tensors the same way (same names, shapes and order): the
    fused tensors' keys are derived from their members, so workers that group differently wait
    for each other in vain and synchronize() raises TimeoutError. Member i is named
    ``names[i]`` if given, else ``"<name>.<i>"`` (name: the n-th unnamed call of this process is
    "grouped_push_pull.noname.<n>", so unnamed calls must come in the same order everywhere).
    Returns a handle for synchronize(), which returns the list of tensors."""
    ctx = _context._require()
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check_tensor(t, "grouped_push_pull (member %d)" % i, device_ok=True)
    if names is None:
        if name is None:
            name = "grouped_push_pull.noname.%d" % ctx.unnamed.next()
        names = ["%s.%d" % (name, i) for i in range(len(tensors))]
    else:
        names = list(names)
        if len(names) != len(tensors):
            raise InvalidArgumentError("grouped_push_pull: %d tensors but %d names"
                                       % (len(tensors), len(names)))
    for n in names:
        claim(n, "grouped_push_pull")
    if any(_staged(t) for t in tensors):
        # Staged members go one by one (each in chunks, under its own name), the rest as a group.
        for t, n in zip(tensors, names):  # every member checked before any starts
            _check_summable(t, "grouped_push_pull", n)
        with torch.no_grad():
            staged = [_stage(t, n, average, priority) if _staged(t) else None
                      for t, n in zip(tensors, names)]
            rest = [i for i, op in enumerate(staged) if op is None]
            group = None
            if rest:
                group = grouped_push_pull_async([tensors[i] for i in rest], average=average,
                                                priority=priority,
                                                names=[names[i] for i in rest])
        handle = _staging.StagedGroup(tensors, staged, group)
        for n in names:
            track(n, handle)
        return handle
    bufs, finish = [], []
    with torch.no_grad():
        for t in tensors:
            d = t.detach()
            if d.is_contiguous():
                bufs.append(d)
            else:
                c = d.contiguous()
                bufs.append(c)
                finish.append(lambda d=d, c=c: d.copy_(c))
        handle = start_group(tensors, bufs, names, average, priority, finish)
    for n in names:
        track(n, handle)
    return handle


def grouped_push_pull(tensors, average=True, name=None, priority=0, names=None):
    """Sums (average=True: averages) every tensor over all workers, in place, as one group;
    returns the list. See grouped_push_pull_async()."""
    return synchronize(grouped_push_pull_async(tensors, average=average, name=name,
                                               priority=priority, names=names))
