"""byteps.torch.parallel: not provided by gradlink. Use torch's DistributedDataParallel with
gradlink's comm hook (gradlink.torch.ddp_hook), or gradlink.torch.DistributedOptimizer."""

import gradlink


class DistributedDataParallel:
    def __init__(self, *args, **kwargs):
        raise gradlink.InvalidArgumentError(
            "byteps.torch.parallel.DistributedDataParallel is not provided by gradlink: wrap the "
            "model in torch.nn.parallel.DistributedDataParallel and register "
            "gradlink.torch.ddp_hook (model.register_comm_hook(gl.DDPHookState(model), "
            "gl.ddp_hook)), or use gradlink.byteps.torch.DistributedOptimizer")
