"""horovod.torch's allgather (uneven first dimensions, every dtype), allgather_object,
reducescatter, alltoall with splits and broadcast_, against single-process references; shapes
that disagree raise MismatchError on every rank (asserts inside)."""

import torch

import gradlink
import gradlink.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
import json, os, sys  # noqa: E401,E402
timeline_path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "timeline.%d.json" % rank)
hvd.start_timeline(timeline_path)


def piece(r, dtype=torch.float32):
    g = torch.Generator().manual_seed(50 + r)
    rows = r + 1  # uneven: rank r has r + 1 rows
    x = torch.randn(rows, 3, generator=g)
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return (x * 100).to(dtype)
    return x.to(dtype)


for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
              torch.int64, torch.bool, torch.uint8, torch.int16):
    got = hvd.allgather(piece(rank, dtype), name="ag.%s" % dtype)
    want = torch.cat([piece(r, dtype) for r in range(size)])
    assert got.dtype == dtype and torch.equal(got, want), (dtype, got[:2], want[:2])
# Signs of zero survive (-0.0 padding).
z = torch.tensor([-0.0, 0.0]) if rank == 0 else torch.tensor([0.0])
g = hvd.allgather(z, name="zeros")
assert torch.signbit(g[0]) and not torch.signbit(g[1]), g
# Async, grouped, objects.
assert torch.equal(hvd.synchronize(hvd.allgather_async(piece(rank), name="ag.async")),
                   torch.cat([piece(r) for r in range(size)]))
gs = hvd.grouped_allgather([piece(rank), piece(rank, torch.int64)], name="ag.grouped")
assert torch.equal(gs[1], torch.cat([piece(r, torch.int64) for r in range(size)]))
objs = hvd.allgather_object({"rank": rank, "text": "x" * rank}, name="obj")
assert objs == [{"rank": r, "text": "x" * r} for r in range(size)], objs

# Shapes that disagree beyond the first dimension: MismatchError on every rank, naming them.
try:
    hvd.allgather(torch.zeros(2, 3 if rank != 1 else 4), name="bad")
except gradlink.MismatchError as e:
    assert "rank 1" in str(e), str(e)
else:
    raise AssertionError("mismatched allgather did not raise")

# reducescatter: the sum (or average) cut along the first dimension, the first ranks one more.
rows = 2 * size + 1
x = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) * (rank + 1)
total = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) * sum(r + 1 for r in range(size))
sizes = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
start = sum(sizes[:rank])
part = hvd.reducescatter(x, op=hvd.Sum, name="rs")
assert torch.equal(part, total[start:start + sizes[rank]]), (part, total)
part = hvd.reducescatter(x, name="rs.avg")
assert torch.allclose(part, total[start:start + sizes[rank]] / size)

# alltoall with splits: rank r sends (j + r) % 3 rows to rank j, rows tagged by sender/target.
def sent(r):
    splits = [(j + r) % 3 for j in range(size)]
    rows = [torch.tensor([[100 * r + j, k]], dtype=torch.int64)
            for j in range(size) for k in range(splits[j])]
    return (torch.cat(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)), splits


t, splits = sent(rank)
out, got = hvd.alltoall(t, splits=splits, name="a2a")
want = [torch.tensor([[100 * r + rank, k]], dtype=torch.int64)
        for r in range(size) for k in range(sent(r)[1][rank])]
want = torch.cat(want) if want else torch.zeros(0, 2, dtype=torch.int64)
assert torch.equal(out, want), (out, want)
assert got.tolist() == [sent(r)[1][rank] for r in range(size)]
even = hvd.alltoall(torch.full((size, 2), rank, dtype=torch.int32), name="a2a.even")
assert torch.equal(even, torch.arange(size, dtype=torch.int32).repeat_interleave(2).view(size, 2))

# broadcast_ in place.
b = torch.full((5,), float(rank))
assert hvd.broadcast_(b, root_rank=size - 1, name="b_") is b and torch.all(b == size - 1)

# The timeline: Chrome-trace JSON, one row per tensor, stages in order and not overlapping.
hvd.stop_timeline()
trace = json.load(open(timeline_path))["traceEvents"]
rows = {e["args"]["name"]: e["tid"] for e in trace if e["name"] == "thread_name"}
assert "allgather.ag.torch.float32.shapes" in rows, sorted(rows)[:5]
spans = [e for e in trace if e["ph"] == "X"]
assert spans and {e["name"] for e in spans} <= {"pack", "queue", "push", "reduce", "pull",
                                                  "unpack", "server sum"}, {e["name"] for e in spans}
# The servers' own time (from their clocks) nests inside its operation's push and reduce
# stages, at the end of them (reduce is 0 when the pushes' completions came after the sum).
server = [e for e in spans if e["name"] == "server sum"]
assert server, "no server time in the timeline"
for e in server:
    stages = [r for r in spans if r["args"]["op"] == e["args"]["op"] and
              r["name"] in ("push", "reduce")]
    assert stages and all(r["tid"] == e["tid"] for r in stages), e
    begin, end = min(r["ts"] for r in stages), max(r["ts"] + r["dur"] for r in stages)
    assert begin <= e["ts"] + 1e-3 and abs(e["ts"] + e["dur"] - end) <= 1e-3, (e, stages)
for tid in set(e["tid"] for e in spans):
    mine = [e for e in spans if e["tid"] == tid]
    assert all(e["dur"] > 0 and e["pid"] == rank for e in mine)
hvd.shutdown()
print("HVD GATHER OK rank %d" % rank)
