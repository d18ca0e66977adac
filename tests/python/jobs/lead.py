"""max_bytes_ahead through the environment (GRADLINK_MAX_BYTES_AHEAD): an operation holds its
partitions back while its sums are out, never more than the limit per server ahead; sums stay
exact."""

import os

import torch

import gradlink.torch as gl

gl.init()  # GRADLINK_PARTITION_BYTES and GRADLINK_MAX_BYTES_AHEAD come from the test
rank, size = gl.rank(), gl.size()
# 16 partitions, on all the servers: the op's lead is the limit times their number.
limit = int(os.environ["GRADLINK_MAX_BYTES_AHEAD"]) * gl.num_servers()

n = 64 * 1024  # 256 KiB of fp32: 16 partitions of 16 KiB
for step in range(3):
    x = ((torch.arange(n) * 7 + rank * 3 + step) % 13 - 6).float()
    want = sum(((torch.arange(n) * 7 + r * 3 + step) % 13 - 6).float() for r in range(size))
    gl.push_pull(x, average=False, name="lead")
    assert torch.equal(x, want), step

s = gl.stats()
# The op's 16 partitions are queued and pumped at once: exactly the limit goes, the rest waits.
assert s["partitions_held"] > 0, s
assert s["peak_bytes_ahead"] == limit, (s, limit)
print("LEAD OK rank %d" % rank)
