"""Under torchrun, nothing started by hand. argv[1]: "backend" (DDP over
init_process_group("gradlink")) or "init" (a Horovod-style script: gradlink.torch.init())."""

import os
import sys

import torch
import torch.distributed as dist

import gradlink.torch as gl

mode = sys.argv[1]
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if mode == "backend":
    dist.init_process_group("gradlink")  # env://: torchrun's MASTER_ADDR/MASTER_PORT
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    # The same parameters on every rank (gathered through the backend).
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(e, flat) for e in everyone)
else:
    gl.init()
    assert (gl.rank(), gl.size()) == (rank, size), (gl.rank(), gl.size())
    assert gl.local_rank() == int(os.environ["LOCAL_RANK"])
    t = torch.full((1000,), float(rank + 1))
    gl.push_pull(t, average=False, name="t")
    assert torch.equal(t, torch.full((1000,), float(size * (size + 1) // 2)))
print("C10D TORCHRUN OK rank %d mode %s" % (rank, mode), flush=True)
