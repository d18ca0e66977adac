"""Handles of started operations: what push_pull_async() and the other *_async calls return,
synchronize() and poll() on them, and the completion thread (Completer) that waits for handles
and runs callbacks (the DDP hook's futures).

A handle waits for its C++ handle once, runs its copy-backs (staging buffers or non-contiguous
members written back into the caller's tensors) and then tells the context's observers
(_context.py) that the operation is done, with its stage timings.
Threads: a handle may be waited for from any thread, one at a time.
"""

import queue
import threading
import time

import torch

from gradlink import TimeoutError as GradlinkTimeout

from . import _context


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
            try:
                self._h.wait(self._timeout if timeout is None else timeout)
            except BaseException:  # noqa: B902 - re-raised
                if self._h.poll():  # failed: the name is free; timed out (running): still taken
                    _context.release(self, self.name)
                raise
            if self._finish:
                with torch.no_grad():
                    for f in self._finish:
                        f()
            self._done = True
            self._finish = None
            _context.release(self, self.name)
            observers = _context.observers()
            if observers:
                timing = self._h.timing()
                for o in observers:
                    o.operation_done(self.name, self._started, timing)

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


class TwoStepHandle:
    """An operation of two steps whose second depends on the first's result on every rank (an
    allgather's shapes, then its data): `then(first's result)` starts the second step and
    returns its handle. Started asynchronously, the second step starts from the completion
    thread as soon as the first is done, so the caller is never blocked at submit time (a rank
    may start it and go on to a barrier, as Horovod allows); with `wait_first` (synchronous
    calls) the caller's thread does both. An error of either step (the second's checks
    included, such as MismatchError) is raised by wait()."""

    def __init__(self, first, then, name, wait_first=False):
        self.name = name
        self._then = then
        self._second = None
        self._error = None
        self._ready = threading.Event()
        if wait_first:
            try:
                self._start_second(first.wait())
            except BaseException as e:  # noqa: B902 - raised by wait(), as the async form's
                self._failed(e)
        else:
            completer().submit(first, self._start_second, self._failed)

    def _start_second(self, result):
        try:
            self._second = self._then(result)
        except BaseException as e:  # noqa: B902 - raised by wait()
            self._error = e
        self._ready.set()

    def _failed(self, error):
        self._error = error
        self._ready.set()

    def poll(self):
        return self._ready.is_set() and (self._error is not None or self._second.poll())

    def wait(self, timeout=None):
        if not self._ready.wait(_context._require().timeout if timeout is None else timeout):
            raise GradlinkTimeout("%s: its first step did not finish in time" % self.name)
        try:
            if self._error is not None:
                raise self._error
            return self._second.wait(timeout)
        finally:
            # Done or failed: the name is free; the second step timed out: it stays taken.
            if self._error is not None or self._second.poll():
                _context.release(self, self.name)

    def timing(self):
        return self._second.timing() if self._second is not None else {}


def synchronize(handle, timeout=None):
    """Waits for a push_pull_async()/broadcast_async() handle; returns its tensor (now holding
    the result). Raises the operation's GradlinkError; gradlink.TimeoutError after `timeout`
    seconds (default: init()'s timeout)."""
    return handle.wait(timeout)


def poll(handle):
    """True once synchronize(handle) would not block."""
    return handle.poll()


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
    """The context's completion thread (started on first use; shutdown() stops it)."""
    ctx = _context._require()
    with ctx.lock:
        if ctx.completer is None:
            ctx.completer = Completer()
        return ctx.completer
