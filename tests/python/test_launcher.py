"""gradlink-run: output prefixes, environment, failure reporting."""

import textwrap


def test_prefixes_and_environment(run_job, tmp_path):
    script = tmp_path / "env.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import gradlink.torch as gl
        gl.init()
        print("env", os.environ["GRADLINK_RANK"], os.environ["GRADLINK_WORKERS"],
              os.environ["GRADLINK_SERVERS"], gl.rank(), gl.size(), gl.local_rank())
        print("to stderr", file=sys.stderr)
        print("no newline at the end", end="")
        # Every server has reached every worker once a push_pull that has partitions on all of
        # them completes (4 partitions of 4 bytes over 2 servers). A worker that leaves the job
        # while a server is still connecting to it makes that server abort inside UCX 1.13
        # (an assertion upstream removed, openucx/ucx#8175); a push_pull whose one partition
        # lay on one server left the other exposed to that race.
        import torch
        gl.push_pull(torch.zeros(4), name="done")
    """))
    job = run_job(3, 2, [str(script)], timeout=60, env={"GRADLINK_PARTITION_BYTES": "4"})
    assert job.rc == 0, job.explain()
    for r in range(3):
        assert "env %d 3 2 %d 3 %d" % (r, r, r) in job.lines("[worker %d]" % r), job.explain()
        assert "to stderr" in job.lines("[worker %d]" % r)
        assert "no newline at the end" in job.lines("[worker %d]" % r)
    assert any("listening on" in line for line in job.lines("[scheduler]")), job.explain()


# --bind pins worker r to the r-th CPU gradlink-run may use (mod their number).
def test_bind_pins_each_worker_to_one_cpu(run_job, tmp_path):
    import os
    script = tmp_path / "affinity.py"
    script.write_text(textwrap.dedent("""
        import os
        import gradlink.torch as gl
        gl.init()
        print("cpus", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
        gl.barrier()
    """))
    job = run_job(3, 1, [str(script)], timeout=60, launcher_args=["--bind"])
    assert job.rc == 0, job.explain()
    usable = sorted(os.sched_getaffinity(0))
    for r in range(3):
        assert "cpus %d" % usable[r % len(usable)] in job.lines("[worker %d]" % r), job.explain()
    unbound = run_job(1, 1, [str(script)], timeout=60)
    assert unbound.rc == 0, unbound.explain()
    assert "cpus " + ",".join(str(c) for c in usable) in unbound.lines("[worker 0]"), \
        unbound.explain()


def test_failed_worker_is_named_and_others_stopped(run_job, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["GRADLINK_RANK"] == "1":
            sys.exit(7)
        time.sleep(120)   # never joins: gradlink-run must stop it
    """))
    job = run_job(2, 1, [str(script)], timeout=60, launcher_args=["--grace", "1"])
    assert job.rc == 7, job.explain()
    assert "gradlink-run: worker 1" in job.err and "exit code 7" in job.err, job.explain()


def test_usage_errors(built):
    import subprocess
    import sys

    from conftest import BIN, LAUNCHER
    p = subprocess.run([sys.executable, LAUNCHER, "--bin-dir", BIN, "-n", "2"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "no worker command" in p.stderr


def test_server_weights(run_job):
    """--server-weights gives each server its --weight: the job is exact (basics.py asserts its
    sums) and the scheduler numbers the servers heaviest first."""
    job = run_job(2, 2, "basics.py", timeout=90, launcher_args=["--server-weights", "1,3"],
                  env={"GRADLINK_LOG_LEVEL": "info"})
    assert job.rc == 0, job.explain()
    assert any("placement weights: server 0 (" in line and ") 3, server 1 (" in line and
               line.endswith(") 1") for line in job.lines("[scheduler]")), job.explain()


def test_server_weights_usage_errors(built):
    import subprocess
    import sys

    from conftest import BIN, LAUNCHER
    for weights, why in (("1", "has 1 weights for 2 servers"), ("1,x", "'x' is not a number")):
        p = subprocess.run([sys.executable, LAUNCHER, "--bin-dir", BIN, "-n", "1", "-s", "2",
                            "--server-weights", weights, "--", "true"],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and why in p.stderr, (weights, p.stderr)


def test_torchrun_environment(built, tmp_path):
    """Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) init() finds the
    scheduler at MASTER_ADDR:MASTER_PORT+1. Started by hand here, as a cluster launcher would."""
    import os
    import re
    import subprocess
    import sys

    from conftest import BIN, REPO
    script = tmp_path / "tr.py"
    script.write_text(textwrap.dedent("""
        import torch
        import gradlink.torch as gl
        gl.init()
        x = torch.full((5,), float(gl.rank() + 1))
        gl.push_pull(x, average=False, name="x")
        print("torchrun rank %d of %d local %d sum %s" % (gl.rank(), gl.size(), gl.local_rank(),
                                                          x[0].item()))
    """))
    sched = subprocess.Popen([os.path.join(BIN, "gradlink-scheduler"), "--port", "0", "-w", "2",
                              "-s", "1", "--job", "default"], stdout=subprocess.PIPE, text=True)
    procs = [sched]
    try:
        port = int(re.search(r":(\d+)", sched.stdout.readline()).group(1))
        procs.append(subprocess.Popen([os.path.join(BIN, "gradlink-server"), "--scheduler",
                                       "127.0.0.1:%d" % port]))
        workers = []
        for r in (1, 0):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1),
                       PYTHONPATH=os.path.join(REPO, "python"))
            for v in ("GRADLINK_SCHEDULER", "GRADLINK_RANK", "GRADLINK_WORKERS",
                      "GRADLINK_LOCAL_RANK", "GRADLINK_JOB"):
                env.pop(v, None)
            workers.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                            stdout=subprocess.PIPE, text=True))
            procs.append(workers[-1])
        outs = [w.communicate(timeout=60)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outs
        assert "torchrun rank 1 of 2 local 1 sum 3.0" in outs[0]
        assert "torchrun rank 0 of 2 local 0 sum 3.0" in outs[1]
        assert sched.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
