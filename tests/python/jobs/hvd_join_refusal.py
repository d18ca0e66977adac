"""While a rank has joined, an allgather (any collective but a sum) fails at once on the others,
as Horovod's does, whether or not their unnamed calls are numbered alike: after the first round
the ranks that called have counted one more unnamed allgather than the one that sat out, so
unless the scheduler refuses at once they wait for each other's names (Horovod's
test_horovod_join_allgather with 3 workers). Broadcasts run first, one over ranks 0 and 2: the
partitions of a broadcast whose every rank had joined (here as soon as 0 and 2 have, before 1),
failed round after round, used to spin their server's thread so that the join's release never
ran (the server hung up after 10 s; 3 of 4 runs failed). Asserts inside."""

import torch

import gradlink.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
evens = hvd.add_process_set([0, 2])
b = hvd.broadcast(torch.arange(4.) * (rank + 1), 1, name="before")
assert torch.equal(b, torch.arange(4.) * 2), b
if rank in (0, 2):
    b = hvd.broadcast(torch.arange(4.) * (rank + 1), 2, process_set=evens, name="before.evens")
    assert torch.equal(b, torch.arange(4.) * 3), b
for first in range(size):
    if rank == first:
        last = hvd.join()
    else:
        try:
            hvd.allgather(torch.ones(3, 2))
            raise AssertionError("an allgather while rank %d had joined did not raise" % first)
        except RuntimeError as e:
            assert "joined" in str(e), e
        last = hvd.join()
    assert last != first, (first, last)
g = hvd.allgather(torch.full((1, 2), float(rank)), name="after")
assert torch.equal(g[:, 0], torch.arange(size, dtype=torch.float32)), g
print("JOIN REFUSAL OK rank %d" % rank, flush=True)
