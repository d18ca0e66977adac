"""bench/placement_model.py against hand-derived values and against a brute-force search in a
per-host traffic model written here independently (flow by flow, no closed forms)."""

import itertools
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))

import placement_model as pm  # noqa: E402


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


# ---- hand-derived values (n = 4 worker hosts, M = B = 1) --------------------------------------

@pytest.mark.parametrize("k,time", [(0, 1.5), (1, 4.0 / 3.0), (2, 1.2), (3, 24.0 / 22.0),
                                    (4, 1.0)])
def test_mixed_time_n4(k, time):
    # n=4: 2*4*3 / (16 + 4k - 2k) = 24 / (16 + 2k)
    assert pm.mixed_time(4, k, 1.0, 1.0) == approx(time)


def test_n4_k3_is_what_the_formula_says():
    # 24 / 22, written out: dedicated share 6/22 each, colocated (1 - 18/22)/4 = 1/22 each.
    assert pm.mixed_time(4, 3, 1.0, 1.0) == approx(24.0 / 22.0)
    d, c = pm.mixed_shares(4, 3)
    assert d == approx(6.0 / 22.0) and c == approx(1.0 / 22.0)


def test_mixed_shares_n4():
    assert pm.mixed_shares(4, 0) == (0.0, 0.25)
    d, c = pm.mixed_shares(4, 2)
    assert d == approx(0.3) and c == approx(0.1)
    d, c = pm.mixed_shares(4, 1)
    assert d == approx(6.0 / 18.0) and c == approx((1 - 6.0 / 18.0) / 4)
    d, c = pm.mixed_shares(4, 4)
    assert d == approx(0.25) and c == 0.0
    for k in range(0, 9):
        d, c = pm.mixed_shares(4, k)
        assert k * d + 4 * c == approx(1.0)
        assert d >= 0 and c >= 0


def test_scaling_in_model_bytes_and_bandwidth():
    assert pm.mixed_time(4, 2, 8e9, 4e9) == approx(2.4)
    assert pm.ps_bound_time(4, 2, 8e9, 4e9) == approx(4.0)  # servers get 2M each way


def test_ps_bound_hand_values():
    assert pm.ps_bound_time(4, 4, 1.0, 1.0) == 1.0
    assert pm.ps_bound_time(4, 1, 1.0, 1.0) == 4.0
    assert pm.ps_bound_time(4, 2, 1.0, 1.0) == 2.0
    assert pm.ps_bound_time(4, 8, 1.0, 1.0) == 1.0


def test_edges():
    assert pm.mixed_shares(1, 0) == (0.0, 1.0)
    assert pm.mixed_shares(1, 3) == (0.0, 1.0)
    assert pm.mixed_time(1, 3, 1.0, 1.0) == 0.0
    assert pm.mixed_shares(4, 6) == (1.0 / 6, 0.0)
    assert pm.mixed_time(4, 6, 1.0, 1.0) == 1.0
    for n in range(2, 12):
        assert pm.mixed_time(n, n, 3.0, 2.0) == approx(1.5)  # the PS bound M/B
        assert pm.mixed_time(n, 0, 1.0, 1.0) == approx(2.0 * (n - 1) / n)  # ring-like


@pytest.mark.parametrize("args", [(0, 1), (-1, 0), (4, -1), (2.5, 1), (4, 1.0), (True, 1)])
def test_bad_counts_raise(args):
    with pytest.raises(ValueError):
        pm.mixed_shares(*args)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="B"):
        pm.mixed_time(4, 2, 1.0, 0.0)
    with pytest.raises(ValueError, match="M"):
        pm.ps_bound_time(4, 2, -1.0, 1.0)
    with pytest.raises(ValueError, match="k"):
        pm.ps_bound_time(4, 0, 1.0, 1.0)


# ---- an independent per-host traffic model -----------------------------------------------------

def busiest_host_time(n, dedicated, colocated, M=1.0, B=1.0):
    """Hosts 0..n-1 run a worker and a server holding colocated[h] of the model; hosts n..n+k-1
    run a server holding dedicated[j]. Every worker pushes each server's share to it and pulls
    it back; a flow between two processes of one host crosses no link. Returns the largest
    per-host bytes in either direction, over B."""
    k = len(dedicated)
    share = list(colocated) + list(dedicated)  # server on host h holds share[h]
    sent = [0.0] * (n + k)
    received = [0.0] * (n + k)
    for w in range(n):  # the worker on host w
        for s in range(n + k):  # the server on host s
            if s == w or share[s] == 0:
                continue
            b = share[s] * M
            sent[w] += b  # push
            received[s] += b
            sent[s] += b  # pull response
            received[w] += b
    return max(max(sent), max(received)) / B


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_model_time_matches_the_traffic_model(n):
    for k in range(0, n + 3):
        d, c = pm.mixed_shares(n, k)
        t = busiest_host_time(n, [d] * k, [c] * n)
        assert t == approx(pm.mixed_time(n, k, 1.0, 1.0)), (n, k)
        if k >= 1:
            # Dedicated servers only, 1/k each.
            assert busiest_host_time(n, [1.0 / k] * k, [0.0] * n) == approx(
                pm.ps_bound_time(n, k, 1.0, 1.0)), (n, k)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_share_minimises_the_busiest_host_symmetric_grid(n):
    # Over every symmetric split (all dedicated hosts equal, all colocated equal) on a fine grid
    # of the colocated share, none has a less busy busiest host than the formula's.
    steps = 4000
    for k in range(1, n + 1):
        best = pm.mixed_time(n, k, 1.0, 1.0)
        grid_best = float("inf")
        for i in range(steps + 1):
            c = (1.0 / n) * i / steps
            d = (1.0 - n * c) / k
            grid_best = min(grid_best, busiest_host_time(n, [d] * k, [c] * n))
        assert best <= grid_best + 1e-12, (n, k)
        # ... and the grid gets within its resolution of it.
        assert grid_best <= best + 2.0 * n / steps, (n, k)


@pytest.mark.parametrize("n,k", [(2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (4, 3), (5, 2)])
def test_share_minimises_the_busiest_host_any_split(n, k):
    # Asymmetric splits too: random points of the simplex and a coarse lattice over it.
    best = pm.mixed_time(n, k, 1.0, 1.0)
    rng = random.Random(n * 100 + k)
    for _ in range(3000):
        x = [rng.expovariate(1.0) for _ in range(n + k)]
        tot = sum(x)
        x = [v / tot for v in x]
        assert busiest_host_time(n, x[n:], x[:n]) >= best - 1e-12
    # Every split into twelfths (stars and bars).
    units, m = 12, n + k
    for bars in itertools.combinations(range(units + m - 1), m - 1):
        edges = (-1,) + bars + (units + m - 1,)
        x = [(edges[i + 1] - edges[i] - 1) / units for i in range(m)]
        assert sum(x) == approx(1.0)
        assert busiest_host_time(n, x[n:], x[:n]) >= best - 1e-12
