"""gradlink-run: output prefixes, environment, failure reporting."""

import textwrap

import re

import pytest


def test_prefixes_and_environment(run_job, tmp_path):
    script = tmp_path / "env.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import gradlink.torch as gl
        gl.init()
        print("env", os.environ["GRADLINK_RANK"], os.environ["GRADLINK_WORKERS"],
              os.environ["GRADLINK_SERVERS"], gl.rank(), gl.size(), gl.local_rank())
        f = gl.stats()["in_force"]
        print("in_force", f["partition_bytes"], f["max_bytes_in_flight"], f["same_host_path"],
              f["host"] != "", "UCX_TLS='tcp'" in f["ucx"])
        print("ucx", "UCX_TCP_RCVBUF='64k' (set by gradlink)" in f["ucx"],
              "UCX_TCP_TX_SEG_SIZE='32k'" in f["ucx"], f["chosen"].startswith("max_bytes_in_flight"))
        print("to stderr", file=sys.stderr)
        print("no newline at the end", end="")
        # One operation before leaving. On the servers' path it would make every server reach
        # every worker first (4 partitions of 4 bytes over 2 servers): a worker that left while
        # a server was still connecting to it made that server abort inside UCX 1.13
        # (openucx/ucx#8175). Here it goes through the same-host path, and the lanes' own
        # flush at Stop() (src/transport/ucx/lane.cc) finishes those connections instead.
        import torch
        gl.push_pull(torch.zeros(4), name="done")
    """))
    job = run_job(3, 2, [str(script)], timeout=60,
                  env={"GRADLINK_PARTITION_BYTES": "4", "UCX_TLS": "tcp",
                       "UCX_TCP_TX_SEG_SIZE": "32k"})
    assert job.rc == 0, job.explain()
    for r in range(3):
        # The settings in force, as the worker's stats give them: the variable's partition, the
        # window gradlink sizes for it (8 partitions on one machine), the same-host path (on by default: every worker is on this host),
        # and the UCX variable set.
        assert "in_force 4 32 True True True" in job.lines("[worker %d]" % r), \
            job.explain()
        # The UCX settings gradlink needs, set by it where the user did not (the receive
        # buffers), never over the user's (the send segments); the window and lead chosen.
        assert "ucx True True True" in job.lines("[worker %d]" % r), job.explain()
        assert "env %d 3 2 %d 3 %d" % (r, r, r) in job.lines("[worker %d]" % r), job.explain()
        assert "to stderr" in job.lines("[worker %d]" % r)
        # The unterminated last line comes out whole; a line UCX logs as the lanes close (a
        # connection refused by a peer already gone: rc stays 0) may follow it on that line.
        assert any(line.startswith("no newline at the end")
                   for line in job.lines("[worker %d]" % r)), job.explain()
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
    sums), and gradlink-run's server i is the scheduler's server i (each claims its id), whatever
    its weight."""
    job = run_job(2, 2, "basics.py", timeout=90, launcher_args=["--server-weights", "1,3"],
                  env={"GRADLINK_LOG_LEVEL": "info", "GRADLINK_LOCAL_ARENA_BYTES": "0"})
    assert job.rc == 0, job.explain()
    assert any("placement weights: server 0 (" in line and ") 1, server 1 (" in line and
               line.endswith(") 3") for line in job.lines("[scheduler]")), job.explain()


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
    """Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) with
    GRADLINK_SCHEDULER naming a job started by hand (an external server pool, as a cluster
    launcher would start one), init() joins that job, not one made through torch's store
    (which test_c10d's torchrun tests cover)."""
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
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                       GRADLINK_SCHEDULER="127.0.0.1:%d" % port,
                       PYTHONPATH=os.path.join(REPO, "python"))
            for v in ("GRADLINK_RANK", "GRADLINK_WORKERS",
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


def _children(pid):
    """{pid: argv} of the processes whose parent is `pid`."""
    import os
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open("/proc/%s/cmdline" % d, "rb") as f:
                    kids[int(d)] = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            pass
    return kids


@pytest.mark.parametrize("target,sig,blamed", [
    ("server 0", "SIGSTOP", "server 0"),
    ("scheduler", "SIGKILL", "scheduler"),
    ("scheduler", "SIGSTOP", "scheduler"),
])
def test_a_lost_member_is_named_and_the_job_ends_within_two_seconds(built, tmp_path, target, sig,
                                                                     blamed):
    """The job's only server, or the scheduler, stopped or killed mid-job (with more servers
    a lost one is replaced: the test below): gradlink-run names that process (by the same name
    the scheduler uses: server S claims id S) and every process is gone within 2 s of that
    verdict. (It blamed worker 0 or server 0 in 3 of 5 such runs, and a stopped peer kept the
    job alive 17.8 s.)"""
    import os
    import signal as signals
    import subprocess
    import sys
    import time
    from conftest import BIN, LAUNCHER
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
        import time, torch
        import gradlink.torch as gl
        gl.init()
        t = torch.ones(4096)
        gl.push_pull(t, name="warm")
        print("READY", flush=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            gl.push_pull(torch.ones(4096), name="loop")
    """))
    servers = "1" if target.startswith("server") else "2"
    p = subprocess.Popen([sys.executable, LAUNCHER, "--bin-dir", BIN, "-n", "2", "-s", servers,
                          "--timeout", "50", "--", sys.executable, str(script)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(tmp_path))
    try:
        ready = 0
        end = time.monotonic() + 40
        while ready < 2 and time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                break
            ready += b"READY" in line
        assert ready == 2, "the job did not start"
        kids = _children(p.pid)
        if target == "scheduler":
            victim = [k for k, argv in kids.items() if argv[0].endswith(b"gradlink-scheduler")]
        else:
            victim = [k for k, argv in kids.items() if argv[0].endswith(b"gradlink-server")
                      and b"--id" in argv and argv[argv.index(b"--id") + 1] == b"0"]
        assert len(victim) == 1, kids
        t0 = time.monotonic()
        os.kill(victim[0], getattr(signals, sig))
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        for k in locals().get("victim", []):
            try:
                os.kill(k, signals.SIGKILL)
            except ProcessLookupError:
                pass
    err = err.decode(errors="replace")
    named = [l for l in err.splitlines() if l.startswith("gradlink-run: ") and "stopping the job" in l]
    assert named and named[0].startswith("gradlink-run: %s (pid %d) failed" % (blamed, victim[0])), err
    # Detection takes up to the 3 s silence limit (a stopped peer) plus a heartbeat; then the
    # verdict and at most 2 s to stop the rest.
    assert took < 3.0 + 0.5 + 2.0 + 1.5, "%.1f s from %s to the end\n%s" % (took, sig, err)
    assert p.returncode != 0
    print("%s %s: named %r, job over %.2f s after the signal" % (sig, target, blamed, took))
    time.sleep(0.2)
    for k in kids:
        try:
            with open("/proc/%d/stat" % k) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        assert state == "Z", "process %d (%s) outlived gradlink-run" % (k, kids[k][0])


def _train(tmp_path, mode, tag, kill=None, servers=3, launcher_args=(), steps=30):
    """failover_train.py under gradlink-run, 2 workers and `servers` servers, through the
    servers (no same-host path); with `kill` = (signal, step), server 1 gets that signal once a
    worker has done that step; or `kill` is a list of (signal, step, server id, text): that
    server (or the scheduler, for id "scheduler") gets it once a worker has done that step and
    gradlink-run's stderr holds the text.
    Returns (gradlink-run's exit code, its stderr, the victims' pids (one: the pid), the output
    folder, the workers' output)."""
    import os
    import subprocess
    import sys
    from conftest import BIN, JOBS, LAUNCHER
    kills = [] if kill is None else [kill + (1, "")] if isinstance(kill, tuple) else list(kill)
    out = tmp_path / tag
    out.mkdir()
    env = dict(os.environ, GRADLINK_LOCAL_ARENA_BYTES="0")
    err_path = tmp_path / (tag + ".err")
    with open(err_path, "wb") as err:
        p = subprocess.Popen([sys.executable, LAUNCHER, "--bin-dir", BIN, "-n", "2", "-s",
                              str(servers), "--timeout", "90", *launcher_args, "--",
                              sys.executable, os.path.join(JOBS, "failover_train.py"), "--mode",
                              mode, "--steps", str(steps), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=err, env=env, cwd=str(tmp_path))
        victims = []
        lines = []
        try:
            for line in p.stdout:
                lines.append(line.decode(errors="replace"))
                m = re.search(rb"\bSTEP (\d+)$", line.rstrip())  # "[worker 0] STEP 5"
                step = int(m.group(1)) if m else None
                if len(victims) < len(kills) and step is not None:
                    sig, at, sid, text = kills[len(victims)]
                    if step >= at and text in err_path.read_text(errors="replace"):
                        victim = [k for k, argv in _children(p.pid).items()
                                  if (argv[0].endswith(b"gradlink-scheduler") if sid == "scheduler"
                                      else argv[0].endswith(b"gradlink-server") and b"--id" in argv
                                      and argv[argv.index(b"--id") + 1] == str(sid).encode())]
                        assert len(victim) == 1, victim
                        victims.append(victim[0])
                        os.kill(victim[0], sig)
            p.wait(timeout=90)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    victim = victims[0] if len(kills) == 1 else victims if kills else None
    return p.returncode, err_path.read_text(errors="replace"), victim, out, "".join(lines)


def _expect_same_parameters(clean, lost):
    """Both ranks' saved parameters of two failover_train.py runs are equal, bit for bit."""
    import torch
    for r in range(2):
        a = torch.load(clean / ("rank%d.pt" % r))
        b = torch.load(lost / ("rank%d.pt" % r))
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name], b[name]), (r, name, (a[name] - b[name]).abs().max())


@pytest.mark.parametrize("mode,sig", [("optimizer", "SIGKILL"), ("ddp", "SIGSTOP"),
                                      ("c10d", "SIGKILL")])
def test_training_through_a_lost_server_ends_with_the_failure_free_bits(built, tmp_path, mode,
                                                                         sig):
    """DistributedOptimizer, DDP with gradlink's comm hook, or DDP over the gradlink
    torch.distributed backend, 30 steps; server 1 of 3 killed
    (or hung) at step 5: gradlink-run reports the loss as an event and exits 0, and every
    parameter on both ranks equals, bit for bit, a run without the loss."""
    import signal as signals
    rc, err, _, clean, out = _train(tmp_path, mode, "clean")
    assert rc == 0, err
    for r in range(2):
        assert "TRAINED rank %d servers_lost 0" % r in out, out
    rc, err, victim, lost, out = _train(tmp_path, mode, "lost", (getattr(signals, sig), 5))
    assert victim is not None, err
    assert rc == 0, err
    for r in range(2):
        assert "TRAINED rank %d servers_lost 1" % r in out, out
    assert "gradlink-run: server 1 was lost; its" in err and "the job goes on" in err, err
    _expect_same_parameters(clean, lost)


def test_restarted_servers_keep_a_two_server_job_alive_through_two_losses(built, tmp_path):
    """--restart-servers: server 0 of 2 killed at step 5 (its partitions move to server 1, and
    gradlink-run starts server 2 in its place, which joins and takes its share back), then
    server 1 killed once server 2 has joined: server 2 takes over everything. Without the
    restart the second loss would be the last server's. The job exits 0 and the parameters
    equal, bit for bit, a run without losses."""
    import signal as signals
    rc, err, _, clean, out = _train(tmp_path, "optimizer", "clean", servers=2, steps=40)
    assert rc == 0, err
    kills = [(signals.SIGKILL, 5, 0, ""),
             (signals.SIGKILL, 10, 1, "gradlink-run: server 2 joined the job")]
    rc, err, victims, lost, out = _train(tmp_path, "optimizer", "lost", kills, servers=2,
                                         launcher_args=("--restart-servers", "1"), steps=40)
    assert victims is not None and len(victims) == 2, (victims, err, out)
    assert rc == 0, err
    for r in range(2):
        assert "TRAINED rank %d servers_lost 2" % r in out, out
    assert "gradlink-run: starting server 2 in place of server 0" in err, err
    assert "gradlink-run: server 1 was lost; its" in err, err
    # Server 2 took its share back (or, while server 0's partitions were still moving, stood by
    # and then took all of server 1's).
    assert ("gradlink-run: server 2 joined the job and took" in err and
            "move to the 1 servers left" in err) or "all to standby server 2" in err, err
    _expect_same_parameters(clean, lost)


@pytest.mark.parametrize("mode,sig", [("optimizer", "SIGKILL"), ("c10d", "SIGKILL"),
                                      ("optimizer", "SIGSTOP")])
def test_a_restarted_scheduler_keeps_training_with_the_failure_free_bits(built, tmp_path, mode,
                                                                         sig):
    """--restart-scheduler: the scheduler is SIGKILLed (or stopped: gradlink-run kills it once
    its members have taken it for lost) at step 5 of DistributedOptimizer training (or DDP over
    the gradlink torch.distributed backend); gradlink-run starts it again on its port, the
    members rejoin it with their keys and plans, and training goes on: the job exits 0 and the
    parameters equal, bit for bit, a run without the loss."""
    import signal as signals
    # A stopped scheduler is replaced only after its members' 3 s silence limit: 120 steps of
    # 50 ms leave room for that.
    steps = 120 if sig == "SIGSTOP" else 30
    rc, err, _, clean, out = _train(tmp_path, mode, "clean", servers=2, steps=steps)
    assert rc == 0, err
    rc, err, victim, lost, out = _train(tmp_path, mode, "lost",
                                        [(getattr(signals, sig), 5, "scheduler", "")], servers=2,
                                        launcher_args=("--restart-scheduler", "1"), steps=steps)
    assert victim is not None, err
    assert rc == 0, err
    assert "gradlink-run: the scheduler was lost" in err, err
    if sig == "SIGSTOP":
        assert "gradlink-run: the scheduler is stopped (SIGSTOP)" in err, err
    assert "gradlink-run: the restarted scheduler resumed the job with 2 workers and 2 servers" \
        in err, err
    for r in range(2):
        assert "TRAINED rank %d servers_lost 0" % r in out, out
    _expect_same_parameters(clean, lost)

