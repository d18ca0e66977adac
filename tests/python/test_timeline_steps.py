"""bench/timeline_steps.py on timelines written here by hand, sample by sample."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))

import timeline_steps as ts  # noqa: E402

BIG = 100000  # bytes per sample: above the default threshold


def write(path, hosts, samples):
    """samples: one dict per 2 ms sample, {column: bytes}; missing columns are 0."""
    cols = [c for h in range(hosts) for c in ("h%d_up" % h, "h%d_down" % h)]
    with open(path, "w") as f:
        f.write("t_ms," + ",".join(cols) + "\n")
        for i, s in enumerate(samples):
            f.write("%.1f," % (2.0 * (i + 1)) + ",".join(str(s.get(c, 0)) for c in cols) + "\n")


def test_find_steps_needs_two_quiet_samples():
    on, off = True, False
    assert ts.find_steps([off, on, on, off, on, off, off, on]) == [(1, 4), (7, 7)]
    assert ts.find_steps([off, off]) == []


def test_two_steps_two_workers_two_servers(tmp_path):
    # Step 1: workers push in samples 1..5; server 0 (host 2) sends in 3..6, server 1 (host 3)
    # in 4..8. Three quiet samples (9..11, server 1 still sending in 8 belongs to step 1).
    # Step 2: pushes in 12..13, only server 0 sends (13..14); one worker's push below the
    # threshold does not count on its own, but the two together do.
    s = [{} for _ in range(16)]
    for i in range(1, 6):
        s[i]["h0_up"] = BIG
        s[i]["h1_up"] = BIG
    for i in range(3, 7):
        s[i]["h2_up"] = BIG
    for i in range(4, 9):
        s[i]["h3_up"] = BIG
    s[12]["h0_up"] = s[12]["h1_up"] = 15000
    s[13]["h0_up"] = BIG
    s[13]["h2_up"] = s[14]["h2_up"] = BIG
    s[15]["h3_up"] = 19999  # below the threshold: not a pull
    p = tmp_path / "tl.csv"
    write(str(p), 4, s)
    t, cols = ts.read(str(p))
    steps = ts.analyse(t, cols, workers=2, servers=2)
    assert len(steps) == 2
    # Sample i ends at 2(i+1) ms: step 1 runs from 4 ms (i=1) to 12 ms (i=5).
    assert steps[0]["start_ms"] == pytest.approx(4.0)
    assert steps[0]["push_ms"] == pytest.approx(8.0)
    assert steps[0]["servers"] == [pytest.approx((4.0, 2.0)), pytest.approx((6.0, 6.0))]
    assert steps[1]["start_ms"] == pytest.approx(26.0)
    assert steps[1]["push_ms"] == pytest.approx(2.0)
    assert steps[1]["servers"][0] == pytest.approx((2.0, 2.0))
    assert steps[1]["servers"][1] is None
    assert not steps[0]["cut"] and not steps[1]["cut"]


def test_a_step_at_the_end_is_marked_cut(tmp_path):
    p = tmp_path / "tl.csv"
    write(str(p), 2, [{}, {"h0_up": BIG}, {"h0_up": BIG}, {}])
    t, cols = ts.read(str(p))
    steps = ts.analyse(t, cols, workers=1, servers=1)
    assert len(steps) == 1 and steps[0]["cut"]


def test_too_few_hosts_is_a_clear_error(tmp_path):
    p = tmp_path / "tl.csv"
    write(str(p), 2, [{"h0_up": BIG}])
    t, cols = ts.read(str(p))
    with pytest.raises(ValueError, match="fewer than 4 hosts"):
        ts.analyse(t, cols, workers=2, servers=2)


@pytest.mark.parametrize("text,match", [
    ("time,h0_up\n1,2\n", "first column must be t_ms"),
    ("t_ms,h0_up,h0_down\n2.0,1\n", r"tl.csv:2: 2 fields, the header has 3"),
    ("t_ms,h0_up,h0_down\n2.0,1,x\n", r"tl.csv:2: invalid literal"),
])
def test_malformed_timeline_names_the_line(tmp_path, text, match):
    p = tmp_path / "tl.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        ts.read(str(p))


def test_empty_timeline_is_a_clear_error(tmp_path):
    p = tmp_path / "tl.csv"
    p.write_text("t_ms,h0_up,h0_down\n")
    with pytest.raises(ValueError, match="no samples"):
        ts.read(str(p))
