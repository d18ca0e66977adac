"""CUDA tensors through gradlink (gradlink/torch/_staging.py's CUDA copy engine), in real
multi-process jobs: 2 workers sharing the one GPU, 2 servers on the CPU. They run where torch
sees a CUDA device (scripts/device/cuda_check.sh runs them on a lent GPU machine) and skip
elsewhere, saying why. The pipeline's logic runs everywhere through its CPU copy engine
(test_torch.py: test_staging_pipeline_with_the_cpu_copy_engine)."""

import socket

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: torch %s sees none (torch.cuda.is_available() is False)"
    % torch.__version__)

SERVERS = {"GRADLINK_LOCAL_ARENA_BYTES": "0"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("chunk", [64 << 10, 4 << 20], ids=["64K-chunks", "4M-chunks"])
def test_cuda_push_pull_is_exact_against_the_host_path(run_job, chunk):
    """Every dtype, sums and averages, many chunks; non-contiguous; groups; work queued on the
    current stream before the call; failures (tests/python/jobs/staging.py)."""
    env = dict(SERVERS, STAGING_DEVICE="cuda", GRADLINK_STAGING_CHUNK_BYTES=str(chunk))
    job = run_job(2, 2, "staging.py", env=env, timeout=180)
    assert job.rc == 0, job.explain()
    for r in range(2):
        assert "STAGING OK rank %d" % r in job.lines("[worker %d]" % r), job.explain()


def test_training_on_the_gpu_matches_single_process(run_job):
    job = run_job(2, 2, "cuda_train.py", env=dict(SERVERS, CUDA_TRAIN_PORT=str(free_port())),
                  timeout=180)
    assert job.rc == 0, job.explain()
    for r in range(2):
        assert "CUDA TRAIN OK rank %d" % r in job.lines("[worker %d]" % r), job.explain()
