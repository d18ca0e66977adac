"""byteps.torch.parallel.DistributedDataParallel on gradlink: the module replicated on every
worker, gradients averaged over the workers during backward.

As BytePS's: the constructor broadcasts the module's state from rank 0; every forward first
broadcasts the buffers from rank 0 (broadcast_buffers=True); each parameter's gradient starts
its push_pull (averaged, optionally compressed) as soon as autograd has accumulated it, and the
last one to arrive waits for all of them, so `loss.backward()` returns with averaged gradients
and the sums overlap the rest of backward. `no_sync()` accumulates gradients locally;
`synchronize()` completes a backward in which some parameters got no gradient (a branch not
taken). `device_ids`: None, or BytePS's one entry (the device the caller put the module on:
the module is not moved, as BytePS does not move it).
"""

import contextlib
import itertools

import torch

import gradlink
import gradlink.torch as _gl

from .compression import Compression


_instances = itertools.count()  # every rank makes its instances in the same order


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module, device_ids=None, broadcast_buffers=True,
                 compression=Compression.none):
        super().__init__()
        if device_ids is not None and len(device_ids) > 1:
            raise gradlink.InvalidArgumentError(
                "DistributedDataParallel: device_ids %s: one process drives one device (give "
                "one entry, as BytePS requires, or None)" % (device_ids,))
        self.device_ids = list(device_ids or [])
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._compression = compression
        self._sync = True
        self._pending = {}  # parameter -> (handle, compressed tensor, ctx)
        # Keys of this instance's own: two models with parameters of one name never meet.
        self._prefix = "ddp%d" % next(_instances)
        self._names = {p: "Gradient.%s.%s" % (self._prefix, n)
                       for n, p in module.named_parameters()}
        self._params = [p for _, p in module.named_parameters() if p.requires_grad]
        self._hooks = []
        if _gl.size() > 1:
            for p in self._params:
                # The gradient accumulator of p: its hook runs once p.grad holds this
                # backward's gradient.
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._hook_for(p))
                self._hooks.append(acc)  # keep the accumulators alive
        if len(module.state_dict()) > 0:
            _gl.broadcast_parameters(module.state_dict(), root_rank=0, prefix=self._prefix)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes inside accumulate locally; the first backward after
        the block averages the sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and _gl.size() > 1:
            buffers = list(self.module.named_buffers())
            if buffers:
                _gl.broadcast_parameters(buffers, root_rank=0,
                                         prefix=self._prefix + ".buffers")
        return self.module(*inputs, **kwargs)

    def _hook_for(self, p):
        def hook(*unused):
            if not self._sync:
                return
            with torch.no_grad():
                wire, ctx = self._compression.compress(p.grad)
                handle = _gl.push_pull_async(wire, average=True, name=self._names[p])
            self._pending[p] = (handle, wire, ctx)
            if len(self._pending) == len(self._params):
                self.synchronize()
        return hook

    def synchronize(self):
        """Waits for every gradient's average (starting those that got no gradient this
        backward, with their current .grad, zeros if none), and writes them into .grad."""
        if _gl.size() == 1:
            return
        with torch.no_grad():
            for p in self._params:
                if p not in self._pending:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    wire, ctx = self._compression.compress(p.grad)
                    self._pending[p] = (_gl.push_pull_async(wire, average=True,
                                                            name=self._names[p]), wire, ctx)
            for p, (handle, wire, ctx) in self._pending.items():
                _gl.synchronize(handle)
                result = self._compression.decompress(wire, ctx)
                if result.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(result)
        self._pending.clear()
