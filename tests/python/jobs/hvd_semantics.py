"""Horovod's semantics in gradlink.torch (issue 42), each against a reference computed here with
plain arithmetic or single-process torch: autograd through every collective with Horovod's
backward, broadcast's new tensor and broadcast_, integer and reduce-scatter scaling, duplicate
names in flight refused at once, DistributedOptimizer without names / over a process set / with
sparse gradients, the callable sparse handle, broadcast_optimizer_state with a parameter that
needs no gradient, and the error classes (asserts inside; errors that the scheduler reports
come last). Run with 3 workers; arguments name the sections to run (default: all of them,
in order): autograd broadcast scaling duplicates optimizer errors."""

import sys
import time

import torch

import gradlink
import gradlink.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert size == 3, "run with 3 workers"
evens = hvd.add_process_set([0, 2])


def up(r, shape, salt):
    """Rank r's upstream gradient (different on every rank)."""
    g = torch.Generator().manual_seed(1000 * salt + r)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def check(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (what, got, want)




# -- Autograd: Horovod's backward of every collective ------------------------------------------


def autograd():
    x = torch.full((4, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    keep = x.detach().clone()

    # allreduce (Sum): the gradient is the sum of every rank's upstream, times the scale factors.
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="g.ar")
    assert y.grad_fn is not None and torch.equal(x.detach(), keep)
    check(y.detach(), torch.full((4, 3), 1.5 * (1 + 2 + 3), dtype=torch.float64), "allreduce")
    y.backward(up(rank, (4, 3), 1))
    check(x.grad, 1.5 * sum(up(r, (4, 3), 1) for r in range(size)), "allreduce grad")

    # allreduce (Average, the default).
    x.grad = None
    hvd.allreduce(x, name="g.avg").backward(up(rank, (4, 3), 2))
    check(x.grad, sum(up(r, (4, 3), 2) for r in range(size)) / size, "allreduce average grad")

    # grouped_allreduce: each member's gradient is its group's allreduce.
    a = torch.ones(2, dtype=torch.float64, requires_grad=True)
    b = torch.ones(5, dtype=torch.float64, requires_grad=True)
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="g.grouped")
    (ya * up(rank, (2,), 3)).sum().add((yb * up(rank, (5,), 4)).sum()).backward()
    check(a.grad, sum(up(r, (2,), 3) for r in range(size)), "grouped_allreduce grad a")
    check(b.grad, sum(up(r, (5,), 4) for r in range(size)), "grouped_allreduce grad b")

    # allgather (rank r has r + 1 rows): the gradient is the average of the upstreams over the
    # ranks, this rank's rows of it.
    rows = [r + 1 for r in range(size)]
    g_in = torch.full((rows[rank], 2), float(rank), dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(g_in, name="g.ag")
    check(gathered.detach(), torch.cat([torch.full((rows[r], 2), float(r), dtype=torch.float64)
                                        for r in range(size)]), "allgather")
    gathered.backward(up(rank, (sum(rows), 2), 5))
    mean = sum(up(r, (sum(rows), 2), 5) for r in range(size)) / size
    check(g_in.grad, mean[sum(rows[:rank]):sum(rows[:rank + 1])], "allgather grad")

    # grouped_allgather.
    ga = torch.full((rows[rank],), float(rank), dtype=torch.float64, requires_grad=True)
    gb = torch.full((rows[rank], 3), 1.0, dtype=torch.float64, requires_grad=True)
    oa, ob = hvd.grouped_allgather([ga, gb], name="g.gag")
    oa.backward(up(rank, (sum(rows),), 6))
    ob.backward(up(rank, (sum(rows), 3), 7))
    mine = slice(sum(rows[:rank]), sum(rows[:rank + 1]))
    check(ga.grad, (sum(up(r, (sum(rows),), 6) for r in range(size)) / size)[mine], "grouped ag a")
    check(gb.grad, (sum(up(r, (sum(rows), 3), 7) for r in range(size)) / size)[mine],
          "grouped ag b")

    # broadcast: a new tensor; the gradient is the upstreams' average on the root, zero elsewhere.
    for root in range(size):
        bx = torch.full((3, 2), float(rank), dtype=torch.float64, requires_grad=True)
        out = hvd.broadcast(bx, root, name="g.b.%d" % root)
        assert out is not bx and torch.all(bx.detach() == rank), "broadcast wrote its source"
        check(out.detach(), torch.full((3, 2), float(root), dtype=torch.float64), "broadcast")
        out.backward(up(rank, (3, 2), 8 + root))
        want = sum(up(r, (3, 2), 8 + root) for r in range(size)) / size
        check(bx.grad, want if rank == root else torch.zeros(3, 2, dtype=torch.float64),
              "broadcast grad root %d" % root)

    # alltoall with splits: rank r sends j + 1 rows to rank j; each block's gradient goes back.
    splits = torch.tensor([j + 1 for j in range(size)], dtype=torch.int32)
    t_in = torch.arange(sum(splits.tolist()) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * rank
    t_in.requires_grad_()
    got, received = hvd.alltoall(t_in, splits, name="g.a2a")
    assert received.tolist() == [rank + 1] * size, received
    upstream = up(rank, tuple(got.shape), 20)
    got.backward(upstream)
    # Rank j received j + 1 rows from every rank, in rank order: this rank's block of j's upstream
    # is rows [rank * (j + 1), (rank + 1) * (j + 1)).
    want = torch.cat([up(j, ((j + 1) * size, 2), 20)[rank * (j + 1):(rank + 1) * (j + 1)]
                      for j in range(size)])
    check(t_in.grad, want, "alltoall grad")

    # reducescatter (Sum): the gradient is the gathered upstreams, times the set's size.
    rs = torch.full((size * 2, 2), float(rank + 1), dtype=torch.float64, requires_grad=True)
    part = hvd.reducescatter(rs, op=hvd.Sum, name="g.rs")
    check(part.detach(), torch.full((2, 2), 6.0, dtype=torch.float64), "reducescatter")
    part.backward(up(rank, (2, 2), 30))
    check(rs.grad, torch.cat([up(r, (2, 2), 30) for r in range(size)]) * size, "reducescatter grad")

    # grouped_reducescatter (Average): the gathered upstreams.
    r1 = torch.ones(size, dtype=torch.float64, requires_grad=True)
    r2 = torch.ones(size, 4, dtype=torch.float64, requires_grad=True)
    p1, p2 = hvd.grouped_reducescatter([r1, r2], op=hvd.Average, name="g.grs")
    (p1 * up(rank, (1,), 31)).sum().add((p2 * up(rank, (1, 4), 32)).sum()).backward()
    check(r1.grad, torch.cat([up(r, (1,), 31) for r in range(size)]), "grouped rs grad 1")
    check(r2.grad, torch.cat([up(r, (1, 4), 32) for r in range(size)]), "grouped rs grad 2")

    # Without requires_grad nothing is recorded.
    assert hvd.allreduce(torch.ones(2), name="g.none").grad_fn is None
    print("autograd ok rank %d" % rank, flush=True)


# -- broadcast and broadcast_ ------------------------------------------------------------------


def broadcast():
    src = torch.arange(6, dtype=torch.int32) * (rank + 1)
    out = hvd.broadcast(src, 1, name="b.new")
    assert torch.equal(src, torch.arange(6, dtype=torch.int32) * (rank + 1)), "source changed"
    assert torch.equal(out, torch.arange(6, dtype=torch.int32) * 2), out
    h = hvd.broadcast_async(src, 2, name="b.new.async")
    assert torch.equal(hvd.synchronize(h), torch.arange(6, dtype=torch.int32) * 3)
    assert torch.equal(src, torch.arange(6, dtype=torch.int32) * (rank + 1)), "source changed"
    inplace = src.clone()
    assert hvd.broadcast_(inplace, 0, name="b.inplace") is inplace
    assert torch.equal(inplace, torch.arange(6, dtype=torch.int32)), inplace
    if rank in (0, 2):
        ps = torch.full((2,), float(rank))
        got = hvd.broadcast(ps, 2, process_set=evens, name="b.ps")
        assert torch.equal(got, torch.full((2,), 2.)), got
        assert torch.equal(ps, torch.full((2,), float(rank))), "process-set source changed"
    try:
        hvd.broadcast([1, 2], 0)
        raise AssertionError("broadcast of a list did not raise")
    except TypeError:
        pass
    print("broadcast ok rank %d" % rank, flush=True)


# -- Scaling, as Horovod scales: integers in fp64 and truncated, halves in fp32 ----------------


def scaling():
    factor = 0.37
    base = torch.arange(-8, 9, dtype=torch.float64) * 7 + 3  # the same on every rank
    for dtype in (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64):
        t = base.to(dtype)
        math = torch.float32 if dtype == torch.float16 else (
            torch.float64 if not dtype.is_floating_point else dtype)
        f = torch.tensor(factor, dtype=torch.float64).to(math)
        pre = hvd.allreduce(t, op=hvd.Sum, prescale_factor=factor, name="s.pre.%s" % dtype)
        want = ((t.to(math) * f).to(dtype).to(math) * size).to(dtype)
        assert torch.equal(pre, want), (dtype, pre, want)
        post = hvd.allreduce(t, op=hvd.Sum, postscale_factor=factor, name="s.post.%s" % dtype)
        assert torch.equal(post, (t.to(math) * size * f).to(dtype)), (dtype, post)
        rs_in = torch.cat([base.to(dtype)] * size)  # 17 rows per rank
        part = hvd.reducescatter(rs_in, op=hvd.Sum, prescale_factor=factor,
                                 postscale_factor=2.0, name="s.rs.%s" % dtype)
        two = torch.tensor(2.0, dtype=torch.float64).to(math)
        want = ((((t.to(math) * f).to(dtype).to(math) * size).to(dtype)).to(math) * two).to(dtype)
        assert torch.equal(part, want), (dtype, part, want)
    print("scaling ok rank %d" % rank, flush=True)


# -- A name in flight is refused at once on this rank (ValueError) -----------------------------


def duplicates():
    starts = {
        "allreduce": lambda n: hvd.allreduce_async(torch.ones(5), name=n),
        "broadcast": lambda n: hvd.broadcast_async(torch.ones(5), 0, name=n),
        "allgather": lambda n: hvd.allgather_async(torch.ones(2, 2), name=n),
        "reducescatter": lambda n: hvd.reducescatter_async(torch.ones(size, 2), name=n),
    }
    for what, start in starts.items():
        name = "dup." + what
        if rank == 0:
            # Rank 0 starts first, alone: neither call may block (the others are in the barrier).
            first = start(name)
            try:
                start(name)
                raise AssertionError("%s: a second call named %s did not raise" % (what, name))
            except ValueError:
                pass
        hvd.barrier()
        if rank != 0:
            first = start(name)
            # Finished (every rank has started it) but not synchronized: still taken, as in
            # Horovod's handle map; whether it had finished must not decide it.
            while not hvd.poll(first):
                time.sleep(0.001)
            try:
                start(name)
                raise AssertionError("%s: a second call named %s did not raise" % (what, name))
            except ValueError:
                pass
        hvd.synchronize(first)
        again = start(name)  # done: the name is free again
        hvd.synchronize(again)
    print("duplicates ok rank %d" % rank, flush=True)


# -- DistributedOptimizer ----------------------------------------------------------------------


def optimizer():
    def data(r):
        g = torch.Generator().manual_seed(70 + r)
        return torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)


    def make():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)).double()


    # Without named_parameters, over the set {0, 2}: its members step on their average gradient;
    # rank 1 (outside it) on its own.
    model = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   process_set=evens)
    names = opt._parameter_names
    assert len(set(names.values())) == len(names) == 4, names
    members = [0, 2] if rank in (0, 2) else [rank]
    ref = make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    for r in members:
        xr, yr = data(r)
        (torch.nn.functional.mse_loss(ref(xr.double()), yr.double()) / len(members)).backward()
    ref_opt.step()
    xr, yr = data(rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(xr.double()), yr.double()).backward()
    opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-12), ("process-set optimizer", n, p, q)

    # Horovod's explicit fusion groups (a number, or lists of parameters), over every worker.
    for i, groups in enumerate((2, "lists")):
        model = make()
        if groups == "lists":
            groups = [[model[0].weight, model[1].bias]]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), groups=groups,
                                       prefix="groups.%d" % i)
        ref = make()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for r in range(size):
            xr, yr = data(r)
            (torch.nn.functional.mse_loss(ref(xr.double()), yr.double()) / size).backward()
        ref_opt.step()
        xr, yr = data(rank)
        torch.nn.functional.mse_loss(model(xr.double()), yr.double()).backward()
        opt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-12), ("groups", groups, n)

    # Sparse gradients (SparseAdam, which takes sparse ones only), sparse or densified on the way.
    inputs = [torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]), torch.tensor([[1, 3, 4], [4, 7, 9]]),
              torch.tensor([[0, 0, 8]])]
    for as_dense in (False, True):
        torch.manual_seed(9)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        ref = torch.nn.Embedding(10, 3, sparse=True)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=as_dense, prefix="sparse.%d" % as_dense)
        emb(inputs[rank]).sum().backward()
        opt.step()
        assert emb.weight.grad.is_sparse
        ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
        loss = sum(ref(inputs[r]).sum() for r in range(size)) / size
        loss.backward()
        ref_opt.step()
        assert torch.allclose(emb.weight, ref.weight, atol=1e-6), ("sparse", as_dense)

    # The sparse allreduce's handle is callable, as Horovod's.
    dense = torch.zeros(6, 2)
    dense[rank] = rank + 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Sum)
    want = torch.zeros(6, 2)
    for r in range(size):
        want[r] = r + 1.0
    assert torch.equal(handle().to_dense(), want)
    assert torch.equal(hvd.synchronize(handle).to_dense(), want)

    # broadcast_optimizer_state with a parameter that takes no gradient: the others get one.
    net = torch.nn.Module()
    net.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    net.b = torch.nn.Parameter(torch.rand(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=net.named_parameters(), prefix="nograd")
    hvd.broadcast_parameters(net.state_dict(), root_rank=0, prefix="nograd")
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert net.a.grad is None and net.b.grad is not None
    assert torch.equal(hvd.broadcast(net.b.grad, 0, name="nograd.b"), net.b.grad)
    print("optimizer ok rank %d" % rank, flush=True)


# -- Errors, as Horovod raises them ------------------------------------------------------------


def errors():
    # A reduce-scatter of shapes that split alike but differ: MismatchError (a RuntimeError) on
    # every rank, from the shapes step; the job goes on.
    shape = [17, 23 * 57] if rank == 0 else [17, 23, 57]
    try:
        hvd.reducescatter(torch.ones(*shape), name="e.rs")
        raise AssertionError("reducescatter of mismatched shapes did not raise")
    except RuntimeError as e:
        assert isinstance(e, gradlink.MismatchError), e
    # alltoall's splits must be integers (ValueError).
    try:
        hvd.alltoall(torch.ones(size), torch.ones(size, dtype=torch.float32))
        raise AssertionError("float splits did not raise")
    except ValueError:
        pass
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="e.after"),
                       torch.full((3,), float(size)))
    # A broadcast whose ranks disagree on the dtype: MismatchError on every rank.
    try:
        hvd.broadcast(torch.zeros(4, dtype=torch.int32 if rank % 2 else torch.float32), 0,
                      name="e.bdtype")
        raise AssertionError("broadcast of mismatched dtypes did not raise")
    except RuntimeError as e:
        assert isinstance(e, gradlink.GradlinkError), e


SECTIONS = [autograd, broadcast, scaling, duplicates, optimizer, errors]
chosen = sys.argv[1:] or [f.__name__ for f in SECTIONS]
for section in SECTIONS:
    if section.__name__ in chosen:
        section()
print("HVD SEMANTICS OK rank %d" % rank, flush=True)
