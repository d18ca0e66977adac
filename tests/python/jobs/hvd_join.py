"""hvd.join with uneven data, as a Horovod script uses it: rank r has 2 + r batches, trains
with DistributedOptimizer until its data runs out, then joins. Each step's averaged gradient is
the sum over the ranks that still had a batch divided by every rank (a joined rank adds zeros,
as under Horovod), so the model must equal a single-process run whose loss at each step is
those ranks' losses summed over the job's size. After the join, the model of the rank
that joined last is broadcast (Horovod's pattern) and one more step has every rank again
(asserts inside). JOIN_TEST_HOSTS=h0,h1,...: rank r counts as host h_r (GRADLINK_HOST), so
that hosts with several workers sum first (hierarchical aggregation)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import gradlink.torch as hvd  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("JOIN_TEST_HOSTS"):
    hosts = os.environ["JOIN_TEST_HOSTS"].split(",")
    os.environ["GRADLINK_HOST"] = "emulated-host-" + hosts[int(os.environ["GRADLINK_RANK"])]
hvd.init()
rank, size = hvd.rank(), hvd.size()
steps = [2 + r for r in range(size)]  # batches per rank: uneven


def present(step):
    return [r for r in range(size) if step < steps[r]]


def train_step(model, opt, step, ranks):
    """This rank's share of one step; `ranks` None: the single-process reference over them."""
    opt.zero_grad()
    batch = common.global_batch(step, 0, size)
    if ranks is None:
        x, y = common.shard(batch, rank, size)
        common.loss_fn(model(x), y).backward()
    else:
        loss = sum(common.loss_fn(model(x), y)
                   for x, y in (common.shard(batch, r, size) for r in ranks)) / size
        loss.backward()
    opt.step()


def reference(n, then_all=False):
    """Single process: n steps averaging the ranks present at each, then one with every rank."""
    ref = common.make_model(seed=0)
    ref_opt = common.make_optimizer("sgd", ref.parameters())
    for step in range(n):
        train_step(ref, ref_opt, step, present(step))
    if then_all:
        train_step(ref, ref_opt, steps[-1], list(range(size)))
    return ref.state_dict()


def expect_equal(state, want, what):
    for (name, got), w in zip(state.items(), want.values()):
        assert torch.allclose(got, w, rtol=0, atol=1e-12), (what, name, (got - w).abs().max())


model = common.make_model(seed=0)
opt = hvd.DistributedOptimizer(common.make_optimizer("sgd", model.parameters()),
                               named_parameters=model.named_parameters())
for step in range(steps[rank]):
    train_step(model, opt, step, None)
    # A plain allreduce beside it counts the ranks still training: the joined add nothing.
    count = hvd.allreduce(torch.ones(3, dtype=torch.int64), op=hvd.Sum, name="count")
    assert count.tolist() == [len(present(step))] * 3, (step, count)
# This rank's model took its own steps, each the present ranks' gradients over the job's size.
expect_equal(model.state_dict(), reference(steps[rank]), "before join")
if os.environ.get("JOIN_TEST_HOSTS"):
    from gradlink.torch import _core  # noqa: E402
    assert _core.stats()["in_force"]["hierarchy"], _core.stats()["in_force"]
last = hvd.join()
assert last == size - 1, last
# Horovod's pattern: the rank that joined last has the model trained on every batch.
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
hvd.broadcast_optimizer_state(opt, root_rank=last)
# In step again: one more step with every rank.
train_step(model, opt, steps[-1], None)
count = hvd.allreduce(torch.ones(3, dtype=torch.int64), op=hvd.Sum, name="count")
assert count.tolist() == [size] * 3, count
expect_equal(model.state_dict(), reference(steps[-1], then_all=True), "after join")
print("HVD JOIN OK rank %d" % rank)
hvd.shutdown()
