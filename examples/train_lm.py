#!/usr/bin/python3
"""Train a small byte-level transformer language model with gradlink.

    build/bin/gradlink-run -n 2 -s 2 -- /usr/bin/python3 examples/train_lm.py
    build/bin/gradlink-run -n 2 -s 2 -- /usr/bin/python3 examples/train_lm.py --check --steps 30

The corpus is text already on every Debian machine, no download:
  --corpus licenses   /usr/share/common-licenses/* (the GPL, Apache, ... licence texts; default)
  --corpus python     the Python standard library's sources, /usr/lib/python3.11/*.py
  --corpus PATH       any file or directory of text files
Bytes are the tokens (vocabulary 256). The last 5% of the corpus is held out for validation.

Data parallel: every worker draws its own batch (seeded by step and rank) and
gradlink.torch.DistributedOptimizer averages the gradients through the gradlink servers while
backward runs. Rank 0 prints a progress bar (a line every --log-every steps when the output is
not a terminal) with the loss averaged over the workers and the job's tokens/s.

--check: after training, rank 0 trains a fresh copy of the model for the same steps in one
process on the global batch (every worker's batch, concatenated) and asserts that the
distributed parameters match it within float tolerance; every rank also asserts that its
parameters are identical to rank 0's.
"""

import argparse
import glob
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import gradlink.torch as gl


# ---- Data --------------------------------------------------------------------------------------

def load_corpus(spec):
    if spec == "licenses":
        files = sorted(glob.glob("/usr/share/common-licenses/*"))
    elif spec == "python":
        files = sorted(glob.glob("/usr/lib/python3.11/*.py"))
    elif os.path.isdir(spec):
        files = sorted(p for p in glob.glob(os.path.join(spec, "**", "*"), recursive=True)
                       if os.path.isfile(p))
    else:
        files = [spec]
    chunks = []
    for path in files:
        if os.path.isfile(path):
            with open(path, "rb") as f:
                chunks.append(f.read())
    data = b"\n".join(chunks)
    if len(data) < 10000:
        sys.exit("train_lm: corpus %r is too small (%d bytes)" % (spec, len(data)))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), len(files)


def get_batch(data, batch, context, seed, step, rank):
    """This rank's batch of `step`: random windows of the corpus (same on every run)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    window = data[idx]
    return window[:, :-1], window[:, 1:]


# ---- Model -------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d, heads, context):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # No bias: a key bias has a zero gradient in exact arithmetic (softmax ignores it), so
        # Adam would follow round-off noise there, and --check could not compare it.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    def __init__(self, d=128, layers=2, heads=4, context=64):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads, context) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))[None]
        return self.head(self.ln(self.blocks(x)))


def lm_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


def make_model(args):
    torch.manual_seed(args.seed)
    return ByteLM(args.d_model, args.layers, args.heads, args.context)


def make_optimizer(args, model):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def lr_at(args, step):
    warm = max(1, args.steps // 10)
    if step < warm:
        return args.lr * (step + 1) / warm
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm)))


@torch.no_grad()
def evaluate(model, data, args, batches=8):
    model.eval()
    losses = []
    for i in range(batches):
        x, y = get_batch(data, args.batch, args.context, args.seed + 7, i, 0)
        losses.append(lm_loss(model, x, y).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(model, prompt, n, context):
    model.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        logits = model(idx[:, -context:])[0, -1] / 0.8
        nxt = torch.multinomial(logits.softmax(-1), 1, generator=g)
        idx = torch.cat([idx, nxt[None]], dim=1)
    model.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# ---- Progress ----------------------------------------------------------------------------------

class Progress:
    def __init__(self, total, bar):
        self.total = total
        self.bar = bar
        self.t0 = time.monotonic()

    def update(self, step, loss, tok_s, final=False):
        done = step + 1
        width = 30
        fill = int(width * done / self.total)
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.total - done)
        text = "[%s%s] %d/%d loss %.4f | %.0f tok/s | %.0fs<%.0fs" % (
            "#" * fill, "." * (width - fill), done, self.total, loss, tok_s, elapsed, eta)
        if self.bar:  # the line ends with \r: the next one overwrites it (gradlink-run keeps \r)
            sys.stdout.write(text + ("\n" if final else "\r"))
        else:
            sys.stdout.write(text + "\n")
        sys.stdout.flush()


# ---- Training ----------------------------------------------------------------------------------

def train(args, data, distributed):
    """Trains for args.steps steps; distributed: every worker its batch, else (the --check
    reference) one process on the concatenation of all workers' batches."""
    rank, size = (gl.rank(), gl.size()) if distributed else (0, 1)
    world = gl.size()
    model = make_model(args)
    opt = make_optimizer(args, model)
    if distributed:
        gl.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = gl.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        gl.broadcast_optimizer_state(opt, root_rank=0)
    show = distributed and rank == 0 and not args.quiet
    bar = args.progress == "bar" or (args.progress == "auto" and (
        sys.stdout.isatty() or os.environ.get("GRADLINK_STDOUT_TTY") == "1"))
    progress = Progress(args.steps, bar) if show else None
    tokens_per_step = world * args.batch * args.context
    loss_avg = torch.zeros(1)
    t_last, steps_since = time.monotonic(), 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        if distributed:
            x, y = get_batch(data, args.batch, args.context, args.seed, step, rank)
        else:
            parts = [get_batch(data, args.batch, args.context, args.seed, step, r)
                     for r in range(world)]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        if args.clip > 0:
            if distributed:
                opt.synchronize()  # clip the averaged gradient
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            if distributed:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        else:
            opt.step()
        steps_since += 1
        if distributed and (step % args.log_every == args.log_every - 1 or step == args.steps - 1):
            loss_avg.fill_(loss.item())
            gl.push_pull(loss_avg, average=True, name="train_lm.loss")  # mean over the workers
            now = time.monotonic()
            tok_s = tokens_per_step * steps_since / (now - t_last)
            t_last, steps_since = now, 0
            if progress:
                progress.update(step, loss_avg.item(), tok_s, final=step == args.steps - 1)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="licenses", help="licenses, python, or a path")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="sequences per worker per step")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto")
    ap.add_argument("--sample", type=int, default=120, help="bytes of text to generate at the end")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: cores/workers)")
    ap.add_argument("--check", action="store_true",
                    help="assert the result equals single-process training on the global batch")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    gl.init()
    rank, size = gl.rank(), gl.size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // gl.local_size()))
    data, nfiles = load_corpus(args.corpus)
    split = int(len(data) * 0.95)
    train_data, val_data = data[:split], data[split:]
    model_params = sum(p.numel() for p in make_model(args).parameters())
    if rank == 0:
        print("train_lm: %d workers, %d servers; corpus %s: %d files, %d bytes (%d for training); "
              "model %d parameters (%d layers, d=%d); global batch %d x %d bytes"
              % (size, gl.num_servers(), args.corpus, nfiles, len(data), split, model_params,
                 args.layers, args.d_model, size * args.batch, args.context), flush=True)
    t0 = time.monotonic()
    model = train(args, train_data, distributed=True)
    elapsed = time.monotonic() - t0
    if rank == 0:
        val = evaluate(model, val_data, args)
        print("train_lm: %d steps in %.1f s, %.0f tokens/s; validation loss %.4f (%.3f bits/byte)"
              % (args.steps, elapsed, args.steps * size * args.batch * args.context / elapsed,
                 val, val / math.log(2)), flush=True)
        if args.sample > 0:
            print("train_lm: sample: %r" % sample(model, b"The ", args.sample, args.context),
                  flush=True)

    if args.check:
        # Every rank holds exactly rank 0's parameters.
        for name, p in model.state_dict().items():
            root = p.clone()
            gl.broadcast_(root, root_rank=0, name="check." + name)
            assert torch.equal(root, p), "rank %d: %s differs from rank 0's" % (rank, name)
        print("train_lm: check: rank %d parameters identical to rank 0's" % rank, flush=True)
        if rank == 0:
            torch.set_num_threads(args.threads or os.cpu_count() or 1)  # the others are done
            ref = train(args, train_data, distributed=False)
            worst, worst_name = 0.0, None
            for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
                if not p.is_floating_point():
                    assert torch.equal(p, q), "check FAILED: %s differs" % name
                    continue
                diff = (p - q).abs().max().item() if p.numel() else 0.0
                if diff > worst:
                    worst, worst_name = diff, name
                assert torch.allclose(p, q, rtol=args.rtol, atol=args.atol), (
                    "check FAILED: %s differs from single-process training by %g" % (name, diff))
            print("train_lm: check passed: distributed == single-process training on the "
                  "global batch after %d steps (max |diff| %.3g in %s; rtol %g, atol %g)"
                  % (args.steps, worst, worst_name, args.rtol, args.atol), flush=True)
    gl.shutdown()


if __name__ == "__main__":
    main()
