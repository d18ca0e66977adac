"""Training through the "gradlink" torch.distributed backend, against the same training over
Gloo in the same processes (a gloo group of the same ranks) and against single-process
training on the global batch:

* DistributedDataParallel with no hook, with allreduce_hook and fp16_compress_hook, with
  gradient_as_bucket_view, static_graph and find_unused_parameters;
* ZeroRedundancyOptimizer;
* a Megatron-style data-parallel sync (a contiguous gradient buffer, buckets launched with
  async_op=True as their parameters' gradients become ready, waited at the end of backward,
  averaged in place), which must start its first bucket's sum before backward ends.

Float sums differ from Gloo's only in the order of the additions: parameters agree to 1e-12
(float64), and agree bit for bit across the gradlink ranks. argv: rank, size, tmp dir."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import gradlink.torch  # noqa: F401  (registers the backend)

rank, size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
gloo = dist.new_group(backend="gloo")
STEPS = 4


class Net(torch.nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 4)
        self.unused = torch.nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def batch(step, r, per_rank=8):
    g = torch.Generator().manual_seed(100 * step + r)
    return (torch.randn(per_rank, 16, generator=g, dtype=torch.float64),
            torch.randn(per_rank, 4, generator=g, dtype=torch.float64))


def train(model, opt):
    """STEPS steps of this rank's batches; the DDP model's parameters after them."""
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


def train_ddp(group, hook=None, **kwargs):
    model = DDP(Net(unused=kwargs.get("find_unused_parameters", False)).double(),
                process_group=group, bucket_cap_mb=0.01, **kwargs)  # several buckets
    if hook is not None:
        model.register_comm_hook(group, hook)
    return train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def same(a, b, what, tol=1e-12):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.allclose(x, y, rtol=tol, atol=tol), (what, i, (x - y).abs().max().item())


def equal_across_ranks(params, what):
    for i, p in enumerate(params):
        theirs = p.clone()
        dist.broadcast(theirs, 0, group=gloo)
        assert torch.equal(p, theirs), (what, "rank %d differs from rank 0" % rank, i)


report = []
cases = [
    ("no hook", None, {}, 1e-12),
    ("allreduce_hook", default_hooks.allreduce_hook, {}, 1e-12),
    # fp16 on the wire: the two backends' sums of the same fp16 values round alike to within
    # one fp16 step; the parameters stay close, not equal.
    ("fp16_compress_hook", default_hooks.fp16_compress_hook, {}, 2e-3),
    ("gradient_as_bucket_view", None, {"gradient_as_bucket_view": True}, 1e-12),
    ("static_graph", None, {"static_graph": True}, 1e-12),
    ("find_unused_parameters", None, {"find_unused_parameters": True}, 1e-12),
]
for name, hook, kwargs, tol in cases:
    ours = train_ddp(None, hook, **kwargs)
    theirs = train_ddp(gloo, hook, **kwargs)
    same(ours, theirs, "DDP " + name, tol)
    equal_across_ranks(ours, "DDP " + name)
    report.append("DDP %s: equal to Gloo (tol %g), identical on every rank" % (name, tol))

# ZeroRedundancyOptimizer: each rank steps its shard, then broadcasts it.
def train_zero(group):
    model = DDP(Net().double(), process_group=group)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  process_group=group, lr=0.01)
    return train(model, opt)


ours, theirs = train_zero(None), train_zero(gloo)
same(ours, theirs, "ZeroRedundancyOptimizer")
equal_across_ranks(ours, "ZeroRedundancyOptimizer")
report.append("ZeroRedundancyOptimizer: equal to Gloo, identical on every rank")


# Megatron-style data-parallel sync, written the way megatron-core's DistributedDataParallel
# does it: every parameter's .grad is a view into one contiguous buffer; parameters are
# bucketed in reverse order (the order backward produces them); a bucket's all_reduce is
# launched (async_op=True) from the gradient-accumulation hook of its last parameter to become
# ready; the handles are waited for once backward has returned; then the buffer is averaged.
class MegatronStyleDP:
    def __init__(self, module, bucket_elems):
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in params)
        self.buffer = torch.zeros(total, dtype=params[0].dtype)
        self.buckets, self.handles, self.first_launch = [], [], None
        at, current, start = total, [], total
        for p in reversed(params):  # gradients become ready from the last layer first
            at -= p.numel()
            p.grad = self.buffer[at:at + p.numel()].view_as(p)
            current.append(p)
            if start - at >= bucket_elems:
                self.buckets.append((at, start, current))
                current, start = [], at
        if current:
            self.buckets.append((0, start, current))
        self.pending = {}
        self._grad_accs = []
        for i, (lo, hi, members) in enumerate(self.buckets):
            for p in members:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._hook(i, p))
                self._grad_accs.append(acc)  # keep them alive (megatron does the same)

    def _hook(self, i, p):
        def ready(*_):
            self.pending[i].discard(p)
            if not self.pending[i]:
                lo, hi, _ = self.buckets[i]
                if self.first_launch is None:
                    self.first_launch = time.monotonic()
                self.handles.append(dist.all_reduce(self.buffer[lo:hi], async_op=True))
        return ready

    def start_backward(self):
        self.buffer.zero_()
        self.handles, self.first_launch = [], None
        self.pending = {i: set(m) for i, (_, _, m) in enumerate(self.buckets)}

    def finish(self):
        for h in self.handles:
            h.wait()
        self.buffer /= size


model = Net().double()
dp = MegatronStyleDP(model, bucket_elems=300)
assert len(dp.buckets) >= 3, len(dp.buckets)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
overlapped = []
for step in range(STEPS):
    x, y = batch(step, rank)
    dp.start_backward()
    torch.nn.functional.mse_loss(model(x), y).backward()
    backward_end = time.monotonic()
    assert len(dp.handles) == len(dp.buckets), "every bucket launched during backward"
    overlapped.append(dp.first_launch < backward_end)
    dp.finish()
    opt.step()
assert all(overlapped), overlapped

# The reference: one process, the global batch (the mean over ranks' shards of equal size).
ref = Net().double()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
for step in range(STEPS):
    xs, ys = zip(*(batch(step, r) for r in range(size)))
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    ref_opt.step()
same(list(model.parameters()), list(ref.parameters()), "Megatron-style DP")
equal_across_ranks([p.detach() for p in model.parameters()], "Megatron-style DP")
report.append("Megatron-style DP (%d buckets, async_op=True): equal to single-process training "
              "on the global batch; first bucket launched before backward ended in %d of %d "
              "steps" % (len(dp.buckets), sum(overlapped), STEPS))

for line in report:
    print("rank %d: %s" % (rank, line))
print("C10D TRAIN OK rank %d" % rank, flush=True)
dist.destroy_process_group()
