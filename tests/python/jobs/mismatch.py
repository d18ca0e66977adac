"""Workers push the same name with different shapes: every one raises MismatchError, for a
different element count (10 + rank) and for the same count in another shape ((3, 4) against
(4, 3))."""

import time

import torch

import gradlink
import gradlink.torch as gl

gl.init()
rank = gl.rank()
t0 = time.monotonic()
try:
    gl.push_pull(torch.ones(10 + rank), name="shape_differs")
    print("NO ERROR rank %d" % rank)
except gradlink.MismatchError as e:
    print("MISMATCH rank %d after %.2f s: %s" % (rank, time.monotonic() - t0, e))
try:
    gl.push_pull(torch.ones((3, 4) if rank == 0 else (4, 3)), name="transposed")
    print("NO ERROR transposed rank %d" % rank)
except gradlink.MismatchError as e:
    print("MISMATCH transposed rank %d: %s" % (rank, e))
# The job goes on: other tensors still work.
x = torch.full((4,), float(rank))
gl.push_pull(x, average=False, name="after_mismatch")
print("after mismatch rank %d: %s" % (rank, x.tolist()))
gl.shutdown()
