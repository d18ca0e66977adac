"""Shared by the job scripts and the tests: models, data and reference training."""

import torch


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    ).double()


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(kind)


def global_batch(step, micro, size, per_rank=8):
    """The global batch of one micro-step: `size` shards of `per_rank` examples, rank-major."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(size * per_rank, 16, generator=g, dtype=torch.float64)
    y = torch.randn(size * per_rank, 4, generator=g, dtype=torch.float64)
    return x, y


def shard(batch, rank, size):
    x, y = batch
    n = x.shape[0] // size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def reference(kind, steps, size, passes=1):
    """Single-process training on the global batch: what the distributed job must match."""
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = global_batch(step, micro, size)
            loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def rank_data(r, dtype, n, salt=0, scale=50):
    """Rank r's reproducible data: n values of dtype (bool: the positive ones; complex: the
    values and their reverse), different for every (rank, salt)."""
    g = torch.Generator().manual_seed(1000 * salt + r)
    x = torch.randn(n, generator=g) * scale
    if dtype == torch.bool:
        return x > 0
    if dtype.is_complex:
        return torch.complex(x, x.flip(0)).to(dtype)
    return x.to(dtype)
