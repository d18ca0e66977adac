"""The "gradlink" backend's all_gather_coalesced and sparse all_reduce, against Gloo in the same
processes (a gloo group of the same ranks), and DDP over an nn.Embedding(sparse=True) against
the same training over Gloo:

* all_gather_coalesced: several dtypes and shapes (an empty tensor, a non-contiguous one), the
  output lists bit for bit and the future's value (a list per rank) as Gloo's;
* sparse all_reduce (SUM): a different nnz on every rank, an empty rank, duplicate entries,
  dense dimensions, float32, float64, int64 (Gloo's dtypes) bit for bit as Gloo's, written
  into the tensor in place, coalesced, and the Work's future holding it; float16, bfloat16,
  bool (which Gloo refuses) against the sum of every rank's entries; a nnz that grows past the
  first capacity; another op, and shapes that differ between ranks, fail on every rank;
* DDP: an nn.Embedding(sparse=True) and a linear layer, SGD, parameters equal to DDP over
  Gloo's (rtol 1e-6) and identical on every rank.

argv: rank, world size, a directory for the FileStore. Prints "C10D SPARSE OK" at the end."""

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradlink.torch  # noqa: F401  (registers the backend)
from common import rank_data

rank, size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
gloo = dist.new_group(backend="gloo")
warnings.filterwarnings("ignore", message=".*all_gather_coalesced will be deprecated")
checked = 0


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# --- all_gather_coalesced ------------------------------------------------------------------
SHAPES = ((5, 3), (7,), (1, 1), (0,), (4, 6))
GLOO_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64,
               torch.int8, torch.uint8)
OTHER_DTYPES = (torch.bfloat16, torch.int16, torch.bool)


def inputs_of(r, dtype):
    ins = [rank_data(r, dtype, numel(s), salt=30 + k).view(s) for k, s in enumerate(SHAPES)]
    ins[-1] = ins[-1].view(6, 4).t()  # non-contiguous
    return ins


for dtype in GLOO_DTYPES + OTHER_DTYPES:
    mine = inputs_of(rank, dtype)
    ours = [[torch.full(s, 7, dtype=dtype) for s in SHAPES] for _ in range(size)]
    fut = dist.all_gather_coalesced(ours, mine, async_op=True)
    value = fut.wait()
    everyone = [inputs_of(r, dtype) for r in range(size)]
    for r in range(size):
        for k in range(len(SHAPES)):
            assert torch.equal(ours[r][k], everyone[r][k]), ("all_gather_coalesced", dtype, r, k)
    if dtype in GLOO_DTYPES:
        theirs = [[torch.full(s, 7, dtype=dtype) for s in SHAPES] for _ in range(size)]
        their_value = dist.all_gather_coalesced(theirs, mine, group=gloo, async_op=True).wait()
        assert all(torch.equal(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)), \
            ("all_gather_coalesced vs gloo", dtype)
        # The future's value: Gloo's structure (a list per rank), holding the output tensors.
        assert len(value) == len(their_value) == size, (len(value), len(their_value))
        for r in range(size):
            assert len(value[r]) == len(their_value[r]) == len(SHAPES)
            for k in range(len(SHAPES)):
                assert torch.equal(value[r][k], their_value[r][k]), ("future value", dtype, r, k)
                if ours[r][k].numel():
                    assert value[r][k].data_ptr() == ours[r][k].data_ptr(), "not the outputs"
    checked += 1
# A mismatched output list: a clear error, nothing started.
try:
    dist.all_gather_coalesced([[torch.empty(2)] for _ in range(size)], [torch.ones(3)])
except RuntimeError as e:
    assert "allgather_coalesced" in str(e) and "shape" in str(e), str(e)
else:
    raise AssertionError("all_gather_coalesced of mismatched outputs did not raise")


# --- sparse all_reduce -----------------------------------------------------------------------
def sparse_of(r, dtype, shape, nnz, sparse_dims, salt, duplicates=True):
    """Rank r's sparse tensor: nnz random entries (some repeated, so uncoalesced) of `shape`
    with `sparse_dims` sparse dimensions."""
    g = torch.Generator().manual_seed(100 * salt + r)
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g)
                       for d in range(sparse_dims)]) if nnz else \
        torch.zeros(sparse_dims, 0, dtype=torch.long)
    if duplicates and nnz > 2:
        idx[:, -1] = idx[:, 0]
    vals = rank_data(r, dtype, nnz * numel(shape[sparse_dims:]), salt=salt, scale=20)
    return torch.sparse_coo_tensor(idx, vals.view((nnz,) + tuple(shape[sparse_dims:])), shape)


def reference(tensors):
    """Gloo's sum: every rank's tensor (coalesced) added in rank order, then coalesced."""
    total = None
    for t in tensors:
        t = t.coalesce()
        t = torch.sparse_coo_tensor(t.indices(), t.values(), t.shape)
        total = t if total is None else total + t
    return total.coalesce()


def same_sparse(a, b):
    return (a.is_coalesced() and b.is_coalesced() and a.shape == b.shape
            and torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values()))


CASES = (  # (shape, sparse dims, nnz per rank, salt)
    ((40, 6), 2, [3 + 5 * r for r in range(size)], 1),
    ((40, 6), 2, [0 if r == 1 else 9 for r in range(size)], 2),    # an empty rank
    ((30, 4, 3), 1, [4 + r for r in range(size)], 3),               # dense dims (4, 3)
    ((8, 5, 2), 2, [7 - 2 * r for r in range(size)], 4),            # dense dim 2
    ((1000,), 1, [300 + 170 * r for r in range(size)], 5),          # a larger capacity
    ((40, 6), 2, [0] * size, 6),                                    # empty everywhere
)
for dtype in (torch.float32, torch.float64, torch.int64):
    for shape, sparse_dims, nnz, salt in CASES:
        mine = sparse_of(rank, dtype, shape, nnz[rank], sparse_dims, salt)
        ours = mine.clone()
        work = dist.all_reduce(ours, async_op=True)
        value = work.get_future().wait()
        work.wait()
        theirs = mine.clone()
        dist.all_reduce(theirs, group=gloo)
        assert same_sparse(ours, theirs), ("sparse all_reduce vs gloo", dtype, shape, nnz)
        everyone = [sparse_of(r, dtype, shape, nnz[r], sparse_dims, salt) for r in range(size)]
        assert same_sparse(ours, reference(everyone)), ("sparse all_reduce", dtype, shape)
        # The sum is in the caller's tensor, which the future's value and result() hold.
        assert len(value) == 1 and same_sparse(value[0], ours), "future value"
        if ours._nnz():
            assert value[0]._values().data_ptr() == ours._values().data_ptr(), "not the tensor"
            assert work.result()[0]._values().data_ptr() == ours._values().data_ptr()
        checked += 1
# On a subgroup (gradlink's group operations over its ranks), against a gloo group of them.
members = [0, size - 1]
sub = dist.new_group(members, backend="gradlink")
sub_gloo = dist.new_group(members, backend="gloo")
if rank in members:
    shape, sparse_dims, nnz, salt = CASES[0]
    mine = sparse_of(rank, torch.float64, shape, nnz[rank], sparse_dims, salt)
    ours, theirs = mine.clone(), mine.clone()
    dist.all_reduce(ours, group=sub)
    dist.all_reduce(theirs, group=sub_gloo)
    assert same_sparse(ours, theirs), "sparse all_reduce on a subgroup"
    checked += 1
# The other dtypes (Gloo refuses all but uint8 and int8 for sparse tensors): against the
# rank-order sum. Where torch's sparse add has no such dtype (torch 1.13: float16, bfloat16,
# bool), every rank fails saying so, and the next operation goes on.
for dtype in (torch.int8, torch.uint8, torch.int16, torch.float16, torch.bfloat16, torch.bool):
    shape, sparse_dims, nnz, salt = CASES[2]
    ours = sparse_of(rank, dtype, shape, nnz[rank], sparse_dims, salt)
    before = ours.clone()
    everyone = [sparse_of(r, dtype, shape, nnz[r], sparse_dims, salt) for r in range(size)]
    try:
        want = reference(everyone)
    except RuntimeError as e:
        want = str(e)
    try:
        dist.all_reduce(ours)
    except RuntimeError as e:
        assert isinstance(want, str) and want in str(e), (dtype, want, str(e))
        assert same_sparse(ours.coalesce(), before.coalesce()), ("left as it was", dtype)
    else:
        assert not isinstance(want, str), ("no sparse sum of %s in torch, but one here" % dtype)
        assert same_sparse(ours, want), ("sparse all_reduce", dtype)
    checked += 1
# What torch's own Python API cannot do for a sparse tensor: only SUM; shapes that differ
# between ranks fail on every rank, naming them.
for name in ("MAX", "AVG"):
    try:
        dist.all_reduce(sparse_of(rank, torch.float32, (4, 4), 2, 2, 7),
                        op=getattr(dist.ReduceOp, name))
    except RuntimeError as e:
        assert "ReduceOp.SUM only" in str(e) and "ReduceOp." + name in str(e), str(e)
    else:
        raise AssertionError("sparse all_reduce with %s did not raise" % name)
try:
    dist.all_reduce(sparse_of(rank, torch.float32, (4, 4 + (rank == 0)), 2, 2, 8))
except RuntimeError as e:
    assert "sparse tensor is" in str(e), str(e)
else:
    raise AssertionError("sparse all_reduce of different shapes did not raise")
checked += 2


# --- DDP over a sparse embedding -------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).sum(1))


def train(group, steps=5):
    model = DDP(Net(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 50, (6 + rank, 3), generator=g)
        y = torch.randn(6 + rank, 1, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y).backward()
        assert model.module.emb.weight.grad.is_sparse
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


ours = train(None)
theirs = train(gloo)
print("DDP sparse: parameters differ from Gloo's by at most %.3g (relative %.3g)"
      % (max((a - b).abs().max().item() for a, b in zip(ours, theirs)),
         max(((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()
             for a, b in zip(ours, theirs))), flush=True)
for i, (a, b, before) in enumerate(zip(ours, theirs, Net().parameters())):
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), ("DDP sparse vs gloo", i,
                                                        (a - b).abs().max().item())
    assert not torch.equal(a, before), ("DDP sparse: not trained", i)
    rank0 = a.clone()
    dist.broadcast(rank0, 0, group=gloo)
    assert torch.equal(a, rank0), ("DDP sparse: ranks differ", i)
checked += 1

dist.barrier()
print("C10D SPARSE OK rank %d: %d checks" % (rank, checked), flush=True)
dist.destroy_process_group()
