"""horovod.torch's allgather, reducescatter and alltoall, and in-place broadcasts, on
gradlink's sums (for now: the servers' own gather, relay and routing are issue 18's next step).

Each is exact: a rank's piece lies in a buffer every other rank fills with zeros (-0.0 for
floating point, so that x + -0.0 == x bit for bit, a zero's sign included), and the sum of the
buffers is the concatenation. That moves n times the result's bytes through the servers, where
the native operations will move each byte once per receiver. Shapes travel first (an int64
table, one row per rank: dtype, number of dimensions, dimensions), so ranks whose tensors
disagree beyond the first dimension, or in dtype, raise MismatchError naming them, on every rank.
"""

import io

import torch

from gradlink import InvalidArgumentError, MismatchError

from . import _core
from ._broadcast import _WIDEN, broadcast, broadcast_async
from ._horovod import _check_process_set, _resolve_op, Average, global_process_set

_MAX_DIMS = 14
_DTYPE_CODE = {t: i for i, t in enumerate((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
    torch.bool, torch.uint8, torch.int8, torch.int16))}


def _names(name, what):
    if name is None:
        name = "%s.noname.%d" % (what, next(_core._require().noname))
    return "%s.%s" % (what, name)


def _shapes(tensor, key):
    """Every rank's (dtype code, shape), through one sum of an int64 table."""
    ctx = _core._require()
    if tensor.dim() > _MAX_DIMS:
        raise InvalidArgumentError("%s: at most %d dimensions" % (key, _MAX_DIMS))
    code = _DTYPE_CODE.get(tensor.dtype)
    if code is None:
        raise InvalidArgumentError("%s: dtype %s is not supported" % (key, tensor.dtype))
    table = torch.zeros(ctx.size, 2 + _MAX_DIMS, dtype=torch.int64)
    row = [code, tensor.dim()] + list(tensor.shape)
    table[ctx.rank, :len(row)] = torch.tensor(row, dtype=torch.int64)
    _core.push_pull(table, average=False, name=key + ".shapes")
    return [(int(r[0]), tuple(int(d) for d in r[2:2 + int(r[1])])) for r in table]


def _check_rest(shapes, key):
    """The dtype and every dimension after the first agree on all ranks, else MismatchError."""
    code0, shape0 = shapes[0]
    bad = [r for r, (c, s) in enumerate(shapes) if c != code0 or len(s) != len(shape0) or
           s[1:] != shape0[1:]]
    if bad:
        inv = {v: k for k, v in _DTYPE_CODE.items()}
        raise MismatchError("%s: every rank's tensor must have rank 0's dtype and dimensions "
                            "after the first; %s" % (key, ", ".join(
                                "rank %d has %s%s" % (r, inv[shapes[r][0]], list(shapes[r][1]))
                                for r in [0] + bad)))


def _sum_into(buf, key):
    """Sums `buf` (its dtype widened if the servers cannot sum it) in place."""
    wide = _WIDEN.get(buf.dtype)
    if wide is None:
        _core.push_pull(buf, average=False, name=key)
        return buf
    w = buf.to(wide)
    _core.push_pull(w, average=False, name=key)
    buf.copy_(w)
    return buf


def _zeros(shape, dtype):
    out = torch.empty(shape, dtype=dtype)
    return out.fill_(-0.0) if out.is_floating_point() else out.zero_()


class _Done:
    """A finished operation's handle (these run synchronously): synchronize() returns `value`."""

    def __init__(self, value):
        self.value = value

    def poll(self):
        return True

    def wait(self, timeout=None):
        return self.value


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's `tensor` along the first dimension, in rank order; first
    dimensions may differ, the rest of the shape and the dtype must agree (MismatchError)."""
    _core._check_tensor(tensor, "allgather")
    _check_process_set(process_set, "allgather")
    key = _names(name, "allgather")
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    shapes = _shapes(t, key)
    _check_rest(shapes, key)
    firsts = [s[0] for _, s in shapes]
    ctx = _core._require()
    offset = sum(firsts[:ctx.rank])
    out = _zeros((sum(firsts),) + tuple(t.shape[1:]), t.dtype)
    with torch.no_grad():
        out[offset:offset + t.shape[0]] = t
        return _sum_into(out, "%s.%s" % (key, "x".join(str(d) for d in out.shape)))


def allgather_async(tensor, name=None, process_set=global_process_set):
    return _Done(allgather(tensor, name, process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    base = _names(name, "grouped_allgather")
    return [allgather(t, "%s.%d" % (base, i), process_set) for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    return _Done(grouped_allgather(tensors, name, process_set))


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
    _check_process_set(process_set, "broadcast_")
    return broadcast(tensor, root_rank, name)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    _check_process_set(process_set, "broadcast_async_")
    return broadcast_async(tensor, root_rank, name)


def _split_sizes(n, parts):
    """Horovod's even split of n rows over `parts` ranks: the first n % parts get one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def reducescatter(tensor, name=None, compression=None, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """The sum (op=Sum) or average (Average, default) of every rank's `tensor`, cut along the
    first dimension as evenly as possible (the first ranks get one row more); this rank's part."""
    from ._horovod import allreduce  # the same sum, then this rank's rows
    _core._check_tensor(tensor, "reducescatter")
    op = _resolve_op(None, op, "reducescatter")
    key = _names(name, "reducescatter")
    t = tensor.detach()
    shapes = _shapes(t, key)
    if any(s != shapes[0] for s in shapes):
        bad = [r for r, s in enumerate(shapes) if s != shapes[0]]
        raise MismatchError("%s: every rank must reduce the same shape and dtype; rank 0 has "
                            "%s, %s" % (key, list(shapes[0][1]), ", ".join(
                                "rank %d %s" % (r, list(shapes[r][1])) for r in bad)))
    kwargs = {} if compression is None else {"compression": compression}
    total = allreduce(t, name=key + ".sum", op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, process_set=process_set, **kwargs)
    ctx = _core._require()
    sizes = _split_sizes(total.shape[0], ctx.size)
    start = sum(sizes[:ctx.rank])
    return total[start:start + sizes[ctx.rank]].clone()


def grouped_reducescatter(tensors, name=None, compression=None, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    base = _names(name, "grouped_reducescatter")
    return [reducescatter(t, "%s.%d" % (base, i), compression, op, process_set,
                          prescale_factor, postscale_factor) for i, t in enumerate(tensors)]


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rank r sends rows splits[j] of `tensor` (in order, along the first dimension) to rank j
    (splits None: an even split) and receives the rows every rank sent it, concatenated in rank
    order. Returns the received tensor; with `splits`, (received tensor, received splits), as
    Horovod does."""
    given = splits is not None
    _core._check_tensor(tensor, "alltoall")
    _check_process_set(process_set, "alltoall")
    ctx = _core._require()
    key = _names(name, "alltoall")
    t = tensor.detach()
    if splits is None:
        if t.shape[0] % ctx.size:
            raise InvalidArgumentError("alltoall: %d rows do not split evenly over %d ranks; "
                                       "give splits" % (t.shape[0], ctx.size))
        splits = [t.shape[0] // ctx.size] * ctx.size
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != ctx.size or any(s < 0 for s in splits) or sum(splits) != t.shape[0]:
        raise InvalidArgumentError("alltoall: splits %s must give %d non-negative counts that "
                                   "add up to the first dimension, %d" % (splits, ctx.size,
                                                                          t.shape[0]))
    # Every rank's splits (rows it sends to each rank), then every rank's tensor.
    matrix = allgather(torch.tensor([splits], dtype=torch.int64), key + ".splits").tolist()
    everything = allgather(t, key + ".data")
    received, got = [], []
    for src in range(ctx.size):
        base = sum(sum(matrix[r]) for r in range(src))
        start = base + sum(matrix[src][:ctx.rank])
        n = matrix[src][ctx.rank]
        received.append(everything[start:start + n])
        got.append(n)
    out = torch.cat(received).clone()
    return (out, torch.tensor(got, dtype=torch.int32)) if given else out
