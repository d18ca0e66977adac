"""The BytePS-style mixed-placement optimum, for the emulated-cluster benchmark.

Model: n worker hosts and k dedicated server hosts, every host with a full-duplex link of B
bytes/s each way; a model of M bytes is summed once per step. Every worker host also runs a
server ("colocated"), holding a share c of the model; each dedicated server holds a share d
(k*d + n*c = 1). Per step, each way:

  dedicated host:  n*d*M         (every worker pushes its share to it; it answers every pull)
  worker host:     (1-c)*M       (pushes to / pulls from the other servers)
                 + (n-1)*c*M     (the other workers' pushes to / pulls from its colocated server)

Equalising the two gives d = 2(n-1) / (n^2 + kn - 2k) and the step time
2n(n-1)M / ((n^2 + kn - 2k) B): k = 0 is the all-colocated (ring-like) 2(n-1)/n M/B, k = n the
PS bound M/B with nothing left for the colocated servers (then none should run).

gradlink places bytes in proportion to server weights (gradlink-server --weight), so the
shares below are the weights to start servers with: d on each dedicated host, c on each worker
host (skip colocated servers when c is 0).
"""


def _check(n, k):
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError("n (worker hosts) must be an integer >= 1, got %r" % (n,))
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError("k (dedicated server hosts) must be an integer >= 0, got %r" % (k,))


def _check_mb(m, b):
    if not m >= 0:
        raise ValueError("M (model bytes) must be >= 0, got %r" % (m,))
    if not b > 0:
        raise ValueError("B (link bytes/s) must be > 0, got %r" % (b,))


def mixed_shares(n, k):
    """(dedicated_share_each, colocated_share_each): the fractions of the model that each of the
    k dedicated server hosts and each of the n worker-colocated servers should hold.

    k = 0: (0.0, 1/n) (there are no dedicated hosts). k >= n: (1/k, 0.0): the dedicated hosts
    alone reach the PS bound, run no colocated servers. n = 1: (0.0, 1.0): a lone worker sums
    locally, nothing need cross a link."""
    _check(n, k)
    if n == 1:
        return 0.0, 1.0
    if k == 0:
        return 0.0, 1.0 / n
    if k >= n:
        return 1.0 / k, 0.0
    d = 2.0 * (n - 1) / (n * n + k * n - 2 * k)
    c = (1.0 - k * d) / n
    return d, max(c, 0.0)


def mixed_time(n, k, M, B):
    """Step time (seconds) of mixed placement at the optimal shares: the busiest host's bytes
    each way over B. For 0 <= k <= n (n >= 2) this is 2n(n-1)M / ((n^2 + kn - 2k) B)."""
    _check(n, k)
    _check_mb(M, B)
    if n == 1:
        return 0.0
    if k >= n:
        return M / B  # every worker pushes and pulls all of M: max(1, n/k) = 1
    return 2.0 * n * (n - 1) * M / ((n * n + k * n - 2 * k) * B)


def ps_bound_time(n, k, M, B):
    """Step time (seconds) with dedicated server hosts only, each holding 1/k: every worker
    moves M each way, every server n*M/k: max(M/B, n*M/(k*B))."""
    _check(n, k)
    _check_mb(M, B)
    if k == 0:
        raise ValueError("ps_bound_time needs k >= 1 dedicated server hosts")
    return max(M / B, n * M / (k * B))
