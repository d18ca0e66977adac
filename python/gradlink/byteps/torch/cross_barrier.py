"""byteps.torch.cross_barrier on gradlink: CrossBarrier, the optimizer wrapper that lets the
averaging of one step's gradients overlap the next step's forward pass (BytePS's "crossing the
global barrier", from ByteScheduler), and the byteps.torch names such scripts take from this
module (`import byteps.torch.cross_barrier as bps`: bps.init(), bps.CrossBarrier(...), ...).

How it works here. step() starts every gradient's average (push_pull, in place, higher
priority for the first layers, which the next forward needs first) and returns at once. Each
module that owns parameters gets a forward pre-hook: before the module runs, each of its
parameters still pending waits for its average and is updated on its own, with the wrapped
optimizer's algorithm and current hyperparameters (a one-parameter optimizer of the same class
sharing the wrapped one's state), and its gradient is zeroed. So layer l computes with updated
weights while the averages of layers after it are still on the wire. Results equal a
DistributedOptimizer step on the averaged gradients.

As BytePS's: SGD, Adam and RMSprop only (their updates are per parameter; ValueError otherwise);
zero_grad() leaves gradients still being averaged alone (their update zeroes them); the last of
`num_steps` steps, synchronize() and state_dict() complete every pending update. Differences:
BytePS applies the updates from a polling thread and treats the first step() as a local one
(its broadcast_optimizer_state initialises the state by calling step()); here the updates run
in the pre-hooks on the caller's thread, and every step() averages (gradlink's
broadcast_optimizer_state needs no step). A parameter used outside its own module's forward
(weights tied into another module's computation) may be read before its update, as in BytePS.
Threads: one training thread, as for any torch optimizer.
"""

import torch

from gradlink.byteps.torch import (  # noqa: F401  (this module's names, as BytePS's)
    Compression,
    DistributedOptimizer,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    declare,
    init,
    local_rank,
    local_size,
    poll,
    push_pull,
    rank,
    shutdown,
    size,
    synchronize,
)
from gradlink.byteps.torch.ops import push_pull_async_inplace

# The optimizers whose step is a sum of independent per-parameter updates (BytePS's list).
_PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.RMSprop)


class _CrossBarrier:
    """The wrapper CrossBarrier() returns: step(), zero_grad(), synchronize(), state_dict();
    every other attribute is the wrapped optimizer's."""

    def __init__(self, model, optimizer, named_parameters, compression, num_steps):
        if not isinstance(optimizer, _PER_PARAMETER):
            raise ValueError("CrossBarrier: %s: only SGD, Adam and RMSprop are supported (their "
                             "updates are per parameter)" % type(optimizer).__name__)
        self._opt = optimizer
        self._compression = compression
        self._final_step = num_steps
        self._step = 0
        self._names = self._parameter_names(model, optimizer, named_parameters)
        self._group = {p: g for g in optimizer.param_groups for p in g["params"]}
        self._order = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._pending = {}  # parameter -> (handle, tensor sent, compression context)
        self._single = {}  # parameter -> its one-parameter optimizer
        self._hooks = []
        if size() > 1:
            for module in model.modules():
                if any(True for _ in module.parameters(recurse=False)):
                    self._hooks.append(module.register_forward_pre_hook(self._before_forward))

    @staticmethod
    def _parameter_names(model, optimizer, named_parameters):
        named = list(named_parameters) if named_parameters is not None else []
        if any(not isinstance(x, tuple) for x in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        seen, dups = set(), set()
        for n, _ in named:
            (dups if n in seen else seen).add(n)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             "duplicates: %s" % ", ".join(sorted(dups)))
        names = {p: n for n, p in (named or model.named_parameters())}
        for gi, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                names.setdefault(p, "push_pull.noname.%d.%d" % (gi, i))
        return names

    def __getattr__(self, item):
        opt = self.__dict__.get("_opt")
        if opt is None:
            raise AttributeError(item)
        return getattr(opt, item)

    def step(self, closure=None):
        """Starts averaging every gradient and returns; the updates happen as the next forward
        reaches each parameter (or at the final step, synchronize(), state_dict())."""
        if size() == 1:
            return self._opt.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()  # a parameter the last forward did not use is still pending
        with torch.no_grad():
            for i, p in enumerate(self._order):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                wire, ctx = self._compression.compress(p.grad)
                handle = push_pull_async_inplace(wire, average=True,
                                                 name="Gradient." + self._names[p],
                                                 priority=len(self._order) - i)
                self._pending[p] = (handle, wire, ctx)
        self._step += 1
        if self._step == self._final_step:
            self.synchronize()
        return loss

    def zero_grad(self, set_to_none=False):
        """Zeroes the gradients that are not being averaged (those are zeroed by their update)."""
        for group in self._opt.param_groups:
            for p in group["params"]:
                if p in self._pending or p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def synchronize(self):
        """Completes every pending update."""
        for p in list(self._pending):
            self._finish(p)

    def state_dict(self):
        self.synchronize()
        return self._opt.state_dict()

    def _before_forward(self, module, inputs):
        for p in module.parameters(recurse=False):
            if p in self._pending:
                self._finish(p)

    def _finish(self, p):
        handle, wire, ctx = self._pending.pop(p)
        synchronize(handle)
        with torch.no_grad():
            result = self._compression.decompress(wire, ctx)
            if result is not p.grad:
                p.grad.copy_(result)
            self._update(p)
            p.grad.zero_()

    def _update(self, p):
        group = self._group[p]
        single = self._single.get(p)
        if single is None:
            single = type(self._opt)([dict(group, params=[p])])
            single.state = self._opt.state  # the wrapped optimizer's state, per parameter
            self._single[p] = single
        else:
            # Hyperparameters as they are now (a scheduler may have changed the lr).
            single.param_groups[0].update((k, v) for k, v in group.items() if k != "params")
        single.step()


def CrossBarrier(model, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, num_steps=10**6):
    """Wraps `optimizer` (SGD, Adam or RMSprop over `model`'s parameters) so that each step's
    gradient averages overlap the next forward pass; `num_steps`: the step after which every
    update is complete. `backward_passes_per_step` is accepted as BytePS's: gradients
    accumulate until step() whatever its value."""
    del backward_passes_per_step
    return _CrossBarrier(model, optimizer, named_parameters, compression, num_steps)
