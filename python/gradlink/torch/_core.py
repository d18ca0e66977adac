"""The process-wide gradlink worker of gradlink.torch, and push_pull on torch tensors."""

import atexit
import itertools
import os
import queue
import sys
import threading
import time
import zlib

import torch

import gradlink
from gradlink import InvalidArgumentError

from . import _staging, _timeline

# torch dtype -> gradlink dtype name (the types the servers can sum).
DTYPES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "int32",
    torch.int64: "int64",
}

DEFAULT_TIMEOUT_S = 300.0


class _Context:
    def __init__(self, worker, local_rank, local_size, timeout):
        self.worker = worker
        self.rank = worker.rank
        self.size = worker.size
        self.local_rank = local_rank
        self.local_size = local_size
        self.timeout = timeout
        self.tensors = {}  # name -> gradlink.Tensor
        self.collectives = {}  # key (name + spec) -> gradlink.Tensor
        self.noname = itertools.count()
        self.lock = threading.Lock()
        self.completer = None
        self.stager = None  # _staging.Stager: device tensors (and GRADLINK_STAGE_HOST=1)

    def declare(self, name, dtype, count, shape=None):
        t = self.tensors.get(name)
        if t is not None and t.dtype == dtype and t.count == count and (
                shape is None or t.shape is None or t.shape == shape):
            return t
        # New, or redeclared with another shape (the worker raises MismatchError).
        t = self.worker.declare(name, dtype, count, shape)
        self.tensors[name] = t
        return t


_ctx = None
_ctx_lock = threading.Lock()


def _env(*names, default=None):
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return default


def _env_int(*names, default=None):
    v = _env(*names)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise InvalidArgumentError("%s=%r is not an integer" % ("/".join(names), v)) from None


# init()'s options while it makes a gradlink process group, which joins through init() itself
# (_c10d._create): the caller's options, not the defaults.
_pending_options = {}


def pending_options():
    return dict(_pending_options)


def _under_torchrun():
    return all(_env(n) is not None for n in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))


def _join_through_torch(timeout):
    """torchrun (or any env:// setting) without GRADLINK_SCHEDULER: the job is made through
    torch's store, as the "gradlink" backend does (_c10d.py): rank 0 hosts the scheduler, each
    host's first rank a server. With no default process group yet, that group is made a
    gradlink one; beside an existing one (gloo, say), its store is used."""
    import torch.distributed as dist
    from . import _c10d
    if not dist.is_initialized():
        dist.init_process_group(_c10d.BACKEND)  # joins (calls init() with the scheduler)
        return None
    store = dist.distributed_c10d._get_default_store()
    return _c10d.init_from_store(store, dist.get_rank(), dist.get_world_size(), timeout)


def init(scheduler=None, rank=None, job=None, *, timeout=None, connect_timeout=None,
         partition_bytes=None, max_bytes_in_flight=None, single_lane=None, fail_fast=None,
         fusion_buffer_bytes=None, fusion_threshold_bytes=None, max_bytes_ahead=None,
         local_arena_bytes=None, local_chunk_bytes=None):
    """Joins the gradlink job; returns once every worker and server has joined.

    Arguments default to the environment:

    * gradlink-run: ``GRADLINK_SCHEDULER`` (host:port), ``GRADLINK_RANK``, ``GRADLINK_JOB``,
      ``GRADLINK_WORKERS``, ``GRADLINK_LOCAL_RANK``, ``GRADLINK_LOCAL_SIZE``.
    * torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with no
      ``GRADLINK_SCHEDULER``: the job is made through torch's store, as
      ``init_process_group("gradlink")`` does (which this calls when there is no default
      process group yet): rank 0 hosts the scheduler, the first rank of each host starts a
      server (``GRADLINK_SERVERS_PER_HOST``), all ending with the job. ``GRADLINK_SCHEDULER``
      names an existing job (an external server pool) instead.

    ``timeout`` (``GRADLINK_TIMEOUT``, default 300 s) is the default deadline of synchronize();
    ``partition_bytes`` (``GRADLINK_PARTITION_BYTES``), ``max_bytes_in_flight``
    (``GRADLINK_MAX_BYTES_IN_FLIGHT``), ``max_bytes_ahead`` (``GRADLINK_MAX_BYTES_AHEAD``, per
    server, 0: no limit); unset, gradlink chooses the three for the job (docs/operations.md,
    "What gradlink tunes"); ``connect_timeout`` (``GRADLINK_CONNECT_TIMEOUT``,
    default 60 s) and ``single_lane`` (``GRADLINK_SINGLE_LANE=1``) tune the worker;
    ``fusion_buffer_bytes`` (``GRADLINK_FUSION_BUFFER_BYTES``, default 4 MiB, 0: no fusion) and
    ``fusion_threshold_bytes`` (``GRADLINK_FUSION_THRESHOLD_BYTES``, default 256 KiB) tune
    tensor fusion (grouped_push_pull, DistributedOptimizer).
    ``local_arena_bytes`` (``GRADLINK_LOCAL_ARENA_BYTES``, default 64 MiB, at most half of
    /dev/shm's free space; 0: off) sizes the same-host path: when every worker is on this host
    they sum through that much shared memory instead of through the servers, with
    bit-identical results (``local_chunk_bytes``,
    ``GRADLINK_LOCAL_CHUNK_BYTES``, default 256 KiB; docs/operations.md, "One host").
    Calling init() again is a no-op. shutdown() runs at exit.

    ``fail_fast`` (``GRADLINK_FAIL_FAST``, default on): an uncaught exception in the main thread
    prints its traceback and ends the process at once (status 1) without leaving the job
    cleanly, so that the scheduler sees this worker lost and every other worker's pending and
    later calls raise PeerLostError naming it within seconds. (A worker that leaves cleanly while
    the others still wait for its gradients would leave them waiting until their timeout.)
    """
    global _ctx, _pending_options
    # (not the job: the process group names its own)
    options = {k: v for k, v in locals().items() if k not in ("scheduler", "rank", "job")}
    if _ctx is not None:
        return
    scheduler = scheduler or _env("GRADLINK_SCHEDULER")
    if not scheduler and _under_torchrun():
        _pending_options = options  # for the init() the gradlink process group makes
        try:
            scheduler = _join_through_torch(
                float(_env("GRADLINK_TIMEOUT", default=DEFAULT_TIMEOUT_S)) if timeout is None
                else timeout)
        finally:
            _pending_options = {}
        if scheduler is None:
            return  # the gradlink process group joined
    with _ctx_lock:
        if _ctx is not None:
            return
        if not scheduler:
            raise InvalidArgumentError(
                "gradlink.torch.init(): no scheduler: run under gradlink-run or torchrun, set "
                "GRADLINK_SCHEDULER=host:port, or init_process_group('gradlink')")
        if rank is None:
            rank = _env_int("GRADLINK_RANK", "RANK", default=-1)
        job = job or _env("GRADLINK_JOB", default="default")
        expected = _env_int("GRADLINK_WORKERS", "WORLD_SIZE")
        if timeout is None:
            timeout = float(_env("GRADLINK_TIMEOUT", default=DEFAULT_TIMEOUT_S))
        if connect_timeout is None and _env("GRADLINK_CONNECT_TIMEOUT") is None:
            connect_timeout = 60.0  # the Python layer's default: workers start at their own pace
        # Every other tuning option: None leaves it to the binding, which applies the GRADLINK_*
        # environment through the C++ mapping (gradlink::ApplyEnvironment: one place reads
        # those variables) and else the C++ defaults. For partition_bytes and
        # max_bytes_in_flight, 0 means the same as None (as it always has); max_bytes_ahead takes
        # 0 as "no limit", local_arena_bytes as "off" and fusion sizes as "no fusion".
        worker = gradlink.Worker(
            scheduler, job=job, rank=rank, single_lane=single_lane,
            connect_timeout=connect_timeout,
            partition_bytes=partition_bytes or None,
            max_bytes_in_flight=max_bytes_in_flight or None,
            max_bytes_ahead=max_bytes_ahead, local_arena_bytes=local_arena_bytes,
            local_chunk_bytes=local_chunk_bytes or None,
            fusion_buffer_bytes=fusion_buffer_bytes,
            fusion_threshold_bytes=fusion_threshold_bytes)
        if expected is not None and worker.size != expected:
            worker.shutdown()
            raise InvalidArgumentError(
                "gradlink.torch.init(): the job has %d workers, the environment says %d"
                % (worker.size, expected))
        local_rank = _env_int("GRADLINK_LOCAL_RANK", "LOCAL_RANK", default=0)
        local_size = _env_int("GRADLINK_LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=1)
        _ctx = _Context(worker, local_rank, local_size, timeout)
        if fail_fast is None:
            fail_fast = _env("GRADLINK_FAIL_FAST", default="1") not in ("0", "", "false")
        if fail_fast:
            _install_fail_fast()
    atexit.register(shutdown)


def _install_fail_fast():
    previous = sys.excepthook
    if getattr(previous, "_gradlink", False):
        return

    def hook(etype, value, tb):
        try:
            previous(etype, value, tb)
            if _ctx is not None and not issubclass(etype, KeyboardInterrupt):
                sys.stderr.write("gradlink: uncaught %s on rank %d: leaving the job abruptly so "
                                 "the other workers fail fast\n" % (etype.__name__, _ctx.rank))
        finally:
            if _ctx is not None:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # noqa: BLE001
                        pass
                os._exit(1)

    hook._gradlink = True
    sys.excepthook = hook


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


def barrier(timeout=None):
    """Blocks until every worker has entered the barrier."""
    ctx = _require()
    ctx.worker.barrier(ctx.timeout if timeout is None else timeout)


def join(timeout=None):
    """This rank has run out of data: waits for its own operations to end, then sits out the
    other ranks' sums (it adds nothing; an average divides by the ranks that pushed) until
    every rank has joined. Returns the rank that joined last; every rank then goes on in step.
    Only sums and averages run while a rank has joined: other collectives that need it raise
    InvalidArgumentError naming it."""
    ctx = _require()
    return ctx.worker.join(ctx.timeout if timeout is None else timeout)


def shutdown():
    """Leaves the job cleanly (pending operations fail with AbortedError). Idempotent."""
    global _ctx
    if _ctx is not None:
        _timeline.stop_timeline()  # a timeline still recording is written, as Horovod does
    with _ctx_lock:
        ctx, _ctx = _ctx, None
    if ctx is None:
        return
    try:
        ctx.worker.shutdown()
    finally:
        if ctx.completer is not None:
            ctx.completer.stop()
        if ctx.stager is not None:
            ctx.stager.stop()


class _Pending:
    """A started operation: waits for the C++ handle once, then runs the copy-backs `finish`
    (staging buffers or non-contiguous members written back into the caller's tensors)."""

    __slots__ = ("_h", "_finish", "_done", "_timeout", "name", "_started")

    def __init__(self, h, finish, timeout, name):
        self._started = time.monotonic()
        self._h = h
        self._finish = finish  # callables
        self._done = False
        self._timeout = timeout
        self.name = name

    def poll(self):
        return self._done or self._h.poll()

    def _complete(self, timeout):
        if not self._done:
            self._h.wait(self._timeout if timeout is None else timeout)
            if self._finish:
                with torch.no_grad():
                    for f in self._finish:
                        f()
            self._done = True
            self._finish = None
            if _timeline.active():
                _timeline.record(self.name, self._started, self._h.timing())

    def timing(self):
        """Seconds by stage (pack, queue, push, reduce, pull, unpack, total) once done."""
        return self._h.timing()


class PushPullHandle(_Pending):
    """The pending result of push_pull_async(); pass it to synchronize() or poll()."""

    __slots__ = ("tensor",)

    def __init__(self, h, tensor, finish, timeout, name):
        super().__init__(h, [finish] if finish is not None else [], timeout, name)
        self.tensor = tensor

    def wait(self, timeout=None):
        self._complete(timeout)
        return self.tensor


def _check_tensor(tensor, what, device_ok=False):
    """`device_ok`: the operation stages CUDA tensors through host memory (sums over every
    worker: push_pull, grouped_push_pull and what is built on them); the others take CPU
    tensors only."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("%s: expected a torch.Tensor, got %s" % (what, type(tensor).__name__))
    if tensor.device.type != "cpu" and not (device_ok and tensor.device.type == "cuda"):
        raise InvalidArgumentError(
            "%s: %s tensors are not supported here (%s): copy to the CPU (t.cpu()), run it, "
            "and copy back" % (what, tensor.device.type,
                               "sums and averages over every worker take CUDA tensors"
                               if tensor.device.type == "cuda" else "CPU and CUDA tensors are"))
    if tensor.is_sparse:
        raise InvalidArgumentError("%s: sparse tensors are not supported" % what)


def _staged(tensor):
    """Whether `tensor` goes through host buffers (_staging.py): a CUDA tensor, or any with
    GRADLINK_STAGE_HOST=1."""
    return tensor.device.type != "cpu" or _staging.stage_host_tensors()


def _check_summable(tensor, what, name):
    if DTYPES.get(tensor.dtype) is None:
        raise InvalidArgumentError(
            "%s of '%s': dtype %s cannot be summed (supported: %s)"
            % (what, name, tensor.dtype, ", ".join(str(d) for d in DTYPES)))


def _stage(tensor, name, average, priority):
    """Starts a staged push_pull of `tensor` in place (_staging.py)."""
    ctx = _require()
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


def staging_stats():
    """Device tensors' path: `path`, which one ran (the transport moves host memory; its own
    device memory types, from UCX, in `device_memory`: gradlink stages through host buffers
    whatever they are), and the staging pool's host buffers `allocated` and `reused`."""
    ctx = _require()
    pool = ctx.stager.pool if ctx.stager is not None else None
    device = list(ctx.worker.stats()["in_force"].get("device_memory", []))
    return {"path": "pinned host staging (%s)" % (
                "the transport moves host memory only" if not device else
                "the transport could move %s memory itself; gradlink hands it host memory"
                % "/".join(device)),
            "device_memory": device,
            "allocated": pool.allocated if pool else 0, "reused": pool.reused if pool else 0}


def start(tensor, buf, name, average, priority, finish=None):
    """Declares `name` for buf's dtype/shape and starts summing buf in place."""
    ctx = _require()
    dtype = DTYPES.get(buf.dtype)
    if dtype is None:
        raise InvalidArgumentError(
            "push_pull of '%s': dtype %s cannot be summed (supported: %s)"
            % (name, buf.dtype, ", ".join(str(d) for d in DTYPES)))
    t = ctx.declare(name, dtype, buf.numel(), tuple(buf.shape))
    h = ctx.worker.push_pull(t, buf.data_ptr(), buf.numel(), dtype, average, priority, buf)
    return PushPullHandle(h, tensor, finish, ctx.timeout, name)


# Element types that routed collectives (broadcast, allgather, alltoall) carry as raw bits: the
# servers copy them, never convert, so any dtype travels as a same-width gradlink type.
_RAW = {8: (torch.int64, "int64"), 4: (torch.int32, "int32"), 2: (torch.int16, "fp16")}


def raw_view(t):
    """`t` (contiguous) as (buffer, gradlink dtype, elements per item, finish): a bit-exact view
    for routing; 1-byte types are widened to int16 (and narrowed back by `finish`)."""
    size = t.element_size()
    if t.dtype == torch.bool or size == 1:
        wide = t.to(torch.int16)
        return wide, "fp16", 1, (lambda: t.copy_(wide))
    for width in (8, 4, 2):
        if size % width == 0:
            dt, name = _RAW[width]
            flat = t.reshape(-1)
            if flat.is_complex():
                flat = torch.view_as_real(flat).reshape(-1)
            return flat.view(dt), name, size // width, None
    raise InvalidArgumentError("dtype %s cannot be routed" % t.dtype)


def start_collective(kind, tensor, inp, out, name, dtype=None, op="sum", root=0, counts=(),
                     shared_counts=False, average=False, priority=0, finish=None, group=()):
    """Declares `name` for the collective and starts it from `inp` into `out` (contiguous; the
    same tensor for in-place allreduce and broadcast). synchronize() returns `tensor`."""
    ctx = _require()
    if dtype is None:
        dtype = DTYPES.get(inp.dtype)
        if dtype is None:
            raise InvalidArgumentError(
                "%s of '%s': dtype %s cannot be reduced (supported: %s)"
                % (kind, name, inp.dtype, ", ".join(str(d) for d in DTYPES)))
    counts = [int(c) for c in counts]
    total = sum(counts) if counts else out.numel()
    # Counts every rank learned from the others (allgather, alltoall) are the same on every
    # rank: they join the key, so that calls with other splits get their own. What a rank
    # derives from its own tensor (a reduce-scatter's split, a root, an op) stays out of it:
    # ranks that disagree then meet on one key and get MismatchError naming them.
    key = name if not shared_counts else "%s|%x" % (
        name, zlib.crc32(",".join(str(c) for c in counts).encode()))
    group = [int(r) for r in group]
    spec = (dtype, total, kind, op, root, tuple(counts), tuple(group))
    with ctx.lock:
        known = ctx.collectives.get(key)
    if known is not None and known[1] == spec:
        t = known[0]
    else:  # new, or declared again otherwise (the worker raises MismatchError)
        # Outside the lock: declaring sends to the scheduler. Two threads declaring one key
        # get the same handle from the worker.
        t = ctx.worker.declare_collective(key, dtype, total, kind, op, root, counts, group)
        with ctx.lock:
            if len(ctx.collectives) > 4096:
                ctx.collectives.clear()  # the worker keeps its declarations; this is a cache
            ctx.collectives[key] = (t, spec)
    h = ctx.worker.run(t, inp.data_ptr(), inp.numel(), out.data_ptr(), out.numel(), dtype,
                       average, priority, (inp, out))
    return PushPullHandle(h, tensor, finish, ctx.timeout, name)


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
    ctx = _require()
    if name is None:
        name = "push_pull.noname.%d" % next(ctx.noname)
    if _staged(tensor):
        with torch.no_grad():
            return _stage(tensor, name, average, priority)
    with torch.no_grad():
        if tensor.is_contiguous():
            return start(tensor, tensor.detach(), name, average, priority)
        t = tensor.detach()
        buf = t.contiguous()
        return start(tensor, buf, name, average, priority, finish=lambda: t.copy_(buf))


def synchronize(handle, timeout=None):
    """Waits for a push_pull_async()/broadcast_async() handle; returns its tensor (now holding
    the result). Raises the operation's GradlinkError; gradlink.TimeoutError after `timeout`
    seconds (default: init()'s timeout)."""
    return handle.wait(timeout)


def poll(handle):
    """True once synchronize(handle) would not block."""
    return handle.poll()


def push_pull(tensor, average=True, name=None, priority=0):
    """Sums (average=True: averages) `tensor` over all workers, in place; returns it."""
    return synchronize(push_pull_async(tensor, average=average, name=name, priority=priority))


class GroupedPushPullHandle(_Pending):
    """The pending result of grouped_push_pull_async(); synchronize() returns the list of
    tensors."""

    __slots__ = ("tensors",)

    def __init__(self, h, tensors, finish, timeout, name):
        super().__init__(h, finish, timeout, name)
        self.tensors = tensors

    def wait(self, timeout=None):
        self._complete(timeout)
        return self.tensors


def start_group(tensors, bufs, names, average, priority, finish=()):
    """Declares names[i] for bufs[i] and starts summing all of them in place as one group."""
    ctx = _require()
    handles, ptrs, counts, dtypes = [], [], [], []
    for buf, name in zip(bufs, names):
        dtype = DTYPES.get(buf.dtype)
        if dtype is None:
            raise InvalidArgumentError(
                "grouped_push_pull of '%s': dtype %s cannot be summed (supported: %s)"
                % (name, buf.dtype, ", ".join(str(d) for d in DTYPES)))
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
    ctx = _require()
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check_tensor(t, "grouped_push_pull (member %d)" % i, device_ok=True)
    if names is None:
        if name is None:
            name = "grouped_push_pull.noname.%d" % next(ctx.noname)
        names = ["%s.%d" % (name, i) for i in range(len(tensors))]
    else:
        names = list(names)
        if len(names) != len(tensors):
            raise InvalidArgumentError("grouped_push_pull: %d tensors but %d names"
                                       % (len(tensors), len(names)))
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
        return _staging.StagedGroup(tensors, staged, group)
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
        return start_group(tensors, bufs, names, average, priority, finish)


def grouped_push_pull(tensors, average=True, name=None, priority=0, names=None):
    """Sums (average=True: averages) every tensor over all workers, in place, as one group;
    returns the list. See grouped_push_pull_async()."""
    return synchronize(grouped_push_pull_async(tensors, average=average, name=name,
                                               priority=priority, names=names))


def stats():
    """The C++ worker's counters: push_pulls, bytes_reduced, groups, fused_ops, bytes_packed,
    bytes_unpacked, bytes_copied_eager, bytes_copied_bounce, bytes_copied_local,
    bytes_copied_results (failover's copy of each last result), local_busy_ns (time this
    worker's threads spent copying and summing in shared memory), protocol_errors,
    partitions_held, peak_bytes_ahead, servers_lost and partitions_recovered (failover); and
    ``in_force``, the settings in force (partition_bytes, max_bytes_in_flight, max_bytes_ahead, fusion_buffer_bytes, fusion_threshold_bytes,
    local_arena_bytes, same_host_path, hierarchy (hierarchical aggregation: "host h of H, local
    rank l of L, ..." or "" when off), single_lane, host, ucx: the UCX_* variables in force, and
    chosen: which of the first three gradlink chose for the job, and why)."""
    return _require().worker.stats()


class Completer:
    """A dedicated thread that waits for handles and then runs their callbacks (e.g. completes
    torch futures), so user callbacks never run on a thread that communication depends on."""

    def __init__(self):
        self._q = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gradlink-completion", daemon=True)
        self._thread.start()

    def submit(self, handle, on_done, on_error):
        self._q.put((handle, on_done, on_error))

    def stop(self):
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(10)

    def _run(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            handle, on_done, on_error = item
            try:
                result = handle.wait()
            except BaseException as e:  # noqa: B902 - delivered to the future
                try:
                    on_error(e)
                except BaseException:  # noqa: B902
                    pass
                continue
            try:
                on_done(result)
            except BaseException:  # noqa: B902
                pass


def completer():
    ctx = _require()
    with ctx.lock:
        if ctx.completer is None:
            ctx.completer = Completer()
        return ctx.completer
