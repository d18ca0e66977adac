"""A communication hook for torch.nn.parallel.DistributedDataParallel.

    model = DDP(model)                          # needs a process group (e.g. gloo) for its setup
    model.register_comm_hook(gradlink.torch.DDPHookState(model), gradlink.torch.ddp_hook)

Each gradient bucket is averaged through the gradlink servers instead of the process group.

Keys. DDP rebuilds its buckets after the first iteration (bucket.index() then means another set
of parameters), so keys never come from the index. A bucket's key is derived from its contents:

* with DDPHookState(module): the names of the bucket's parameters (found by their data
  pointers), e.g. "ddp.<hash>.fc2.bias..fc1.weight", plus the buffer's dtype and length;
* with state None (or a DDPHookState without a module): the dtypes and shapes of the bucket's
  parameters, plus how many buckets with the same signature came before it in this iteration
  (DDP launches buckets in index order, the same on every rank; the count restarts after the
  bucket whose is_last() is true).

Either way every rank derives the same key for the same bucket, a rebuilt bucket gets a new key,
and a disagreement between ranks is a MismatchError rather than a silent wrong sum. Named keys
are the default recommendation: they are readable in errors and need no iteration bookkeeping.

The returned torch.futures.Future is completed by a dedicated completion thread (never a
gradlink lane thread), with the averaged buffer.
"""

import hashlib
import threading

import torch

from . import _core


class DDPHookState:
    """State of ddp_hook. `module`: the (DDP) model, to name keys after its parameters.
    `prefix`: prefix of the keys (use another one for a second DDP model). `average`: average
    (default) or sum."""

    def __init__(self, module=None, prefix="ddp", average=True):
        self.module = module
        self.prefix = prefix
        self.average = average
        self._names = None
        self._seen = {}
        self._lock = threading.Lock()

    def _param_names(self):
        if self._names is None and self.module is not None:
            self._names = {p.data_ptr(): n for n, p in self.module.named_parameters()}
        return self._names

    def bucket_name(self, bucket):
        buf = bucket.buffer()
        params = bucket.parameters()
        tail = "%s[%d]" % (buf.dtype, buf.numel())
        names = self._param_names()
        if names is not None:
            found = [names.get(p.data_ptr()) for p in params]
            if params and all(n is not None for n in found):
                digest = hashlib.sha1(("|".join(found) + "|" + tail).encode()).hexdigest()[:16]
                label = found[0] if len(found) == 1 else "%s..%s" % (found[0], found[-1])
                return "%s.%s.%s" % (self.prefix, digest, label)
        sig = ";".join("%s%s" % (p.dtype, tuple(p.shape)) for p in params) + "|" + tail
        digest = hashlib.sha1(sig.encode()).hexdigest()[:16]
        with self._lock:
            n = self._seen.get(digest, 0)
            self._seen[digest] = n + 1
            if bucket.is_last():
                self._seen.clear()
        return "%s.%s.%d" % (self.prefix, digest, n)


_default_state = DDPHookState()


def ddp_hook(state, bucket):
    """DDP communication hook: averages bucket.buffer() in place through gradlink; returns a
    torch.futures.Future completed with it. `state`: a DDPHookState or None (see module doc)."""
    if state is None:
        state = _default_state
    buf = bucket.buffer()
    name = state.bucket_name(bucket)
    # Buckets are numbered from the last layers (ready first) to the first layers: the higher
    # index is needed first by the next forward pass.
    handle = _core.push_pull_async(buf, average=state.average, name=name,
                                   priority=bucket.index())
    # A CUDA bucket's future records an event on the completing thread's stream (which waits
    # for the copies back: _staging.py) that DDP's stream then waits for.
    fut = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    _core.completer().submit(handle, fut.set_result, fut.set_exception)
    return fut
