"""Which torch tensors gradlink takes, and the errors that say why not: the dtypes the servers
can sum (DTYPES), the bit-exact views that routed collectives carry any dtype as (raw_view), the
checks every operation runs on its tensors, and whether a tensor goes through the staging
pipeline (_staged).

Pure functions of their arguments (and GRADLINK_STAGE_HOST); threads: any.
"""

import torch

from gradlink import InvalidArgumentError

from . import _staging

# torch dtype -> gradlink dtype name (the types the servers can sum).
DTYPES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def summable_dtype(dtype, what, name, verb="summed"):
    """gradlink's name for `dtype`; InvalidArgumentError naming the operation and tensor when
    the servers cannot sum it."""
    d = DTYPES.get(dtype)
    if d is None:
        raise InvalidArgumentError(
            "%s of '%s': dtype %s cannot be %s (supported: %s)"
            % (what, name, dtype, verb, ", ".join(str(t) for t in DTYPES)))
    return d


def _check_tensor(tensor, what, device_ok=False):
    """`device_ok`: the operation stages CUDA tensors through host memory (sums over every
    worker: push_pull, grouped_push_pull and what is built on them); the others take CPU
    tensors only."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("%s: expected a torch.Tensor, got %s" % (what, type(tensor).__name__))
    if tensor.device.type != "cpu" and not (device_ok and tensor.device.type == "cuda"):
        raise InvalidArgumentError(
            "%s: %s tensors are not supported here (%s): copy to the CPU (t.cpu()), run it, "
            "and copy back" % (what, tensor.device.type,
                               "sums and averages over every worker take CUDA tensors"
                               if tensor.device.type == "cuda" else "CPU and CUDA tensors are"))
    if tensor.is_sparse:
        raise InvalidArgumentError("%s: sparse tensors are not supported" % what)


def _staged(tensor):
    """Whether `tensor` goes through host buffers (_staging.py): a CUDA tensor, or any with
    GRADLINK_STAGE_HOST=1."""
    return tensor.device.type != "cpu" or _staging.stage_host_tensors()


def _check_summable(tensor, what, name):
    summable_dtype(tensor.dtype, what, name)


# Element types that routed collectives (broadcast, allgather, alltoall) carry as raw bits: the
# servers copy them, never convert, so any dtype travels as a same-width gradlink type.
_RAW = {8: (torch.int64, "int64"), 4: (torch.int32, "int32"), 2: (torch.int16, "fp16")}


def raw_view(t):
    """`t` (contiguous) as (buffer, gradlink dtype, elements per item, finish): a bit-exact view
    for routing; 1-byte types are widened to int16 (and narrowed back by `finish`)."""
    size = t.element_size()
    if t.dtype == torch.bool or size == 1:
        wide = t.to(torch.int16)
        return wide, "fp16", 1, (lambda: t.copy_(wide))
    for width in (8, 4, 2):
        if size % width == 0:
            dt, name = _RAW[width]
            flat = t.reshape(-1)
            if flat.is_complex():
                flat = torch.view_as_real(flat).reshape(-1)
            return flat.view(dt), name, size // width, None
    raise InvalidArgumentError("dtype %s cannot be routed" % t.dtype)
