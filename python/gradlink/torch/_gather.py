"""horovod.torch's allgather, reducescatter and alltoall, and in-place broadcasts, on the
servers' own collectives (gradlink/collective.h): a gather, where each rank's rows go once to
every other rank; a reduce-scatter, where each rank pulls only its rows of the reduction; an
all-to-all, where each block goes once from its sender to its receiver.

Shapes travel first (an int64 row per rank, gathered: dtype, number of dimensions, dimensions;
for alltoall the splits too), so ranks whose tensors disagree beyond the first dimension (for
a reduce-scatter: in any dimension), or in dtype, raise MismatchError naming them, on every
rank. The two steps run as one TwoStepHandle: an *_async call returns at once (the data step
starts from the completion thread once the shapes are known), so a rank may start one and go
on, as under Horovod. Routed data travels as raw bits of the same width (1-byte types widened
to 16 bits), so every dtype, complex included, arrives bit for bit.

A name still in flight on this rank is refused at once (InvalidArgumentError, a ValueError).
The synchronous calls are `_<name>` here; the public ones, differentiable, are _autograd.py's.
"""

import io
import math

import torch

from gradlink import InvalidArgumentError, MismatchError

from . import _context, _core
from ._horovod import (_GroupHandle, _members, _scaled, _set_name, Average, Compression, Max,
                       Min, Product, ReduceOp, Sum, global_process_set)

_MAX_DIMS = 14
_DTYPE_CODE = {t: i for i, t in enumerate((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.complex64, torch.complex128))}


def _names(name, what, process_set=None):
    if name is None:
        ranks = getattr(process_set, "ranks", None)
        name = "%s.noname.%d" % (what, _core._require().unnamed.next(ranks))
    return "%s.%s" % (what, name)


def _shape_row(tensor, key, extra=()):
    """This rank's int64 row: `extra` (alltoall's splits), then dtype code, number of
    dimensions and the dimensions."""
    if tensor.dim() > _MAX_DIMS:
        raise InvalidArgumentError("%s: at most %d dimensions" % (key, _MAX_DIMS))
    code = _DTYPE_CODE.get(tensor.dtype)
    if code is None:
        raise InvalidArgumentError("%s: dtype %s is not supported" % (key, tensor.dtype))
    n = len(extra)
    row = torch.zeros(n + 2 + _MAX_DIMS, dtype=torch.int64)
    row[:n + 2 + tensor.dim()] = torch.tensor(list(extra) + [code, tensor.dim()] +
                                              list(tensor.shape), dtype=torch.int64)
    return row


def _decode_shapes(table, skip=0):
    """[(dtype code, shape)] of every rank's row (after `skip` leading numbers)."""
    return [(int(r[skip]), tuple(int(d) for d in r[skip + 2:skip + 2 + int(r[skip + 1])]))
            for r in table]


def _check_rest(shapes, key, group=None, whole=False):
    """The dtype and every dimension after the first (`whole`: every dimension) agree on all
    ranks, else MismatchError (shapes in position order; `group` maps positions to ranks)."""
    code0, shape0 = shapes[0]
    start = 0 if whole else 1
    bad = [r for r, (c, s) in enumerate(shapes) if c != code0 or len(s) != len(shape0) or
           s[start:] != shape0[start:]]
    if bad:
        inv = {v: k for k, v in _DTYPE_CODE.items()}
        raise MismatchError("%s: every rank's tensor must have rank 0's dtype and %s; %s" % (
            key, "shape" if whole else "dimensions after the first", ", ".join(
                "rank %d has %s%s" % (group[r] if group else r, inv[shapes[r][0]],
                                      list(shapes[r][1]))
                for r in [0] + bad)))


def _start_rows(row, key, group=None):
    """Starts gathering every member's int64 row (the same length everywhere), stacked in rank
    order: one native allgather (over `group`, or every worker); the handle returns the table.
    The caller has claimed the operation's name (see _two_steps)."""
    m = len(group) if group else _core._require().size
    out = torch.empty(m, row.numel(), dtype=torch.int64)
    return _core.start_collective("allgather", out, row, out, key, dtype="int64",
                                  counts=[row.numel()] * m, shared_counts=True,
                                  group=group or (), claimed=True)


def _two_steps(key, what, row, group, then, wait_first):
    """Claims `key`, starts gathering `row` under "<key>.shapes" and, once every rank's row is
    known, `then(table)` (the data step, under `key`); returns the tracked TwoStepHandle."""
    _core.claim(key, what)
    first = _start_rows(row, key + ".shapes", group)
    return _core.track(key, _core.TwoStepHandle(first, then, key, wait_first))


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
                                  group=group or (), claimed=True)


def _start_allgather(tensor, name, process_set, what, wait_first, info=None):
    """Starts an allgather (see allgather_async); `info["firsts"]` gets every rank's first
    dimension once the shapes are known."""
    _core._check_tensor(tensor, what)
    group, _, _ = _members(process_set, what)
    key = _set_name(group, _names(name, "allgather", process_set))
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)

    def then(table):
        shapes = _decode_shapes(table)
        _check_rest(shapes, key, group)
        firsts = [s[0] for _, s in shapes]
        if info is not None:
            info["firsts"] = firsts
        return _start_gather(t, firsts, key, group)

    return _two_steps(key, what, _shape_row(t, key), group, then, wait_first)


def _allgather(tensor, name, process_set):
    """allgather() without autograd: (the result, every rank's first dimension)."""
    info = {}
    out = _core.synchronize(_start_allgather(tensor, name, process_set, "allgather", True, info))
    return out, info["firsts"]


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts allgather() and returns at once: the shapes are exchanged first, then the data
    goes through the servers' gather (each rank's bytes once to every other rank)."""
    return _start_allgather(tensor, name, process_set, "allgather", False)


def _grouped_allgather(tensors, name, process_set):
    """grouped_allgather() without autograd: [(result, every rank's first dimension)]."""
    base = _names(name, "grouped_allgather", process_set)
    infos = [{} for _ in tensors]
    handles = [_start_allgather(t, "%s.%d" % (base, i), process_set, "grouped_allgather", False,
                                infos[i])
               for i, t in enumerate(tensors)]
    return [(_core.synchronize(h), info["firsts"]) for h, info in zip(handles, infos)]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    base = _names(name, "grouped_allgather", process_set)
    return _GroupHandle([allgather_async(t, "%s.%d" % (base, i), process_set)
                         for i, t in enumerate(tensors)])


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj` (pickled), as a list in rank order. Unnamed, the call is named after
    the object's type, as Horovod's is: the same on every rank whatever calls came before (an
    unnamed collective that failed on some ranks only leaves the ranks' counters of unnamed
    calls apart)."""
    key = "allgather_object." + (name or type(obj).__name__)
    f = io.BytesIO()
    torch.save(obj, f)
    data = torch.frombuffer(bytearray(f.getvalue()), dtype=torch.uint8)
    sizes = _allgather(torch.tensor([data.numel()], dtype=torch.int64), key + ".sizes",
                       process_set)[0].tolist()
    flat = _allgather(data, key + ".data", process_set)[0]
    out, at = [], 0
    for n in sizes:
        out.append(torch.load(io.BytesIO(flat[at:at + n].numpy().tobytes())))
        at += n
    return out


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
                         postscale_factor, what, wait_first=False):
    _core._check_tensor(tensor, what)
    group, pos, m = _members(process_set, what)
    op = _resolve_any_op(op, what)
    key = _set_name(group, _names(name, "reducescatter", process_set))
    t = tensor.detach()
    if t.dim() == 0:
        raise InvalidArgumentError("%s: a 0-d tensor cannot be scattered" % what)
    compression = compression or Compression.none
    with torch.no_grad():
        wire, cctx = compression.compress(t.contiguous())
        if prescale_factor != 1.0:
            wire = _scaled(wire, prescale_factor)  # a copy: the input is only read
        sizes = _split_sizes(t.shape[0], m)
        row = math.prod(t.shape[1:])
        out = torch.empty((sizes[pos],) + tuple(t.shape[1:]), dtype=wire.dtype)

    def finish():
        result = compression.decompress(out, cctx)
        if postscale_factor != 1.0:
            result = _scaled(result, postscale_factor)
        handle.tensor = result

    def then(table):
        # Every rank's whole shape and dtype must be this one's (Horovod's check): the split
        # alone cannot tell [17, 1311] from [17, 23, 57].
        _check_rest(_decode_shapes(table), key, group, whole=True)
        return start()

    def start():
        nonlocal handle
        handle = _core.start_collective("reduce_scatter", out, wire, out, key, op=_OPS[op],
                                        counts=[n * row for n in sizes],
                                        average=op == Average, finish=finish,
                                        group=group or (), claimed=True)
        return handle

    handle = None
    return _two_steps(key, what, _shape_row(t, key), group, then, wait_first)


def _reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                   postscale_factor):
    """reducescatter() without autograd."""
    return _core.synchronize(_start_reducescatter(tensor, name, compression, op, process_set,
                                                  prescale_factor, postscale_factor,
                                                  "reducescatter", True))


def reducescatter_async(tensor, name=None, compression=None, op=Average,
                        process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    return _start_reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                                postscale_factor, "reducescatter")


def _grouped_reducescatter(tensors, name, compression, op, process_set, prescale_factor,
                           postscale_factor):
    """grouped_reducescatter() without autograd."""
    return _core.synchronize(grouped_reducescatter_async(
        tensors, name, compression, op, process_set, prescale_factor, postscale_factor))


def grouped_reducescatter_async(tensors, name=None, compression=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    base = _names(name, "grouped_reducescatter", process_set)
    return _GroupHandle([_start_reducescatter(t, "%s.%d" % (base, i), compression, op,
                                              process_set, prescale_factor, postscale_factor,
                                              "grouped_reducescatter")
                         for i, t in enumerate(tensors)])


def _start_alltoall(tensor, splits, name, process_set, wait_first):
    """Starts an alltoall (see alltoall()); the handle returns (received tensor, received
    splits)."""
    _core._check_tensor(tensor, "alltoall")
    group, pos, m = _members(process_set, "alltoall")
    key = _set_name(group, _names(name, "alltoall", process_set))
    t = tensor.detach()
    if t.dim() == 0:
        raise InvalidArgumentError("alltoall: a 0-d tensor cannot be split")
    if splits is None:
        if t.shape[0] % m:
            raise InvalidArgumentError("alltoall: %d rows do not split evenly over %d ranks; "
                                       "give splits" % (t.shape[0], m))
        splits = [t.shape[0] // m] * m
    elif isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            # Horovod takes 32-bit integer splits (64-bit ones are converted) and refuses others.
            raise InvalidArgumentError("alltoall: splits must be an int32 tensor, not %s"
                                       % splits.dtype)
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != m or any(s < 0 for s in splits) or sum(splits) != t.shape[0]:
        raise InvalidArgumentError("alltoall: splits %s must give %d non-negative counts that "
                                   "add up to the first dimension, %d" % (splits, m,
                                                                          t.shape[0]))
    # Every rank's splits and shape in one gather of int64 rows; the rest of the shape and the
    # dtype must agree.
    if _DTYPE_CODE.get(t.dtype) is None or t.dim() > _MAX_DIMS:
        raise InvalidArgumentError("alltoall: dtype %s with %d dimensions is not supported"
                                   % (t.dtype, t.dim()))

    def then(table):
        matrix = [[int(x) for x in r[:m]] for r in table]
        _check_rest(_decode_shapes(table, m), key, group)
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
            handle.tensor = (out, received)

        handle = _core.start_collective("alltoall", out, inp, outp, key, dtype=dtype,
                                        counts=counts, shared_counts=True, finish=finish,
                                        group=group or (), claimed=True)
        return handle

    return _two_steps(key, "alltoall", _shape_row(t, key, splits), group, then, wait_first)


class _FirstOf:
    """alltoall_async() without splits: synchronize() returns the received tensor only."""

    def __init__(self, inner):
        self._inner = inner
        self.name = inner.name

    def poll(self):
        return self._inner.poll()

    def wait(self, timeout=None):
        return self._inner.wait(timeout)[0]

    def timing(self):
        return self._inner.timing()


def _alltoall(tensor, splits, name, process_set):
    """alltoall() without autograd: (received tensor, received splits)."""
    return _core.synchronize(_start_alltoall(tensor, splits, name, process_set, True))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    handle = _start_alltoall(tensor, splits, name, process_set, False)
    return handle if splits is not None else _FirstOf(handle)


class _SparseHandle:
    """sparse_allreduce_async()'s handle: calling it (Horovod's form) or synchronize() returns
    the coalesced sum or average."""

    def __init__(self, handles, shape, average_over, key):
        self._handles = handles  # the dense shapes, the indices, the values
        self._shape = shape
        self._over = average_over
        self._key = key
        self._result = None
        self.name = key

    def poll(self):
        return self._result is not None or all(h.poll() for h in self._handles)

    def wait(self, timeout=None):
        if self._result is None:
            try:
                shapes, indices, values = (_core.synchronize(h, timeout) for h in self._handles)
            finally:
                if self.poll():  # done or failed, not timed out: the name is free
                    _context.release(self, self._key)
            if any(list(map(int, r)) != list(self._shape) for r in shapes):
                raise MismatchError("%s: every rank's sparse tensor must have the shape %s; %s"
                                    % (self._key, list(self._shape),
                                       [list(map(int, r)) for r in shapes]))
            out = torch.sparse_coo_tensor(indices.t(), values, self._shape).coalesce()
            self._result = out / self._over if self._over else out
        return self._result

    __call__ = wait


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Horovod's sparse allreduce: every rank's sparse COO tensor (the same dense shape) summed
    (op=Sum) or averaged (Average), through an allgather of the indices and the values, as
    Horovod does it; the result is coalesced. Returns at once; the handle, called (as
    Horovod's) or passed to synchronize(), returns the result."""
    op = ReduceOp(op)
    if op not in (Sum, Average):
        raise InvalidArgumentError("sparse_allreduce_async: op=%s (Sum or Average)" % op.name)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise InvalidArgumentError("sparse_allreduce_async: expected a sparse COO tensor")
    group, _, m = _members(process_set, "sparse_allreduce_async")
    key = _set_name(group, _names(name, "sparse_allreduce", process_set))
    _core.claim(key, "sparse_allreduce_async")
    t = tensor.detach().coalesce()
    dense = torch.tensor([list(t.shape)], dtype=torch.int64)  # one row per rank
    handles = [allgather_async(dense, key + ".shape", process_set),
               allgather_async(t.indices().t().contiguous(), key + ".indices", process_set),
               allgather_async(t.values(), key + ".values", process_set)]
    rows = _SparseHandle(handles, t.shape, m if op == Average else 0, key)
    return _core.track(key, rows)
