"""Horovod's semantics in gradlink.torch (issue 42): one real gradlink-run job of 3 workers
(tests/python/jobs/hvd_semantics.py) whose sections each check one behaviour against a
reference computed in the job: autograd through every collective, broadcast and broadcast_,
integer and reduce-scatter scaling, duplicate names in flight, DistributedOptimizer without
names / over a process set / with sparse gradients, the callable sparse handle,
broadcast_optimizer_state with a parameter that needs no gradient, the error classes."""

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
