#!/usr/bin/python3
"""Watching a job (docs/operations.md, "Watching a job"): metrics, the stall inspector,
gradlink-top, each case with real processes on loopback (the harness of run_integration.py).

  metrics       a 2-worker, 2-server job scraped by a real Prometheus (its HTTP service
                discovery reads the scheduler's /targets); a counter must grow in its query
                API; promtool checks every role's text; gradlink-top --once and, under tmux,
                its live view (q quits); the scrape and answers are printed for the record
  metrics_input bad input to the metrics server: 404/405, a request that never ends (closed
                after 2 s), 1,000 idle connections (a scrape still answers at once, the job
                goes on); a metrics port that is taken fails the process, naming the port
  stall         the stall inspector: a tensor rank 1 declares late, a round it pushes late
                (the scheduler and rank 0 name rank 1 and the tensor), a rank that is only
                slow (no message), and GRADLINK_STALL_SHUTDOWN_SECONDS ending the job

Usage: run_metrics.py --bin-dir DIR --probe EXE --rogue EXE [--budget S] CASE
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_integration as ri  # noqa: E402
from run_integration import Failure  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TOOLS = os.path.join(ROOT, "tools")
INFO = {"GRADLINK_LOG_LEVEL": "info"}


def get(url, timeout=5.0):
    """(status, body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_for(what, fn, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise Failure("%s: not within %.0f s" % (what, seconds))


def metrics_address(p, who):
    m = re.search(r"%s: metrics: http://(\S+)/metrics" % who, p.err())
    return m.group(1) if m else None


def start_loop_job(h, job, worker_env=None, workers=2, servers=2):
    """A scheduler, servers and probe workers summing checked rounds until `stop` exists."""
    stop = os.path.join(h.tmp, "stop-" + job)
    sched, addr = h.start_scheduler(workers, servers, extra=["--job", job], env=INFO)
    srv = h.start_servers(addr, servers, ["--job", job], env=INFO)
    wk = [h.spawn("worker%d" % r, [h.probe, "--scheduler", addr, "--job", job, "--mode", "loop",
                                   "--rank", str(r), "--count", "262144", "--until-file", stop],
                  env=dict(INFO, **(worker_env or {}))) for r in range(workers)]
    sched_metrics = wait_for("the scheduler's metrics line",
                             lambda: metrics_address(sched, "scheduler"), 15)
    return sched, srv, wk, sched_metrics, stop


def end_loop_job(h, label, sched, srv, wk, stop):
    open(stop, "w").close()
    try:
        h.wait_all(wk, [0] * len(wk), 60, label)
        for p in srv + [sched]:
            if h.wait(p, 15) != 0:
                raise Failure("%s: %s exited with %d" % (label, p.name, p.rc()))
    except Failure:
        h.dump_logs(srv + wk + [sched])
        raise


def targets(sched_metrics):
    status, body = get("http://%s/targets" % sched_metrics)
    if status != 200:
        raise Failure("/targets answered %d" % status)
    return {g["labels"]["gradlink_role"]: g["targets"] for g in json.loads(body)}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def documented_metrics():
    """The metric names of docs/operations.md's table ("### The metrics")."""
    text = open(os.path.join(ROOT, "docs", "operations.md")).read()
    table = text.split("### The metrics", 1)[1].split("###", 1)[0]
    return set(re.findall(r"^\| `(gradlink_[a-z_]+)` \|", table, re.M))


def dashboard_queries():
    board = json.load(open(os.path.join(ROOT, "docs", "grafana-dashboard.json")))
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def promtool_check(text, who):
    r = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                       capture_output=True, timeout=30)
    if r.returncode != 0:
        raise Failure("promtool check metrics on the %s's /metrics failed:\n%s%s" % (
            who, r.stdout.decode(), r.stderr.decode()))


def case_metrics(h):
    sched, srv, wk, sm, stop = start_loop_job(h, "it-metrics", {"GRADLINK_METRICS_PORT": "0"})
    prom = None
    try:
        t = wait_for("/targets listing 2 servers and 2 workers", lambda: (
            lambda t: t if len(t.get("server", [])) == 2 and len(t.get("worker", [])) == 2
            else None)(targets(sm)), 30)
        if t.get("scheduler") != [sm]:
            raise Failure("/targets names the scheduler as %s, not %s" % (t.get("scheduler"), sm))
        # Every role's text passes promtool, carries HELP/TYPE, and its job and role labels.
        for role, address in (("scheduler", sm), ("server", t["server"][0]),
                              ("worker", t["worker"][0])):
            status, text = get("http://%s/metrics" % address)
            if status != 200:
                raise Failure("%s /metrics answered %d" % (role, status))
            promtool_check(text, role)
            if 'job="it-metrics"' not in text or 'role="%s"' % role not in text:
                raise Failure("%s metrics lack the job and role labels:\n%s" % (role, text[:2000]))
            print("---- %s /metrics (first 30 lines)" % role)
            print("\n".join(text.splitlines()[:30]))
        # docs/operations.md's table names exactly the families the three roles serve.
        served = set()
        for address in (sm, t["server"][0], t["worker"][0]):
            served |= set(re.findall(r"^# TYPE (\S+) ", get("http://%s/metrics" % address)[1],
                                     re.M))
        documented = documented_metrics()
        if served != documented:
            raise Failure("docs/operations.md's metrics table and what the roles serve differ: "
                          "served, not documented: %s; documented, not served: %s" % (
                              sorted(served - documented), sorted(documented - served)))
        # Each member's log line names the address the scheduler lists.
        logged = sorted(filter(None, [metrics_address(p, "server %d" % i) for p in srv
                                      for i in range(2)]))
        if logged != sorted(t["server"]):
            raise Failure("servers logged %s, /targets lists %s" % (logged, t["server"]))

        # A real Prometheus finds every member through /targets and scrapes them each second.
        port = free_port()
        conf = os.path.join(h.tmp, "prometheus.yml")
        with open(conf, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: gradlink\n    honor_labels: true\n"
                    "    http_sd_configs:\n      - url: http://%s/targets\n"
                    "        refresh_interval: 2s\n" % sm)
        prom = h.spawn("prometheus", ["prometheus", "--config.file", conf, "--storage.tsdb.path",
                                      os.path.join(h.tmp, "tsdb"), "--web.listen-address",
                                      "127.0.0.1:%d" % port, "--log.level", "warn"])
        api = "http://127.0.0.1:%d/api/v1/query?query=" % port

        def query(q):
            try:
                status, body = get(api + urllib.request.quote(q), timeout=3)
            except OSError:
                return None
            if status != 200:
                return None
            return json.loads(body)["data"]["result"]

        q = 'sum(gradlink_server_summed_bytes_total{job="it-metrics"})'
        seen = []

        def grown():
            r = query(q)
            if r:
                v = float(r[0]["value"][1])
                if not seen or v != seen[-1]:
                    seen.append(v)
            return len(seen) >= 2 and seen[-1] > seen[0]
        wait_for("Prometheus to scrape a growing gradlink_server_summed_bytes_total", grown, 60)
        up_q = 'count(up{job="gradlink"} == 1)'
        try:
            wait_for("Prometheus to have every member up", lambda: (
                lambda r: r and int(r[0]["value"][1]) == 5)(query(up_q)), 20)
        except Failure:
            pass  # named below with what Prometheus says
        up = query(up_q)
        print("---- Prometheus: %s = %s (grew from %s); members up: %s" % (
            q, seen[-1], seen[0], up[0]["value"][1] if up else None))
        if not up or int(up[0]["value"][1]) != 5:
            raise Failure("Prometheus should scrape 5 members (scheduler, 2 servers, 2 workers) "
                          "up, found %s" % up)
        # The Grafana dashboard uses documented metrics only, in queries Prometheus accepts.
        for expr in dashboard_queries():
            names = set(re.findall(r"\b(gradlink_[a-z_]+?)(?:_bucket)?\b", expr))
            if not names <= documented:
                raise Failure("docs/grafana-dashboard.json uses %s, not in the metrics table" %
                              sorted(names - documented))
            status, body = get(api.replace("query?query=", "query?query=") +
                               urllib.request.quote(expr.replace("$job", "it-metrics")))
            if status != 200:
                raise Failure("Prometheus refused the dashboard's query %r: %s" % (expr, body))
        rounds = query('sum(gradlink_worker_round_seconds_count{job="it-metrics"})')
        print("---- Prometheus: operations the workers completed, as scraped: %s" % (
            rounds[0]["value"][1] if rounds else None))

        # gradlink-top: one snapshot, then the live view under tmux (q quits it).
        top = os.path.join(TOOLS, "gradlink-top")
        r = subprocess.run([top, "--once", sm], capture_output=True, timeout=30, text=True)
        print("---- gradlink-top --once\n" + r.stdout + r.stderr)
        rows = [l for l in r.stdout.splitlines() if re.match(r"^[01]\s+127\.0\.0\.1:\d+", l)]
        if r.returncode != 0 or len(rows) != 4 or "EVENTS" not in r.stdout:
            raise Failure("gradlink-top --once: expected rows for servers 0, 1 and workers 0, 1")
        in_rates = [float(l.split()[2]) for l in rows[:2]]
        if not any(v > 0 for v in in_rates):
            raise Failure("gradlink-top --once: no server shows bytes coming in: %s" % in_rates)
        session = "gltop-%d" % os.getpid()
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "40",
                        "%s %s" % (top, sm)], check=True, timeout=10)
        try:
            def pane():
                out = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                     capture_output=True, text=True, timeout=10).stdout
                return out if "ENGINES BUSY" in out and "WORKER" in out else None
            screen = wait_for("gradlink-top's live view in tmux", pane, 20)
            print("---- gradlink-top under tmux\n" + screen)
            subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True, timeout=10)
            wait_for("gradlink-top to quit on q", lambda: subprocess.run(
                ["tmux", "has-session", "-t", session], capture_output=True).returncode != 0, 10)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    finally:
        if prom is not None:
            h.kill(prom)
        end_loop_job(h, "metrics job", sched, srv, wk, stop)
    # The job is over: gradlink-top says it cannot read it, and exits 2 (no traceback).
    r = subprocess.run([os.path.join(TOOLS, "gradlink-top"), "--once", sm], capture_output=True,
                       timeout=30, text=True)
    if r.returncode != 2 or "cannot read" not in r.stderr or "Traceback" in r.stderr:
        raise Failure("gradlink-top on an ended job: rc %d, %r" % (r.returncode, r.stderr))
    print("ok   metrics: Prometheus scraped 5 members, promtool passed, gradlink-top ran")


def raw_request(address, data, read_seconds=5.0):
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=read_seconds)
    try:
        s.sendall(data)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode(errors="replace")
    finally:
        s.close()


def case_metrics_input(h):
    sched, srv, wk, sm, stop = start_loop_job(h, "it-metrics-input")
    idle = []
    try:
        t = wait_for("/targets listing 2 servers", lambda: (
            lambda t: t if len(t.get("server", [])) == 2 else None)(targets(sm)), 30)
        server = t["server"][0]
        if "worker" in t:
            raise Failure("workers serve no metrics by default, but /targets lists %s" % t["worker"])
        for request, want in ((b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n", "404"),
                              (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", "405"),
                              (b"GARBAGE\r\n\r\n", "400")):
            answer = raw_request(server, request)
            if not answer.startswith("HTTP/1.1 " + want):
                raise Failure("%r answered %r, expected %s" % (request, answer[:60], want))
        # A request that never ends is closed within the 2 s it may take.
        t0 = time.monotonic()
        answer = raw_request(server, b"GET /metrics HTTP/1.1\r\n", read_seconds=10)
        took = time.monotonic() - t0
        if answer or not 1.5 <= took <= 4:
            raise Failure("an unfinished request was closed after %.1f s with %r" % (took, answer))
        # 1,000 idle connections: a scrape still answers at once, and the job goes on.
        host, port = server.rsplit(":", 1)
        rounds_before = get("http://%s/metrics" % server)[1]
        for _ in range(1000):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        t0 = time.monotonic()
        status, text = get("http://%s/metrics" % server, timeout=5)
        took = time.monotonic() - t0
        if status != 200 or took > 1.0:
            raise Failure("with 1,000 idle connections a scrape took %.2f s (status %d)" %
                          (took, status))

        def rounds(text):
            m = re.search(r"^gradlink_server_rounds_total\{[^}]*\} (\S+)", text, re.M)
            return float(m.group(1)) if m else 0.0
        time.sleep(0.5)
        after = rounds(get("http://%s/metrics" % server)[1])
        if after <= rounds(rounds_before):
            raise Failure("the job made no progress while 1,000 connections sat idle")
        print("ok   1,000 idle connections: a scrape took %.3f s, rounds %d -> %d" % (
            took, rounds(rounds_before), after))
        for s in idle:
            s.close()
        idle = []
        # A metrics port that is taken fails the process at start, naming it.
        for role, argv in (("gradlink-server", [h.bin("gradlink-server"), "--scheduler", "127.0.0.1:1",
                                                "--metrics-port", port]),
                           ("gradlink-scheduler", [h.bin("gradlink-scheduler"), "-w", "1", "-s", "1",
                                                   "--metrics-port", port])):
            p = h.spawn(role + "-taken", argv)
            rc = h.wait(p, 15)
            if rc == 0 or port not in p.err() or "taken" not in p.err():
                raise Failure("%s on a taken metrics port: rc %d, %r" % (role, rc, p.err()))
            print("ok   %s --metrics-port %s (taken): rc %d: %s" % (role, port, rc,
                                                                    p.err().strip()))
    finally:
        for s in idle:
            s.close()
        end_loop_job(h, "metrics input job", sched, srv, wk, stop)


STALL_LINE = "stall inspector"


def stall_job(h, label, stall, delay_ms, check_s, shutdown_s=0, want_rc=0):
    env = {"GRADLINK_STALL_CHECK_SECONDS": str(check_s)}
    if shutdown_s:
        env["GRADLINK_STALL_SHUTDOWN_SECONDS"] = str(shutdown_s)
    job = "it-stall-%s-%d" % (stall, delay_ms)
    sched, addr = h.start_scheduler(2, 2, extra=["--job", job], env=env)
    srv = h.start_servers(addr, 2, ["--job", job], env=env)
    wk = [h.spawn("worker%d" % r, [h.probe, "--scheduler", addr, "--job", job, "--mode", "stall",
                                   "--rank", str(r), "--stall", stall, "--delay-ms",
                                   str(delay_ms), "--wait-s", "60"], env=env) for r in range(2)]
    t0 = time.monotonic()
    try:
        if want_rc == 0:
            h.wait_all(wk, [0, 0], 60, label)
            for p in srv + [sched]:
                if h.wait(p, 15) != 0:
                    raise Failure("%s: %s exited with %d" % (label, p.name, p.rc()))
        else:
            h.wait_all(wk[:1], [want_rc], 60, label)
            if h.wait(sched, 15) == 0:
                raise Failure("%s: the scheduler of a job ended by a stall exited 0" % label)
    except Failure:
        h.dump_logs(srv + wk + [sched])
        raise
    finally:
        for p in srv + wk + [sched]:
            h.kill(p)
    print("ok   %-58s %6.2f s" % (label, time.monotonic() - t0))
    return sched, srv, wk


def case_stall(h):
    # A tensor rank 1 declares 3.5 s late: named by the scheduler and by rank 0, not rank 1.
    sched, _, wk = stall_job(h, "stall: rank 1 declares grad.b 3.5 s late", "declare", 3500, 1)
    msg = [l for l in sched.err().splitlines() if "has not declared 'grad.b'" in l]
    if not msg or "rank 1 has not declared 'grad.b'" not in msg[0] or "rank 0 declared" not in msg[0]:
        raise Failure("the scheduler did not name rank 1 and 'grad.b':\n%s" % sched.err())
    if STALL_LINE not in wk[0].err() or STALL_LINE in wk[1].err():
        raise Failure("rank 0 (which declared) must log the stall, rank 1 not:\n%s\n%s" % (
            wk[0].err(), wk[1].err()))
    print("---- the scheduler's message:\n" + "\n".join(
        l for l in sched.err().splitlines() if STALL_LINE in l or "has not" in l))
    # A round rank 1 pushes 3.5 s late: named with its round, by the scheduler and rank 0.
    sched, _, wk = stall_job(h, "stall: rank 1 pushes grad.b 3.5 s late", "push", 3500, 1)
    if "rank 1 has not pushed round 0 of 'grad.b'" not in sched.err():
        raise Failure("the scheduler did not name rank 1's push of 'grad.b':\n%s" % sched.err())
    if "rank 1 has not pushed round 0 of 'grad.b'" not in wk[0].err() or STALL_LINE in wk[1].err():
        raise Failure("rank 0 must log rank 1's missing push, rank 1 nothing:\n%s\n%s" % (
            wk[0].err(), wk[1].err()))
    print("---- the scheduler's message:\n" + "\n".join(
        l for l in sched.err().splitlines() if STALL_LINE in l or "has not" in l))
    # Only slow (0.8 s late with a 3 s period): no message anywhere.
    sched, srv, wk = stall_job(h, "stall: rank 1 only slow (0.8 s, period 3 s)", "push", 800, 3)
    for p in [sched] + srv + wk:
        if STALL_LINE in p.err():
            raise Failure("a slow rank was reported as a stall by %s:\n%s" % (p.name, p.err()))
    # GRADLINK_STALL_SHUTDOWN_SECONDS: the job ends with the inspector's message (rank 0's
    # operation fails with it: exit 4), for a tensor rank 1 does not declare and for a round it
    # does not push (within the 30 s the test waits: never).
    for stall in ("declare", "push"):
        sched, _, wk = stall_job(h, "stall: shutdown after 2 s (rank 1 does not %s)" % stall,
                                 stall, 30000, 1, shutdown_s=2, want_rc=4)
        if "the job ends" not in sched.err() or "rank 1 has not" not in wk[0].err():
            raise Failure("the job did not end naming the stall:\n%s\n%s" % (sched.err(),
                                                                              wk[0].err()))


CASES = {
    "metrics": case_metrics,
    "metrics_input": case_metrics_input,
    "stall": case_stall,
}

if __name__ == "__main__":
    sys.exit(ri.main(CASES, __doc__))
