"""Broadcasts through the servers' relay: the root pushes its tensor once, every other worker
receives it (gradlink/collective.h), bit for bit in every dtype (routed as raw bits).

Horovod's forms: broadcast() returns a new tensor and leaves its argument alone (here
_broadcast(); the public one, differentiable, is _autograd.py's); broadcast_() writes in
place; both take a process set. Also broadcast_parameters(), broadcast_object() and
broadcast_optimizer_state()."""

import collections
import io

import torch

from gradlink import InvalidArgumentError

from . import _core


def _start(tensor, root_rank, name, priority=0, group=None, what="broadcast"):
    """Starts overwriting `tensor` in place on every worker (of `group`, the ranks of a process
    set) with root_rank's values under the key "broadcast.<name>"; returns a handle for
    synchronize(). The key is declared with the tensor's own dtype where the servers know it,
    so ranks whose dtypes disagree get MismatchError (the bytes are routed raw either way)."""
    _core._check_tensor(tensor, what)
    ctx = _core._require()
    if not 0 <= root_rank < ctx.size or (group and root_rank not in group):
        raise InvalidArgumentError("%s: root_rank %d out of range for %s" % (
            what, root_rank, "ranks %s" % list(group) if group else "%d workers" % ctx.size))
    if name is None:
        name = "noname.%d" % ctx.unnamed.next(group)
    name = "broadcast." + name
    with torch.no_grad():
        t = tensor.detach()
        src = t if t.is_contiguous() else t.contiguous()
        buf, dtype, per, narrow = _core.raw_view(src)
        if per == 1 and narrow is None:
            dtype = _core.DTYPES.get(src.dtype, dtype)
        finish = []
        if narrow is not None:
            finish.append(narrow)
        if src is not t:
            finish.append(lambda: t.copy_(src))

        def done():
            for f in finish:
                f()

        return _core.start_collective("broadcast", tensor, buf, buf, name, dtype=dtype,
                                      root=group.index(root_rank) if group else root_rank,
                                      priority=priority, finish=done if finish else None,
                                      group=group or ())


def _group_of(process_set, root_rank, what):
    """The ranks of `process_set` (None: every worker) and the key prefix for `name`."""
    from ._horovod import _members  # (_horovod does not import this module)
    group, _, _ = _members(process_set, what)
    if group is not None and root_rank not in group:
        raise InvalidArgumentError("%s: root_rank %d is not in %r" % (what, root_rank,
                                                                     process_set))
    return group


def _set_key(group, name):
    from ._horovod import _set_name
    if group is None:
        return name
    return _set_name(group, name if name is not None else "noname.%d" % _core._require(
        ).unnamed.next(group))


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """Starts overwriting `tensor` in place on every rank of `process_set` (every worker by
    default) with root_rank's values; synchronize(handle) returns `tensor`. Ranks whose
    shapes, dtypes or roots disagree get MismatchError; a name still in flight on this rank is
    refused (InvalidArgumentError, a ValueError)."""
    group = _group_of(process_set, root_rank, "broadcast_")
    return _start(tensor, root_rank, _set_key(group, name), group=group, what="broadcast_")


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Horovod's in-place broadcast: `tensor` becomes root_rank's on every rank; returns it."""
    return _core.synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank=0, name=None, process_set=None):
    """Starts broadcasting root_rank's `tensor` into a new tensor on every rank of
    `process_set`; `tensor` is left alone. synchronize(handle) returns the new tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("broadcast: expected a torch.Tensor, got %s" % type(tensor).__name__)
    group = _group_of(process_set, root_rank, "broadcast")
    out = tensor.detach().clone()
    return _start(out, root_rank, _set_key(group, name), group=group)


def _broadcast(tensor, root_rank, name, process_set):
    """broadcast() without autograd."""
    return _core.synchronize(broadcast_async(tensor, root_rank, name, process_set))


def _named_tensors(params):
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    if isinstance(params, collections.abc.Mapping):
        items = list(params.items())
    else:
        items = list(params)
        # Plain tensors (model.parameters(), as Horovod takes them) are named by position: every
        # worker must pass them in the same order.
        items = [("%d" % i, item) if isinstance(item, torch.Tensor) else item
                 for i, item in enumerate(items)]
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise InvalidArgumentError(
                    "broadcast_parameters: expected a state_dict, a module, tensors "
                    "(model.parameters()) or (name, tensor) pairs such as "
                    "model.named_parameters()")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise InvalidArgumentError("broadcast_parameters: names are not unique")
    return items


def broadcast_parameters(params, root_rank=0, prefix="parameters"):
    """Makes every worker's tensors equal to root_rank's, in place.

    `params`: a state_dict (model.state_dict(): parameters and buffers), a module, (name,
    tensor) pairs (model.named_parameters()), or tensors (model.parameters(), named by their
    position: the same order on every worker). Keys are "broadcast.<prefix>.<name>": use another
    `prefix` for a second model whose parameter names collide with different shapes."""
    handles = []
    items = _named_tensors(params)
    for i, (name, t) in enumerate(items):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError("broadcast_parameters: '%s' is a %s, not a tensor"
                                       % (name, type(t).__name__))
        # The first tensors (the first layers) go first.
        handles.append(_start(t, root_rank, "%s.%s" % (prefix, name), priority=len(items) - i,
                              what="broadcast_parameters"))
    for h in handles:
        _core.synchronize(h)


def broadcast_object(obj, root_rank=0, name="object", process_set=None):
    """Returns root_rank's `obj` on every worker (of `process_set`, Horovod's; every worker by
    default), serialized with torch.save, so tensors inside are fine; other workers' `obj` is
    ignored. Two broadcasts through the servers: the size, then the bytes as int64 words."""
    from ._horovod import _members, _set_name  # (_horovod does not import this module)
    ctx = _core._require()
    group, _, _ = _members(process_set, "broadcast_object")
    name = _set_name(group, "object" if name is None else name)

    def broadcast(t, root, key):
        return _core.synchronize(_start(t, root, key, group=group, what="broadcast_object"))

    if ctx.rank == root_rank:
        f = io.BytesIO()
        torch.save(obj, f)
        data = f.getvalue()
        size = torch.tensor([len(data)], dtype=torch.int64)
    else:
        data = None
        size = torch.zeros(1, dtype=torch.int64)
    broadcast(size, root_rank, "object.%s.size" % name)
    n = int(size.item())
    words = (n + 7) // 8
    buf = torch.zeros(words * 8, dtype=torch.uint8)
    if data is not None:
        buf[:n] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    broadcast(buf.view(torch.int64), root_rank, "object.%s.%d" % (name, words))
    if ctx.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(buf[:n].numpy().tobytes()), map_location="cpu")


def broadcast_optimizer_state(optimizer, root_rank=0, model=None):
    """Makes every worker's optimizer state (per-parameter state such as momentum buffers and
    Adam moments, and the param_groups' hyperparameters such as lr) equal to root_rank's.

    The root's optimizer.state_dict() travels through the servers (broadcast_object) and the
    other workers load it, so it works even when only the root has taken a step (e.g. after
    loading a checkpoint on rank 0). `model` (Horovod's, to find sparse parameters) is not
    needed: the whole state travels, sparse or dense.

    As under Horovod, an optimizer that has no state yet is left with a gradient (zeros) on
    every parameter that requires one and has none, so that code written for Horovod finds
    p.grad set; parameters that require no gradient keep none. (Horovod also takes an
    optimizer step on those zeros to create the state; gradlink does not need to, and that
    step would move the parameters by their weight decay.)"""
    if not optimizer.state:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
    state = optimizer.state_dict() if _core.rank() == root_rank else None
    state = broadcast_object(state, root_rank, name="optimizer_state")
    if _core.rank() != root_rank:
        optimizer.load_state_dict(state)
