"""horovod.torch's allreduce family, ops, compression and DistributedOptimizer keywords, as a
Horovod script calls them (`import gradlink.torch as hvd`), against single-process references
(asserts inside)."""

import torch

import gradlink
import gradlink.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()


def inputs(r, n=1000, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + r)
    return torch.randn(n, generator=g).to(dtype)


# Out of place: a new tensor, the input untouched; Average by default, op=Sum, average=False.
x = inputs(rank)
keep = x.clone()
want_sum = sum(inputs(r) for r in range(size))
y = hvd.allreduce(x, name="oop.avg")
assert torch.equal(x, keep), "allreduce changed its input"
assert torch.allclose(y, want_sum / size, atol=1e-6), (y[:3], (want_sum / size)[:3])
assert torch.allclose(hvd.allreduce(x, op=hvd.Sum, name="oop.sum"), want_sum, atol=1e-5)
assert torch.allclose(hvd.allreduce(x, average=False, name="oop.sum2"), want_sum, atol=1e-5)

# In place, and async with synchronize/poll; pre- and postscale.
z = inputs(rank)
out = hvd.allreduce_(z, op=hvd.Sum, name="inplace")
assert out is z and torch.allclose(z, want_sum, atol=1e-5)
h = hvd.allreduce_async(inputs(rank), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                        name="scaled")
r = hvd.synchronize(h)
assert hvd.poll(h)
assert torch.allclose(r, want_sum * 1.5, atol=1e-5), (r[:3], (want_sum * 1.5)[:3])
h = hvd.allreduce_async_(inputs(rank), name="async_inplace")
assert torch.allclose(hvd.synchronize(h), want_sum / size, atol=1e-6)

# Grouped.
ts = [inputs(rank, n) for n in (10, 300, 5000)]
res = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grp")
for n, t in zip((10, 300, 5000), res):
    assert torch.allclose(t, sum(inputs(q, n) for q in range(size)), atol=1e-5), n
res = hvd.synchronize(hvd.grouped_allreduce_async_(ts, name="grp_"))
assert all(a is b for a, b in zip(res, ts))
# Fused, as Horovod's: small members share fusion buffers; with fp16 compression and scaling.
fused_before = hvd.stats()["fused_ops"]
small = [inputs(rank, n) for n in (7, 30, 100)]
res = hvd.grouped_allreduce(small, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5,
                            compression=hvd.Compression.fp16, name="grp.fp16")
assert hvd.stats()["fused_ops"] > fused_before, hvd.stats()
for n, t in zip((7, 30, 100), res):
    want = (sum((inputs(q, n) * 2.0).to(torch.float16).float() for q in range(size))
            ).to(torch.float16).float() * 0.5
    assert t.dtype == torch.float32 and torch.equal(t, want), (n, t[:3], want[:3])

# Compression.fp16: fp16 on the wire, summed in fp32, cast back: the same as summing the fp16
# values exactly and rounding once to fp16.
c = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="fp16")
assert c.dtype == torch.float32
want16 = sum(inputs(q).to(torch.float16).float() for q in range(size)).to(torch.float16).float()
assert torch.equal(c, want16), (c[:3], want16[:3])

# Min, Max and Product on the servers, every dtype, against a fold in rank order (16-bit
# floats folded in fp32 and rounded once, integers wrapping): bit for bit.
def values(r, dtype):
    g = torch.Generator().manual_seed(300 + r)
    if dtype.is_floating_point:
        return (torch.randn(777, generator=g) * 2).to(dtype)
    return torch.randint(-(1 << 20), 1 << 20, (777,), generator=g, dtype=torch.int64).to(dtype)


for op in (hvd.Min, hvd.Max, hvd.Product):
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                  torch.int64):
        mine = values(rank, dtype)
        keep = mine.clone()
        got = hvd.allreduce(mine, op=op, name="op.%s.%s" % (op.name, dtype))
        assert torch.equal(mine, keep), "allreduce op=%s changed its input" % op.name
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        acc = values(0, dtype).to(wide)
        for q in range(1, size):
            v = values(q, dtype).to(wide)
            acc = torch.minimum(acc, v) if op == hvd.Min else (
                torch.maximum(acc, v) if op == hvd.Max else acc * v)
        assert torch.equal(got, acc.to(dtype)), (op.name, dtype, got[:4], acc[:4])
        # In place too.
        assert torch.equal(hvd.allreduce_(mine, op=op, name="op_.%s.%s" % (op.name, dtype)),
                           acc.to(dtype))

# Adasum: a clear error naming it; average and op together: ValueError.
try:
    hvd.allreduce(x, op=hvd.Adasum, name="bad")
except gradlink.InvalidArgumentError as e:
    assert "Adasum" in str(e), str(e)
else:
    raise AssertionError("op Adasum did not raise")
try:
    hvd.allreduce(x, average=True, op=hvd.Sum)
except ValueError:
    pass
else:
    raise AssertionError("average and op together did not raise")
try:
    hvd.add_process_set([0, size])  # a rank the job does not have
except gradlink.InvalidArgumentError as e:
    assert str(size) in str(e), str(e)
else:
    raise AssertionError("add_process_set of a rank out of range did not raise")

# sparse_allreduce_async: every rank's sparse rows, summed / averaged, coalesced.
def sparse_of(r):
    idx = torch.tensor([[r, (r + 1) % 4], [1, 2]])
    return torch.sparse_coo_tensor(idx, torch.tensor([1.0 + r, 10.0 * r]), (4, 3))


dense = sum(sparse_of(r).to_dense() for r in range(size))
got = hvd.synchronize(hvd.sparse_allreduce_async(sparse_of(rank), name="sparse", op=hvd.Sum))
assert got.is_sparse and torch.equal(got.to_dense(), dense), (got.to_dense(), dense)
got = hvd.synchronize(hvd.sparse_allreduce_async(sparse_of(rank), name="sparse.avg"))
assert torch.allclose(got.to_dense(), dense / size)

# barrier: gradlink's (timeout) and Horovod's (process_set) forms.
hvd.barrier()
hvd.barrier(30.0)
pair = hvd.add_process_set([0, 1])
if pair.included():
    hvd.barrier(pair)
    hvd.barrier(process_set=pair)
    got = hvd.broadcast_object({"from": rank}, root_rank=1, name="pair.obj", process_set=pair)
    assert got == {"from": 1}, got

# broadcast_parameters with model.parameters() (plain tensors, named by position).
model = torch.nn.Linear(8, 4)
torch.manual_seed(rank)
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn_like(p))
hvd.broadcast_parameters(model.parameters(), root_rank=0)
torch.manual_seed(0)
for p in model.parameters():
    assert torch.equal(p, torch.randn_like(p)), "broadcast_parameters(model.parameters())"

# broadcast_optimizer_state with Horovod's model= (the root's lr everywhere).
adam = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
hvd.broadcast_optimizer_state(adam, 0, model=model)
assert adam.param_groups[0]["lr"] == 0.01, adam.param_groups[0]["lr"]

# DistributedOptimizer with Horovod's keywords: compression=fp16, op=Sum /
# gradient_predivide_factor, against the same step computed here from every rank's gradient.
def grads_of(r):
    m = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p, q in zip(m.parameters(), model.parameters()):
            p.copy_(q)
    g = torch.Generator().manual_seed(7 + r)
    m(torch.randn(16, 8, generator=g)).pow(2).sum().backward()
    return [p.grad.clone() for p in m.parameters()]


all_grads = [grads_of(r) for r in range(size)]
for kind, kwargs in (("sum", dict(op=hvd.Sum)),
                     ("predivide", dict(gradient_predivide_factor=4.0)),
                     ("fp16", dict(compression=hvd.Compression.fp16))):
    m = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p, q in zip(m.parameters(), model.parameters()):
            p.copy_(q)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(prefix=kind), **kwargs)
    g = torch.Generator().manual_seed(7 + rank)
    m(torch.randn(16, 8, generator=g)).pow(2).sum().backward()
    opt.synchronize()
    for i, p in enumerate(m.parameters()):
        total = sum(gr[i] for gr in all_grads)
        if kind == "sum":
            want = total
        elif kind == "predivide":
            want = sum(gr[i] / 4.0 for gr in all_grads) / size * 4.0
        else:
            want = (sum(gr[i].to(torch.float16).float() for gr in all_grads) / size).to(
                torch.float16).float()
        tol = 1e-5 if kind != "fp16" else 0
        assert torch.allclose(p.grad, want, atol=tol, rtol=0), (kind, i, p.grad.flatten()[:3],
                                                               want.flatten()[:3])
    with opt.skip_synchronize():
        opt.step()
try:
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                             gradient_predivide_factor=2.0)
except ValueError:
    pass
else:
    raise AssertionError("gradient_predivide_factor with op=Sum did not raise")

# What the build has, answered truthfully; host-major cross ranks; HorovodInternalError is what
# gradlink raises.
assert not any(f() for f in (hvd.mpi_built, hvd.mpi_enabled, hvd.gloo_built, hvd.gloo_enabled,
                             hvd.nccl_built, hvd.ddl_built, hvd.ccl_built, hvd.cuda_built,
                             hvd.rocm_built, hvd.mpi_threads_supported))
assert hvd.cross_size() * hvd.local_size() >= size and hvd.cross_rank() < hvd.cross_size()
assert hvd.cross_rank() == rank // hvd.local_size()
assert issubclass(gradlink.MismatchError, hvd.HorovodInternalError)

hvd.shutdown()
print("HVD API OK rank %d" % rank)
