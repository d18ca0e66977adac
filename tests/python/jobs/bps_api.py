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
bps.shutdown()
print("BPS API OK rank %d" % rank)
