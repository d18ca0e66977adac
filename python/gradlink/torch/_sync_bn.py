"""horovod.torch.SyncBatchNorm: batch normalization whose statistics are those of the global
batch (every rank's local batch together), as one BatchNorm over the concatenated batch would
compute them.

torch 1.13 has no CPU kernels for the distributed batch-norm statistics (batch_norm_stats,
batch_norm_gather_stats_with_counts), so they are computed here from per-channel sums: one
allreduce of [sum x, sum x^2, count] (in fp64, so that the variance does not lose the small
differences of large sums) forward, one of [sum dy, sum dy * xhat] backward. Ranks may hold
local batches of different sizes (the counts are summed). The gradients of weight and bias stay
local, as in torch.nn.SyncBatchNorm: the optimizer's allreduce averages them with the other
parameters'.
"""

import itertools

import torch

from ._autograd import allreduce
from ._horovod import Sum, _members, _set_name, global_process_set


def _reduce_dims(x):
    return [0] + list(range(2, x.dim()))


def _per_channel(v, x):
    return v.view([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, name,
                process_set):
        dims = _reduce_dims(x)
        x64 = x.detach().to(torch.float64)
        local = torch.cat([x64.sum(dims), (x64 * x64).sum(dims),
                           torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64)])
        total = allreduce(local, op=Sum, name=name + ".stats", process_set=process_set)
        channels = x.shape[1]
        count = total[-1]
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_(min=0)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1)) if count > 1 else var
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        xhat = (x64 - _per_channel(mean, x)) * _per_channel(invstd, x)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight.detach().to(torch.float64), x)
        if bias is not None:
            y = y + _per_channel(bias.detach().to(torch.float64), x)
        ctx.save_for_backward(xhat, invstd, weight, count.reshape(1))
        ctx.name, ctx.process_set, ctx.has_bias = name, process_set, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight, count = ctx.saved_tensors
        dims = _reduce_dims(dy)
        dy64 = dy.to(torch.float64)
        local_dy = dy64.sum(dims)
        local_dy_xhat = (dy64 * xhat).sum(dims)
        total = allreduce(torch.cat([local_dy, local_dy_xhat]), op=Sum, name=ctx.name + ".grad",
                          process_set=ctx.process_set)
        channels = dy.shape[1]
        mean_dy = total[:channels] / count
        mean_dy_xhat = total[channels:] / count
        scale = invstd if weight is None else invstd * weight.detach().to(torch.float64)
        dx = _per_channel(scale, dy) * (dy64 - _per_channel(mean_dy, dy) -
                                        xhat * _per_channel(mean_dy_xhat, dy))
        dweight = local_dy_xhat.to(weight.dtype) if weight is not None else None
        dbias = local_dy.to(dy.dtype) if ctx.has_bias else None
        return dx.to(dy.dtype), dweight, dbias, None, None, None, None, None, None


_layers = itertools.count()


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Horovod's SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats):
    in training, normalizes with the mean and variance of the global batch (every rank's
    local batch; the running statistics likewise); in eval mode, with the running
    statistics, like BatchNorm. Every rank must run the same SyncBatchNorm layers in the same
    order (each forward and backward is a collective)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set
        # Layers are named by creation order: every rank builds the same model.
        self._id = next(_layers)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got %dD input)" % input.dim())

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or _members(self.process_set, "SyncBatchNorm")[2] == 1:
            return super().forward(input)
        momentum = self.momentum if self.momentum is not None else 0.0
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        group, _, _ = _members(self.process_set, "SyncBatchNorm")
        name = _set_name(group, "syncbn.%d" % self._id)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, momentum, name, self.process_set)
