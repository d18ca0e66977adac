"""Autograd through horovod.torch's collectives: allreduce, grouped_allreduce, allgather,
grouped_allgather, broadcast, alltoall, reducescatter and grouped_reducescatter are
differentiable, and each one's backward is the collective Horovod defines for it:

* allreduce: the same allreduce of the gradient (op, scale factors and process set);
* allgather: the gradient averaged over the set, then this rank's rows of it;
* broadcast: the gradient averaged over the set on the root, zero elsewhere;
* alltoall: an alltoall of the gradient that sends every block back where it came from;
* reducescatter: an allgather of the gradient, times the set's size for op=Sum (and times
  the scale factors);
* the grouped forms: the grouped collective of the gradients.

A backward is itself a collective: every rank of the set must run it (call backward() on the
same outputs in the same order everywhere), as under Horovod. The synchronous calls go through
these functions only when autograd needs them (grad mode on and an input that requires grad),
so other calls are untouched.

The public calls live here, above the modules that run the collectives (_horovod, _gather,
_broadcast: each has the call without autograd as `_<name>`), which never import this one.
Threads: any (the collectives' own rules).
"""

import torch

from . import _broadcast, _context, _gather, _horovod


def wants_grad(*tensors):
    """Whether a call on `tensors` must record a backward."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _rank_in(process_set):
    """(group, this rank's position in it, its size) of a backward over `process_set`."""
    return _horovod._members(process_set, "backward")


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, compression, op, prescale, postscale, process_set):
        ctx.args = (average, op, prescale, postscale, process_set)
        return _horovod._allreduce(tensor, average, name, compression, op, prescale, postscale,
                                   process_set)

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, process_set = ctx.args
        out = _horovod._allreduce(grad.contiguous(), average, None, _horovod.Compression.none,
                                  op, prescale, postscale, process_set)
        return (out,) + (None,) * 7


def _allreduce_recorded(tensor, average, name, compression, op, prescale, postscale,
                        process_set):
    return _Allreduce.apply(tensor, average, name, compression, op, prescale, postscale,
                            process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, compression, op, prescale, postscale, process_set,
                *tensors):
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(_horovod._grouped_allreduce(list(tensors), average, name, compression, op,
                                                 prescale, postscale, process_set))

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, process_set = ctx.args
        outs = _horovod._grouped_allreduce([g.contiguous() for g in grads], average, None,
                                           _horovod.Compression.none, op, prescale, postscale,
                                           process_set)
        return (None,) * 7 + tuple(outs)


def _grouped_allreduce_recorded(tensors, average, name, compression, op, prescale, postscale,
                      process_set):
    return list(_GroupedAllreduce.apply(average, name, compression, op, prescale, postscale,
                                        process_set, *tensors))


def _my_rows(grad, firsts, pos, shape):
    """This rank's rows of an allgather's gradient, shaped as its input was."""
    start = sum(firsts[:pos])
    return grad.narrow(0, start, firsts[pos]).reshape(shape)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        out, firsts = _gather._allgather(tensor, name, process_set)
        ctx.args = (firsts, tuple(tensor.shape), process_set)
        return out

    @staticmethod
    def backward(ctx, grad):
        firsts, shape, process_set = ctx.args
        _, pos, _ = _rank_in(process_set)
        avg = _horovod._allreduce(grad.contiguous(), None, None, _horovod.Compression.none,
                                  _horovod.Average, 1.0, 1.0, process_set)
        return _my_rows(avg, firsts, pos, shape), None, None


def _allgather_recorded(tensor, name, process_set):
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        results = _gather._grouped_allgather(list(tensors), name, process_set)
        ctx.args = ([f for _, f in results], [tuple(t.shape) for t in tensors], process_set)
        return tuple(out for out, _ in results)

    @staticmethod
    def backward(ctx, *grads):
        firsts, shapes, process_set = ctx.args
        _, pos, _ = _rank_in(process_set)
        avgs = _horovod._grouped_allreduce([g.contiguous() for g in grads], None, None,
                                           _horovod.Compression.none, _horovod.Average, 1.0,
                                           1.0, process_set)
        return (None, None) + tuple(_my_rows(a, f, pos, s)
                                    for a, f, s in zip(avgs, firsts, shapes))


def _grouped_allgather_recorded(tensors, name, process_set):
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, process_set)
        return _broadcast._broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        root_rank, process_set = ctx.args
        avg = _horovod._allreduce(grad.contiguous(), None, None, _horovod.Compression.none,
                                  _horovod.Average, 1.0, 1.0, process_set)
        if _context.rank() != root_rank:
            avg.zero_()
        return avg, None, None, None


def _broadcast_recorded(tensor, root_rank, name, process_set):
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _gather._alltoall(tensor, splits, name, process_set)
        ctx.args = (received, process_set)
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *unused):
        received, process_set = ctx.args
        back, _ = _gather._alltoall(grad.contiguous(), received, None, process_set)
        return back, None, None, None


def _alltoall_recorded(tensor, splits, name, process_set):
    return _Alltoall.apply(tensor, splits, name, process_set)


def _reducescatter_grad(grads, op, prescale, postscale, process_set):
    """Horovod's backward of a reduce-scatter: each gradient gathered over the set, times the
    set's size for op=Sum, times the scale factors."""
    _, _, size = _rank_in(process_set)
    factor = (size if op == _horovod.Sum else 1) * prescale * postscale
    outs = [out for out, _ in _gather._grouped_allgather([g.contiguous() for g in grads], None,
                                                         process_set)]
    if factor != 1:
        for o in outs:
            o.mul_(factor)
    return outs


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, compression, op, process_set, prescale, postscale):
        ctx.args = (op, prescale, postscale, process_set)
        return _gather._reducescatter(tensor, name, compression, op, process_set, prescale,
                                      postscale)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return (_reducescatter_grad([grad], op, prescale, postscale, process_set)[0],
                None, None, None, None, None, None)


def _reducescatter_recorded(tensor, name, compression, op, process_set, prescale, postscale):
    return _Reducescatter.apply(tensor, name, compression, op, process_set, prescale,
                                postscale)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, compression, op, process_set, prescale, postscale, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_gather._grouped_reducescatter(list(tensors), name, compression, op,
                                                    process_set, prescale, postscale))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        return (None,) * 6 + tuple(_reducescatter_grad(list(grads), op, prescale, postscale,
                                                       process_set))


def _grouped_reducescatter_recorded(tensors, name, compression, op, process_set, prescale,
                                    postscale):
    return list(_GroupedReducescatter.apply(name, compression, op, process_set, prescale,
                                            postscale, *tensors))


# ---- The public calls: through the functions above when autograd needs them --------------


def allreduce(tensor, average=None, name=None, compression=_horovod.Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0,
              process_set=_horovod.global_process_set):
    """The allreduce of `tensor` over all workers, as a new tensor (`tensor` is left alone).
    `compression`: Compression.fp16 sends floating-point tensors as fp16. Differentiable: the
    gradient's backward is the same allreduce of the gradient."""
    if wants_grad(tensor):
        return _allreduce_recorded(tensor, average, name, compression, op, prescale_factor,
                                   postscale_factor, process_set)
    return _horovod._allreduce(tensor, average, name, compression, op, prescale_factor,
                               postscale_factor, process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=_horovod.Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=_horovod.global_process_set):
    """The allreduce of every tensor of `tensors`, as new tensors, as one group (fused).
    Differentiable: the backward is the grouped allreduce of the gradients."""
    tensors = list(tensors)
    if wants_grad(*tensors):
        return _grouped_allreduce_recorded(tensors, average, name, compression, op,
                                           prescale_factor, postscale_factor, process_set)
    return _horovod._grouped_allreduce(tensors, average, name, compression, op,
                                       prescale_factor, postscale_factor, process_set)


def allgather(tensor, name=None, process_set=_horovod.global_process_set):
    """Concatenates every rank's `tensor` along the first dimension, in rank order; first
    dimensions may differ, the rest of the shape and the dtype must agree (MismatchError).
    Differentiable: the backward averages the gradient over the set and keeps this rank's
    rows, as Horovod's."""
    if wants_grad(tensor):
        return _allgather_recorded(tensor, name, process_set)
    return _gather._allgather(tensor, name, process_set)[0]


def grouped_allgather(tensors, name=None, process_set=_horovod.global_process_set):
    """allgather() of every tensor of `tensors`, started together; differentiable."""
    tensors = list(tensors)
    if wants_grad(*tensors):
        return _grouped_allgather_recorded(tensors, name, process_set)
    return [out for out, _ in _gather._grouped_allgather(tensors, name, process_set)]


def alltoall(tensor, splits=None, name=None, process_set=_horovod.global_process_set):
    """Rank r sends rows splits[j] of `tensor` (in order, along the first dimension) to rank j
    (splits None: an even split) and receives the rows every rank sent it, concatenated in rank
    order, through the servers' all-to-all routing (each block once, from its sender to its
    receiver; a rank's own block is copied locally). Returns the received tensor; with
    `splits` (int32), (received tensor, received splits), as Horovod does. Differentiable: the
    backward sends each block of the gradient back to where it came from."""
    if wants_grad(tensor):
        return _alltoall_recorded(tensor, splits, name, process_set)
    out, received = _gather._alltoall(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def reducescatter(tensor, name=None, compression=None, op=_horovod.Average,
                  process_set=_horovod.global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    """The sum (op=Sum), average (Average, default), min, max or product of every rank's
    `tensor`, cut along the first dimension as evenly as possible (the first ranks get one row
    more): this rank's part, from the servers' reduce-scatter (each rank pulls only its rows).
    Ranks whose tensors differ in shape or dtype get MismatchError naming them. Scale factors
    as allreduce's (integers scaled in fp64). Differentiable: the backward gathers the
    gradient (times the set's size for op=Sum), as Horovod's."""
    if wants_grad(tensor):
        return _reducescatter_recorded(tensor, name, compression, op, process_set,
                                       prescale_factor, postscale_factor)
    return _gather._reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                                  postscale_factor)


def grouped_reducescatter(tensors, name=None, compression=None, op=_horovod.Average,
                          process_set=_horovod.global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter() of every tensor of `tensors`, started together; differentiable."""
    tensors = list(tensors)
    if wants_grad(*tensors):
        return _grouped_reducescatter_recorded(tensors, name, compression, op, process_set,
                                               prescale_factor, postscale_factor)
    return _gather._grouped_reducescatter(tensors, name, compression, op, process_set,
                                          prescale_factor, postscale_factor)


def broadcast(tensor, root_rank=0, name=None, process_set=None):
    """Horovod's broadcast: root_rank's `tensor` as a new tensor on every rank of
    `process_set` (every worker by default); `tensor` is left alone (broadcast_() writes it in
    place). Differentiable: the gradient is averaged over the set on the root and zero on the
    other ranks, as Horovod's."""
    if wants_grad(tensor):
        return _broadcast_recorded(tensor, root_rank, name, process_set)
    return _broadcast._broadcast(tensor, root_rank, name, process_set)
