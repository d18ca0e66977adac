#!/usr/bin/env python3
"""bench/cuda_staging.py: what staging CUDA tensors through host memory costs
(gradlink/torch/_staging.py). Run under gradlink-run with 2 workers (they may share one GPU):

  build/bin/gradlink-run -n 2 -s 2 -- python3 bench/cuda_staging.py [--sizes 4M,64M,256M,1G]

Per size, each rank times push_pull (a sum) of the same bytes from host memory and from the GPU
(--iters timed after one warm-up, medians), and, on its own, the device-to-host and
host-to-device copy rates into pinned memory in the pipeline's chunks. Rank 0 prints a table:
staging's share of the step (device time / host time - 1; the target is <= 10% where the
network dominates) and the copy rates (the target: at least half the link's PCIe rate)."""

import argparse
import statistics
import time

import torch

import gradlink.torch as gl
from gradlink.torch import _staging


def size_of(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def timed(fn, iters):
    fn()  # warm-up (plans the keys, fills the buffer pool)
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        gl.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def copy_rate(nbytes, to_host):
    """GB/s of chunked copies between a device tensor and pinned host buffers on a side stream."""
    chunk = _staging.chunk_bytes()
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    per = chunk // 4
    stream = torch.cuda.Stream()
    best = None
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for i in range(0, dev.numel(), per):
                if to_host:
                    host[i:i + per].copy_(dev[i:i + per], non_blocking=True)
                else:
                    dev[i:i + per].copy_(host[i:i + per], non_blocking=True)
        stream.synchronize()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return nbytes / best / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4M,64M,256M,1G")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    gl.init()
    rows = []
    for s in a.sizes.split(","):
        n = size_of(s) // 4
        host = torch.randn(n)
        dev = torch.randn(n, device="cuda")
        t_host = timed(lambda: gl.push_pull(host, average=False, name="host.%s" % s), a.iters)
        t_dev = timed(lambda: gl.push_pull(dev, average=False, name="dev.%s" % s), a.iters)
        rows.append((s, t_host, t_dev, copy_rate(n * 4, True), copy_rate(n * 4, False)))
        del host, dev
    if gl.rank() == 0:
        print("| S | host push_pull ms | CUDA push_pull ms | staging share | D2H GB/s | H2D GB/s |")
        print("|---|---|---|---|---|---|")
        for s, th, td, d2h, h2d in rows:
            print("| %s | %.2f | %.2f | %+.1f%% | %.1f | %.1f |"
                  % (s, th * 1e3, td * 1e3, (td / th - 1) * 100, d2h, h2d))
        print("chunk bytes %d (GRADLINK_STAGING_CHUNK_BYTES)" % _staging.chunk_bytes())
    gl.shutdown()


if __name__ == "__main__":
    main()
