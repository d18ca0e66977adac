"""hvd.SyncBatchNorm against one torch.nn.BatchNorm2d over the global batch (every rank's local
batch concatenated, computed here on each rank): outputs, input gradients, running statistics
over two steps, the summed weight and bias gradients, and eval mode; local batches of different
sizes (asserts inside)."""

import torch

import gradlink.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
C = 4


def batch(r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(2 + r, C, 5, 3, generator=g) * 3 + 1  # rank r holds 2 + r samples


def grad_out(r, step):
    g = torch.Generator().manual_seed(1000 + 100 * step + r)
    return torch.randn(2 + r, C, 5, 3, generator=g)


ours = hvd.SyncBatchNorm(C)
ref = torch.nn.BatchNorm2d(C)
with torch.no_grad():
    w, b = torch.randn(C), torch.randn(C)
    for m in (ours, ref):
        m.weight.copy_(w)
        m.bias.copy_(b)
start = sum(2 + r for r in range(rank))
mine = slice(start, start + 2 + rank)
for step in range(2):
    for m in (ours, ref):
        m.zero_grad()
    x = batch(rank, step).requires_grad_()
    y = ours(x)
    y.backward(grad_out(rank, step))
    X = torch.cat([batch(r, step) for r in range(size)]).requires_grad_()
    Y = ref(X)
    Y.backward(torch.cat([grad_out(r, step) for r in range(size)]))
    assert torch.allclose(y, Y[mine], atol=1e-5), (step, (y - Y[mine]).abs().max())
    assert torch.allclose(x.grad, X.grad[mine], atol=1e-5), (step, (x.grad - X.grad[mine]).abs().max())
    assert torch.allclose(ours.running_mean, ref.running_mean, atol=1e-6), step
    assert torch.allclose(ours.running_var, ref.running_var, atol=1e-5), step
    # Weight and bias gradients are local (the optimizer sums them): their sum is BatchNorm's.
    dw = hvd.allreduce(ours.weight.grad, op=hvd.Sum, name="dw.%d" % step)
    db = hvd.allreduce(ours.bias.grad, op=hvd.Sum, name="db.%d" % step)
    assert torch.allclose(dw, ref.weight.grad, atol=1e-4), (dw, ref.weight.grad)
    assert torch.allclose(db, ref.bias.grad, atol=1e-4), (db, ref.bias.grad)
assert int(ours.num_batches_tracked) == 2
ours.eval()
ref.eval()
x = batch(rank, 5)
assert torch.allclose(ours(x), ref(x), atol=1e-5)
hvd.shutdown()
print("SYNC BN OK rank %d" % rank)
