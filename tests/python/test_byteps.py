"""gradlink.byteps.torch against byteps.torch: every public name of BytePS's (0.2.5, the last
release: byteps/torch/__init__.py, ops.py, compression.py, parallel/, cross_barrier.py) is
there, and the ones gradlink lacked behave as BytePS's (tests/python/jobs/byteps_ops.py)."""

import importlib

import pytest


def expect_ok(job, tag, workers):
    """The job ended well and every worker printed "<tag> OK rank <r>"."""
    assert job.rc == 0, job.explain()
    for r in range(workers):
        assert "%s OK rank %d" % (tag, r) in job.lines("[worker %d]" % r), job.explain()

# byteps.torch's public names, module by module, as BytePS 0.2.5 defines or imports them.
BYTEPS_NAMES = {
    "": ["Compression", "byteps_push_pull", "push_pull", "poll", "synchronize", "declare",
         "init", "shutdown", "suspend", "resume", "size", "local_size", "rank", "local_rank",
         "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
         "broadcast_object", "parallel"],
    ".ops": ["init", "shutdown", "suspend", "resume", "size", "local_size", "rank",
             "local_rank", "push_pull_async", "BytePSPushPull", "push_pull",
             "push_pull_async_inplace", "push_pull_group_sync_inplace", "push_pull_inplace",
             "poll", "declare", "byteps_torch_set_num_grads", "synchronize"],
    ".compression": ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"],
    ".parallel": ["DistributedDataParallel"],
    ".cross_barrier": ["CrossBarrier", "Compression", "init", "shutdown", "size", "local_size",
                       "rank", "local_rank", "poll", "synchronize", "broadcast_parameters",
                       "broadcast_optimizer_state"],
}


@pytest.mark.parametrize("module", sorted(BYTEPS_NAMES), ids=lambda m: "byteps.torch" + m)
def test_every_byteps_torch_name_is_there(built, module):
    m = importlib.import_module("gradlink.byteps.torch" + module)
    missing = [n for n in BYTEPS_NAMES[module] if not hasattr(m, n)]
    assert not missing, "gradlink.byteps.torch%s lacks %s" % (module, ", ".join(missing))


def test_byteps_ops_cross_barrier_and_ddp_as_byteps_has_them(run_job):
    expect_ok(run_job(3, 2, "byteps_ops.py", timeout=90), "BPS OPS", 3)
