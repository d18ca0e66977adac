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

from ._broadcast import (  # noqa: F401
    broadcast,
    broadcast_async,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ._core import (  # noqa: F401
    PushPullHandle,
    barrier,
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
    synchronize,
)
from ._ddp import DDPHookState, ddp_hook  # noqa: F401
from ._optimizer import DistributedOptimizer  # noqa: F401

__all__ = [
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
    "PushPullHandle",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ddp_hook",
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
    "synchronize",
]
