"""The "gradlink" torch.distributed backend, every operation against Gloo in the same processes
(a gloo group of the same ranks), bit for bit where torch 1.13's Gloo has the operation and
its result is deterministic (integers, min/max, routing), against a single-process computation
otherwise (float sums in gradlink's rank order, AVG, bf16, reduce-scatter, list all-to-all);
subgroups; async work and futures; clear errors for what is not supported.

argv: rank, world size, a directory for the FileStore. Prints "C10D OPS OK" at the end."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import gradlink.torch  # noqa: F401  (registers the backend)
from common import rank_data

rank, size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
assert dist.get_backend() == "gradlink", dist.get_backend()
gloo = dist.new_group(backend="gloo")
R = dist.ReduceOp


def data(r, dtype, n=1031, salt=0):
    return rank_data(r, dtype, n, salt, scale=40)


def reference(dtype, op, tensors):
    """What gradlink computes: in rank order, 16-bit floats in fp32, rounded once."""
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = tensors[0].to(wide).clone()
    for t in tensors[1:]:
        t = t.to(wide)
        if op in (R.SUM, R.AVG):
            acc = acc + t
        elif op == R.PRODUCT:
            acc = acc * t
        elif op == R.MIN:
            acc = torch.minimum(acc, t)
        elif op == R.MAX:
            acc = torch.maximum(acc, t)
    if op == R.AVG:
        acc = torch.div(acc, len(tensors), rounding_mode="trunc") if not acc.is_floating_point() \
            else acc / len(tensors)
    return acc.to(dtype)


checked = 0

# all_reduce: every op, every dtype. Gloo bit for bit where it is deterministic.
INTS = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
for dtype in INTS + FLOATS:
    for op in (R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT):
        if op == R.AVG and dtype in (torch.int16, torch.int8, torch.uint8):
            continue  # (gradlink's integer average is int32's; torch has no rule for these)
        mine = data(rank, dtype, salt=1)
        if op == R.PRODUCT and dtype.is_floating_point:
            mine = 1 + mine / 400  # keep products finite
            mine = mine.to(dtype)
        ours = mine.clone()
        dist.all_reduce(ours, op=op)
        everyone = [data(r, dtype, salt=1) if not (op == R.PRODUCT and dtype.is_floating_point)
                    else (1 + data(r, dtype, salt=1) / 400).to(dtype) for r in range(size)]
        deterministic = not dtype.is_floating_point or op in (R.MIN, R.MAX)
        if deterministic and op != R.AVG and dtype != torch.int16 and dtype != torch.bfloat16:
            theirs = mine.clone()
            dist.all_reduce(theirs, op=op, group=gloo)
        else:
            theirs = reference(dtype, op, everyone)
        assert torch.equal(ours, theirs), ("all_reduce", dtype, op, (ours - theirs).abs().max())
        checked += 1

# bool: sum and max are "or", min and product "and".
b = data(rank, torch.bool, salt=2)
everyone = torch.stack([data(r, torch.bool, salt=2) for r in range(size)])
for op, want in ((R.SUM, everyone.any(0)), (R.MAX, everyone.any(0)), (R.MIN, everyone.all(0)),
                 (R.PRODUCT, everyone.all(0))):
    t = b.clone()
    dist.all_reduce(t, op=op)
    assert torch.equal(t, want), ("bool all_reduce", op)
    checked += 1

# A non-contiguous tensor is reduced in place like a contiguous one.
m = data(rank, torch.float64, n=64, salt=3).view(8, 8).t()
want = reference(torch.float64, R.SUM, [data(r, torch.float64, n=64, salt=3).view(8, 8).t()
                                        for r in range(size)])
dist.all_reduce(m)
assert torch.equal(m, want), "non-contiguous all_reduce"

# all_reduce_coalesced
ts = [data(rank, torch.int64, n=n, salt=4) for n in (5, 700, 33)]
ours = [t.clone() for t in ts]
dist.all_reduce_coalesced(ours)
theirs = [t.clone() for t in ts]
for t in theirs:
    dist.all_reduce(t, group=gloo)
assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), "all_reduce_coalesced"
checked += 1
# A tensor it cannot reduce, after one it can: the call fails naming it, and nothing was
# started (no sum arrives later in the first tensor). Straight to the process group: torch's
# all_reduce_coalesced() refuses mixed dtypes itself (and views complex tensors as real).
first = data(rank, torch.float32, n=300, salt=5)
before = first.clone()
try:
    dist.distributed_c10d._get_default_group().allreduce_coalesced(
        [first, torch.ones(3, dtype=torch.complex64)], dist.AllreduceCoalescedOptions())
except RuntimeError as e:
    assert "no reduction of ComplexFloat" in str(e), str(e)
else:
    raise AssertionError("allreduce_coalesced of a complex tensor did not raise")
dist.barrier()
time.sleep(0.3)
assert torch.equal(first, before), "all_reduce_coalesced started a sum before failing"

# Routing: broadcast, all_gather, gather, scatter, all_to_all_single: every dtype bit for bit
# (Gloo where it has the dtype; the other ranks' known data otherwise).
GLOO_ROUTES = (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64,
               torch.int8, torch.uint8)
OTHERS = (torch.bfloat16, torch.int16, torch.bool, torch.complex64, torch.complex128)
for dtype in GLOO_ROUTES + OTHERS:
    gl_has = dtype in GLOO_ROUTES
    for root in range(size):
        mine = data(rank, dtype, salt=5)
        ours = mine.clone()
        dist.broadcast(ours, root)
        theirs = mine.clone()
        if gl_has:
            dist.broadcast(theirs, root, group=gloo)
        else:
            theirs = data(root, dtype, salt=5)
        assert torch.equal(ours, theirs), ("broadcast", dtype, root)
        checked += 1

    mine = data(rank, dtype, n=300, salt=6).view(100, 3)
    ours = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(ours, mine)
    everyone = [data(r, dtype, n=300, salt=6).view(100, 3) for r in range(size)]
    if gl_has:
        theirs = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(theirs, mine, group=gloo)
        assert all(torch.equal(a, b) for a, b in zip(theirs, everyone))
    assert all(torch.equal(a, b) for a, b in zip(ours, everyone)), ("all_gather", dtype)
    flat = torch.empty(size * 100, 3, dtype=dtype)
    dist._all_gather_base(flat, mine)
    assert torch.equal(flat, torch.cat(everyone)), ("_all_gather_base", dtype)
    checked += 2

    root = size - 1
    out = [torch.empty_like(mine) for _ in range(size)] if rank == root else None
    dist.gather(mine, out, dst=root)
    if rank == root:
        assert all(torch.equal(a, b) for a, b in zip(out, everyone)), ("gather", dtype)
    parts = [data(100 + j, dtype, n=300, salt=7).view(100, 3) for j in range(size)]
    got = torch.empty_like(mine)
    dist.scatter(got, parts if rank == 0 else None, src=0)
    assert torch.equal(got, parts[rank]), ("scatter", dtype)
    checked += 2

    # all_to_all_single, even and with uneven splits (Gloo has both).
    x = data(rank, dtype, n=size * 20, salt=8).view(size * 10, 2)
    ours = torch.empty_like(x)
    dist.all_to_all_single(ours, x)
    if gl_has:
        theirs = torch.empty_like(x)
        dist.all_to_all_single(theirs, x, group=gloo)
        assert torch.equal(ours, theirs), ("all_to_all_single", dtype)
    else:
        want = torch.cat([data(r, dtype, n=size * 20, salt=8).view(size * 10, 2)[
            rank * 10:(rank + 1) * 10] for r in range(size)])
        assert torch.equal(ours, want), ("all_to_all_single", dtype)
    send = [(rank + j) % 3 + (j == 0) for j in range(size)]   # rows to rank j
    recv = [(i + rank) % 3 + (rank == 0) for i in range(size)]  # rows from rank i
    x = data(rank, dtype, n=2 * sum(send), salt=9).view(sum(send), 2)
    ours = torch.empty(sum(recv), 2, dtype=dtype)
    dist.all_to_all_single(ours, x, recv, send)
    pieces = []
    for i in range(size):
        s_i = [(i + j) % 3 + (j == 0) for j in range(size)]
        xi = data(i, dtype, n=2 * sum(s_i), salt=9).view(sum(s_i), 2)
        pieces.append(xi[sum(s_i[:rank]):sum(s_i[:rank + 1])])
    assert torch.equal(ours, torch.cat(pieces)), ("all_to_all_single uneven", dtype)
    if gl_has:
        theirs = torch.empty(sum(recv), 2, dtype=dtype)
        dist.all_to_all_single(theirs, x, recv, send, group=gloo)
        assert torch.equal(ours, theirs), ("all_to_all_single uneven vs gloo", dtype)
    checked += 2

# all_to_all (lists; torch 1.13's Gloo has none): against the known data.
ins = [data(10 * rank + j, torch.float32, n=3 + j + rank, salt=10) for j in range(size)]
outs = [torch.empty(3 + rank + i) for i in range(size)]
dist.all_to_all(outs, ins)
for i in range(size):
    assert torch.equal(outs[i], data(10 * i + rank, torch.float32, n=3 + rank + i, salt=10)), \
        ("all_to_all", i)
checked += 1

# reduce_scatter (list) and _reduce_scatter_base, every op: against the rank-order reference.
for dtype in (torch.float32, torch.int64, torch.bfloat16):
    for op in (R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT):
        lens = [7 + r for r in range(size)]
        mine = [data(10 * rank + j, dtype, n=lens[j], salt=11) for j in range(size)]
        if op == R.PRODUCT and dtype.is_floating_point:
            mine = [(1 + m / 400).to(dtype) for m in mine]
        out = torch.empty(lens[rank], dtype=dtype)
        dist.reduce_scatter(out, mine, op=op)
        everyone = [data(10 * r + rank, dtype, n=lens[rank], salt=11) for r in range(size)]
        if op == R.PRODUCT and dtype.is_floating_point:
            everyone = [(1 + m / 400).to(dtype) for m in everyone]
        assert torch.equal(out, reference(dtype, op, everyone)), ("reduce_scatter", dtype, op)
        x = torch.cat([data(10 * rank + j, dtype, n=9, salt=12) for j in range(size)])
        out = torch.empty(9, dtype=dtype)
        if op == R.PRODUCT and dtype.is_floating_point:
            x = (1 + x / 400).to(dtype)
        dist._reduce_scatter_base(out, x, op=op)
        everyone = [data(10 * r + rank, dtype, n=9, salt=12) for r in range(size)]
        if op == R.PRODUCT and dtype.is_floating_point:
            everyone = [(1 + m / 400).to(dtype) for m in everyone]
        assert torch.equal(out, reference(dtype, op, everyone)), ("_reduce_scatter_base", dtype, op)
        checked += 2

# reduce: the root gets Gloo's result; the others' tensors are left as they were.
for op in (R.SUM, R.MAX, R.PRODUCT):
    mine = data(rank, torch.int64, salt=13)
    ours = mine.clone()
    dist.reduce(ours, dst=1, op=op)
    theirs = mine.clone()
    dist.reduce(theirs, dst=1, op=op, group=gloo)
    if rank == 1:
        assert torch.equal(ours, theirs), ("reduce", op)
    else:
        assert torch.equal(ours, mine), ("reduce leaves a non-root alone", op)
    checked += 1

# torch 2.x only: several all_gather_into_tensor / reduce_scatter_tensor calls as one Work
# (dist._coalescing_manager's fast path: the backend's allgather_into_tensor_coalesced and
# reduce_scatter_tensor_coalesced), and the functional collectives (DTensor's), which issue
# even a single one that way. Against the ranks' known data and the rank-order reference.
if int(torch.__version__.split(".")[0]) >= 2:
    import torch.distributed._functional_collectives as funcol
    cases = (((5, 3), torch.float32), ((7,), torch.int64), ((1, 1), torch.bfloat16),
             ((0,), torch.float32), ((4, 2), torch.complex64))

    def numel(shape):
        n = 1
        for d in shape:
            n *= d
        return n

    ins = [data(rank, dt, n=numel(s), salt=20 + k).view(s) for k, (s, dt) in enumerate(cases)]
    outs = [torch.empty((size * s[0],) + s[1:], dtype=dt) for s, dt in cases]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i, async_op=True)
    cm.wait()
    for k, (o, (s, dt)) in enumerate(zip(outs, cases)):
        want = torch.cat([data(r, dt, n=numel(s), salt=20 + k).view(s) for r in range(size)])
        assert torch.equal(o, want), ("coalesced all_gather_into_tensor", k, dt)
    checked += 1
    for op in (R.SUM, R.MAX, R.AVG):
        cases = ((6, torch.float32), (9, torch.int64), (4, torch.bfloat16))
        ins = [data(rank, dt, n=size * n, salt=25 + k) for k, (n, dt) in enumerate(cases)]
        outs = [torch.empty(n, dtype=dt) for n, dt in cases]
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.reduce_scatter_tensor(o, i, op=op, async_op=True)
        cm.wait()
        for k, (o, (n, dt)) in enumerate(zip(outs, cases)):
            parts = [data(r, dt, n=size * n, salt=25 + k)[rank * n:(rank + 1) * n]
                     for r in range(size)]
            assert torch.equal(o, reference(dt, op, parts)), \
                ("coalesced reduce_scatter_tensor", op, k, dt)
        checked += 1
    x = data(rank, torch.float32, n=size * 4, salt=28)
    everyone = [data(r, torch.float32, n=size * 4, salt=28) for r in range(size)]
    world = dist.group.WORLD
    got = funcol.all_gather_tensor(x, 0, world).wait()
    assert torch.equal(got, torch.cat(everyone)), "funcol.all_gather_tensor"
    got = funcol.reduce_scatter_tensor(x, "sum", 0, world).wait()
    want = reference(torch.float32, R.SUM, [e[rank * 4:(rank + 1) * 4] for e in everyone])
    assert torch.equal(got, want), "funcol.reduce_scatter_tensor"
    got = funcol.all_reduce(x, "sum", world).wait()
    assert torch.equal(got, reference(torch.float32, R.SUM, everyone)), "funcol.all_reduce"
    checked += 3

# Async work: wait(), is_completed(), is_success(), and the future's value.
t = data(rank, torch.int32, salt=14)
w = dist.all_reduce(t, async_op=True)
fut = w.get_future()
value = fut.wait()
w.wait()
assert w.is_completed() and w.is_success(), "work state"
want = data(rank, torch.int32, salt=14)
dist.all_reduce(want, group=gloo)
assert torch.equal(t, want) and torch.equal(value[0], want), "async all_reduce"
# Many in flight at once, of one signature (slots) and of several.
ts = [data(rank + 10 * k, torch.int64, n=257 + (k % 3), salt=15) for k in range(12)]
works = [dist.all_reduce(t, async_op=True) for t in ts]
for w in works:
    w.wait()
for k, t in enumerate(ts):
    want = data(rank + 10 * k, torch.int64, n=257 + (k % 3), salt=15)
    dist.all_reduce(want, group=gloo)
    assert torch.equal(t, want), ("in flight", k)
checked += 2

# Subgroups: gradlink's group operations over those ranks, against a gloo group of them.
members = [0, size - 1]
sub = dist.new_group(members, backend="gradlink")
sub_gloo = dist.new_group(members, backend="gloo")
pair = dist.new_group([0, 1], backend="gradlink")  # another group, another name
if rank in members:
    for op in (R.SUM, R.MAX):
        mine = data(rank, torch.int64, salt=16)
        ours, theirs = mine.clone(), mine.clone()
        dist.all_reduce(ours, op=op, group=sub)
        dist.all_reduce(theirs, op=op, group=sub_gloo)
        assert torch.equal(ours, theirs), ("subgroup all_reduce", op)
    avg = data(rank, torch.float64, salt=17)
    dist.all_reduce(avg, op=R.AVG, group=sub)
    want = reference(torch.float64, R.AVG, [data(r, torch.float64, salt=17) for r in members])
    assert torch.equal(avg, want), "subgroup AVG divides by the group's size"
    b = data(rank, torch.float32, salt=18)
    dist.broadcast(b, src=size - 1, group=sub)  # src is a global rank
    assert torch.equal(b, data(size - 1, torch.float32, salt=18)), "subgroup broadcast"
    outs = [torch.empty(50) for _ in members]
    dist.all_gather(outs, data(rank, torch.float32, n=50, salt=19), group=sub)
    assert all(torch.equal(o, data(r, torch.float32, n=50, salt=19))
               for o, r in zip(outs, members)), "subgroup all_gather"
    dist.barrier(group=sub)
    checked += 5
if rank in (0, 1):
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=pair)
    assert torch.equal(t, torch.full((4,), 3.0)), "second subgroup"

# What gradlink does not do: a clear error naming it, never a hang.
# (send / recv are supported now: jobs/c10d_p2p.py.)
for what, call in (("BAND", lambda: dist.all_reduce(torch.ones(1, dtype=torch.int32),
                                                    op=R.BAND)),
                   ("split sizes expect", lambda: dist.all_to_all_single(
                       torch.empty(size + (rank == 0)), torch.ones(size),
                       [1 + (rank == 0 and i == 1) for i in range(size)], [1] * size))):
    try:
        call()
    except RuntimeError as e:
        assert what.lower() in str(e).lower(), (what, str(e))
    else:
        raise AssertionError("%s did not raise" % what)
checked += 2

dist.barrier()
# Every one of them went through gradlink's worker (and nothing through a fallback).
done = gradlink.torch.stats()["push_pulls"]
assert done >= checked, (done, checked)
print("C10D OPS OK rank %d: %d checks" % (rank, checked), flush=True)
dist.destroy_process_group()
