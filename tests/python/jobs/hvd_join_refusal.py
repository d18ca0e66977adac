"""While a rank has joined, an allgather (any collective but a sum) fails at once on the others,
as Horovod's does, whether or not their unnamed calls are numbered alike: after the first round
the ranks that called have counted one more unnamed allgather than the one that sat out, so
unless the scheduler refuses at once they wait for each other's names (Horovod's
test_horovod_join_allgather with 3 workers). Asserts inside."""

import torch

import gradlink.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
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
