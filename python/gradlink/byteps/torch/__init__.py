"""byteps.torch's API on gradlink: `import gradlink.byteps.torch as bps` in place of
`import byteps.torch as bps`.

BytePS's push_pull returns a new tensor (gradlink.torch's works in place), hence a module of its
own. The sums are gradlink's (servers, or the same-host path; fp16/bf16 accumulated in fp32).
    bps.init(); bps.rank(), bps.size(), bps.local_rank(), bps.local_size()
    bps.push_pull(tensor, average=True, name=None, version=0, priority=0, compression=...)
    bps.push_pull_async_inplace / push_pull_inplace / synchronize / poll / declare
    bps.DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step)
    bps.broadcast_parameters, bps.broadcast_optimizer_state, bps.broadcast_object
Not provided: suspend/resume (elastic training) and byteps.torch.parallel's
DistributedDataParallel; both raise naming what to use instead.
"""

import gradlink
import gradlink.torch as _gl
from gradlink.torch import (  # noqa: F401
    Compression,
    broadcast_object,
    init as _init,
    is_initialized,
    local_rank,
    local_size,
    poll,
    rank,
    shutdown,
    size,
    synchronize,
)
from gradlink.torch import _horovod


def init(lazy=True, **kwargs):
    """Joins the gradlink job (BytePS's `lazy` is accepted; gradlink always joins at once)."""
    return _init(**kwargs)


def declare(name, **kwargs):
    """BytePS declares tensor names up front, in the same order on every worker. gradlink keys
    tensors by their name's hash, so no declaration (or order) is needed: a no-op."""
    return name


def push_pull_async_inplace(tensor, average=True, name=None, version=0, priority=0):
    """Starts averaging (average=False: summing) `tensor` over all workers in place; returns a
    handle for synchronize()/poll(). `version` is accepted and ignored."""
    return _gl.push_pull_async(tensor, average=average, name=name, priority=priority)


def push_pull_inplace(tensor, average=True, name=None, version=0, priority=0):
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority))


def push_pull_async(tensor, average=True, name=None, version=0, priority=0):
    """Out of place: a handle whose synchronize() returns a new tensor; `tensor` is left alone."""
    return _horovod.allreduce_async(tensor, average=average, name=name)


def push_pull(tensor, average=True, name=None, version=0, priority=0,
              compression=Compression.none):
    """The average (average=False: sum) of `tensor` over all workers, as a new tensor."""
    return _horovod.allreduce(tensor, average=average, name=name, compression=compression)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1):
    """byteps.torch.DistributedOptimizer: gradients averaged over all workers during backward
    (gradlink.torch.DistributedOptimizer underneath: buckets, priorities, fp16 compression)."""
    return _gl.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                    compression=compression,
                                    backward_passes_per_step=backward_passes_per_step)


def broadcast_parameters(params, root_rank, prefix=None):
    """Makes every worker's parameters root_rank's (a state_dict, named parameters or
    tensors); `prefix` names the keys, as in BytePS."""
    return _gl.broadcast_parameters(params, root_rank=root_rank,
                                    prefix="parameters" if prefix is None else prefix)


def broadcast_optimizer_state(optimizer, root_rank, prefix="Parameter."):
    return _gl.broadcast_optimizer_state(optimizer, root_rank=root_rank)


def suspend():
    raise gradlink.InvalidArgumentError(
        "bps.suspend(): elastic training is not implemented by gradlink; a lost worker fails "
        "the job (restart from a checkpoint)")


def resume(num_workers, num_servers, global_rank=-1, context=None):
    raise gradlink.InvalidArgumentError(
        "bps.resume(): elastic training is not implemented by gradlink")

from . import parallel  # noqa: E402,F401  (bps.parallel.DistributedDataParallel)
