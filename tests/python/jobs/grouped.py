"""grouped_push_pull: exact sums of many tensors of every dtype, shapes and layouts (asserts
inside); copies counted; workers that group differently get TimeoutError, not a wrong sum."""

import torch

import gradlink
import gradlink.torch as gl

# Small buffers and threshold so that a few hundred small tensors fill several buffers and
# some members go unfused.
gl.init(fusion_buffer_bytes=16 << 10, fusion_threshold_bytes=4 << 10)
rank, size = gl.rank(), gl.size()

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def value(i, n, r, step):
    # Small integers: exact in every dtype, and so are their sums.
    return (torch.arange(n) * 7 + i * 31 + r * 3 + step * 5) % 17 - 8


def expected(i, n, step):
    return sum(value(i, n, r, step) for r in range(size))


g = torch.Generator().manual_seed(5)  # the same shapes on every worker
specs = []
for i in range(200):
    dtype = DTYPES[i % len(DTYPES)]
    n = int(torch.randint(1, 400, (1,), generator=g)) if i % 23 else 3000  # some unfused
    specs.append((dtype, n))

before = gl.stats()
for step in range(3):
    tensors = [value(i, n, rank, step).to(dtype) for i, (dtype, n) in enumerate(specs)]
    # Non-contiguous members are summed through a copy and written back.
    base = value(999, 24, rank, step).double().view(4, 6)
    tensors.append(base.t())
    out = gl.grouped_push_pull(tensors, average=False, name="grads")
    assert out is not None and len(out) == len(tensors)
    for i, (dtype, n) in enumerate(specs):
        assert out[i] is tensors[i]
        assert torch.equal(tensors[i].long(), expected(i, n, step)), (step, i, dtype)
    assert torch.equal(base.long().view(-1), expected(999, 24, step)), step

after = gl.stats()
total = sum(n * torch.tensor([], dtype=d).element_size() for d, n in specs) + 24 * 8
assert after["groups"] - before["groups"] == 3, (before, after)
assert after["bytes_reduced"] - before["bytes_reduced"] == 3 * total, (before, after, total)
packed = after["bytes_packed"] - before["bytes_packed"]
assert 0 < packed < 3 * total and packed == after["bytes_unpacked"] - before["bytes_unpacked"]
assert after["fused_ops"] - before["fused_ops"] >= 3 * len(DTYPES)

# Average, async, timing.
xs = [torch.full((50,), float(2 * (rank + 1))) for _ in range(10)]
h = gl.grouped_push_pull_async(xs, average=True, name="avg")
res = gl.synchronize(h)
assert len(res) == len(xs) and all(a is b for a, b in zip(res, xs)) and gl.poll(h)
avg = 2 * sum(r + 1 for r in range(size)) / size
assert all(torch.all(x == avg) for x in xs)
t = h.timing()
assert t["total"] > 0 and abs(sum(v for k, v in t.items() if k != "total") - t["total"]) < 1e-6

# Explicit names; a group of one.
y = torch.ones(5)
gl.grouped_push_pull([y], average=False, names=["single"])
assert torch.all(y == size)

# Bad arguments.
try:
    gl.grouped_push_pull([torch.ones(3)], names=["a", "b"])
    raise AssertionError("no error for names of the wrong length")
except gradlink.InvalidArgumentError:
    pass
try:
    gl.grouped_push_pull([torch.ones(3, dtype=torch.uint8)], name="u8")
    raise AssertionError("no error for uint8")
except gradlink.InvalidArgumentError:
    pass

# Workers that group the same tensors differently: their fused tensors never meet, so each
# waits until its deadline (TimeoutError), and nothing is written into the tensors.
zs = [torch.full((10,), float(rank + 1)) for _ in range(4)]
order = [0, 1, 2, 3] if rank == 0 else [1, 0, 2, 3]
h = gl.grouped_push_pull_async([zs[i] for i in order], average=False,
                               names=["mix.%d" % i for i in order])
try:
    gl.synchronize(h, timeout=1.5)
    raise AssertionError("no TimeoutError for workers that group differently")
except gradlink.TimeoutError as e:
    assert "group the same tensors the same way" in str(e), str(e)
assert all(torch.all(z == rank + 1) for z in zs)

print("GROUPED OK rank %d" % rank)
# Leave at once (pending groups fail with AbortedError).
gl.shutdown()
