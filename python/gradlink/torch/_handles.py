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
            self._h.wait(self._timeout if timeout is None else timeout)
            if self._finish:
                with torch.no_grad():
                    for f in self._finish:
                        f()
            self._done = True
            self._finish = None
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
