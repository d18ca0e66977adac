"""The torch.distributed backend "gradlink" (registered when gradlink.torch is imported).

    import torch.distributed as dist
    import gradlink.torch                          # registers the backend
    dist.init_process_group("gradlink")            # env://, tcp://, file://; under torchrun
    model = torch.nn.parallel.DistributedDataParallel(model)   # its buckets go to gradlink

The process group is C++ (python/c10d/: a c10d ProcessGroup on torch 1.13, a Backend on 2.x)
and runs every collective on this process's gradlink worker, through the servers' own
operations. This module does the rendezvous through the Store torch hands the backend:

* ``GRADLINK_SCHEDULER`` set (gradlink-run, or an external server pool): join that job.
* Otherwise rank 0 hosts the scheduler in this process and publishes its address, the job
  name and a fresh job secret in the store (_rendezvous.py); the first rank of each host starts one
  gradlink-server for the job (``GRADLINK_SERVERS_PER_HOST``, default 1), a child process that
  ends with the job. Every worker then joins.

Subgroups (``dist.new_group(ranks, backend="gradlink")``) share the worker; their collectives
are the servers' group operations over those ranks.
"""

import atexit
import datetime

import torch.distributed as dist

from gradlink import InvalidArgumentError, _env

from . import _context, _init
from ._rendezvous import BACKEND, init_from_store, rendezvous  # noqa: F401
from ._rendezvous import _end_job, _job, group_uid


def _module():
    try:
        from gradlink import _gradlink_c10d
    except ImportError as e:
        raise ImportError(
            "gradlink: the torch.distributed backend (_gradlink_c10d) is not built: it needs "
            "libtorch's C++ headers when gradlink is built (Debian: apt-get install libtorch-dev, "
            "then rebuild). (%s)" % e) from e
    return _gradlink_c10d


def _create(opts, pg_options=None):
    """torch's creator (extended API): a gradlink process group for opts.group_rank of
    opts.group_size over opts.global_ranks_in_group."""
    c10d = _module()
    rank, size = opts.group_rank, opts.group_size
    timeout_s = opts.timeout.total_seconds() if isinstance(opts.timeout, datetime.timedelta) \
        else float(opts.timeout)
    members = sorted(int(r) for r in (opts.global_ranks_in_group or []))
    if not members:  # the default group
        if not _context.is_initialized():
            first = not _job["servers"] and _job["scheduler"] is None
            address = rendezvous(opts.store, rank, size, timeout_s)
            if first:
                atexit.register(_end_job)  # runs after the worker's shutdown (registered later)
            _init.init(scheduler=address, rank=rank, **_init.pending_options())
        ctx = _context._require()
        if ctx.size != size or ctx.rank != rank:
            raise InvalidArgumentError(
                "gradlink: the default process group is rank %d of %d, but this process's "
                "gradlink worker is rank %d of %d (gradlink.torch.init() joined another job)"
                % (rank, size, ctx.rank, ctx.size))
        uid = "world"
    else:
        if not _context.is_initialized():
            raise InvalidArgumentError(
                "gradlink: new_group(backend='gradlink') needs a gradlink job: make the default "
                "process group gradlink too, or call gradlink.torch.init() first")
        ctx = _context._require()
        uid = group_uid(members)
        if members == list(range(ctx.size)):
            members = []  # every worker: plain sums take the hierarchical path
    # Keys per signature (python/c10d/process_group.h): 1 unless code keeps several collectives
    # of one signature in flight at once and they must overlap (each slot costs the servers the
    # key's memory).
    slots = _env.c10d_slots()
    return c10d.create(ctx.worker._shared(), rank, size, members, uid, timeout_s, slots)


def register():
    if hasattr(dist.Backend, BACKEND.upper()):
        return
    import inspect
    kwargs = {}
    params = inspect.signature(dist.Backend.register_backend).parameters
    if "extended_api" in params:
        kwargs["extended_api"] = True
    if "devices" in params:
        kwargs["devices"] = ["cpu"]
    dist.Backend.register_backend(BACKEND, _create, **kwargs)
