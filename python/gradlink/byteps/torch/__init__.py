"""byteps.torch's API on gradlink: `import gradlink.byteps.torch as bps` in place of
`import byteps.torch as bps` (BytePS 0.2.5's names; docs/byteps_api.md lists each one).

BytePS's push_pull returns a new tensor (gradlink.torch's works in place), hence a module of its
own. The sums are gradlink's (servers, or the same-host path; fp16/bf16 accumulated in fp32).
    bps.init(); bps.rank(), bps.size(), bps.local_rank(), bps.local_size(), bps.shutdown()
    bps.push_pull(tensor, average=True, name=..., version=0, priority=0, compression=...)
    bps.byteps_push_pull (push_pull_async_inplace) / poll / synchronize / declare
    bps.DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step)
    bps.broadcast_parameters, bps.broadcast_optimizer_state, bps.broadcast_object
Submodules as BytePS has them: ops (every push_pull call, byteps_torch_set_num_grads),
compression, parallel (DistributedDataParallel) and cross_barrier (CrossBarrier).
Not provided: suspend/resume (elastic training) and BytePS's asynchronous training
(BYTEPS_ENABLE_ASYNC); both raise naming what to use instead.
"""

import os

import gradlink
import gradlink.torch as _gl
from gradlink.torch import _horovod  # noqa: F401  (the home of the compressors)
from gradlink.torch import broadcast_object, is_initialized  # noqa: F401

from .compression import Compression
from .ops import (  # noqa: F401
    declare,
    init,
    local_rank,
    local_size,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    rank,
    resume,
    shutdown,
    size,
    suspend,
    synchronize,
)
from .ops import push_pull_async_inplace as byteps_push_pull  # noqa: F401  (BytePS's alias)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1):
    """byteps.torch.DistributedOptimizer: each gradient is averaged over all workers as soon as
    backward has produced it (after `backward_passes_per_step` backward passes: accumulated
    locally before), and step() waits for the averages before the wrapped optimizer's step.
    synchronize(), skip_synchronize() and set_backward_passes_per_step() as BytePS has them.
    gradlink.torch.DistributedOptimizer underneath (buckets, priorities, fp16 compression).

    BytePS's asynchronous training (BYTEPS_ENABLE_ASYNC=1: workers push weight deltas and never
    wait for each other) is not provided: gradlink's rounds are synchronous."""
    if int(os.environ.get("BYTEPS_ENABLE_ASYNC", "0") or 0) != 0:
        raise gradlink.InvalidArgumentError(
            "BYTEPS_ENABLE_ASYNC: BytePS's asynchronous training is not provided by gradlink "
            "(every round sums all workers' gradients); unset it for synchronous training")
    return _gl.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                    compression=compression,
                                    backward_passes_per_step=backward_passes_per_step)


def broadcast_parameters(params, root_rank, prefix="Parameter."):
    """Makes every worker's tensors root_rank's, in place: a state_dict, named parameters or
    tensors (as BytePS takes them); `prefix` starts their keys' names, as in BytePS."""
    return _gl.broadcast_parameters(params, root_rank=root_rank,
                                    prefix="parameters" if prefix is None else prefix)


def broadcast_optimizer_state(optimizer, root_rank, prefix="Parameter."):
    """Makes every worker's optimizer state (per-parameter state and the param_groups'
    hyperparameters) root_rank's. `prefix` is BytePS's; gradlink sends the whole state as one
    object, so no per-tensor names are made from it."""
    del prefix
    return _gl.broadcast_optimizer_state(optimizer, root_rank=root_rank)


from . import parallel  # noqa: E402,F401  (bps.parallel.DistributedDataParallel)
from . import ops, compression  # noqa: E402,F401
