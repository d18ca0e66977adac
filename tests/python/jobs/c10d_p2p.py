"""The "gradlink" backend's point-to-point against Gloo in the same processes (a gloo group of
the same ranks): send / recv / isend / irecv, recv from any source, tags in order, every dtype,
eager and announced sizes, non-contiguous tensors, new_group's rank translation,
batch_isend_irecv, disagreeing sizes and dtypes (an error on both sides), and a pending recv that
holds up no collective.

argv: rank, world size (>= 3), a directory for the FileStore. Prints "C10D P2P OK" at the end."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import gradlink.torch  # noqa: F401  (registers the backend)

rank, size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
assert size >= 3
dist.init_process_group("gradlink", init_method="file://" + os.path.join(tmp, "store"),
                        rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
gloo = dist.new_group(backend="gloo")
checked = 0


def data(src, dtype, n, salt=0):
    """What rank `src` sends: distinct per sender, dtype, size and salt."""
    g = torch.Generator().manual_seed(src * 7919 + n * 31 + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype) * (1 + 2j)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**31), min(info.max, 2**31 - 1), (n,), generator=g,
                         dtype=torch.int64).to(dtype)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.view(-1).view(torch.uint8) if a.dtype != torch.bool else a,
                    b.view(-1).view(torch.uint8) if b.dtype != torch.bool else b)


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)
right, left = (rank + 1) % size, (rank - 1) % size

# A ring of isend / irecv, every dtype, an eager size and one announced (> 64 KiB), beside Gloo.
for dtype in DTYPES:
    for n in (1, 1000, 300001):
        for group in (None, gloo):
            out = torch.empty(n, dtype=dtype)
            reqs = [dist.irecv(out, src=left, group=group),
                    dist.isend(data(rank, dtype, n), dst=right, group=group)]
            for q in reqs:
                q.wait()
            assert same(out, data(left, dtype, n)), (dtype, n, group)
            checked += 1

# Blocking send / recv, both orders, and a zero-element tensor.
for n in (0, 17, 100000):
    if rank == 0:
        dist.send(data(0, torch.float32, n), dst=1)
        back = torch.empty(n)
        assert dist.recv(back, src=1) == 1
        assert same(back, data(0, torch.float32, n) * 2)
    elif rank == 1:
        got = torch.empty(n)
        assert dist.recv(got, src=0) == 0
        assert same(got, data(0, torch.float32, n))
        dist.send(got * 2, dst=0)
    checked += 1

# Tags: messages of one (source, tag) arrive in order; tags do not overtake each other's order,
# and a recv of tag 2 takes tag 2's first message even when tag 1's came first.
if rank == 0:
    works = []
    for i in range(6):
        for tag in (1, 2):
            n = 50000 if i % 2 else 10  # eager and announced, interleaved
            works.append(dist.isend(torch.full((n,), float(100 * tag + i)), dst=1, tag=tag))
    for w in works:
        w.wait()
elif rank == 1:
    for tag in (2, 1):
        for i in range(6):
            n = 50000 if i % 2 else 10
            t = torch.empty(n)
            dist.recv(t, src=0, tag=tag)
            assert torch.all(t == 100 * tag + i), (tag, i, t[:3])
checked += 1
dist.barrier()

# From any source: rank 0 receives one message from each other rank, each naming its sender.
if rank == 0:
    seen = set()
    for _ in range(size - 1):
        t = torch.empty(2000, dtype=torch.int64)
        src = dist.recv(t, tag=7)
        assert same(t, data(src, torch.int64, 2000, salt=7)), src
        seen.add(src)
    assert seen == set(range(1, size)), seen
    # irecv from any source: the work's source rank.
    t = torch.empty(3, dtype=torch.int64)
    w = dist.irecv(t, tag=8)
    w.wait()
    assert w._source_rank() == t[0].item(), (w._source_rank(), t)
else:
    dist.send(data(rank, torch.int64, 2000, salt=7), dst=0, tag=7)
    if rank == 1:
        dist.send(torch.tensor([rank, 0, 0]), dst=0, tag=8)
checked += 1

# Non-contiguous tensors both ways: a transposed send, a strided view received into.
if rank == 0:
    m = torch.arange(600, dtype=torch.float64).view(20, 30)
    dist.send(m.t(), dst=1)
    dist.send(m[:, ::3], dst=1)
elif rank == 1:
    want = torch.arange(600, dtype=torch.float64).view(20, 30)
    got = torch.empty(30, 20, dtype=torch.float64)
    dist.recv(got, src=0)
    assert torch.equal(got, want.t())
    host = torch.zeros(20, 20, dtype=torch.float64)
    view = host[:, ::2]
    assert not view.is_contiguous()
    dist.recv(view, src=0)
    assert torch.equal(host[:, ::2], want[:, ::3]) and torch.all(host[:, 1::2] == 0)
checked += 1

# new_group: ranks are the job's in the API, translated to the group's and back.
sub = dist.new_group([1, 2])
if rank in (1, 2):
    peer = 3 - rank
    t = torch.empty(5000)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, torch.float32, 5000, 9),
                                              peer, sub),
                                   dist.P2POp(dist.irecv, t, peer, sub)])
    for q in reqs:
        q.wait()
    assert same(t, data(peer, torch.float32, 5000, 9))
    if rank == 2:
        src = dist.recv(t, group=sub)
        assert src == 1, src  # the job's rank, as torch reports it
    else:
        dist.send(t, dst=2, group=sub)
    # A message of the subgroup never meets a recv of the default group (same peer, same tag).
    # (A send completes once its recv has taken it, as Gloo's does: isend, then wait.)
    if rank == 1:
        works = [dist.isend(torch.ones(4), dst=2, group=sub, tag=5),
                 dist.isend(torch.full((4,), 2.0), dst=2, tag=5)]
        for w in works:
            w.wait()
    else:
        a, b = torch.empty(4), torch.empty(4)
        dist.recv(a, src=1, tag=5)            # the default group's
        dist.recv(b, src=1, tag=5, group=sub)
        assert torch.all(a == 2) and torch.all(b == 1), (a, b)
checked += 1

# batch_isend_irecv in both directions around the ring, beside Gloo.
for group in (None, gloo):
    recv_l, recv_r = torch.empty(70000), torch.empty(70000)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, data(rank, torch.float32, 70000, 1), right, group),
        dist.P2POp(dist.isend, data(rank, torch.float32, 70000, 2), left, group),
        dist.P2POp(dist.irecv, recv_l, left, group),
        dist.P2POp(dist.irecv, recv_r, right, group)])
    for q in reqs:
        q.wait()
    assert same(recv_l, data(left, torch.float32, 70000, 1))
    assert same(recv_r, data(right, torch.float32, 70000, 2))
    checked += 1


def refused(fn, *words):
    try:
        fn()
    except (RuntimeError, ValueError) as e:  # (torch 2.x checks some arguments itself)
        for w in words:
            assert w in str(e), (w, str(e))
        return str(e)
    raise AssertionError("no error; expected one naming %s" % (words,))


# A size or dtype that disagrees fails both sides, eager and announced; nothing is received.
for n_send, n_recv, send_dtype, recv_dtype in ((10, 12, torch.float32, torch.float32),
                                               (200000, 100000, torch.float32, torch.float32),
                                               (10, 10, torch.float32, torch.int32),
                                               (100000, 100000, torch.int64, torch.float64)):
    if rank == 0:
        refused(lambda: dist.send(torch.ones(n_send, dtype=send_dtype), dst=1, tag=3),
                "refused", str(n_recv * torch.empty(0, dtype=recv_dtype).element_size()))
    elif rank == 1:
        t = torch.zeros(n_recv, dtype=recv_dtype)
        refused(lambda: dist.recv(t, src=0, tag=3), "worker 0",
                str(n_send * torch.empty(0, dtype=send_dtype).element_size()))
        assert torch.all(t == 0)
    checked += 1
# ...and the stream goes on: the next message of that tag is received.
if rank == 0:
    dist.send(torch.full((3,), 4.0), dst=1, tag=3)
elif rank == 1:
    t = torch.empty(3)
    dist.recv(t, src=0, tag=3)
    assert torch.all(t == 4)

# Bad arguments are refused at the call.
refused(lambda: dist.send(torch.ones(1), dst=size + 3), "rank")
if rank == 0:
    refused(lambda: dist.send(torch.ones(1), dst=0), "rank")

# A recv waiting for its peer holds up no collective: rank 0's recv is posted first, an
# all_reduce runs and completes, then rank 1 sends.
if rank in (0, 1):
    t = torch.empty(100)
    if rank == 0:
        w = dist.irecv(t, src=1, tag=11)
    s = torch.ones(10)
    dist.all_reduce(s)
    assert torch.all(s == size)
    if rank == 0:
        w.wait()
        assert torch.all(t == 5)
    else:
        dist.send(torch.full((100,), 5.0), dst=0, tag=11)
else:
    s = torch.ones(10)
    dist.all_reduce(s)
checked += 1

dist.barrier()
print("C10D P2P OK rank %d (%d checks)" % (rank, checked), flush=True)
dist.destroy_process_group()
