"""Horovod's semantics in gradlink.torch (issue 42): one real gradlink-run job of 3 workers
(tests/python/jobs/hvd_semantics.py) whose sections each check one behaviour against a
reference computed in the job: autograd through every collective, broadcast and broadcast_,
integer and reduce-scatter scaling, duplicate names in flight, DistributedOptimizer without
names / over a process set / with sparse gradients, the callable sparse handle,
broadcast_optimizer_state with a parameter that needs no gradient, the error classes; and, in
jobs of their own, collectives while a rank has joined (hvd_join_refusal.py) and the life cycle
(hvd_lifecycle.py)."""

import time

import pytest

pytest.importorskip("torch")

SECTIONS = ("autograd", "broadcast", "scaling", "duplicates", "optimizer")


def test_horovod_semantics(run_job):
    job = run_job(3, 2, "hvd_semantics.py", timeout=90)
    assert job.rc == 0, job.explain()
    for r in range(3):
        lines = job.lines("[worker %d]" % r)
        for section in SECTIONS:
            assert "%s ok rank %d" % (section, r) in lines, job.explain()
        assert "HVD SEMANTICS OK rank %d" % r in lines, job.explain()


def test_init_shutdown_init_and_an_exit_without_shutdown(run_job):
    """HOROVOD_* set as horovodrun sets them; init -> shutdown -> init three times in one
    process; workers that exit 0 without shutdown() end the job at once (gradlink-run exits 0;
    it would wait for its --timeout and fail with 143 if the job hung on)."""
    start = time.monotonic()
    job = run_job(2, 2, "hvd_lifecycle.py", timeout=60)
    took = time.monotonic() - start
    assert job.rc == 0, job.explain()
    for r in range(2):
        lines = job.lines("[worker %d]" % r)
        for section in ("env ok", "reinit ok", "drain ok", "LIFECYCLE OK"):
            assert "%s rank %d" % (section, r) in lines, job.explain()
    assert took < 30, "the job took %.1f s\n%s" % (took, job.explain())


def test_collectives_while_a_rank_has_joined_fail_at_once(run_job):
    """Horovod's test_horovod_join_allgather with 3 workers: each rank joins first in turn while
    the others allgather (unnamed, so their names drift apart after the first round) and must
    get an error at once, then join; the rank that joined last is never the first; the job goes
    on. Before the scheduler refused such a key at once, the third round hung."""
    job = run_job(3, 2, "hvd_join_refusal.py", timeout=60)
    assert job.rc == 0, job.explain()
    for r in range(3):
        assert "JOIN REFUSAL OK rank %d" % r in job.lines("[worker %d]" % r), job.explain()


def test_a_job_whose_workers_never_join_ends_at_once_with_their_status(run_job):
    """Workers that exit 0 before init() (a script that ends first; each of Horovod's tests
    that skips itself for want of a GPU, in its own job): gradlink-run stops the scheduler and
    servers, left waiting for members that never come, within 1.5 s and exits 0. It used to
    wait 15 s, stop them and exit 143 ("job failed")."""
    start = time.monotonic()
    job = run_job(2, 2, ["-c", "print('never joins', flush=True)"], timeout=40)
    took = time.monotonic() - start
    assert job.rc == 0, job.explain()
    assert "never joined the job" in job.err, job.explain()
    assert took < 10, "the job took %.1f s\n%s" % (took, job.explain())
