"""The staging pipeline (gradlink/torch/_staging.py) in a real job: tensors on STAGING_DEVICE
("cpu": host tensors through the pipeline with its CPU copy engine, GRADLINK_STAGE_HOST=1;
"cuda": CUDA tensors, with its CUDA engine) against the same values pushed from host memory
without staging, bit for bit, every dtype, sums and averages; many chunks each
(GRADLINK_STAGING_CHUNK_BYTES, set by the test), pushed in chunk order; host buffers reused by
the next step; a non-contiguous tensor; a grouped push_pull mixing staged and plain members; work
queued on the current stream before the call is in the sum (CUDA); a disagreement on averaging
fails every rank's staged op with MismatchError. Asserts inside; prints "STAGING OK rank r".
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradlink  # noqa: E402
import gradlink.torch as gl  # noqa: E402
from gradlink.torch import _core  # noqa: E402

torch.set_num_threads(1)
DEVICE = os.environ.get("STAGING_DEVICE", "cpu")
gl.init()
rank, size = gl.rank(), gl.size()
CHUNK = int(os.environ["GRADLINK_STAGING_CHUNK_BYTES"])


def staged(on):
    """Host tensors through the pipeline (on) or straight to the worker (off); device tensors
    are always staged."""
    os.environ["GRADLINK_STAGE_HOST"] = "1" if on and DEVICE == "cpu" else "0"


def values(dtype, n, step, r=None):
    r = rank if r is None else r
    g = torch.Generator().manual_seed(7919 * step + 104729 * r + 13)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100 / 3).to(dtype)
    return torch.randint(-50000, 50000, (n,), generator=g, dtype=torch.int64).to(dtype)


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(
        torch.int32 if t.element_size() == 4 else torch.int64)


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
N = 10007  # not a multiple of any chunk: a short last chunk

for step in range(2):
    for dtype in DTYPES:
        for average in ([False, True] if dtype.is_floating_point else [False]):
            tag = "%s.%s" % (str(dtype).split(".")[1], "avg" if average else "sum")
            staged(False)
            want = gl.push_pull(values(dtype, N, step), average=average, name="ref." + tag)
            staged(True)
            t = values(dtype, N, step).to(DEVICE)
            h = gl.push_pull_async(t, average=average, name="staged." + tag)
            assert isinstance(h, gl._staging.StagedOp), type(h)
            chunks = (N * t.element_size() + CHUNK - 1) // CHUNK
            assert len(h.chunks) == chunks > 1, (len(h.chunks), chunks)
            got = gl.synchronize(h)
            assert got is t and h.poll()
            assert h.pushed == list(range(chunks)), h.pushed  # in chunk order
            assert same_bits(t, want), (tag, step, (t.cpu().double() - want.double()).abs().max())
    stats = _core.staging_stats()
    assert stats["path"].startswith("pinned host staging"), stats
    if step == 0:
        first = stats
        assert first["allocated"] > 0, first
    else:  # the second step took every buffer from the pool
        assert stats["allocated"] == first["allocated"], (first, stats)
        assert stats["reused"] >= first["allocated"], (first, stats)

# A non-contiguous tensor: summed through a contiguous copy, written back by synchronize().
staged(False)
base = values(torch.float32, 64 * 48, 5).reshape(64, 48)
want = gl.push_pull(base.clone(), average=False, name="ref.t")
staged(True)
t = values(torch.float32, 64 * 48, 5).reshape(64, 48).to(DEVICE).t()
assert not t.is_contiguous()
gl.push_pull(t, average=False, name="staged.t")
assert same_bits(t.t(), want)

# A group: staged members one by one, the plain ones (CPU, unstaged) as a fused group.
staged(False)
wants = [gl.push_pull(values(torch.float32, n, 6 + i), average=True, name="ref.g%d" % i)
         for i, n in enumerate([300, 5000, 17])]
staged(True)
members = [values(torch.float32, n, 6 + i) for i, n in enumerate([300, 5000, 17])]
members[1] = members[1].to(DEVICE)  # the large one staged (on the device, or host-staged)
out = gl.grouped_push_pull(members, average=True, names=["staged.g%d" % i for i in range(3)])
assert len(out) == 3 and all(a is b for a, b in zip(out, members))
for m, w in zip(members, wants):
    assert same_bits(m, w)

if DEVICE == "cuda":
    # Work queued on the current stream before the call is in the sum: a long kernel, then the
    # push_pull, no synchronisation between them.
    staged(False)
    want = gl.push_pull(values(torch.float32, N, 9) * 3, average=False, name="ref.stream")
    t = values(torch.float32, N, 9).cuda()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64  # keeps the stream busy
    t.mul_(3)
    gl.push_pull(t, average=False, name="staged.stream")
    assert same_bits(t, want)

# Ranks that disagree on averaging: every rank's staged op fails with MismatchError.
staged(True)
t = values(torch.float32, N, 11).to(DEVICE)
try:
    gl.push_pull(t, average=(rank == 0), name="staged.mismatch")
except gradlink.MismatchError as e:
    assert "averag" in str(e), e
else:
    raise AssertionError("no MismatchError for ranks that disagree on averaging")

# A chunk's key named as another shape's before (names are labels per call): planned afresh.
staged(False)
gl.push_pull(torch.zeros(5), average=False, name="reused#0/3")
staged(True)
t = values(torch.float32, 3 * CHUNK // 4, 12).to(DEVICE)  # 3 chunks
want = sum(values(torch.float32, 3 * CHUNK // 4, 12, r) for r in range(size)).to(DEVICE)
gl.push_pull(t, average=False, name="reused")
assert torch.allclose(t, want), (t[:3], want[:3])

# Chunks whose keys cannot be declared (their names too long by one character: chunks 10 and
# 11 of 12; chunks 0 to 9 are declared and run): the staged op fails naming that error, the
# other chunks end, nothing hangs.
t = values(torch.float32, 12 * CHUNK // 4, 13).to(DEVICE)  # 12 chunks
base = "n" * (4096 - len("#0/12"))
try:
    gl.push_pull(t, average=False, name=base)
except gradlink.GradlinkError as e:
    assert "1 to 4096 characters" in str(e), e
else:
    raise AssertionError("no error for chunks whose names are too long")
t = values(torch.float32, 3 * CHUNK // 4, 14).to(DEVICE)
want = sum(values(torch.float32, 3 * CHUNK // 4, 14, r) for r in range(size)).to(DEVICE)
gl.push_pull(t, average=False, name="after")
assert torch.allclose(t, want), (t[:3], want[:3])

print("STAGING OK rank %d" % rank)
gl.shutdown()
