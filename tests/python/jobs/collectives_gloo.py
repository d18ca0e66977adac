"""The servers' collectives through gradlink.torch against Gloo (torch.distributed) in the same
processes, bit for bit where torch 1.13's Gloo has the operation (broadcast, even all_gather,
all_to_all_single, integer and floating-point MIN/MAX/PRODUCT all_reduce), and against a
single-process computation where it does not (bf16, reduce-scatter with every op, uneven
splits); disagreeing reduce-scatter shapes raise MismatchError naming the ranks on every rank
(asserts inside). argv[1]: a directory for Gloo's FileStore."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import gradlink
import gradlink.torch as hvd
from common import rank_data

hvd.init()
rank, size = hvd.rank(), hvd.size()
dist.init_process_group("gloo", init_method="file://" + os.path.join(sys.argv[1], "gloo.store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))


def data(r, dtype, n=4099, salt=0):
    return rank_data(r, dtype, n, salt)


# What torch 1.13's Gloo broadcasts, gathers and routes; the others against references.
GLOO_TYPES = (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64,
              torch.int8, torch.uint8)
OTHER_TYPES = (torch.bfloat16, torch.int16, torch.bool, torch.complex64, torch.complex128)

# Broadcast from every root: gradlink's relay equals Gloo's broadcast bit for bit.
for dtype in GLOO_TYPES + OTHER_TYPES:
    for root in range(size):
        mine = data(rank, dtype, salt=1)
        ours = hvd.broadcast_(mine.clone(), root, name="b.%s.%d" % (dtype, root))
        if dtype in GLOO_TYPES:
            theirs = mine.clone()
            dist.broadcast(theirs, root)
        else:
            theirs = data(root, dtype, salt=1)
        assert torch.equal(ours, theirs), ("broadcast", dtype, root)

# allgather (even, so Gloo's all_gather takes it), and alltoall with even splits.
for dtype in GLOO_TYPES + OTHER_TYPES:
    mine = data(rank, dtype, n=600, salt=2).view(200, 3)
    ours = hvd.allgather(mine, name="ag.%s" % dtype)
    parts = [torch.empty_like(mine) for _ in range(size)]
    if dtype in GLOO_TYPES:
        dist.all_gather(parts, mine)
    else:
        parts = [data(r, dtype, n=600, salt=2).view(200, 3) for r in range(size)]
    assert torch.equal(ours, torch.cat(parts)), ("allgather", dtype)
    mine = data(rank, dtype, n=size * 40, salt=3)
    ours = hvd.alltoall(mine, name="a2a.%s" % dtype)
    if dtype in GLOO_TYPES:
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine)
    else:
        theirs = torch.cat([data(r, dtype, n=size * 40, salt=3)[rank * 40:(rank + 1) * 40]
                            for r in range(size)])
    assert torch.equal(ours, theirs), ("alltoall", dtype)

# Min / max / product: Gloo's all_reduce where its result is deterministic (integers; min and
# max of floats), a rank-order fold otherwise.
OPS = ((hvd.Min, dist.ReduceOp.MIN), (hvd.Max, dist.ReduceOp.MAX),
       (hvd.Product, dist.ReduceOp.PRODUCT))
for ours_op, gloo_op in OPS:
    for dtype in (torch.int32, torch.int64, torch.float32, torch.float64):
        if ours_op == hvd.Product and dtype.is_floating_point:
            continue  # Gloo's float product order is its own
        mine = data(rank, dtype, salt=4) if ours_op != hvd.Product else (
            data(rank, torch.int64, salt=4) % 7 + 1).to(dtype)
        ours = hvd.allreduce(mine, op=ours_op, name="op.%s.%s" % (ours_op.name, dtype))
        theirs = mine.clone()
        dist.all_reduce(theirs, op=gloo_op)
        assert torch.equal(ours, theirs), (ours_op.name, dtype, ours[:4], theirs[:4])

# reduce-scatter (Gloo 1.13 has none) with every op, against the fold of every rank's input.
rows = 3 * size + 2
split = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
start = sum(split[:rank])
for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        def inp(r):
            x = data(r, dtype, n=rows * 5, salt=5).view(rows, 5)
            return (x % 3 + 1).to(dtype) if op == hvd.Product else x
        ours = hvd.reducescatter(inp(rank), op=op, name="rs.%s.%s" % (op.name, dtype))
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        acc = inp(0).to(wide)
        for r in range(1, size):
            x = inp(r).to(wide)
            acc = (torch.minimum(acc, x) if op == hvd.Min else torch.maximum(acc, x)
                   if op == hvd.Max else acc * x if op == hvd.Product else acc + x)
        if op == hvd.Average:
            acc = acc / size if wide.is_floating_point else torch.div(acc, size, rounding_mode="trunc")
        want = acc.to(dtype)[start:start + split[rank]]
        assert torch.equal(ours, want), (op.name, dtype, ours[:2], want[:2])

# Reduce-scatter with fp16 compression: fp16 on the wire, summed in fp32, rounded once.
x = data(rank, torch.float32, n=rows * 5, salt=9).view(rows, 5)
ours = hvd.reducescatter(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="rs.fp16")
want = sum(data(r, torch.float32, n=rows * 5, salt=9).view(rows, 5).to(torch.float16).float()
           for r in range(size)).to(torch.float16).float()[start:start + split[rank]]
assert ours.dtype == torch.float32 and torch.equal(ours, want), (ours[:1], want[:1])

# Reduce-scatter shapes that disagree: MismatchError on every rank, naming the ranks.
try:
    hvd.reducescatter(torch.zeros(6 if rank != 1 else 9, 2), op=hvd.Sum, name="rs.bad")
except gradlink.MismatchError as e:
    assert "rank 1" in str(e), str(e)
else:
    raise AssertionError("mismatched reducescatter did not raise")

# Process sets: the even ranks, against Gloo's subgroup of the same ranks.
members = [r for r in range(size) if r % 2 == 0]
evens = hvd.add_process_set(members)
assert evens.process_set_id not in (None, 0) and evens.size() == len(members)
gloo_evens = dist.new_group(members)  # every rank calls new_group
if evens.included():
    x = data(rank, torch.float32, salt=6)
    ours = hvd.allreduce(x, op=hvd.Sum, process_set=evens, name="ps.sum")
    theirs = x.clone()
    dist.all_reduce(theirs, group=gloo_evens)
    assert torch.equal(ours, theirs), "process set sum"
    avg = hvd.allreduce(x, process_set=evens, name="ps.avg")
    assert torch.equal(avg, theirs / len(members)), "process set average"
    mine = data(rank, torch.int64, n=30, salt=7).view(10, 3)
    gathered = hvd.allgather(mine, process_set=evens, name="ps.ag")
    parts = [torch.empty_like(mine) for _ in members]
    dist.all_gather(parts, mine, group=gloo_evens)
    assert torch.equal(gathered, torch.cat(parts)), "process set allgather"
    root = members[-1]
    b = data(rank, torch.float64, salt=8)
    want = b.clone()
    dist.broadcast(want, root, group=gloo_evens)
    assert torch.equal(hvd.broadcast_(b, root, process_set=evens, name="ps.b"), want)
    rows = 2 * len(members) + 1
    part = hvd.reducescatter(torch.arange(rows, dtype=torch.float32) * (rank + 1),
                             op=hvd.Sum, process_set=evens, name="ps.rs")
    split = [rows // len(members) + (1 if i < rows % len(members) else 0)
             for i in range(len(members))]
    at = sum(split[:evens.rank()])
    total = torch.arange(rows, dtype=torch.float32) * sum(r + 1 for r in members)
    assert torch.equal(part, total[at:at + split[evens.rank()]]), (part, total)
    t = torch.full((len(members),), float(rank))
    assert torch.equal(hvd.alltoall(t, process_set=evens, name="ps.a2a"),
                       torch.tensor([float(r) for r in members]))
else:
    try:
        hvd.allreduce(torch.zeros(3), process_set=evens, name="ps.sum")
    except gradlink.InvalidArgumentError as e:
        assert "not in" in str(e), str(e)
    else:
        raise AssertionError("a rank outside the process set ran its allreduce")
hvd.barrier()
assert hvd.remove_process_set(evens)
try:
    hvd.allreduce(torch.zeros(3), process_set=evens, name="ps.gone")
except gradlink.InvalidArgumentError as e:
    assert "not registered" in str(e), str(e)
else:
    raise AssertionError("a removed process set still ran")

dist.destroy_process_group()
hvd.shutdown()
print("COLLECTIVES GLOO OK rank %d" % rank)
