"""gradlink.torch in real multi-process jobs started through gradlink-run."""

import os
import re
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs"))
import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Every worker of these jobs is on this host, so the sums go through the same-host path by
# default (with 64 KiB chunks here: tensors of many chunks); SERVERS turns it off. The same
# semantics either way (basics.py checks which way the bytes went).
SAME_HOST = {"GRADLINK_LOCAL_CHUNK_BYTES": str(64 << 10)}
SERVERS = {"GRADLINK_LOCAL_ARENA_BYTES": "0"}
PATHS = pytest.mark.parametrize("env", [SERVERS, SAME_HOST], ids=["servers", "same-host"])


def expect_ok(job, tag, workers):
    """The job ended well and every worker printed "<tag> OK rank <r>"."""
    assert job.rc == 0, job.explain()
    for r in range(workers):
        assert "%s OK rank %d" % (tag, r) in job.lines("[worker %d]" % r), job.explain()


@PATHS
def test_push_pull_and_broadcast_basics(run_job, env):
    job = run_job(3, 2, "basics.py", env=env)
    assert job.rc == 0, job.explain()
    for r in range(3):
        assert "BASICS OK rank %d" % r in job.lines("[worker %d]" % r), job.explain()


def test_horovod_allreduce_family_compression_and_optimizer_keywords(run_job):
    expect_ok(run_job(3, 2, "hvd_api.py"), "HVD API", 3)


@PATHS
def test_horovod_join_with_uneven_batches(run_job, env):
    expect_ok(run_job(3, 2, "hvd_join.py", env=env), "HVD JOIN", 3)


def test_horovod_join_on_hosts_summing_first(run_job):
    """Ranks 0 and 2 share an emulated host, rank 1 has its own: hosts sum first. Rank 0 joins
    while rank 2 still trains (rank 0 keeps pushing its share of their host's partials), then
    rank 1 (its host sits out whole). The job checks that hosts summed first."""
    expect_ok(run_job(3, 2, "hvd_join.py", env={"JOIN_TEST_HOSTS": "0,1,0"}), "HVD JOIN", 3)


@PATHS
def test_staging_pipeline_with_the_cpu_copy_engine(run_job, env):
    """The pipeline CUDA tensors take (gradlink/torch/_staging.py), run on host tensors with its
    CPU copy engine: bit-identical to unstaged pushes, chunk order, buffer reuse, failures."""
    env = dict(env, STAGING_DEVICE="cpu", GRADLINK_STAGING_CHUNK_BYTES="4096")
    expect_ok(run_job(2, 2, "staging.py", env=env), "STAGING", 2)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_distributed_optimizer_through_the_staging_pipeline(run_job, tmp_path, kind):
    """Every gradient through the staging pipeline (GRADLINK_STAGE_HOST=1, 1 KiB chunks): the
    same parameters as single-process training on the global batch."""
    env = dict(SERVERS, GRADLINK_STAGE_HOST="1", GRADLINK_STAGING_CHUNK_BYTES="1024")
    # (--bucket-bytes 0: staged gradients go one by one, unfused; the job checks that.)
    job = run_job(2, 2, ["train_equiv.py", "--opt", kind, "--steps", "4", "--passes", "1",
                         "--bucket-bytes", "0", "--out", str(tmp_path)], env=env)
    assert job.rc == 0, job.explain()
    for r in range(2):
        staged = [int(line.split()[-1]) for line in job.lines("[worker %d]" % r)
                  if line.startswith("staging buffers ")]
        assert staged and staged[0] > 0, job.explain()  # the gradients were staged
    ref = common.reference(kind, 4, size=2, passes=1)
    for r in range(2):
        got = torch.load(tmp_path / ("rank%d.pt" % r))
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: "rank %d %s: %s" % (r, name, m))


def test_horovod_allgather_reducescatter_alltoall(run_job):
    expect_ok(run_job(3, 2, "hvd_gather.py"), "HVD GATHER", 3)


def test_collectives_against_gloo(run_job, tmp_path):
    expect_ok(run_job(3, 2, ["collectives_gloo.py", str(tmp_path)], timeout=120),
              "COLLECTIVES GLOO", 3)


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(run_job):
    expect_ok(run_job(3, 2, "sync_bn.py"), "SYNC BN", 3)


@pytest.mark.parametrize("flags", [[], ["--fp16-allreduce"]], ids=["fp32", "fp16"])
def test_horovod_style_mnist_with_adam_and_accumulation(run_job, flags):
    script = os.path.join(REPO, "examples", "hvd_mnist.py")
    job = run_job(2, 2, [script, "--check", "--epochs", "2", "--train-size", "1200"] + flags,
                  timeout=150)
    assert job.rc == 0, job.explain()
    assert any("test set: average loss" in line for line in job.lines("[worker 0]")), job.explain()
    for r in range(2):
        assert any("hvd_mnist: check: rank %d parameters identical to rank 0's" % r in line
                   for line in job.lines("[worker %d]" % r)), job.explain()


def test_byteps_api(run_job):
    expect_ok(run_job(3, 2, "bps_api.py"), "BPS API", 3)


def test_grouped_push_pull(run_job):
    job = run_job(3, 2, "grouped.py")
    assert job.rc == 0, job.explain()
    for r in range(3):
        assert "GROUPED OK rank %d" % r in job.lines("[worker %d]" % r), job.explain()


def test_max_bytes_ahead_from_the_environment(run_job):
    job = run_job(3, 2, "lead.py", env={"GRADLINK_PARTITION_BYTES": str(16 << 10),
                                        "GRADLINK_MAX_BYTES_AHEAD": str(48 << 10), **SERVERS})
    assert job.rc == 0, job.explain()
    for r in range(3):
        assert "LEAD OK rank %d" % r in job.lines("[worker %d]" % r), job.explain()


# The worker that fails a job is named even when its process ends after the others: rank 1 cuts
# its connection to the scheduler (which aborts the job, so the server exits at once) and only
# exits a second later. gradlink-run must name worker 1, as the scheduler's verdict does, not
# the server that ended first.
def test_launcher_names_the_worker_the_scheduler_blames(run_job, tmp_path):
    script = tmp_path / "cut.py"
    script.write_text(
        "import os, socket, time, torch, gradlink, gradlink.torch as gl\n"
        "gl.init()\n"
        "if gl.rank() == 1:\n"
        "    port = int(os.environ['GRADLINK_SCHEDULER'].rsplit(':', 1)[1])\n"
        "    for fd in os.listdir('/proc/self/fd'):\n"
        "        try:\n"
        "            s = socket.socket(fileno=os.dup(int(fd)))\n"
        "        except OSError:\n"
        "            continue\n"
        "        try:\n"
        "            if s.family == socket.AF_INET and s.getpeername()[1] == port:\n"
        "                s.shutdown(socket.SHUT_RDWR)\n"
        "        except OSError:\n"
        "            pass\n"
        "        s.close()\n"
        "    time.sleep(1.0)\n"
        "    os._exit(3)\n"
        "try:\n"
        "    gl.push_pull(torch.ones(4), name='x')\n"
        "except gradlink.PeerLostError as e:\n"
        "    print('RAISED: %s' % e)\n")
    job = run_job(2, 1, [str(script)])
    assert job.rc == 3, job.explain()
    assert re.search(r"gradlink-run: job failed: worker 1 .* failed first: exit code 3", job.err), \
        job.explain()
    assert "[server 0]" in job.text and "job aborted" in job.text, job.explain()


# bucket_bytes: None fuses small gradients into buckets (the default), 0 pushes each alone.
# same_host: through the same-host path (GRADLINK_LOCAL_ARENA_BYTES) instead of the servers.
@pytest.mark.parametrize("kind,passes,buckets,same_host", [("sgd", 1, None, False),
                                                           ("adam", 1, None, False),
                                                           ("sgd", 2, None, False),
                                                           ("sgd", 1, 0, False),
                                                           ("adam", 2, 1000, False),
                                                           ("adam", 1, None, True),
                                                           ("sgd", 1, 0, True)])
def test_distributed_optimizer_matches_single_process(run_job, tmp_path, kind, passes, buckets,
                                                      same_host):
    steps = 6
    extra = [] if buckets is None else ["--bucket-bytes", str(buckets)]
    env = SAME_HOST if same_host else SERVERS
    job = run_job(2, 2, ["train_equiv.py", "--opt", kind, "--steps", str(steps),
                         "--passes", str(passes), "--out", str(tmp_path)] + extra, env=env)
    assert job.rc == 0, job.explain()
    ref = common.reference(kind, steps, size=2, passes=passes)
    start = common.make_model().state_dict()
    for r in range(2):
        got = torch.load(tmp_path / ("rank%d.pt" % r))
        for name, want in ref.items():
            assert not torch.equal(want, start[name])  # training moved it
            torch.testing.assert_close(got[name], want, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: "rank %d %s: %s" % (r, name, m))


def test_ddp_hook_matches_gloo_allreduce(run_job, tmp_path):
    job = run_job(2, 2, ["ddp_equiv.py", "--steps", "5", "--out", str(tmp_path)])
    assert job.rc == 0, job.explain()
    for r in range(2):
        assert "DDP OK rank %d" % r in job.lines("[worker %d]" % r), job.explain()
    r0, r1 = (torch.load(tmp_path / ("rank%d.pt" % r)) for r in range(2))
    for variant in r0:
        for name in r0[variant]:
            assert torch.equal(r0[variant][name], r1[variant][name]), (variant, name)


def _equal_exactly(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
        if a.is_floating_point():
            assert torch.equal(torch.signbit(a), torch.signbit(b)), path + " (sign of zero)"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _equal_exactly(a[k], b[k], "%s/%s" % (path, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal_exactly(x, y, "%s/%d" % (path, i))
    else:
        assert a == b, (path, a, b)


def test_broadcast_parameters_and_optimizer_state(run_job, tmp_path):
    root = 1
    job = run_job(3, 2, ["broadcast.py", "--root", str(root), "--out", str(tmp_path)])
    assert job.rc == 0, job.explain()
    want = torch.load(tmp_path / ("before%d.pt" % root))
    other = torch.load(tmp_path / "before0.pt")
    assert not torch.equal(want["model"]["0.weight"], other["model"]["0.weight"])
    for r in range(3):
        _equal_exactly(want, torch.load(tmp_path / ("after%d.pt" % r)), "rank%d" % r)


def test_shape_mismatch_raises_on_every_rank(run_job):
    job = run_job(2, 1, "mismatch.py")
    assert job.rc == 0, job.explain()
    for r in range(2):
        lines = job.lines("[worker %d]" % r)
        hit = [line for line in lines if line.startswith("MISMATCH rank %d" % r)]
        assert hit, job.explain()
        assert "shape_differs" in hit[0] and "fp32[10]" in hit[0] and "fp32[11]" in hit[0]
        hit = [line for line in lines if line.startswith("MISMATCH transposed rank %d" % r)]
        assert hit, job.explain()
        assert "shape (3, 4)" in hit[0] and "shape (4, 3)" in hit[0], hit[0]
        assert "after mismatch rank %d: [1.0, 1.0, 1.0, 1.0]" % r in lines


@PATHS
def test_killed_worker_fails_the_others_and_the_launcher(run_job, env):
    job = run_job(3, 2, ["killed.py", "--victim", "1"], timeout=90, env=env)
    assert job.rc == 128 + 9, job.explain()
    assert re.search(r"gradlink-run: worker 1 \(pid \d+\) failed: killed by SIGKILL", job.err), \
        job.explain()
    assert re.search(r"gradlink-run: job failed: worker 1 .* failed first", job.err), job.explain()
    for r in (0, 2):
        raised = [line for line in job.lines("[worker %d]" % r) if line.startswith("RAISED")]
        assert raised, job.explain()
        m = re.match(r"RAISED (\w+) after ([\d.]+) s", raised[0])
        assert m.group(1) in ("PeerLostError", "AbortedError"), raised[0]
        assert float(m.group(2)) < 20, raised[0]   # bounded: seconds, not a hang
        assert "worker 1" in raised[0], raised[0]  # names the lost worker


def test_uncaught_exception_fails_the_others_fast(run_job, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import time, torch, gradlink, gradlink.torch as gl\n"
        "gl.init()\n"
        "if gl.rank() == 1:\n"
        "    time.sleep(0.5)\n"
        "    raise RuntimeError('boom')\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    gl.push_pull(torch.ones(4), name='x')\n"
        "except gradlink.PeerLostError as e:\n"
        "    print('RAISED after %.2f s: %s' % (time.monotonic() - t0, e))\n")
    job = run_job(2, 1, [str(script)])
    assert job.rc == 1, job.explain()
    assert "RuntimeError: boom" in job.text
    assert "gradlink-run: worker 1" in job.err, job.explain()
    raised = [line for line in job.lines("[worker 0]") if line.startswith("RAISED")]
    assert raised and "worker 1" in raised[0], job.explain()


# A Horovod-style script with only its import changed: DistributedOptimizer with fp16
# compression, broadcasts, hvd.allreduce of a metric; every rank ends with rank 0's parameters.
@pytest.mark.parametrize("flags", [[], ["--fp16-allreduce"]], ids=["fp32", "fp16"])
def test_horovod_style_synthetic_benchmark(run_job, flags):
    script = os.path.join(REPO, "examples", "hvd_synthetic_benchmark.py")
    job = run_job(2, 2, [script, "--check", "--num-iters", "2", "--width", "64"] + flags,
                  timeout=120)
    assert job.rc == 0, job.explain()
    assert any("total img/sec on 2 worker(s)" in line for line in job.lines("[worker 0]")), \
        job.explain()
    for r in range(2):
        assert ("hvd_synthetic_benchmark: check: rank %d parameters identical to rank 0's" % r
                in job.lines("[worker %d]" % r)), job.explain()


@pytest.mark.parametrize("flags", [[], ["--fp16-pushpull"], ["--ddp"]],
                         ids=["optimizer", "fp16", "ddp"])
def test_byteps_style_synthetic_benchmark(run_job, flags):
    script = os.path.join(REPO, "examples", "bps_synthetic_benchmark.py")
    job = run_job(2, 2, [script, "--check", "--num-iters", "2", "--width", "64"] + flags,
                  timeout=120)
    assert job.rc == 0, job.explain()
    assert any("Total img/sec on 2 worker(s)" in line for line in job.lines("[worker 0]")), \
        job.explain()
    for r in range(2):
        assert ("bps_synthetic_benchmark: check: rank %d parameters identical to rank 0's" % r
                in job.lines("[worker %d]" % r)), job.explain()


def test_train_lm_check(run_job):
    script = os.path.join(REPO, "examples", "train_lm.py")
    job = run_job(2, 2, [script, "--check", "--steps", "8", "--d-model", "32", "--layers", "1",
                         "--heads", "2", "--context", "32", "--batch", "8", "--log-every", "4",
                         "--sample", "20"], timeout=120)
    assert job.rc == 0, job.explain()
    lines = job.lines("[worker 0]")
    assert any("check passed" in line for line in lines), job.explain()
    assert any("tok/s" in line and "loss" in line for line in lines), job.explain()
    assert "train_lm: check: rank 1 parameters identical to rank 0's" in job.lines("[worker 1]")


def test_horovods_stall_variables_name_the_late_rank_and_tensor(run_job):
    """HOROVOD_STALL_CHECK_TIME_SECONDS reaches the scheduler and the servers: a rank 3.5 s late
    to a tensor is named, with the tensor, by the scheduler and by the rank that waits."""
    job = run_job(2, 2, "hvd_stall.py", env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert job.rc == 0, job.explain()
    assert len(job.lines("[worker 0] HVD STALL ok")) == 1, job.explain()
    named = [l for l in job.text.splitlines() if "rank 1 has not" in l and "'grad.late'" in l]
    assert any(l.startswith("[scheduler]") for l in named), job.explain()
    assert any(l.startswith("[worker 0]") for l in named), job.explain()
    assert not any(l.startswith("[worker 1]") for l in named), job.explain()
