"""horovod.torch's allgather, reducescatter and alltoall, and in-place broadcasts, on the
servers' own collectives (gradlink/collective.h): a gather, where each rank's rows go once to
every other rank; a reduce-scatter, where each rank pulls only its rows of the reduction; an
all-to-all, where each block goes once from its sender to its receiver.

Shapes travel first (an int64 row per rank, gathered: dtype, number of dimensions, dimensions;
for alltoall the splits too), so ranks whose tensors disagree beyond the first dimension, or in
dtype, raise MismatchError naming them, on every rank. A reduce-scatter needs no such step: its
split is part of the key's declaration, which the scheduler compares across ranks. Routed data
travels as raw bits of the same width (1-byte types widened to 16 bits), so every dtype,
complex included, arrives bit for bit.
"""

import io
import math

import torch

from gradlink import InvalidArgumentError, MismatchError

from . import _core
from ._broadcast import broadcast, broadcast_async
from ._horovod import (_GroupHandle, _members, _set_name, Average, Compression, Max, Min,
                       Product, ReduceOp, Sum, global_process_set)

_MAX_DIMS = 14
_DTYPE_CODE = {t: i for i, t in enumerate((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.complex64, torch.complex128))}


def _names(name, what):
    if name is None:
        name = "%s.noname.%d" % (what, next(_core._require().noname))
    return "%s.%s" % (what, name)


def _shapes(tensor, key, group=None):
    """Every rank's (dtype code, shape), through one sum of an int64 table."""
    ctx = _core._require()
    if tensor.dim() > _MAX_DIMS:
        raise InvalidArgumentError("%s: at most %d dimensions" % (key, _MAX_DIMS))
    code = _DTYPE_CODE.get(tensor.dtype)
    if code is None:
        raise InvalidArgumentError("%s: dtype %s is not supported" % (key, tensor.dtype))
    row = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    row[:2 + tensor.dim()] = torch.tensor([code, tensor.dim()] + list(tensor.shape),
                                          dtype=torch.int64)
    table = _gather_rows(row, key + ".shapes", group)
    return [(int(r[0]), tuple(int(d) for d in r[2:2 + int(r[1])])) for r in table]


def _check_rest(shapes, key, group=None):
    """The dtype and every dimension after the first agree on all ranks, else MismatchError
    (shapes in position order; `group` maps positions to ranks)."""
    code0, shape0 = shapes[0]
    bad = [r for r, (c, s) in enumerate(shapes) if c != code0 or len(s) != len(shape0) or
           s[1:] != shape0[1:]]
    if bad:
        inv = {v: k for k, v in _DTYPE_CODE.items()}
        raise MismatchError("%s: every rank's tensor must have rank 0's dtype and dimensions "
                            "after the first; %s" % (key, ", ".join(
                                "rank %d has %s%s" % (group[r] if group else r, inv[shapes[r][0]],
                                                      list(shapes[r][1]))
                                for r in [0] + bad)))


def _gather_rows(rows, key, group=None):
    """Every member's int64 row (the same length everywhere), stacked in rank order: one native
    allgather (over `group`, or every worker)."""
    m = len(group) if group else _core._require().size
    out = torch.empty(m, rows.numel(), dtype=torch.int64)
    _core.synchronize(_core.start_collective(
        "allgather", out, rows, out, key, dtype="int64", counts=[rows.numel()] * m,
        shared_counts=True, group=group or ()))
    return out


def _start_gather(t, firsts, key, group=None):
    """Starts the native allgather of `t` (this rank's rows) given every rank's first
    dimension; the handle's synchronize() returns the concatenation."""
    src = t.contiguous()
    out = torch.empty((sum(firsts),) + tuple(t.shape[1:]), dtype=t.dtype)
    inp, dtype, per, _ = _core.raw_view(src)
    outp, _, _, finish = _core.raw_view(out)
    counts = [f * per * math.prod(t.shape[1:]) for f in firsts]
    return _core.start_collective("allgather", out, inp, outp, key, dtype=dtype,
                                  counts=counts, shared_counts=True, finish=finish,
                                  group=group or ())


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's `tensor` along the first dimension, in rank order; first
    dimensions may differ, the rest of the shape and the dtype must agree (MismatchError)."""
    return _core.synchronize(allgather_async(tensor, name, process_set))


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts allgather(); the shapes are exchanged first (synchronously), the data then goes
    through the servers' gather: each rank's bytes once to every other rank."""
    _core._check_tensor(tensor, "allgather")
    group, _, _ = _members(process_set, "allgather")
    key = _set_name(group, _names(name, "allgather"))
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    shapes = _shapes(t, key, group)
    _check_rest(shapes, key, group)
    return _start_gather(t, [s[0] for _, s in shapes], key, group)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return _core.synchronize(grouped_allgather_async(tensors, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    base = _names(name, "grouped_allgather")
    return _GroupHandle([allgather_async(t, "%s.%d" % (base, i), process_set)
                         for i, t in enumerate(tensors)])


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj` (pickled), as a list in rank order."""
    key = name or "allgather_object.noname.%d" % next(_core._require().noname)
    f = io.BytesIO()
    torch.save(obj, f)
    data = torch.frombuffer(bytearray(f.getvalue()), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), key + ".sizes",
                      process_set).tolist()
    flat = allgather(data, key + ".data", process_set)
    out, at = [], 0
    for n in sizes:
        out.append(torch.load(io.BytesIO(flat[at:at + n].numpy().tobytes())))
        at += n
    return out


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Horovod's in-place broadcast: `tensor` becomes root_rank's on every rank; returns it.
    (gradlink's broadcast is in place too.)"""
    return _core.synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    group, _, _ = _members(process_set, "broadcast_")
    if group is None:
        return broadcast_async(tensor, root_rank, name)
    if root_rank not in group:
        raise InvalidArgumentError("broadcast_: root_rank %d is not in %r" % (root_rank,
                                                                            process_set))
    return broadcast_async(tensor, root_rank, _set_name(group, name or "noname.%d" % next(
        _core._require().noname)), group=group)


def _split_sizes(n, parts):
    """Horovod's even split of n rows over `parts` ranks: the first n % parts get one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


_OPS = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "product"}


def _resolve_any_op(op, what):
    op = ReduceOp(op)
    if op not in _OPS:
        raise InvalidArgumentError("%s: op=%s is not implemented by gradlink (Adasum is not)"
                                   % (what, op.name))
    return op


def _start_reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                         postscale_factor, what):
    _core._check_tensor(tensor, what)
    group, pos, m = _members(process_set, what)
    op = _resolve_any_op(op, what)
    key = _set_name(group, _names(name, "reducescatter"))
    t = tensor.detach()
    if t.dim() == 0:
        raise InvalidArgumentError("%s: a 0-d tensor cannot be scattered" % what)
    compression = compression or Compression.none
    with torch.no_grad():
        wire, cctx = compression.compress(t.contiguous())
        if prescale_factor != 1.0:
            wire = wire * prescale_factor  # a copy: the input is only read
        sizes = _split_sizes(t.shape[0], m)
        row = math.prod(t.shape[1:])
        out = torch.empty((sizes[pos],) + tuple(t.shape[1:]), dtype=wire.dtype)

    def finish():
        result = compression.decompress(out, cctx)
        if postscale_factor != 1.0:
            result = result * postscale_factor
        handle.tensor = result

    handle = _core.start_collective("reduce_scatter", out, wire, out, key, op=_OPS[op],
                                    counts=[n * row for n in sizes], average=op == Average,
                                    finish=finish, group=group or ())
    return handle


def reducescatter(tensor, name=None, compression=None, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """The sum (op=Sum), average (Average, default), min, max or product of every rank's
    `tensor`, cut along the first dimension as evenly as possible (the first ranks get one row
    more): this rank's part, from the servers' reduce-scatter (each rank pulls only its rows).
    Ranks whose tensors differ in shape or dtype get MismatchError naming them."""
    return _core.synchronize(reducescatter_async(tensor, name, compression, op, process_set,
                                                 prescale_factor, postscale_factor))


def reducescatter_async(tensor, name=None, compression=None, op=Average,
                        process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    return _start_reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                                postscale_factor, "reducescatter")


def grouped_reducescatter(tensors, name=None, compression=None, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    return _core.synchronize(grouped_reducescatter_async(
        tensors, name, compression, op, process_set, prescale_factor, postscale_factor))


def grouped_reducescatter_async(tensors, name=None, compression=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    base = _names(name, "grouped_reducescatter")
    return _GroupHandle([_start_reducescatter(t, "%s.%d" % (base, i), compression, op,
                                              process_set, prescale_factor, postscale_factor,
                                              "grouped_reducescatter")
                         for i, t in enumerate(tensors)])


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rank r sends rows splits[j] of `tensor` (in order, along the first dimension) to rank j
    (splits None: an even split) and receives the rows every rank sent it, concatenated in rank
    order, through the servers' all-to-all routing (each block once, from its sender to its
    receiver; a rank's own block is copied locally). Returns the received tensor; with
    `splits`, (received tensor, received splits), as Horovod does."""
    return _core.synchronize(alltoall_async(tensor, splits, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    given = splits is not None
    _core._check_tensor(tensor, "alltoall")
    group, pos, m = _members(process_set, "alltoall")
    key = _set_name(group, _names(name, "alltoall"))
    t = tensor.detach()
    if t.dim() == 0:
        raise InvalidArgumentError("alltoall: a 0-d tensor cannot be split")
    if splits is None:
        if t.shape[0] % m:
            raise InvalidArgumentError("alltoall: %d rows do not split evenly over %d ranks; "
                                       "give splits" % (t.shape[0], m))
        splits = [t.shape[0] // m] * m
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != m or any(s < 0 for s in splits) or sum(splits) != t.shape[0]:
        raise InvalidArgumentError("alltoall: splits %s must give %d non-negative counts that "
                                   "add up to the first dimension, %d" % (splits, m,
                                                                          t.shape[0]))
    # Every rank's splits and shape in one gather of int64 rows; the rest of the shape and the
    # dtype must agree.
    code = _DTYPE_CODE.get(t.dtype)
    if code is None or t.dim() > _MAX_DIMS:
        raise InvalidArgumentError("alltoall: dtype %s with %d dimensions is not supported"
                                   % (t.dtype, t.dim()))
    row = torch.zeros(m + 2 + _MAX_DIMS, dtype=torch.int64)
    row[:m] = torch.tensor(splits, dtype=torch.int64)
    row[m:m + 2 + t.dim()] = torch.tensor([code, t.dim()] + list(t.shape),
                                                        dtype=torch.int64)
    table = _gather_rows(row, key + ".splits", group)
    matrix = [[int(x) for x in r[:m]] for r in table]
    _check_rest([(int(r[m]), tuple(int(d) for d in r[m + 2:m + 2 +
                                                               int(r[m + 1])]))
                 for r in table], key, group)
    src = t.contiguous()
    got = [matrix[i][pos] for i in range(m)]
    out = torch.empty((sum(got),) + tuple(t.shape[1:]), dtype=t.dtype)
    inp, dtype, per, _ = _core.raw_view(src)
    outp, _, _, narrow = _core.raw_view(out)
    elems = per * math.prod(t.shape[1:])
    counts = [matrix[i][j] * elems for i in range(m) for j in range(m)]
    received = torch.tensor(got, dtype=torch.int32)

    def finish():
        if narrow is not None:
            narrow()
        if given:
            handle.tensor = (out, received)

    handle = _core.start_collective("alltoall", out, inp, outp, key, dtype=dtype, counts=counts,
                                    shared_counts=True, finish=finish, group=group or ())
    return handle


class _Done:
    """A finished operation's handle: synchronize() returns `value`."""

    def __init__(self, value):
        self.value = value

    def poll(self):
        return True

    def wait(self, timeout=None):
        return self.value


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Horovod's sparse allreduce: every rank's sparse COO tensor (the same dense shape) summed
    (op=Sum) or averaged (Average), through an allgather of the indices and the values, as
    Horovod does it; the result is coalesced. Runs when called; synchronize(handle) returns it."""
    op = ReduceOp(op)
    if op not in (Sum, Average):
        raise InvalidArgumentError("sparse_allreduce_async: op=%s (Sum or Average)" % op.name)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise InvalidArgumentError("sparse_allreduce_async: expected a sparse COO tensor")
    group, _, m = _members(process_set, "sparse_allreduce_async")
    key = _set_name(group, _names(name, "sparse_allreduce"))
    t = tensor.coalesce()
    dense = torch.tensor(list(t.shape), dtype=torch.int64)
    shapes = _gather_rows(dense, key + ".shape", group)
    if any(list(map(int, r)) != list(t.shape) for r in shapes):
        raise MismatchError("%s: every rank's sparse tensor must have the shape %s; %s" % (
            key, list(t.shape), [list(map(int, r)) for r in shapes]))
    indices = allgather(t.indices().t().contiguous(), key + ".indices", process_set)
    values = allgather(t.values(), key + ".values", process_set)
    out = torch.sparse_coo_tensor(indices.t(), values, t.shape).coalesce()
    if op == Average:
        out = out / m
    return _Done(out)
