"""Joining and leaving the job: init() (its options from the arguments, else the environment
through gradlink/_env.py; the torchrun route through torch's store), the fail-fast hook,
shutdown(), and the job-wide waits barrier() and join().

The context it makes lives in _context.py; the torch.distributed rendezvous in _rendezvous.py.
Threads: init() and shutdown() from any thread (the context's lock orders them).
"""

import atexit
import os
import sys

import gradlink
from gradlink import InvalidArgumentError, _env

from . import _context

# The worker a shutdown() under gradlink-run kept, with (scheduler, job, rank) it joined as: the
# next init() of the same job takes it again, the process's exit leaves the job. Horovod's
# programs may shutdown() and init() again in one process (its own tests do, in every
# tearDown); under gradlink-run the job is the workers' processes, so a shutdown() before the
# process ends does not end it: the other workers go on and this one may come back. Guarded by
# _context.setting_lock.
_kept = None

# init()'s options while it makes a gradlink process group, which joins through init() itself
# (_c10d._create): the caller's options, not the defaults.
_pending_options = {}


def pending_options():
    return dict(_pending_options)


def _join_through_torch(timeout):
    """torchrun (or any env:// setting) without GRADLINK_SCHEDULER: the job is made through
    torch's store, as the "gradlink" backend does (_c10d.py): rank 0 hosts the scheduler, each
    host's first rank a server. With no default process group yet, that group is made a
    gradlink one; beside an existing one (gloo, say), its store is used."""
    import torch.distributed as dist
    from . import _rendezvous
    if not dist.is_initialized():
        dist.init_process_group(_rendezvous.BACKEND)  # joins (calls init() with the scheduler)
        return None
    store = dist.distributed_c10d._get_default_store()
    return _rendezvous.init_from_store(store, dist.get_rank(), dist.get_world_size(), timeout)


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
    global _pending_options
    # (not the job: the process group names its own)
    options = {k: v for k, v in locals().items() if k not in ("scheduler", "rank", "job")}
    if _context.is_initialized():
        return
    # The worker's variables as the C++ worker parses them (InvalidArgumentError naming a
    # malformed one, before anything starts).
    env = _env.options("worker")
    scheduler = scheduler or env["scheduler"]
    if timeout is None:
        timeout = env["operation_timeout"]  # GRADLINK_TIMEOUT, else the C++ default (300 s)
    if not scheduler and _env.under_torchrun():
        _pending_options = options  # for the init() the gradlink process group makes
        try:
            scheduler = _join_through_torch(timeout)
        finally:
            _pending_options = {}
        if scheduler is None:
            return  # the gradlink process group joined
    with _context.setting_lock:
        if _context.is_initialized():
            return
        if not scheduler:
            raise InvalidArgumentError(
                "gradlink.torch.init(): no scheduler: run under gradlink-run or torchrun, set "
                "GRADLINK_SCHEDULER=host:port, or init_process_group('gradlink')")
        if rank is None:
            rank = env["rank"] if _env.is_set("GRADLINK_RANK") else _env.integer(
                "RANK", default=-1)
        job = job or env["job"]
        expected = _env.workers()
        kept = _take_kept((scheduler, job, rank))
        if kept is not None:
            ctx = _context.Context(kept[0], _env.local_rank(), _env.local_size(), timeout,
                                   (scheduler, job, rank))
            # Unnamed calls go on numbering where they were: a name from before never comes
            # back for another call (a rank whose call failed before the shutdown would take
            # it up with another shape while the others cannot).
            ctx.unnamed = kept[1]
            _context.install(ctx)
            return
        if connect_timeout is None and not _env.is_set("GRADLINK_CONNECT_TIMEOUT"):
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
        _context.install(_context.Context(worker, _env.local_rank(), _env.local_size(), timeout,
                                          (scheduler, job, rank)))
        if fail_fast is None:
            fail_fast = _env.fail_fast()
        if fail_fast:
            _install_fail_fast()
    if not _registered[0]:
        _registered[0] = True
        atexit.register(_at_exit)


def _install_fail_fast():
    previous = sys.excepthook
    if getattr(previous, "_gradlink", False):
        return

    def hook(etype, value, tb):
        ctx = _context.current()
        try:
            previous(etype, value, tb)
            if ctx is not None and not issubclass(etype, KeyboardInterrupt):
                sys.stderr.write("gradlink: uncaught %s on rank %d: leaving the job abruptly so "
                                 "the other workers fail fast\n" % (etype.__name__, ctx.rank))
        finally:
            if ctx is not None:
                # A hook around this one may have swapped sys.stderr for a buffer it prints once
                # this one returns (torch 2.x's init_process_group does, to prefix "[rankN]:"):
                # this one never returns, so what went there is printed here.
                captured = sys.stderr
                if captured is not sys.__stderr__ and hasattr(captured, "getvalue"):
                    try:
                        sys.__stderr__.write(captured.getvalue())
                    except Exception:  # noqa: BLE001
                        pass
                for stream in (sys.stdout, sys.stderr, sys.__stderr__):
                    try:
                        stream.flush()
                    except Exception:  # noqa: BLE001
                        pass
                os._exit(1)

    hook._gradlink = True
    sys.excepthook = hook


def shutdown():
    """Leaves the job cleanly (pending operations fail with AbortedError). Idempotent.

    Under gradlink-run, whose job lasts as long as its workers' processes, the worker keeps its
    place until the process exits: init() again in this process takes it back (as Horovod's
    init() after shutdown() does), with the front end's state (names in flight, caches) new."""
    global _kept
    if _context.is_initialized():
        _context.notify_shutdown()  # a timeline still recording is written, as Horovod does
    live = _context.current()
    if live is not None and live.completer is not None:
        # Drained while the context still stands: an operation of two steps whose first step
        # has ended starts its second (which needs the context) on every rank alike. Stopped
        # after the context was taken, the completion thread's second steps failed to start
        # on this rank while the other ranks' went out, waiting for it for good (and a later
        # join() waited for them: Horovod's test_barrier_with_multiple_collectives, then
        # test_horovod_join_allgather, one file run in two).
        live.completer.stop()
        with live.lock:
            live.completer = None  # a later submit starts another, stopped below
    ctx = _context.take()
    if ctx is None:
        return
    keep = _env.launched_by_gradlink_run() and not _exiting[0]
    try:
        if not keep:
            ctx.worker.shutdown()
    finally:
        if ctx.completer is not None:
            ctx.completer.stop()
        if ctx.stager is not None:
            ctx.stager.stop()
        if keep:
            with _context.setting_lock:
                _leave_kept()
                _kept = (ctx.worker, ctx.joined_as, ctx.unnamed)


_exiting = [False]
_registered = [False]  # _at_exit, once per process


def _at_exit():
    """The process ends: the job is left for good (a kept worker too)."""
    _exiting[0] = True
    shutdown()
    with _context.setting_lock:
        _leave_kept()


def _take_kept(joined_as):
    """(worker, its counter of unnamed calls) kept if it joined as `joined_as` (then no longer
    kept); else None, and a kept worker of another job leaves it. Holding
    _context.setting_lock."""
    global _kept
    if _kept is None:
        return None
    worker, kept_as, noname = _kept
    if kept_as == joined_as:
        _kept = None
        return worker, noname
    _leave_kept()
    return None


def _leave_kept():
    global _kept
    if _kept is not None:
        worker, _kept = _kept[0], None
        worker.shutdown()


def barrier(timeout=None):
    """Blocks until every worker has entered the barrier."""
    ctx = _context._require()
    ctx.worker.barrier(ctx.timeout if timeout is None else timeout)


def join(timeout=None):
    """This rank has run out of data: waits for its own operations to end, then sits out the
    other ranks' sums (it adds zeros: an average still divides by every rank, as Horovod's) until
    every rank has joined. Returns the rank that joined last; every rank then goes on in step.
    Only sums and averages run while a rank has joined: other collectives that need it raise
    InvalidArgumentError naming it."""
    ctx = _context._require()
    return ctx.worker.join(ctx.timeout if timeout is None else timeout)
