"""Device tensors (CUDA) through gradlink: staged through pinned host memory, chunk by chunk.

gradlink's worker moves host memory (Debian's UCX has no CUDA transports), so a device tensor
is summed in chunks of GRADLINK_STAGING_CHUNK_BYTES (4 MiB by default, whole elements):

1. The operation waits for the work already queued on the tensor's current stream: an event
   recorded there, which the copy stream waits for (no device synchronisation).
2. Each chunk is copied device-to-host, on a side stream, into a pinned host buffer taken from
   a pool (buffers are kept per dtype and size and reused by later steps).
3. The stager thread pushes each chunk (its own key: the tensor's name for one chunk,
   "<name>#<i>/<n>" for several) as soon as that chunk's copy has completed, in chunk order.
4. As each chunk's sum arrives, it is copied host-to-device into the tensor, in place, on a
   second side stream; its buffer goes back to the pool once that copy has run.

Copies overlap the network and each other: chunk i+1 is copied out while chunk i is pushed,
and chunk i is copied back while later chunks are still summed. The sums are the servers' as
for host tensors (fp16 and bf16 accumulate in fp32), element for element, so a device tensor's
result is bit-identical to the same tensor pushed from host memory.

Stream semantics (as NCCL-backed torch ops): the tensor is safe to use on its current stream
once synchronize()/wait() returns, which makes the current stream wait for the copies back (an
event, not a host wait on the device). Do not touch the tensor in between.

The pipeline is written against a copy engine: CudaCopyEngine (streams, events, pinned memory,
asynchronous copies, all through torch's own CUDA API) for CUDA tensors, and CpuCopyEngine,
whose copies complete at once, which runs host tensors through the very same pipeline when
GRADLINK_STAGE_HOST=1 (how make test exercises it on machines without a GPU).
"""

import threading
import time

import torch

from gradlink import AbortedError, InvalidArgumentError, TimeoutError, _env  # noqa: A004

from . import _context

_DEFAULT_CHUNK_BYTES = _env.STAGING_CHUNK_DEFAULT


def chunk_bytes():
    """GRADLINK_STAGING_CHUNK_BYTES (4 MiB; at least 1 KiB)."""
    return _env.staging_chunk_bytes()


def stage_host_tensors():
    """GRADLINK_STAGE_HOST=1: host tensors go through the staging pipeline (CpuCopyEngine)."""
    return _env.stage_host()


class _Done:
    """An event that has already happened (CpuCopyEngine's copies are done when issued)."""

    @staticmethod
    def query():
        return True


_DONE = _Done()


class CpuCopyEngine:
    """Copies that complete as they are issued: host tensors through the staging pipeline."""

    name = "cpu"

    def begin(self, tensor):
        return None  # nothing queued on a stream to wait for

    def to_host(self, dst, src, after):
        dst.copy_(src)
        return _DONE

    def to_device(self, dst, src):
        dst.copy_(src)
        return _DONE

    def host_buffer(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def make_current_wait(self, tensor, events):
        pass


class CudaCopyEngine:
    """One device's side streams: device-to-host copies on one, host-to-device on the other, so
    that copies back never queue behind copies out."""

    name = "cuda"

    def __init__(self, device):
        self.device = device
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)

    def begin(self, tensor):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(tensor.device))
        return ev

    def _copy(self, stream, dst, src, after=None):
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        # The caching allocator must not hand the device tensor's memory to another stream's
        # work before this copy has run.
        (src if src.is_cuda else dst).record_stream(stream)
        return ev

    def to_host(self, dst, src, after):
        return self._copy(self.d2h, dst, src, after)

    def to_device(self, dst, src):
        return self._copy(self.h2d, dst, src)

    def host_buffer(self, numel, dtype):
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def make_current_wait(self, tensor, events):
        stream = torch.cuda.current_stream(tensor.device)
        for ev in events:
            stream.wait_event(ev)


class HostBufferPool:
    """Pinned (or, for the CPU engine, plain) host buffers kept per (engine, dtype, elements)
    and reused: steps after the first allocate nothing."""

    def __init__(self):
        self._free = {}
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def take(self, engine, numel, dtype):
        key = (engine.name, dtype, numel)
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reused += 1
                return free.pop()
            self.allocated += 1
        return engine.host_buffer(numel, dtype)

    def give(self, engine, buf):
        with self._lock:
            self._free.setdefault((engine.name, buf.dtype, buf.numel()), []).append(buf)


class _Chunk:
    __slots__ = ("index", "name", "view", "host", "copied_out", "handle", "copied_back")

    def __init__(self, index, name, view, host):
        self.index = index
        self.name = name
        self.view = view            # the tensor's elements (flat, on the device)
        self.host = host            # their host buffer
        self.copied_out = None      # event: device-to-host copy done
        self.handle = None          # the chunk's push_pull, once pushed
        self.copied_back = None     # event: host-to-device copy done


class StagedOp:
    """One device tensor's push_pull through host buffers (module doc). Driven by the stager
    thread; wait()/poll() as gradlink's other handles."""

    def __init__(self, tensor, flat, name, average, priority, engine, pool, start, timeout,
                 finish=None):
        self.tensor = tensor
        self._finish = finish  # a non-contiguous tensor: copies `flat`'s result into it
        self.name = name
        self._average = average
        self._priority = priority
        self._engine = engine
        self._pool = pool
        self._start = start  # _core.start
        self._timeout = timeout
        self._done = threading.Event()
        self._failure = None
        self._started = time.monotonic()
        self._finished = None
        elem = flat.element_size()
        per = max(1, chunk_bytes() // elem)
        n = (flat.numel() + per - 1) // per
        ready = engine.begin(tensor)
        self.chunks = []
        for i in range(n):
            view = flat[i * per:(i + 1) * per]
            host = pool.take(engine, view.numel(), view.dtype)
            c = _Chunk(i, name if n == 1 else "%s#%d/%d" % (name, i, n), view, host)
            c.copied_out = engine.to_host(host, view, ready)
            self.chunks.append(c)
        self._next_push = 0
        self._ended = 0  # chunks whose push_pull has ended (copied back, or failed)
        self.pushed = []  # chunk indices in the order they were pushed

    def advance(self):
        """One non-blocking step (the stager thread): pushes the chunks whose copies out are
        done, in order; copies back those whose sums arrived. True if anything moved."""
        moved = False
        while self._next_push < len(self.chunks):
            c = self.chunks[self._next_push]
            if not c.copied_out.query():
                break
            try:
                c.handle = self._start(c.host, c.host, c.name, self._average, self._priority)
            except Exception as e:  # noqa: BLE001 - delivered to wait()
                self._fail(e)
                c.handle = _FAILED
            self.pushed.append(c.index)
            self._next_push += 1
            moved = True
        for c in self.chunks[:self._next_push]:
            if c.copied_back is not None or c.handle is _ENDED:
                continue
            if c.handle is not _FAILED:
                if not c.handle.poll():
                    continue
                try:
                    c.handle.wait(0)
                    c.copied_back = self._engine.to_device(c.view, c.host)
                except Exception as e:  # noqa: BLE001 - delivered to wait()
                    self._fail(e)
            if c.copied_back is None:
                self._pool.give(self._engine, c.host)  # no copy back reads it
                c.handle = _ENDED
            self._ended += 1
            moved = True
        if self._ended == len(self.chunks) and not self._done.is_set():
            self._finished = time.monotonic()
            self._done.set()
        return moved

    def recycle(self):
        """Buffers whose copies back have run go back to the pool; True once all have."""
        left = False
        for c in self.chunks:
            if c.copied_back is None or c.host is None:
                continue
            if c.copied_back.query():
                self._pool.give(self._engine, c.host)
                c.host = None
            else:
                left = True
        return not left

    def _fail(self, e):
        if self._failure is None:
            self._failure = e

    def abort(self, e):
        """Ends the op with `e` now (the stager stopped, or met an error of its own); chunks
        still in flight keep their buffers, which are never reused."""
        self._fail(e)
        if not self._done.is_set():
            self._finished = time.monotonic()
            self._done.set()

    def poll(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        timeout = self._timeout if timeout is None else timeout
        if not self._done.wait(timeout):
            pushed = sum(1 for c in self.chunks if c.handle is not None)
            raise TimeoutError(
                "push_pull of '%s' (%s tensor, %d chunk(s) staged through host memory) not "
                "complete after %.1f s: %d of them pushed, %d ended"
                % (self.name, self._engine.name, len(self.chunks), timeout, pushed, self._ended))
        _context.release(self, self.name)  # done or failed: its name is free
        if self._failure is not None:
            raise self._failure
        self._engine.make_current_wait(
            self.tensor, [c.copied_back for c in self.chunks if c.copied_back is not None])
        if self._finish is not None:
            with torch.no_grad():
                self._finish()  # on the current stream, after the copies back
            self._finish = None
        return self.tensor

    def timing(self):
        """Seconds: total (from the call to the last chunk's copy back issued) and per stage of
        the chunks' push_pulls, summed over chunks."""
        total = (self._finished or time.monotonic()) - self._started
        out = {"total": total, "chunks": len(self.chunks)}
        for c in self.chunks:
            if c.handle not in (None, _FAILED, _ENDED):
                for k, v in c.handle.timing().items():
                    if k != "total":
                        out[k] = out.get(k, 0.0) + v
        return out


class StagedGroup:
    """grouped_push_pull with staged members: each staged member's StagedOp, the others' group
    handle; wait() returns the list of tensors."""

    def __init__(self, tensors, staged, group):
        self.tensors = tensors
        self._parts = [op for op in staged if op is not None] + ([group] if group else [])
        self.name = "group of %d tensors (%d staged)" % (
            len(tensors), sum(op is not None for op in staged))

    def poll(self):
        return all(p.poll() for p in self._parts)

    def wait(self, timeout=None):
        failure = None
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self._parts:  # every part, so that none is left running
            try:
                p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - the first is raised
                failure = failure or e
        if self.poll():  # done or failed, not timed out: the members' names are free
            _context.release(self, self.name)
        if failure is not None:
            raise failure
        return self.tensors

    def timing(self):
        return {"total": max(p.timing().get("total", 0.0) for p in self._parts)}


_FAILED = object()  # a chunk whose push could not start
_ENDED = object()   # a chunk that failed and gave its buffer back


class Stager:
    """The thread that drives every staged operation of a process (StagedOp.advance)."""

    def __init__(self):
        self._ops = []
        self._draining = []
        self._cv = threading.Condition()
        self._stop = False
        self.pool = HostBufferPool()
        self._engines = {}
        self._thread = threading.Thread(target=self._run, name="gradlink-stager", daemon=True)
        self._thread.start()

    def engine(self, tensor):
        if tensor.device.type == "cpu":
            key = "cpu"
        elif tensor.device.type == "cuda":
            key = ("cuda", tensor.device.index)
        else:
            raise InvalidArgumentError("push_pull: %s tensors are not supported (CPU and CUDA are)"
                                       % tensor.device.type)
        with self._cv:
            e = self._engines.get(key)
            if e is None:
                e = CpuCopyEngine() if key == "cpu" else CudaCopyEngine(tensor.device)
                self._engines[key] = e
            return e

    def submit(self, op):
        with self._cv:
            if self._stop or not self._thread.is_alive():
                raise AbortedError("push_pull of '%s': gradlink's stager has stopped (%s)"
                                   % (op.name, self._why or "shut down"))
            self._ops.append(op)
            self._cv.notify()

    def stop(self):
        with self._cv:
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(10)

    _why = None

    def _run(self):
        try:
            self._loop()
        except BaseException as e:  # noqa: B902 - every pending op learns of it
            self._why = "its thread failed: %r" % (e,)
        finally:
            with self._cv:
                self._stop = True
                ops, self._ops = self._ops, []
            for op in ops:
                op.abort(AbortedError("push_pull of '%s': gradlink's stager stopped (%s)"
                                      % (op.name, self._why or "shut down")))

    def _loop(self):
        idle = 0
        while True:
            with self._cv:
                while not self._ops and not self._draining and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                ops = list(self._ops)
            moved = False
            for op in ops:
                try:
                    moved = op.advance() or moved
                except Exception as e:  # noqa: BLE001 - a copy engine's error (CUDA) ends the op
                    op.abort(e)
            with self._cv:
                for op in ops:
                    if op.poll():
                        self._ops.remove(op)
                        self._draining.append(op)
                keep = []
                for op in self._draining:
                    try:
                        if not op.recycle():
                            keep.append(op)
                    except Exception:  # noqa: BLE001 - its buffers are not reused
                        pass
                self._draining = keep
            # Events and handles are polled: spin while things move, then back off to 1 ms.
            idle = 0 if moved else min(idle + 1, 20)
            if idle:
                time.sleep(50e-6 * idle)
