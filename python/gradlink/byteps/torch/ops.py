"""byteps.torch.ops on gradlink: the push_pull calls and the job's basics, under the names and
signatures BytePS scripts import them by (`from byteps.torch.ops import push_pull_async_inplace
as byteps_push_pull`, `poll`, `synchronize`, `declare`, `byteps_torch_set_num_grads`, ...).

Every sum or average is gradlink's (servers, or the same-host path; fp16/bf16 accumulated in
fp32); a name is the tensor's key on every worker (the same shape and dtype on every worker for
a name, as BytePS requires). `version` is accepted and ignored, as BytePS's CPU path ignores it;
`priority` orders the sends (higher first), as gradlink's own push_pull does.

Differences from BytePS, all where BytePS cannot be followed honestly: suspend()/resume()
(elastic training) raise InvalidArgumentError naming the alternative; a handle is an object,
not an int (only ever passed to poll() and synchronize()).
Threads: every call may be made from any thread; a handle is waited for by one thread at a time.
"""

import threading

import torch

import gradlink
from gradlink.torch import _core
from gradlink.torch._horovod import Compression


def init(lazy=True, **kwargs):
    """Joins the gradlink job. BytePS's `lazy` (start its threads at the first push_pull) is
    accepted: gradlink always joins at once. Other keyword arguments go to gradlink's init()."""
    del lazy
    return _core.init(**kwargs)


shutdown = _core.shutdown
size = _core.size
local_size = _core.local_size
rank = _core.rank
local_rank = _core.local_rank
poll = _core.poll


def suspend():
    """BytePS's elastic suspend: not provided (a lost worker fails a gradlink job)."""
    raise gradlink.InvalidArgumentError(
        "bps.suspend(): elastic training is not implemented by gradlink; a lost worker fails "
        "the job (restart from a checkpoint)")


def resume(num_workers, num_servers, global_rank=-1, context=None):
    """BytePS's elastic resume: not provided (the workers of a gradlink job are fixed)."""
    raise gradlink.InvalidArgumentError(
        "bps.resume(): elastic training is not implemented by gradlink")


def synchronize(handle):
    """Waits for a push_pull handle; returns its output (the input tensor for the in-place
    calls, a new tensor for push_pull_async)."""
    return _core.synchronize(handle)


def declare(name):
    """BytePS declares a name before its first push_pull (its keys are declaration order, so
    every worker must declare in the same order). gradlink keys a tensor by its name's hash,
    so nothing needs declaring: accepted, and returns 0 as BytePS's does."""
    if not isinstance(name, str):
        raise TypeError("declare(): name must be a str, not %s" % type(name).__name__)
    return 0


def _check(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("%s: expected a torch.Tensor, got %s" % (what, type(tensor).__name__))


def push_pull_async_inplace(tensor, average=True, name=None, version=0, priority=0):
    """Starts averaging (average=False: summing) `tensor` over all workers in place; returns a
    handle for poll()/synchronize(), which returns `tensor` holding the result."""
    _check(tensor, "push_pull_async_inplace")
    return _core.push_pull_async(tensor, average=bool(average), name=name, priority=priority)


def push_pull_inplace(tensor, average=True, name=None, version=0, priority=0):
    """push_pull_async_inplace() and synchronize(): returns `tensor`, now the average/sum."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority))


def push_pull_async(tensor, average=True, name=None, version=0, priority=0):
    """Starts averaging (average=False: summing) `tensor` over all workers into a new tensor;
    `tensor` is left alone. synchronize(handle) returns the new tensor."""
    _check(tensor, "push_pull_async")
    out = tensor.detach().clone()
    return _core.push_pull_async(out, average=bool(average), name=name, priority=priority)


class BytePSPushPull(torch.autograd.Function):
    """push_pull as an autograd function: the forward averages (sums) the input over the
    workers; the backward averages (sums) the incoming gradient the same way, under the same
    name, so every worker's input gets the gradient of the sum of the workers' losses."""

    @staticmethod
    def forward(ctx, tensor, average, name, version, priority):
        ctx.average, ctx.name, ctx.version, ctx.priority = average, name, version, priority
        return synchronize(push_pull_async(tensor, average, name, version, priority))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(push_pull_async(grad_output.contiguous(), ctx.average, ctx.name,
                                           ctx.version, ctx.priority))
        return grad, None, None, None, None


def push_pull(tensor, average=True, name=None, version=0, priority=0,
              compression=Compression.none):
    """The average (average=False: the sum) of `tensor` over all workers, as a new tensor;
    `tensor` is left alone. `name` is required (AssertionError without one, as in BytePS).
    Differentiable: a tensor that requires grad gets the push_pull of the output's gradient.
    `compression` (Compression.fp16) sends floating-point tensors as fp16."""
    if name is None:
        raise AssertionError("To manually call push_pull, you must specify a name by name=...")
    _check(tensor, "push_pull")
    wire, ctx = compression.compress(tensor)
    summed = BytePSPushPull.apply(wire, average, name, version, priority)
    return compression.decompress(summed, ctx)


class _GradCount:
    """The counter of push_pull_group_sync_inplace(): how many gradients of the current group
    (byteps_torch_set_num_grads) have been started; it wraps to 0 once the group is complete."""

    def __init__(self):
        self._mu = threading.Lock()
        self._num_grads = 1
        self._count = 0

    def set(self, num_grads):
        if int(num_grads) < 1:
            raise gradlink.InvalidArgumentError(
                "byteps_torch_set_num_grads(%r): the group needs at least one gradient"
                % (num_grads,))
        with self._mu:
            self._num_grads = int(num_grads)
            self._count = 0

    def next(self):
        with self._mu:
            self._count += 1
            count = self._count
            if self._count == self._num_grads:
                self._count = 0
            return count


_grad_count = _GradCount()


def byteps_torch_set_num_grads(num_grads_):
    """Sets how many gradients make one group for push_pull_group_sync_inplace() (BytePS's
    DistributedDataParallel sets it to the model's number of gradients); resets the count."""
    _grad_count.set(num_grads_)
    return 0


def push_pull_group_sync_inplace(tensor, average=True, name=None, version=0, priority=0):
    """push_pull_async_inplace() that also counts the group's gradients: returns (handle,
    count), count being this call's position in the group (1..num_grads); after the group's
    last gradient the count starts again at 1, so `count == num_grads` tells the caller that
    every gradient of this backward has been started."""
    handle = push_pull_async_inplace(tensor, average, name, version, priority)
    return handle, _grad_count.next()
