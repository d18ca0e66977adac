"""byteps.torch's API as a BytePS script calls it (`import gradlink.byteps.torch as bps`),
against single-process references (asserts inside)."""

import torch

import gradlink
import gradlink.byteps.torch as bps

bps.init()
rank, size = bps.rank(), bps.size()
assert 0 <= bps.local_rank() < bps.local_size()


def inputs(r, n=500):
    return torch.randn(n, generator=torch.Generator().manual_seed(300 + r))


want = sum(inputs(r) for r in range(size))
bps.declare("pp")
x = inputs(rank)
keep = x.clone()
y = bps.push_pull(x, average=False, name="pp")
assert torch.equal(x, keep) and torch.allclose(y, want, atol=1e-5), "push_pull is out of place"
y = bps.push_pull(x, name="pp.avg")
assert torch.allclose(y, want / size, atol=1e-6)
h = bps.push_pull_async_inplace(x, average=False, name="pp.inplace")
assert bps.synchronize(h) is x and torch.allclose(x, want, atol=1e-5)
z = inputs(rank)
bps.push_pull_inplace(z, average=True, name="pp.inplace2")
assert torch.allclose(z, want / size, atol=1e-6)
c = bps.push_pull(inputs(rank), average=False, name="pp.fp16", compression=bps.Compression.fp16)
want16 = sum(inputs(r).half().float() for r in range(size)).half().float()
assert torch.equal(c, want16)

model = torch.nn.Linear(6, 3)
torch.manual_seed(rank)
with torch.no_grad():
    for p in model.parameters():
        p.normal_()
bps.broadcast_parameters(model.state_dict(), root_rank=0)
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
bps.broadcast_optimizer_state(opt, root_rank=0)
g = torch.Generator().manual_seed(9 + rank)
model(torch.randn(4, 6, generator=g)).sum().backward()
opt.step()
ref = [p.detach().clone() for p in model.parameters()]
for i, p in enumerate(ref):
    bps.broadcast_parameters([("check.%d" % i, p)], root_rank=0)
    assert torch.equal(p, list(model.parameters())[i].detach()), "rank %d diverged" % rank
assert bps.broadcast_object({"r": rank}, root_rank=1, name="o") == {"r": 1}
for fn in (bps.suspend, lambda: bps.resume(1, 1)):
    try:
        fn()
    except gradlink.InvalidArgumentError:
        pass
    else:
        raise AssertionError("suspend/resume did not raise")
# byteps.torch.parallel.DistributedDataParallel: rank 0's state everywhere at construction,
# gradients averaged in backward (equal local batches: the global batch's mean loss), no_sync
# accumulating locally, buffers broadcast from rank 0 at every forward; checked against one
# model trained here on the global batch.
from gradlink.byteps.torch.parallel import DistributedDataParallel  # noqa: E402


def net():
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def local_batch(r, step):
    g = torch.Generator().manual_seed(500 + 10 * step + r)
    return torch.randn(4, 6, generator=g)


torch.manual_seed(77 + rank)  # every rank different: the constructor broadcasts rank 0's
ddp = DistributedDataParallel(net())
torch.manual_seed(77)
reference = net()
with torch.no_grad():
    for p, q in zip(ddp.parameters(), reference.parameters()):
        assert torch.equal(p, q), "DistributedDataParallel did not start from rank 0's state"
sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(3):
    sgd.zero_grad()
    ref_sgd.zero_grad()
    if step == 2:  # two micro-batches, the first without sync: the average of their sum
        with ddp.no_sync():
            ddp(local_batch(rank, 20)).pow(2).mean().backward()
        ddp(local_batch(rank, step)).pow(2).mean().backward()
        for b in (20, step):
            torch.cat([reference(local_batch(r, b)) for r in range(size)]).pow(2).mean().backward()
    else:
        ddp(local_batch(rank, step)).pow(2).mean().backward()
        torch.cat([reference(local_batch(r, step)) for r in range(size)]).pow(2).mean().backward()
    for p, q in zip(ddp.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), (step, p.grad, q.grad)
    sgd.step()
    ref_sgd.step()
bn = DistributedDataParallel(torch.nn.BatchNorm1d(3))
with torch.no_grad():
    bn.module.running_mean.fill_(float(rank))
bn.eval()
bn(torch.zeros(2, 3))
assert torch.equal(bn.module.running_mean, torch.zeros(3)), "buffers not broadcast from rank 0"
bps.shutdown()
print("BPS API OK rank %d" % rank)
