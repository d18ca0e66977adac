"""What the worker reports: stats() (the C++ worker's counters and the settings in force) and
staging_stats() (the path device tensors took and the staging pool's buffers).
Threads: any."""

from . import _context


def stats():
    """The C++ worker's counters: push_pulls, bytes_reduced, groups, fused_ops, bytes_packed,
    bytes_unpacked, bytes_copied_eager, bytes_copied_bounce, bytes_copied_local,
    bytes_copied_results (failover's copy of each last result), local_busy_ns (time this
    worker's threads spent copying and summing in shared memory), protocol_errors,
    partitions_held, peak_bytes_ahead, servers_lost and partitions_recovered (failover); and
    ``in_force``, the settings in force (partition_bytes, max_bytes_in_flight, max_bytes_ahead,
    fusion_buffer_bytes, fusion_threshold_bytes, local_arena_bytes, same_host_path, hierarchy
    (hierarchical aggregation: "host h of H, local rank l of L, ..." or "" when off),
    single_lane, host, ucx: the UCX_* variables in force, and chosen: which of the first three
    gradlink chose for the job, and why)."""
    return _context._require().worker.stats()


def staging_stats():
    """Device tensors' path: `path`, which one ran (the transport moves host memory; its own
    device memory types, from UCX, in `device_memory`: gradlink stages through host buffers
    whatever they are), and the staging pool's host buffers `allocated` and `reused`."""
    ctx = _context._require()
    pool = ctx.stager.pool if ctx.stager is not None else None
    device = list(ctx.worker.stats()["in_force"].get("device_memory", []))
    return {"path": "pinned host staging (%s)" % (
                "the transport moves host memory only" if not device else
                "the transport could move %s memory itself; gradlink hands it host memory"
                % "/".join(device)),
            "device_memory": device,
            "allocated": pool.allocated if pool else 0, "reused": pool.reused if pool else 0}
