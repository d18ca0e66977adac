"""MNIST-style training written the way Horovod's PyTorch MNIST example is (change the import
line `import horovod.torch as hvd` to `import gradlink.torch as hvd`), on digits made here: no
download. Each image is a 28x28 stroke pattern of its class plus noise, so a small CNN learns
it in a few epochs.

    gradlink-run -n 2 -s 2 -- python3 examples/hvd_mnist.py --epochs 2

Each rank trains on its shard (a DistributedSampler over the training set), with Adam wrapped in
hvd.DistributedOptimizer (backward_passes_per_step micro-batches accumulated before every
averaged step, optionally fp16 compression), SyncBatchNorm in the model, parameters and
optimizer state broadcast from rank 0, and the test loss and accuracy averaged over ranks with
hvd.allreduce. --check fails unless the test accuracy beats --min-accuracy and every rank ends
with rank 0's parameters.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

import gradlink.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST-style example (Horovod style)")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--test-batch-size", type=int, default=200)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.002)
parser.add_argument("--train-size", type=int, default=2000)
parser.add_argument("--test-size", type=int, default=400)
parser.add_argument("--batches-per-allreduce", type=int, default=2,
                    help="micro-batches accumulated before each averaged step "
                         "(DistributedOptimizer's backward_passes_per_step)")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--check", action="store_true")
parser.add_argument("--min-accuracy", type=float, default=0.8)
args = parser.parse_args()


def make_digits(n, seed):
    """n 1x28x28 images of 10 classes: class c draws a bar at angle c * 18 degrees."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    ys, xs = torch.meshgrid(torch.arange(28.0) - 13.5, torch.arange(28.0) - 13.5, indexing="ij")
    angle = labels.float() * (torch.pi / 10)
    dist = (xs[None] * torch.sin(angle)[:, None, None] - ys[None] * torch.cos(angle)[:, None, None])
    images = torch.exp(-dist.pow(2) / 4.0) + 0.3 * torch.randn(n, 28, 28, generator=g)
    return tud.TensorDataset(images.unsqueeze(1), labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)
        self.bn1 = hvd.SyncBatchNorm(8)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)
        self.fc1 = nn.Linear(256, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.bn1(self.conv1(x)), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


hvd.init()
torch.manual_seed(args.seed + hvd.rank())  # different on each rank: the broadcasts fix it
torch.set_num_threads(1)
train_set = make_digits(args.train_size, args.seed)
test_set = make_digits(args.test_size, args.seed + 1)
train_sampler = tud.distributed.DistributedSampler(train_set, num_replicas=hvd.size(),
                                                   rank=hvd.rank(), seed=args.seed)
train_loader = tud.DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
test_sampler = tud.distributed.DistributedSampler(test_set, num_replicas=hvd.size(),
                                                  rank=hvd.rank(), shuffle=False)
test_loader = tud.DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

model = Net()
# Horovod's scaling: the learning rate by the number of workers times the accumulated batches.
optimizer = torch.optim.Adam(model.parameters(),
                             lr=args.lr * hvd.size() * args.batches_per_allreduce ** 0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     backward_passes_per_step=args.batches_per_allreduce,
                                     op=hvd.Average)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    k = args.batches_per_allreduce
    batches = list(train_loader)
    # Whole steps only: every rank runs the same number of micro-batches per step.
    steps = min(hvd.allreduce(torch.tensor(len(batches) // k), op=hvd.Min,
                              name="steps.%d" % epoch).item(), len(batches) // k)
    for step in range(steps):
        optimizer.zero_grad()
        for data, target in batches[step * k:(step + 1) * k]:
            loss = F.nll_loss(model(data), target) / k
            loss.backward()
        optimizer.step()
        if step % 10 == 0 and hvd.rank() == 0:
            print("train epoch %d [%d/%d]\tloss %.4f" % (epoch, step, steps, loss.item() * k),
                  flush=True)


def test():
    model.eval()
    loss, correct, n = 0.0, 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            out = model(data)
            loss += F.nll_loss(out, target, reduction="sum").item()
            correct += out.argmax(1).eq(target).float().sum().item()
            n += len(target)
    loss = metric_average(loss / n, "avg_loss")
    accuracy = metric_average(correct / n, "avg_accuracy")
    if hvd.rank() == 0:
        print("test set: average loss %.4f, accuracy %.2f%%" % (loss, 100 * accuracy), flush=True)
    return accuracy


for epoch in range(1, args.epochs + 1):
    train(epoch)
    accuracy = test()

if args.check:
    flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()
                      if p.is_floating_point()])
    root = hvd.broadcast(flat.clone(), root_rank=0, name="check.params")
    assert torch.equal(flat, root), "rank %d parameters differ from rank 0's" % hvd.rank()
    assert accuracy >= args.min_accuracy, "accuracy %.3f below %.3f" % (accuracy,
                                                                        args.min_accuracy)
    print("hvd_mnist: check: rank %d parameters identical to rank 0's, accuracy %.3f"
          % (hvd.rank(), accuracy), flush=True)
hvd.shutdown()
