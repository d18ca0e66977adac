"""The torch.distributed backend "gradlink": processes started the way torch.distributed users
start them (a FileStore or torchrun), with no gradlink launcher: the backend makes the job
(rank 0 hosts the scheduler, each host's first rank a server) through torch's store."""

import glob
import os
import subprocess
import sys
import time

import pytest

from conftest import BUILD, JOBS, REPO


@pytest.fixture(scope="module")
def backend(built):
    if not glob.glob(os.path.join(BUILD, "python", "gradlink", "_gradlink_c10d*.so")):
        pytest.skip("the torch.distributed backend is not built (needs libtorch-dev)")
    return built


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    for k in list(env):  # a job of its own, not one a surrounding gradlink-run made
        if k.startswith("GRADLINK_") and k != "GRADLINK_BUILD_DIR":
            del env[k]
    return env


def spawn(script, size, tmp_path, args=(), timeout=180, env=None):
    """Runs `script` as `size` processes (argv: rank, size, tmp_path, *args); returns
    [(rc, output)] by rank, once all have ended (or been killed at `timeout`)."""
    full = _env()
    full.update(env or {})
    procs = [subprocess.Popen([sys.executable, os.path.join(JOBS, script), str(r), str(size),
                               str(tmp_path), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=full, cwd=str(tmp_path))
             for r in range(size)]
    end = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            results.append((None, out.decode(errors="replace")))
            continue
        results.append((p.returncode, out.decode(errors="replace")))
    return results


def _torch_version():
    """(major, minor) of this Python's torch, None without one."""
    try:
        import torch
    except ImportError:
        return None
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def explain(results):
    return "\n".join("--- rank %d (exit %s)\n%s" % (r, rc, out)
                     for r, (rc, out) in enumerate(results))


@pytest.mark.parametrize("slots", ["1", "3"])
def test_every_operation_against_gloo(backend, tmp_path, slots):
    """With one key per signature (the default) and with three (GRADLINK_C10D_SLOTS)."""
    results = spawn("c10d_ops.py", 3, tmp_path, env={"GRADLINK_C10D_SLOTS": slots})
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and "C10D OPS OK rank %d" % r in out, explain(results)


def test_point_to_point_against_gloo(backend, tmp_path):
    """send / recv / isend / irecv / batch_isend_irecv, tags, any source, every dtype, new_group,
    disagreeing sizes (jobs/c10d_p2p.py)."""
    results = spawn("c10d_p2p.py", 3, tmp_path, timeout=120)
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and "C10D P2P OK rank %d" % r in out, explain(results)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_hung_peer_fails_pending_point_to_point(backend, tmp_path, how):
    """Rank 2 SIGKILLed or SIGSTOPped while rank 0 waits in a recv from it and rank 1 in a send
    to it: both fail within seconds, naming worker 2."""
    results = spawn("c10d_p2p_killed.py", 3, tmp_path, args=(how,), timeout=90)
    for r in (0, 1):
        rc, out = results[r]
        line = [l for l in out.splitlines() if l.startswith("C10D P2P LOST rank %d" % r)]
        assert rc == 0 and line, explain(results)
        assert "worker 2" in line[0], line[0]
        secs = float(line[0].split("after ")[1].split(" s")[0])
        assert secs < 15.0, line[0]


def test_all_gather_coalesced_sparse_all_reduce_and_ddp_with_a_sparse_embedding(backend,
                                                                                tmp_path):
    """Against Gloo in the same processes (jobs/c10d_sparse.py): all_gather_coalesced; a sparse
    all_reduce with a different nnz on each rank, an empty rank and dense dimensions; DDP over
    an nn.Embedding(sparse=True)."""
    results = spawn("c10d_sparse.py", 3, tmp_path, timeout=120)
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and "C10D SPARSE OK rank %d" % r in out, explain(results)


def test_an_uncaught_exception_is_printed_and_leaves_at_once(backend, tmp_path):
    """torch 2.x's init_process_group wraps sys.excepthook and prints what it buffered only once
    gradlink's hook returns, which it never does (it leaves the job): the traceback must still
    be printed."""
    results = spawn("c10d_uncaught.py", 1, tmp_path, timeout=60)
    rc, out = results[0]
    assert rc == 1, explain(results)
    assert "ValueError: deliberately uncaught on rank 0" in out, explain(results)
    assert "gradlink: uncaught ValueError on rank 0" in out, explain(results)


def test_ddp_zero_and_a_megatron_style_sync(backend, tmp_path):
    results = spawn("c10d_train.py", 2, tmp_path)
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and "C10D TRAIN OK rank %d" % r in out, explain(results)
    print(results[0][1])


def test_a_killed_peer_fails_every_rank_within_seconds(backend, tmp_path):
    t0 = time.monotonic()
    results = spawn("c10d_killed.py", 3, tmp_path, timeout=120)
    took = time.monotonic() - t0
    assert results[2][0] != 0, explain(results)  # the victim
    for r in (0, 1):
        rc, out = results[r]
        assert rc == 0, explain(results)
        line = [l for l in out.splitlines() if l.startswith("C10D KILLED rank %d" % r)]
        assert line, explain(results)
        assert "worker 2" in line[0], line[0]  # names the lost peer
        secs = float(line[0].split("after ")[1].split(" s")[0])
        assert secs < 10.0, line[0]
    assert took < 100, explain(results)


def _torchrun(tmp_path, argv, nproc):
    version = _torch_version()
    if version is None or version < (2, 0):
        cmd = [sys.executable, "-m", "torch.distributed.run",
               # torch 1.13 on Python 3.11 crashes at start without these (README, "torchrun").
               "--redirects", "1", "--tee", "1",
               "--standalone", "--nproc_per_node", str(nproc), *argv]
    else:
        # torch 2.x's torchrun needs no flags; where torch was built without libuv (Debian 13's
        # torch 2.6), torchrun cannot start at all, and the launcher works around that
        # (jobs/c10d_torchrun_launch.py); elsewhere it is torchrun itself.
        cmd = [sys.executable, os.path.join(JOBS, "c10d_torchrun_launch.py"),
               "--standalone", "--nproc_per_node", str(nproc), *argv]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(),
                       cwd=str(tmp_path), timeout=240)
    return p.returncode, p.stdout.decode(errors="replace")


@pytest.mark.parametrize("mode", ["backend", "init"])
def test_torchrun_starts_a_gradlink_job(backend, tmp_path, mode):
    """torchrun --standalone (a port torchrun picks), nothing started by hand: DDP over
    init_process_group("gradlink"), or a Horovod-style script's gradlink.torch.init()."""
    rc, out = _torchrun(tmp_path, [os.path.join(JOBS, "c10d_torchrun.py"), mode], 2)
    assert rc == 0, out
    for r in range(2):
        assert "C10D TORCHRUN OK rank %d mode %s" % (r, mode) in out, out


def test_an_external_server_pool_named_by_gradlink_scheduler(backend, tmp_path):
    """GRADLINK_SCHEDULER names a job started by hand (a pool of 3 servers): the backend joins
    it and starts nothing of its own."""
    import re
    from conftest import BIN
    sched = subprocess.Popen([os.path.join(BIN, "gradlink-scheduler"), "--port", "0", "-w", "2",
                              "-s", "3", "--job", "pool"], stdout=subprocess.PIPE, text=True)
    procs = [sched]
    try:
        port = int(re.search(r":(\d+)", sched.stdout.readline()).group(1))
        for s in range(3):
            procs.append(subprocess.Popen([os.path.join(BIN, "gradlink-server"), "--scheduler",
                                           "127.0.0.1:%d" % port, "--job", "pool", "--id",
                                           str(s)]))
        env = {"GRADLINK_SCHEDULER": "127.0.0.1:%d" % port, "GRADLINK_JOB": "pool",
               "C10D_EXPECT_SERVERS": "3", "WORLD_SIZE": "2"}
        results = []
        workers = [subprocess.Popen(
            [sys.executable, os.path.join(JOBS, "c10d_torchrun.py"), "tcp",
             "file://" + str(tmp_path / "store")], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=dict(_env(), RANK=str(r), **env), cwd=str(tmp_path))
            for r in range(2)]
        procs += workers
        for w in workers:
            out, _ = w.communicate(timeout=90)
            results.append((w.returncode, out.decode(errors="replace")))
        for r, (rc, out) in enumerate(results):
            assert rc == 0 and "C10D TORCHRUN OK rank %d mode tcp" % r in out, explain(results)
        assert sched.wait(timeout=30) == 0  # the job ended cleanly: every worker left
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _fsdp_skip():
    version = _torch_version()
    if version is None:
        return "FSDP needs torch >= 2.x on CPU; torch is not installed"
    if version < (2, 0):
        return ("FSDP needs torch >= 2.x on CPU; torch %d.%d refuses CPU-only execution"
                % version)
    return None


@pytest.mark.skipif(_fsdp_skip() is not None, reason=_fsdp_skip() or "")
def test_fsdp_on_cpu_equals_single_process_training_and_gloo(backend, tmp_path):
    """FullyShardedDataParallel over the backend (2 ranks, CPU; FULL_SHARD, SHARD_GRAD_OP,
    NO_SHARD): the full parameters after a few SGD steps equal single-process training on the
    global batch (1e-5 relative), and FSDP over Gloo in the same processes."""
    results = spawn("c10d_fsdp.py", 2, tmp_path)
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and "C10D FSDP OK rank %d" % r in out, explain(results)
    print(results[0][1])


def test_a_pipeline_parallel_job_equals_one_process(backend, tmp_path):
    """examples/pipeline_parallel.py: 2 pipeline stages (isend / irecv / batch_isend_irecv
    between them, GPipe microbatches) x 2 data-parallel replicas (all_reduce on each stage's
    new_group); its parameters equal one-process training on the global batch (1e-5 relative)."""
    results = spawn("c10d_pipeline.py", 4, tmp_path, args=("--check",), timeout=120)
    for r, (rc, out) in enumerate(results):
        assert rc == 0 and "PIPELINE OK rank %d" % r in out, explain(results)
    print(results[0][1])
