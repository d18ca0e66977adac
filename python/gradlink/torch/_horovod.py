"""horovod.torch's allreduce family, reduce ops and compression, on gradlink's push_pull.

Semantics as Horovod 0.28 documents them: `allreduce*` return a new tensor and leave the input
alone, `allreduce_*` work in place; `average` and `op` are exclusive (op defaults to Average);
prescale_factor multiplies each rank's input before the sum, postscale_factor the result after
it (and after the average). Sums and averages run on the servers (fp16/bf16 accumulated in fp32,
bit-reproducible); Min, Max and Product are the servers' own reductions (gradlink/collective.h);
Adasum raises InvalidArgumentError naming it. Process sets (add_process_set) run over their
members on the servers. Scale factors multiply as Horovod's do (integers in fp64, truncated
back; 16-bit floats in fp32). The synchronous allreduce and grouped_allreduce are
_allreduce and _grouped_allreduce here; the public ones, differentiable, are _autograd.py's.
"""

import enum

import torch

from gradlink import InvalidArgumentError

from . import _core


class ReduceOp(enum.IntEnum):
    """horovod.torch's reduce ops (hvd.Average, hvd.Sum, ...)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product


class ProcessSet:
    """A set of ranks a collective runs over (Horovod's process sets). Make one with a list of
    ranks and register it with add_process_set() (every rank may; only members run its
    collectives); `global_process_set` is every worker. Collectives of a set run on the
    servers over its members only: splits, averages and roots are the set's."""

    def __init__(self, ranks=None):
        self.ranks = None if ranks is None else sorted(set(int(r) for r in ranks))
        self.process_set_id = 0 if ranks is None else None

    def included(self):
        return True if self.ranks is None else _core.rank() in self.ranks

    def size(self):
        return _core.size() if self.ranks is None else len(self.ranks)

    def rank(self):
        return _core.rank() if self.ranks is None else self.ranks.index(_core.rank())

    def __repr__(self):
        return "ProcessSet(global)" if self.ranks is None else "ProcessSet(%s)" % self.ranks


global_process_set = ProcessSet()
_next_set_id = [1]


def add_process_set(process_set):
    """Registers a ProcessSet (or a list of ranks) and returns it, with its process_set_id."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None or ps.process_set_id is not None:
        raise ValueError("add_process_set: %r is registered already" % ps)
    n = _core.size()
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= n:
        raise InvalidArgumentError("add_process_set: ranks %s must be non-empty and in [0, %d)"
                                   % (ps.ranks, n))
    ps.process_set_id = _next_set_id[0]
    _next_set_id[0] += 1
    return ps


def remove_process_set(process_set):
    """Unregisters a process set; True if it was registered (the global one cannot be)."""
    if process_set is global_process_set or process_set.ranks is None:
        raise InvalidArgumentError("remove_process_set: global_process_set cannot be removed")
    was = process_set.process_set_id is not None
    process_set.process_set_id = None
    return was


def _members(process_set, what):
    """(group, this rank's position, size) of a collective over `process_set`: group None for
    every worker; InvalidArgumentError for a set not registered or not holding this rank."""
    if process_set is None or process_set is global_process_set or process_set.ranks is None:
        return None, _core.rank(), _core.size()
    if process_set.process_set_id is None:
        raise InvalidArgumentError("%s: %r is not registered (add_process_set)" % (what, process_set))
    if _core.rank() not in process_set.ranks:
        raise InvalidArgumentError("%s: rank %d is not in %r" % (what, _core.rank(), process_set))
    return process_set.ranks, process_set.ranks.index(_core.rank()), len(process_set.ranks)


def barrier(process_set=global_process_set, timeout=None):
    """Blocks until every rank of `process_set` (every worker by default) has entered the
    barrier. gradlink's barrier(timeout) is kept: a number as the first argument is the
    timeout in seconds."""
    if isinstance(process_set, (int, float)) and not isinstance(process_set, bool):
        process_set, timeout = global_process_set, process_set
    group, _, _ = _members(process_set, "barrier")
    if group is None:
        return _core.barrier(timeout)
    token = torch.zeros(1, dtype=torch.int32)  # one key per set, a round per barrier
    h = _core.start_collective("allreduce", token, token, token, _set_name(group, "barrier"),
                               group=group)
    _core.synchronize(h, timeout)


def join(device=-1):
    """Horovod's join: this rank has run out of data. The others' allreduces go on without
    it (it contributes nothing, as Horovod's zeros; Average divides by the ranks that
    contributed) until every rank has joined; returns the rank that joined last. `device` is
    accepted for Horovod's signature (tensors here are on the CPU). Differences from Horovod:
    allgather, broadcast, alltoall, reducescatter, Min/Max/Product and process-set
    collectives raise InvalidArgumentError while a rank has joined. Where hosts sum first, a
    joined rank keeps pushing its share of its host's partial sums until the release."""
    del device
    return _core.join()


def _set_name(group, name):
    """Keys of a process set are its own: the same tensor name in two sets never meets."""
    return name if group is None else "ps[%s].%s" % (",".join(str(r) for r in group), name)


class Compressor:
    """horovod.torch.Compression's interface: compress(tensor) -> (tensor, ctx) before the
    allreduce, decompress(tensor, ctx) after it."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as fp16 (half the bytes); the servers accumulate them in
    fp32 and round once; the result is cast back to the tensor's dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """hvd.Compression.none / hvd.Compression.fp16."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _resolve_op(average, op, what):
    if average is not None and op is not None:
        raise ValueError("%s: the op parameter supersedes average; give only one" % what)
    if op is None:
        op = Average if average is None or average else Sum
    op = ReduceOp(op)
    if op == Adasum:
        raise InvalidArgumentError(
            "%s: op=Adasum is not implemented by gradlink (Sum, Average, Min, Max and Product "
            "are)" % what)
    return op


# The servers' reductions other than the sum (gradlink/collective.h).
_NATIVE_OPS = {ReduceOp.Min: "min", ReduceOp.Max: "max", ReduceOp.Product: "product"}


# Where Horovod scales: integers in fp64 (then truncated back), 16-bit floats in fp32, the
# others in their own type; the factor rounded to that type first.
_HALF = (torch.float16, torch.bfloat16)


def _scale(tensor, factor):
    """Multiplies `tensor` by `factor` in place, as Horovod's prescale/postscale do."""
    if factor == 1.0:
        return
    dtype = tensor.dtype
    math = (torch.float32 if dtype in _HALF else
            dtype if dtype.is_floating_point or dtype.is_complex else torch.float64)
    f = torch.tensor(float(factor), dtype=torch.float64).to(math)
    if math == dtype:
        tensor.mul_(f)
    else:
        tensor.copy_(tensor.to(math) * f)


def _scaled(tensor, factor):
    """`tensor` times `factor` as a new tensor (as _scale())."""
    out = tensor.clone()
    _scale(out, factor)
    return out


def _write_back(out, wire, cctx, compression, postscale_factor):
    """After the sum: `wire` decompressed into `out` (unless it is `out`), postscaled."""
    result = compression.decompress(wire, cctx)
    if result.data_ptr() != out.data_ptr():
        out.detach().copy_(result)
    _scale(out.detach(), postscale_factor)
    return out


class _AllreduceHandle:
    """An allreduce in flight: the push_pull's handle, then the postscale and the copy-out
    (out-of-place and compressed variants)."""

    def __init__(self, inner, result, finish, name):
        self._inner, self._result, self._finish, self.name = inner, result, finish, name
        self._done = False

    def poll(self):
        return self._done or self._inner.poll()

    def wait(self, timeout=None):
        if not self._done:
            self._inner.wait(timeout)
            with torch.no_grad():
                self._result = self._finish()
            self._done = True
        return self._result

    def timing(self):
        return self._inner.timing()


def _start(tensor, out, average, name, op, prescale_factor, postscale_factor, process_set,
           compression, what):
    """Starts the allreduce of `tensor` into `out` (the same tensor: in place)."""
    _core._check_tensor(tensor, what, device_ok=True)
    group, _, _ = _members(process_set, what)
    op = _resolve_op(average, op, what)
    if tensor.device.type != "cpu" and (op in _NATIVE_OPS or group is not None):
        raise InvalidArgumentError(
            "%s: op=%s%s of a %s tensor: only sums and averages over every worker take device "
            "tensors (copy it to the CPU)" % (what, op.name, " in a process set" if group else "",
                                              tensor.device.type))
    ctx = _core._require()
    if name is None:
        name = "allreduce.noname.%d" % ctx.unnamed.next(group)
    name = _set_name(group, name)
    with torch.no_grad():
        # What travels: `out` itself, or its compressed copy.
        wire, cctx = compression.compress(out.detach())
        _scale(wire, prescale_factor)
        if op in _NATIVE_OPS or group is not None:
            if not wire.is_contiguous():
                raise InvalidArgumentError("%s: op=%s of a non-contiguous tensor" % (what, op.name))
            inner = _core.start_collective("allreduce", wire, wire, wire, name,
                                           op=_NATIVE_OPS.get(op, "sum"),
                                           average=op == Average, group=group or ())
        else:
            inner = _core.push_pull_async(wire, average=op == Average, name=name)

    def finish():
        return _write_back(out, wire, cctx, compression, postscale_factor)

    return _AllreduceHandle(inner, out, finish, name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an in-place allreduce of `tensor`; synchronize(handle) returns `tensor`."""
    return _start(tensor, tensor, average, name, op, prescale_factor, postscale_factor,
                  process_set, Compression.none, "allreduce_async_")


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Averages (or sums, op=Sum) `tensor` over all workers, in place; returns it."""
    return _core.synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                              postscale_factor, process_set))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce into a new tensor; `tensor` is left alone. synchronize(handle)
    returns the result."""
    out = tensor.detach().clone()
    return _start(tensor, out, average, name, op, prescale_factor, postscale_factor,
                  process_set, Compression.none, "allreduce_async")


def _allreduce(tensor, average, name, compression, op, prescale_factor, postscale_factor,
               process_set):
    """allreduce() without autograd."""
    out = tensor.detach().clone()
    return _core.synchronize(_start(tensor, out, average, name, op, prescale_factor,
                                    postscale_factor, process_set, compression, "allreduce"))


class _GroupHandle:
    """Handles of a grouped allreduce; waits for all, returns their results in order."""

    def __init__(self, handles):
        self._handles = handles

    def poll(self):
        return all(h.poll() for h in self._handles)

    def wait(self, timeout=None):
        return [h.wait(timeout) for h in self._handles]


def _grouped(tensors, in_place, average, name, op, prescale_factor, postscale_factor,
             process_set, compression, what):
    tensors = list(tensors)
    if name is None:
        name = "grouped_allreduce.noname.%d" % _core._require().unnamed.next(
            getattr(process_set, "ranks", None))
    resolved = _resolve_op(average, op, what)
    group, _, _ = _members(process_set, what)
    if resolved in (Sum, Average) and group is None:
        # Sums and averages over every worker go as one fused group (grouped_push_pull):
        # small members share fusion buffers, as in Horovod.
        for i, t in enumerate(tensors):
            _core._check_tensor(t, "%s (member %d)" % (what, i), device_ok=True)
        with torch.no_grad():
            outs = [t if in_place else t.detach().clone() for t in tensors]
            wires = [compression.compress(o.detach()) for o in outs]
            for w, _ in wires:
                _scale(w, prescale_factor)
            inner = _core.grouped_push_pull_async([w for w, _ in wires],
                                                  average=resolved == Average, name=name)

        def finish():
            return [_write_back(o, w, c, compression, postscale_factor)
                    for o, (w, c) in zip(outs, wires)]

        return _AllreduceHandle(inner, outs, finish, name)
    handles = []
    for i, t in enumerate(tensors):
        out = t if in_place else t.detach().clone()
        handles.append(_start(t, out, average, "%s.%d" % (name, i), op, prescale_factor,
                              postscale_factor, process_set, compression, what))
    return _GroupHandle(handles)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    return _grouped(tensors, True, average, name, op, prescale_factor, postscale_factor,
                    process_set, Compression.none, "grouped_allreduce_async_")


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return _core.synchronize(grouped_allreduce_async_(tensors, average, name, op,
                                                      prescale_factor, postscale_factor,
                                                      process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    return _grouped(tensors, False, average, name, op, prescale_factor, postscale_factor,
                    process_set, Compression.none, "grouped_allreduce_async")


def _grouped_allreduce(tensors, average, name, compression, op, prescale_factor,
                       postscale_factor, process_set):
    """grouped_allreduce() without autograd."""
    return _core.synchronize(_grouped(tensors, False, average, name, op, prescale_factor,
                                      postscale_factor, process_set, compression,
                                      "grouped_allreduce"))


def cross_rank():
    """Horovod's cross rank: this worker's host among the hosts, with ranks placed host-major
    (local_size() workers per host, as torchrun and gradlink-run place them)."""
    return _core.rank() // max(1, _core.local_size())


def cross_size():
    """The number of hosts, with local_size() workers each (see cross_rank)."""
    local = max(1, _core.local_size())
    return (_core.size() + local - 1) // local


# What this build has, answered truthfully: gradlink moves tensors through its own servers
# (over UCX), not through MPI, Gloo, NCCL, DDL or oneCCL, and has no GPU support yet.
def mpi_built():
    return False


def mpi_enabled():
    return False


def mpi_threads_supported():
    return False


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    return 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return False


def rocm_built():
    return False
