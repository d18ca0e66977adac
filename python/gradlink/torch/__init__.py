"""gradlink for PyTorch: data-parallel training with gradients summed by gradlink servers.

    import gradlink.torch as gl
    gl.init()                                       # under gradlink-run or torchrun
    model = Net()
    gl.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = gl.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                  named_parameters=model.named_parameters())
    gl.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in data:                               # each worker its own shard
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

or, with DistributedDataParallel:

    model = DDP(model)                              # torch.distributed process group (gloo)
    model.register_comm_hook(gl.DDPHookState(model), gl.ddp_hook)

Many small tensors at once: ``gl.grouped_push_pull(tensors)`` fuses them (like Horovod's
grouped_allreduce); DistributedOptimizer groups small gradients into buckets the same way.

Tensors are CPU tensors (CUDA tensors raise InvalidArgumentError for now). Errors raise
gradlink.GradlinkError subclasses (MismatchError, PeerLostError, TimeoutError, ...).
"""

from gradlink import (  # noqa: F401
    AbortedError,
    GradlinkError,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    TimeoutError,
    UnavailableError,
)

from ._autograd import (  # noqa: F401
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from ._broadcast import (  # noqa: F401
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ._core import (  # noqa: F401
    GroupedPushPullHandle,
    PushPullHandle,
    grouped_push_pull,
    grouped_push_pull_async,
    init,
    is_initialized,
    local_rank,
    local_size,
    num_servers,
    poll,
    push_pull,
    push_pull_async,
    rank,
    shutdown,
    size,
    stats,
    synchronize,
)
from ._ddp import DDPHookState, ddp_hook  # noqa: F401
from ._sync_bn import SyncBatchNorm  # noqa: F401
from ._gather import (  # noqa: F401
    allgather_async,
    allgather_object,
    alltoall_async,
    grouped_allgather_async,
    grouped_reducescatter_async,
    reducescatter_async,
    sparse_allreduce_async,
)
from ._horovod import (  # noqa: F401
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    barrier,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    global_process_set,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    remove_process_set,
)
from ._optimizer import DistributedOptimizer  # noqa: F401
from ._timeline import start_timeline, stop_timeline  # noqa: F401

# horovod.common.exceptions.HorovodInternalError: what a failed collective raises. gradlink's
# errors are GradlinkError subclasses, so `except hvd.HorovodInternalError` catches them all.
HorovodInternalError = GradlinkError

__all__ = [
    "join",
    "Adasum",
    "Average",
    "Compression",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "global_process_set",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "remove_process_set",
    "start_timeline",
    "stop_timeline",
    "allgather",
    "allgather_async",
    "allgather_object",
    "alltoall",
    "alltoall_async",
    "broadcast_",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "SyncBatchNorm",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rocm_built",
    "HorovodInternalError",
    "AbortedError",
    "GradlinkError",
    "InvalidArgumentError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "TimeoutError",
    "UnavailableError",
    "DDPHookState",
    "DistributedOptimizer",
    "GroupedPushPullHandle",
    "PushPullHandle",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ddp_hook",
    "grouped_push_pull",
    "grouped_push_pull_async",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "num_servers",
    "poll",
    "push_pull",
    "push_pull_async",
    "rank",
    "shutdown",
    "size",
    "stats",
    "synchronize",
]

# The torch.distributed backend "gradlink" (init_process_group("gradlink")), when it is built.
from . import _c10d as _c10d_backend  # noqa: E402

_c10d_backend.register()
