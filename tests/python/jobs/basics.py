"""push_pull / broadcast semantics on every dtype, async handles, barrier (asserts inside)."""

import torch

import gradlink
import gradlink.torch as gl

gl.init()
rank, size = gl.rank(), gl.size()
assert gl.is_initialized() and 0 <= rank < size and gl.num_servers() >= 1

# Sum and average on every dtype; small integers are exact everywhere.
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
              torch.int64):
    x = ((torch.arange(1000) % 7) + rank).to(dtype)
    gl.push_pull(x, average=False, name="sum.%s" % dtype)
    want = (torch.arange(1000) % 7) * size + sum(range(size))
    assert torch.equal(x.long(), want), (dtype, x[:5], want[:5])
    y = torch.full((33,), 2 * (rank + 1), dtype=dtype)
    gl.push_pull(y, average=True, name="avg.%s" % dtype)
    avg = 2 * sum(r + 1 for r in range(size)) / size
    if dtype in (torch.int32, torch.int64):
        avg = int(avg)
    assert torch.all(y == torch.tensor(avg, dtype=dtype)), (dtype, y[:3], avg)

# Non-contiguous tensors: summed through a copy, written back.
base = torch.arange(12, dtype=torch.float32).view(3, 4)
t = base.t()
gl.push_pull(t, average=False, name="noncontig")
assert torch.equal(base, torch.arange(12, dtype=torch.float32).view(3, 4) * size)

# Async: several in flight, in any order; a large one cut into partitions.
handles = [gl.push_pull_async(torch.full((100000 * (i + 1),), float(rank + i)), average=False,
                              name="async.%d" % i, priority=i) for i in range(4)]
for i, h in reversed(list(enumerate(handles))):
    out = gl.synchronize(h)
    assert gl.poll(h)
    assert torch.all(out == sum(r + i for r in range(size))), i
big = torch.ones(3 << 20)  # 12 MiB: several partitions over the servers
gl.push_pull(big, average=False, name="big")
assert torch.all(big == size)

# The same name again: a new round of the same key.
for step in range(5):
    z = torch.full((10,), float(step * (rank + 1)))
    gl.push_pull(z, average=False, name="again")
    assert torch.all(z == step * sum(r + 1 for r in range(size)))

# Unnamed calls (same order on every worker).
u = torch.ones(3)
gl.push_pull(u, average=False)
assert torch.all(u == size)

# Broadcast: exact, any dtype.
for dtype in (torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8, torch.int8,
              torch.complex64):
    v = (torch.arange(20) * (rank + 3) % 5).to(dtype)
    gl.broadcast_(v, root_rank=size - 1, name="bcast.%s" % dtype)
    assert torch.equal(v, (torch.arange(20) * (size - 1 + 3) % 5).to(dtype)), dtype

# A name back with another shape and dtype (Horovod's names are labels per call): the earlier
# declaration is retired, the new one planned and summed; then the first shape again.
for shape, dtype in (((11,), torch.float32), ((2, 3), torch.float64), ((10,), torch.float32)):
    w = torch.full(shape, float(rank + 1), dtype=dtype)
    gl.push_pull(w, average=False, name="again")
    assert w.dtype == dtype and torch.all(w == sum(r + 1 for r in range(size))), (shape, w)

# Unsupported dtype for push_pull.
try:
    gl.push_pull(torch.ones(3, dtype=torch.uint8), name="u8")
    raise AssertionError("no error for uint8")
except gradlink.InvalidArgumentError as e:
    assert isinstance(e, ValueError)

# Which path the sums took: through shared memory only when the same-host path is on.
import os  # noqa: E402
local = gl.stats()["bytes_copied_local"]
if os.environ.get("GRADLINK_LOCAL_ARENA_BYTES") != "0":  # on by default
    assert local > 12 << 20, local
else:
    assert local == 0, local

gl.barrier()
gl.barrier(timeout=30)
print("BASICS OK rank %d" % rank)
gl.shutdown()
gl.shutdown()  # idempotent
assert not gl.is_initialized()
