#!/usr/bin/python3
"""Pipeline parallel x data parallel over the "gradlink" torch.distributed backend.

    gradlink-run -n 4 -s 2 -- /usr/bin/python3 examples/pipeline_parallel.py --check
    python3 examples/pipeline_parallel.py RANK SIZE DIR [--check]   # each rank; FileStore DIR/store
    torchrun --standalone --nproc_per_node 4 examples/pipeline_parallel.py  # env:// (*)

(*) torch 1.13 on Python 3.11 also needs --redirects 1 --tee 1 (docs/torch_distributed.md).

An MLP of 4 blocks (Linear + Tanh, float64, fixed seeds) is cut into --stages pipeline stages
(default 2, 4 / stages blocks each); the job's processes are stages x replicas. Ranks are laid
out as Megatron-LM lays them out, data parallel innermost:

    rank = stage * replicas + replica        (4 processes: stage 0 = ranks 0, 1; stage 1 = 2, 3)

so rank r's pipeline neighbours are r -/+ replicas and its data-parallel group is its stage's.

Each step is a GPipe schedule: the replica's batch is split into --microbatches M.
  forward:  stage 0 runs every microbatch and isends its activations to the next stage (tag m);
            a later stage posts the M irecvs at once (batch_isend_irecv), runs each microbatch
            as it arrives and passes it on; the last stage computes each one's loss / M.
  backward: in reverse microbatch order the last stage backpropagates its losses and isends the
            gradients of its inputs to the previous stage, which has posted M irecvs for them
            (batch_isend_irecv), backpropagates each and passes its input gradients on.
  Gradients accumulate over the microbatches in .grad. Then each stage's replicas average them
  through the gradlink servers (one all_reduce of a flat buffer on the stage's new_group, as
  Megatron's contiguous gradient buffer), and SGD with momentum steps.
Megatron-LM's pipeline schedules use the same calls: isend / irecv / batch_isend_irecv between
stages, all_reduce in the data-parallel groups.

--check: every rank also trains the whole model in one process on the global batch (every
replica's batch, no microbatches) and compares its stage's parameters with that model's; the
worst relative difference per stage (max |a - b| / max |b| over each tensor) is gathered
(all_reduce MAX) and rank 0 prints it. Every rank prints "PIPELINE OK rank R" when every stage
is within --rtol (1e-5), else "PIPELINE MISMATCH" and exits 1.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gradlink.torch as gl

BLOCKS = 4
WIDTHS = [16, 32, 32, 32, 4]  # block i maps WIDTHS[i] -> WIDTHS[i + 1]


def make_model():
    torch.manual_seed(0)
    layers = []
    for i in range(BLOCKS):
        layers += [nn.Linear(WIDTHS[i], WIDTHS[i + 1]), nn.Tanh()]
    return nn.Sequential(*layers).double()


def global_batch(step, rows):
    """The step's inputs and targets for every replica together (replica r takes the r-th
    --batch rows)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, WIDTHS[0], generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :WIDTHS[-1]])


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target)


def join(args):
    """init_process_group("gradlink") from argv (a FileStore), torchrun, or gradlink-run."""
    timeout = datetime.timedelta(seconds=60)
    if args.rank is not None:
        dist.init_process_group("gradlink", init_method="file://" + os.path.join(args.dir, "store"),
                                rank=args.rank, world_size=args.size, timeout=timeout)
    elif "MASTER_ADDR" in os.environ:  # torchrun, or gradlink-run across hosts: env://
        dist.init_process_group("gradlink", timeout=timeout)
    else:
        # gradlink-run on one host sets no torchrun variables: join its job, and give torch a
        # store on rank 0 (a free port, which rank 0 broadcasts through gradlink).
        gl.init()
        rank, size = gl.rank(), gl.size()
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False) \
            if rank == 0 else None
        port = gl.broadcast_object(store.port if store else None, root_rank=0, name="store")
        store = store or dist.TCPStore("127.0.0.1", port, size, False, timeout)
        dist.init_process_group("gradlink", store=store, rank=rank, world_size=size,
                                timeout=timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rank", type=int, nargs="?")
    ap.add_argument("size", type=int, nargs="?")
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--stages", type=int, default=2, choices=(1, 2, 4))
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="rows per replica per step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    join(args)
    rank, size = dist.get_rank(), dist.get_world_size()
    if size % args.stages or args.batch % args.microbatches:
        sys.exit("pipeline_parallel: %d ranks are not a multiple of %d stages, or %d rows not of "
                 "%d microbatches" % (size, args.stages, args.batch, args.microbatches))
    replicas = size // args.stages
    stage, replica = divmod(rank, replicas)
    first, last = stage == 0, stage == args.stages - 1
    prev_rank, next_rank = rank - replicas, rank + replicas
    # Every rank makes every group, in the same order (torch.distributed requires it).
    dp_groups = [dist.new_group([s * replicas + r for r in range(replicas)], backend="gradlink")
                 for s in range(args.stages)]
    dp_group = dp_groups[stage]

    per_stage = BLOCKS // args.stages
    blocks = slice(2 * stage * per_stage, 2 * (stage + 1) * per_stage)
    model = make_model()[blocks]  # the same initial weights as the whole model's
    width_in, width_out = WIDTHS[stage * per_stage], WIDTHS[(stage + 1) * per_stage]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    M, mb = args.microbatches, args.batch // args.microbatches

    t0 = time.monotonic()
    for step in range(args.steps):
        x, target = global_batch(step, args.batch * replicas)
        rows = slice(replica * args.batch, (replica + 1) * args.batch)
        x_mbs, target_mbs = x[rows].split(mb), target[rows].split(mb)
        opt.zero_grad()

        # Forward of every microbatch.
        if not first:
            inputs = [torch.empty(mb, width_in, dtype=torch.float64) for _ in range(M)]
            arrived = dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, t, prev_rank, tag=m) for m, t in enumerate(inputs)])
        saved, losses, sends = [], [], []
        for m in range(M):
            if first:
                inp = x_mbs[m]
            else:
                arrived[m].wait()
                inp = inputs[m].requires_grad_()
            out = model(inp)
            saved.append((inp, out))
            if last:
                losses.append(loss_fn(out, target_mbs[m]) / M)
            else:
                sends.append(dist.isend(out.detach(), next_rank, tag=m))
        for w in sends:
            w.wait()

        # Backward, last microbatch first; gradients accumulate in .grad.
        if not last:
            out_grads = [torch.empty(mb, width_out, dtype=torch.float64) for _ in range(M)]
            arrived = dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, t, next_rank, tag=m) for m, t in enumerate(out_grads)])
        sends = []
        for m in reversed(range(M)):
            inp, out = saved[m]
            if last:
                losses[m].backward()
            else:
                arrived[m].wait()
                out.backward(out_grads[m])
            if not first:
                sends.append(dist.isend(inp.grad, prev_rank, tag=m))
        for w in sends:
            w.wait()

        # The stage's replicas average their gradients through the servers, then step.
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.view(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat /= replicas
        for g, avg in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(avg.view_as(g))
        opt.step()
        if last and replica == 0 and (step % 10 == 0 or step == args.steps - 1):
            print("step %d: loss %.6f (replica 0)" % (step, sum(l.item() for l in losses)),
                  flush=True)
    elapsed = time.monotonic() - t0
    if rank == 0:
        print("pipeline_parallel: %d stages x %d replicas, %d microbatches of %d rows: %d steps "
              "in %.2f s" % (args.stages, replicas, M, mb, args.steps, elapsed), flush=True)

    if args.check:
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr, momentum=0.9)
        for step in range(args.steps):
            x, target = global_batch(step, args.batch * replicas)
            ref_opt.zero_grad()
            loss_fn(ref(x), target).backward()
            ref_opt.step()
        diffs = [(p - q).abs().max() / q.abs().max()
                 for p, q in zip(model.parameters(), ref[blocks].parameters())]
        worst = torch.zeros(args.stages, dtype=torch.float64)
        worst[stage] = torch.stack(diffs).max()  # a NaN stays NaN, and fails the check
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every stage's worst, on every rank
        text = ", ".join("stage %d %.3g" % (s, w) for s, w in enumerate(worst.tolist()))
        if rank == 0:
            print("pipeline_parallel: max relative difference from one process: " + text,
                  flush=True)
        if not bool(torch.all(worst <= args.rtol)):
            print("PIPELINE MISMATCH rank %d: %s (rtol %g)" % (rank, text, args.rtol), flush=True)
            sys.exit(1)
        print("PIPELINE OK rank %d" % rank, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
