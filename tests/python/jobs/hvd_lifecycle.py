"""Horovod's life cycle under gradlink-run (issue 42): the variables horovodrun sets, init ->
shutdown -> init in one process (as every tearDown of Horovod's test_torch.py does), names that
come back with another shape, an operation of two steps left running at shutdown(), and an exit
without shutdown() (the job must still end at once: test_horovod_semantics.py times it).
Asserts inside; prints a line per section."""

import os
import socket
import time

import torch

import gradlink.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()

# The variables horovodrun sets, as Horovod's programs read them.
assert int(os.environ["HOROVOD_RANK"]) == rank
assert int(os.environ["HOROVOD_SIZE"]) == size
assert int(os.environ["HOROVOD_LOCAL_RANK"]) == hvd.local_rank()
assert int(os.environ["HOROVOD_LOCAL_SIZE"]) == hvd.local_size()
assert int(os.environ["HOROVOD_CROSS_RANK"]) == hvd.cross_rank()
assert int(os.environ["HOROVOD_CROSS_SIZE"]) == hvd.cross_size()
assert os.environ["HOROVOD_HOSTNAME"] == socket.gethostname()
print("env ok rank %d" % rank, flush=True)

# init -> shutdown -> init, three times, a collective each time (the same name with another
# shape and dtype each round: names are labels per call).
for round_ in range(3):
    n = 10 + round_
    dtype = (torch.float32, torch.float64, torch.int32)[round_]
    out = hvd.allreduce(torch.full((n,), rank + 1, dtype=dtype), op=hvd.Sum, name="life")
    assert out.dtype == dtype and torch.equal(
        out, torch.full((n,), size * (size + 1) // 2, dtype=dtype)), (round_, out)
    hvd.barrier()
    hvd.shutdown()
    assert not hvd.is_initialized()
    try:
        hvd.rank()
        raise AssertionError("rank() after shutdown()")
    except ValueError:
        pass
    hvd.init()
    assert hvd.is_initialized() and hvd.rank() == rank and hvd.size() == size
print("reinit ok rank %d" % rank, flush=True)

# An allgather started and not waited for, then shutdown() at once (Horovod's
# test_barrier_with_multiple_collectives): its second step (the data, after the shapes) must
# start on every rank before the context goes, or the ranks that did start it wait for the
# others for good (and a later join() with them). Rank 0 starts late and shuts down late (its
# second step starts meanwhile); rank 1 shuts down while its shapes step still waits. Under
# gradlink-run the worker stays, so the operation runs to its end: its handle, waited for after
# init(), has every rank's rows.
if rank == 0:
    time.sleep(0.5)
h = hvd.allgather_async(torch.full((rank + 1, 3), float(rank)))
if rank == 0:
    time.sleep(0.5)
hvd.shutdown()
hvd.init()
g = h.wait(20)
want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
assert torch.equal(g, want), g
print("drain ok rank %d" % rank, flush=True)

# The job still works, and this process now ends without calling shutdown().
g = hvd.allgather(torch.full((rank + 1, 2), float(rank)))
assert g.shape == (size * (size + 1) // 2, 2)
print("LIFECYCLE OK rank %d" % rank, flush=True)
