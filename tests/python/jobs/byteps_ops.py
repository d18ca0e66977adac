"""byteps.torch's names that gradlink.byteps.torch lacked, used as BytePS scripts use them
(`from byteps.torch.ops import ...`, `import byteps.torch.cross_barrier as bps`, BytePS's
DistributedDataParallel with device_ids), each checked against a reference computed here in one
process: the sums from every rank's inputs, gradients worked out by hand, and one model trained
on the global batch with plain torch.optim."""

import os

import torch

import gradlink
import gradlink.byteps.torch as bps
from gradlink.byteps.torch.compression import Compression, FP16Compressor, NoneCompressor
from gradlink.byteps.torch.ops import (
    byteps_torch_set_num_grads,
    push_pull_async,
    push_pull_group_sync_inplace,
    synchronize,
)
from gradlink.byteps.torch.parallel import DistributedDataParallel as DDP

bps.init(lazy=False)
rank, size = bps.rank(), bps.size()


def inputs(r, n=300, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * seed + r))


want = sum(inputs(r) for r in range(size))

# byteps_push_pull (the in-place async call under BytePS's alias) and ops.push_pull_async (a new
# tensor, the input left alone).
x = inputs(rank)
assert synchronize(bps.byteps_push_pull(x, average=False, name="alias")) is x
assert torch.allclose(x, want, atol=1e-5)
x, keep = inputs(rank), inputs(rank)
y = synchronize(push_pull_async(x, average=True, name="oop"))
assert torch.equal(x, keep) and torch.allclose(y, want / size, atol=1e-6)
assert bps.declare("Gradient.anything") == 0
assert Compression.none is NoneCompressor and Compression.fp16 is FP16Compressor

# push_pull needs a name, as in BytePS.
try:
    bps.push_pull(inputs(rank))
except AssertionError:
    pass
else:
    raise AssertionError("push_pull without a name did not raise")

# push_pull is differentiable: rank k's loss is sum(w_k * y); with y the sum of the x_r, the
# gradient of the workers' total loss with respect to each x_r is the sum of the w_k (the
# average of the w_k when y is the average).
w = [inputs(k, seed=7) for k in range(size)]
for average in (False, True):
    x = inputs(rank).requires_grad_()
    y = bps.push_pull(x, average=average, name="autograd.%d" % average)
    assert y.requires_grad, "push_pull's output has no grad_fn"
    (w[rank] * y).sum().backward()
    expect = sum(w) / (size if average else 1)
    assert torch.allclose(x.grad, expect, atol=1e-5), (average, x.grad[:4], expect[:4])

# push_pull_group_sync_inplace counts the gradients of a group of byteps_torch_set_num_grads().
byteps_torch_set_num_grads(3)
counts, pending = [], []
for i in range(4):
    t = inputs(rank, seed=20 + i)
    handle, count = push_pull_group_sync_inplace(t, average=False, name="group.%d" % i)
    counts.append(count)
    pending.append((handle, t, i))
assert counts == [1, 2, 3, 1], counts
for handle, t, i in pending:
    synchronize(handle)
    assert torch.allclose(t, sum(inputs(r, seed=20 + i) for r in range(size)), atol=1e-5)

# BytePS's asynchronous training is refused, naming it.
os.environ["BYTEPS_ENABLE_ASYNC"] = "1"
try:
    bps.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
except gradlink.InvalidArgumentError as e:
    assert "BYTEPS_ENABLE_ASYNC" in str(e)
else:
    raise AssertionError("BYTEPS_ENABLE_ASYNC=1 was accepted")
del os.environ["BYTEPS_ENABLE_ASYNC"]


def net():
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def local_batch(r, step):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(500 + 10 * step + r))


def global_loss(model, step):
    return torch.cat([model(local_batch(r, step)) for r in range(size)]).pow(2).mean()


# BytePS's DistributedDataParallel takes device_ids with one entry (the example scripts pass
# [bps.local_rank()]); the module stays where it is.
torch.manual_seed(5 + rank)
ddp = DDP(net(), device_ids=[bps.local_rank()])
torch.manual_seed(5)
ref = net()
ddp(local_batch(rank, 0)).pow(2).mean().backward()
global_loss(ref, 0).backward()
for p, q in zip(ddp.parameters(), ref.parameters()):
    assert torch.allclose(p.grad, q.grad, atol=1e-6)

# CrossBarrier: the averages of a step overlap the next forward, whose modules wait for their
# own parameters' updates; the result is plain training on the global batch.
import gradlink.byteps.torch.cross_barrier as cb  # noqa: E402

for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
             lambda ps: torch.optim.Adam(ps, lr=0.01)):
    torch.manual_seed(11)
    model, ref = net(), net()
    ref.load_state_dict(model.state_dict())
    opt = cb.CrossBarrier(model, make(model.parameters()),
                          named_parameters=model.named_parameters(), num_steps=3)
    cb.broadcast_optimizer_state(opt, root_rank=0)
    ref_opt = make(ref.parameters())
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(local_batch(rank, step)).pow(2).mean()
        ref_loss = global_loss(ref, step)
        # The local loss was computed with the updated weights: with the same weights, the mean
        # of the ranks' local losses is the global loss.
        total = bps.push_pull(loss.detach().reshape(1), average=True,
                              name="cb.loss.%s.%d" % (type(opt._opt).__name__, step))
        assert torch.allclose(total, ref_loss.detach().reshape(1), atol=1e-6), (step, total,
                                                                             ref_loss)
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):  # num_steps=3: all updates done
        assert torch.allclose(p, q, atol=1e-6), (type(opt._opt).__name__, p, q)
try:
    cb.CrossBarrier(net(), torch.optim.Adagrad(net().parameters()))
except ValueError:
    pass
else:
    raise AssertionError("CrossBarrier took Adagrad")

bps.shutdown()
print("BPS OPS OK rank %d" % rank)
