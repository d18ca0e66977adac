"""A synthetic benchmark written the way Horovod's PyTorch example is: change the import line
(`import horovod.torch as hvd` -> `import gradlink.torch as hvd`) and it runs on gradlink.

    gradlink-run -n 2 -s 2 -- python3 examples/hvd_synthetic_benchmark.py --num-iters 3

A small MLP on random data (CPU: Debian's torch has no CUDA), forward/backward/step timed per
batch; gradients averaged by hvd.DistributedOptimizer (optionally as fp16), parameters and
optimizer state broadcast from rank 0, the throughput averaged over workers with
hvd.allreduce. --check verifies at the end that every rank holds rank 0's parameters.
"""

import argparse
import timeit

import torch
import torch.nn.functional as F

import gradlink.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark (Horovod style)")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--width", type=int, default=512, help="hidden layer width")
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=5)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--check", action="store_true", help="verify the parameters at the end")
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234 + hvd.rank())  # a different model on each rank: the broadcast fixes it

model = torch.nn.Sequential(torch.nn.Linear(256, args.width), torch.nn.ReLU(),
                            torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                            torch.nn.Linear(args.width, 10))
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 256)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log("Model: MLP 256-%d-%d-10, batch size %d, %d workers, %s" % (
    args.width, args.width, args.batch_size, hvd.size(),
    "fp16 allreduce" if args.fp16_allreduce else "fp32 allreduce"))
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log("Iter #%d: %.1f img/sec per worker" % (x, img_sec))
    img_secs.append(img_sec)
mean = sum(img_secs) / len(img_secs)
total = hvd.allreduce(torch.tensor(mean), op=hvd.Sum, name="img_sec").item()
log("Img/sec per worker: %.1f; total img/sec on %d worker(s): %.1f" % (mean, hvd.size(), total))

if args.check:
    # After identical averaged steps from identical parameters, every rank holds rank 0's.
    # (Each rank draws its own data, so without averaged gradients the models would drift.)
    for name, p in model.named_parameters():
        ref = hvd.broadcast(p.detach().clone(), root_rank=0, name="check." + name)
        assert torch.equal(ref, p.detach()), "rank %d: %s differs from rank 0's" % (hvd.rank(), name)
    print("hvd_synthetic_benchmark: check: rank %d parameters identical to rank 0's" % hvd.rank(),
          flush=True)
