"""FullyShardedDataParallel on CPU over the "gradlink" backend (torch 2.x: torch 1.13's FSDP
refuses CPU-only execution), against single-process training on the global batch, and against
the same FSDP training over Gloo in the same processes (a gloo group of the same ranks):

* a small MLP (float32) whose Linear layers are FSDP units of their own inside a root unit,
  sizes chosen so that the flat parameters do not split evenly (FSDP pads them);
* FULL_SHARD (all-gathers in forward and backward, reduce-scatters of the gradients),
  SHARD_GRAD_OP, and NO_SHARD (all-reduces);
* a few SGD (momentum) steps on each rank's own batch; then the full parameters
  (summon_full_params: all-gathers) equal, to 1e-5 relative, the parameters of one process
  trained on the concatenation of every rank's batch, and are identical on every rank.

What FSDP calls: all_gather_into_tensor (_allgather_base), reduce_scatter_tensor
(_reduce_scatter_base), all_reduce, and barrier. argv: rank, size, tmp dir. Prints the largest
differences, then "C10D FSDP OK rank R"."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import gradlink.torch  # noqa: F401  (registers the backend)

rank, size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
gloo = dist.new_group(backend="gloo")
STEPS, PER_RANK, LR, RTOL = 5, 8, 0.1, 1e-5


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 33)   # 561 elements: odd, padded for 2 ranks
        self.b = torch.nn.Linear(33, 47)
        self.c = torch.nn.Linear(47, 5)
        self.scale = torch.nn.Parameter(torch.ones(5))  # the root unit's own parameter

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


def batch(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(PER_RANK, 16, generator=g), torch.randn(PER_RANK, 5, generator=g)


def clean(name):
    return name.replace("_fsdp_wrapped_module.", "")


def train_fsdp(group, strategy):
    """STEPS steps of this rank's batches; every full parameter afterwards, by name."""
    model = FSDP(MLP(), process_group=group, sharding_strategy=strategy,
                 auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with FSDP.summon_full_params(model):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def train_reference():
    """One process, the global batch (every rank's batch; the mean over equal shards)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in range(size)))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_rel(a, b):
    """The largest |a - b| / max(|b|, 1e-3) over every parameter, and the largest |a - b|."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    rel = max(((a[n] - b[n]).abs() / b[n].abs().clamp_min(1e-3)).max().item() for n in b)
    absd = max((a[n] - b[n]).abs().max().item() for n in b)
    return rel, absd


def close(a, b, what):
    for n in b:
        assert torch.allclose(a[n], b[n], rtol=RTOL, atol=RTOL * 1e-2), \
            (what, n, (a[n] - b[n]).abs().max().item())


def equal_across_ranks(params, what):
    for n, p in params.items():
        theirs = p.clone()
        dist.broadcast(theirs, 0, group=gloo)
        assert torch.equal(p, theirs), (what, "rank %d differs from rank 0" % rank, n)


reference = train_reference()
initial = {n: p.detach().clone() for n, p in MLP().named_parameters()}
assert max_rel(reference, initial)[1] > 1e-2, "the reference moved the parameters"
before = gradlink.torch.stats()["push_pulls"]
report = []
for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                 ShardingStrategy.NO_SHARD):
    ours = train_fsdp(None, strategy)          # the default group: gradlink
    theirs = train_fsdp(gloo, strategy)
    close(ours, reference, "FSDP %s over gradlink vs single process" % strategy.name)
    close(theirs, reference, "FSDP %s over Gloo vs single process" % strategy.name)
    equal_across_ranks(ours, "FSDP %s over gradlink" % strategy.name)
    r_ref, a_ref = max_rel(ours, reference)
    r_gloo, a_gloo = max_rel(ours, theirs)
    g_ref, ga_ref = max_rel(theirs, reference)
    report.append("FSDP %s, %d steps: gradlink vs single process max rel %.3g (abs %.3g); "
                  "Gloo vs single process max rel %.3g (abs %.3g); gradlink vs Gloo max rel "
                  "%.3g (abs %.3g); identical on every rank"
                  % (strategy.name, STEPS, r_ref, a_ref, g_ref, ga_ref, r_gloo, a_gloo))
# The collectives went through gradlink's worker (and nothing through a fallback).
used = gradlink.torch.stats()["push_pulls"] - before
assert used >= 3 * STEPS, used
report.append("%d gradlink operations" % used)
for line in report:
    print("rank %d: %s" % (rank, line))
print("C10D FSDP OK rank %d" % rank, flush=True)
dist.destroy_process_group()
