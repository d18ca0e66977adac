#!/usr/bin/python3
"""train_step.py: one rank of bench/train_cluster's training job.

A communication-bound model (an MLP of --layers dense layers of --width x --width, fp32, and a
10-way head), a small batch (--batch rows a rank, drawn from a generator seeded by step and
rank, so every method sees the same data), SGD with momentum, trained for --warmup + --steps
steps by one of:

  gloo-ddp       torch DistributedDataParallel over a Gloo process group
  gradlink-opt   gradlink.torch.DistributedOptimizer (gradlink.torch.init() from GRADLINK_*)
  gradlink-hook  DDP (its Gloo group only sets it up) with gradlink.torch.ddp_hook
  gradlink-ddp   DDP over init_process_group("gradlink") (the torch.distributed backend): its
                 servers are the job named by GRADLINK_SCHEDULER, else one per worker host

Before the job's first step each rank times --compute-steps forward/backward passes (after an
untimed one, which allocates the gradients as the training loop's warm-up does) with no
communication (every rank at once: the compute a step costs on this machine, contended as in
the job). Each step: a barrier, then the step timed on each rank (zero_grad, forward,
backward, the optimizer's step, and whatever communication the method runs inside them).

Output (stdout): one JSON line {"rank", "method", "step_s": [timed steps], "compute_s":
[no-communication passes], "cpu_s": [the process's CPU time in each timed step,
all threads], "digest": sha256 of every parameter's bytes after the last step,
"loss": the last step's loss}. --save FILE writes the final state_dict (rank 0, for the
cross-method comparison).
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def make_model(width, layers):
    torch.manual_seed(0)  # the same initial parameters on every rank and for every method
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*mods)


def batch(step, rank, rows, width):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g)


def digest(model):
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", required=True, choices=["gloo-ddp", "gradlink-opt", "gradlink-hook",
                                                           "gradlink-ddp"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--compute-steps", type=int, default=2)
    ap.add_argument("--save", default="")
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True): gradients are views of DDP's buckets")
    a = ap.parse_args()
    torch.set_num_threads(1)

    model = make_model(a.width, a.layers)
    # The compute a step costs, without communication (every rank at once).
    compute = []
    probe = make_model(a.width, a.layers)
    for i in range(1 + a.compute_steps):  # the first untimed: it allocates the gradients
        x, y = batch(10**6 + i, a.rank, a.batch, a.width)
        t0 = time.perf_counter()
        F.cross_entropy(probe(x), y).backward()
        if i > 0:
            compute.append(time.perf_counter() - t0)
    del probe

    uses_gloo = a.method in ("gloo-ddp", "gradlink-hook")
    if uses_gloo:
        dist.init_process_group("gloo", init_method="tcp://%s:%d" % (a.master_addr, a.master_port),
                                rank=a.rank, world_size=a.world_size)
    gl = None
    if a.method == "gradlink-ddp":  # DDP over the torch.distributed backend, nothing else
        import gradlink.torch  # noqa: F401  (registers it)
        dist.init_process_group("gradlink",
                                init_method="tcp://%s:%d" % (a.master_addr, a.master_port),
                                rank=a.rank, world_size=a.world_size)
        model = torch.nn.parallel.DistributedDataParallel(model,
                                                          gradient_as_bucket_view=a.bucket_view)
    elif a.method.startswith("gradlink"):
        import gradlink.torch as gl
        gl.init()
        assert gl.rank() == a.rank and gl.size() == a.world_size, (gl.rank(), gl.size())
    if uses_gloo:
        model = torch.nn.parallel.DistributedDataParallel(model,
                                                          gradient_as_bucket_view=a.bucket_view)
    if a.method == "gradlink-hook":
        model.register_comm_hook(gl.DDPHookState(model), gl.ddp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if a.method == "gradlink-opt":
        opt = gl.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    barrier = gl.barrier if gl is not None else dist.barrier

    times, cpu, loss = [], [], None
    for step in range(a.warmup + a.steps):
        x, y = batch(step, a.rank, a.batch, a.width)
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    barrier()
    plain = model.module if uses_gloo or a.method == "gradlink-ddp" else model
    if a.save:
        torch.save(plain.state_dict(), a.save)
    rec = {"rank": a.rank, "method": a.method, "step_s": times, "cpu_s": cpu, "compute_s": compute,
           "digest": digest(plain), "loss": loss.item()}
    if gl is not None:
        f = gl.stats()["in_force"]
        rec["in_force"] = {k: f[k] for k in ("partition_bytes", "max_bytes_in_flight",
                                             "max_bytes_ahead", "chosen", "ucx")}
    print(json.dumps(rec), flush=True)
    if gl is not None:
        gl.shutdown()
    if uses_gloo or a.method == "gradlink-ddp":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
