"""A synthetic benchmark written the way BytePS's PyTorch example is: change the import line
(`import byteps.torch as bps` -> `import gradlink.byteps.torch as bps`) and it runs on gradlink.

    gradlink-run -n 2 -s 2 -- python3 examples/bps_synthetic_benchmark.py --num-iters 3

A small MLP on random data (CPU), forward/backward/step timed per batch. Gradients are averaged
either by bps.DistributedOptimizer (default; --fp16-pushpull compresses them to fp16) or, with
--ddp, by bps.parallel.DistributedDataParallel. Parameters and optimizer state start from rank
0's; --check verifies at the end that every rank holds rank 0's parameters.
"""

import argparse
import timeit

import torch
import torch.nn.functional as F

import gradlink.byteps.torch as bps

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark (BytePS style)")
parser.add_argument("--fp16-pushpull", action="store_true", default=False,
                    help="use fp16 compression during push_pull")
parser.add_argument("--ddp", action="store_true", default=False,
                    help="bps.parallel.DistributedDataParallel instead of DistributedOptimizer")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=5)
parser.add_argument("--check", action="store_true")
args = parser.parse_args()

bps.init()
torch.manual_seed(4321 + bps.rank())  # a different model on each rank: the broadcast fixes it
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, args.width), torch.nn.ReLU(),
                            torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                            torch.nn.Linear(args.width, 10))
compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none
if args.ddp:
    from gradlink.byteps.torch.parallel import DistributedDataParallel
    model = DistributedDataParallel(model, compression=compression)  # broadcasts rank 0's state
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * bps.size(), momentum=0.9)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * bps.size(), momentum=0.9)
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 256)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s):
    if bps.rank() == 0:
        print(s, flush=True)


log("Model: MLP width %d, batch size %d, workers %d, %s" % (
    args.width, args.batch_size, bps.size(),
    "DistributedDataParallel" if args.ddp else "DistributedOptimizer"))
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log("Iter #%d: %.1f img/sec per worker" % (x, img_sec))
    img_secs.append(img_sec)
mean = sum(img_secs) / len(img_secs)
total = bps.push_pull(torch.tensor([mean]), average=False, name="img_sec").item()
log("Total img/sec on %d worker(s): %.1f" % (bps.size(), total))

if args.check:
    net = model.module if args.ddp else model
    flat = torch.cat([p.detach().reshape(-1) for p in net.state_dict().values()])
    root = flat.clone()
    bps.broadcast_parameters([("check.params", root)], root_rank=0)
    assert torch.equal(flat, root), "rank %d parameters differ from rank 0's" % bps.rank()
    print("bps_synthetic_benchmark: check: rank %d parameters identical to rank 0's"
          % bps.rank(), flush=True)
bps.shutdown()
