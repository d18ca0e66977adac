"""Under torchrun, nothing started by hand. argv[1]: "backend" (DDP over
init_process_group("gradlink")), "init" (a Horovod-style script: gradlink.torch.init()), or
"tcp URL" (the backend through init_method=URL, RANK and WORLD_SIZE from the environment, no
MASTER_ADDR: the other hosts find rank 0's address themselves)."""

import os
import sys

import torch
import torch.distributed as dist

import gradlink.torch as gl

mode = sys.argv[1]
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if mode in ("backend", "tcp"):
    if mode == "tcp":
        dist.init_process_group("gradlink", init_method=sys.argv[2], rank=rank, world_size=size)
    else:
        dist.init_process_group("gradlink")  # env://: torchrun's MASTER_ADDR/MASTER_PORT
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2).double())
    if os.environ.get("C10D_EXPECT_SERVERS"):  # the job the backend joined or made
        assert gl.num_servers() == int(os.environ["C10D_EXPECT_SERVERS"]), gl.num_servers()
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
    gl.init(fusion_buffer_bytes=1 << 20)  # the caller's options reach the worker
    assert gl.stats()["in_force"]["fusion_buffer_bytes"] == 1 << 20, gl.stats()["in_force"]
    assert (gl.rank(), gl.size()) == (rank, size), (gl.rank(), gl.size())
    assert gl.local_rank() == int(os.environ["LOCAL_RANK"])
    t = torch.full((1000,), float(rank + 1))
    gl.push_pull(t, average=False, name="t")
    assert torch.equal(t, torch.full((1000,), float(size * (size + 1) // 2)))
print("C10D TORCHRUN OK rank %d mode %s" % (rank, mode), flush=True)
