"""The README's "Running a job by hand" recipe, run as written: the scheduler, the servers and
the gradlink-bench workers, each command as often as its comment says, PORT replaced by the port
the scheduler prints. Regression: gradlink-bench's --job defaulted to 'bench' while the scheduler
and server default to 'default', so the recipe failed with "this scheduler runs job 'default'"."""

import os
import re
import subprocess

from conftest import BIN, REPO


def recipe():
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Running a job by hand", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    steps = []
    for line in block.strip().splitlines():
        command, _, comment = line.partition("#")
        times = 2 if "twice" in comment else 1
        steps.append((command.split(), times))
    return steps


def test_the_recipe_is_what_this_test_runs():
    steps = recipe()
    assert [s[0][0] for s in steps] == ["build/bin/gradlink-scheduler", "build/bin/gradlink-server",
                                        "build/bin/gradlink-bench"]
    assert [t for _, t in steps] == [1, 2, 2]


def test_running_a_job_by_hand(built):
    steps = recipe()
    def argv(words, port=None):
        words = [os.path.join(BIN, w[len("build/bin/"):]) if w.startswith("build/bin/") else w
                 for w in words]
        return [w.replace("PORT", str(port)) for w in words]
    procs = []
    try:
        sched = subprocess.Popen(argv(steps[0][0]), stdout=subprocess.PIPE, text=True, cwd=REPO)
        procs.append(sched)
        first = sched.stdout.readline()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", first)
        assert m, "the scheduler printed %r" % first
        port = int(m.group(1))
        workers = []
        for words, times in steps[1:]:
            for _ in range(times):
                p = subprocess.Popen(argv(words, port), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=REPO)
                procs.append(p)
                if "gradlink-bench" in words[0]:
                    workers.append(p)
        outs = []
        for w in workers:
            out, _ = w.communicate(timeout=240)
            assert w.returncode == 0, out[-3000:]
            assert "WRONG" not in out, out[-3000:]
            outs.append(out)
        table = "".join(outs)  # one worker prints the table
        assert "67108864" in table or "64M" in table, table[-3000:]
        assert table.count(" OK") >= 15, table[-3000:]  # every size from 4K to 64M checked
        assert sched.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
