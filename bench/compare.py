# Over 600 lines on purpose: one benchmark tool (its CLI, the systems, the runs, the tables).
"""bench/compare: gradlink push_pull against Open MPI's MPI_Allreduce and Gloo's all_reduce on one
host, side by side, same sizes, same number of ranks (fp32 sum; every element of every result
checked by each system; a wrong value or a failed run fails the comparison).

  bench/compare [--bin build/bin] [-b 4K] [-e 64M] [-f 4] [-n 20] [--warmup 3] [--repeats 3]
                [--ranks 2] [--systems a,b,...] [--plot bench/compare.png | --no-plot]
                [--results bench/RESULTS.md [--history FILE] | --no-results]

Systems (--systems takes these names; all by default):
  gradlink-default gradlink-bench -w N -s 1 with no flags: what a user gets. Every worker is on
                   this host, so they sum through the same-host path (shared memory; the
                   server is started but idle), unpinned
  gradlink-local   the same with --bind: each worker pinned to one CPU, as mpirun pins its
                   ranks by default
  gradlink-shm-1s  the servers' path (--local-arena 0), GRADLINK_UCX_ERROR_MODE=none (UCX
                   shared memory)
  gradlink-shm-2s  the same with 2 servers
  gradlink-tcp-1s  the servers' path (--local-arena 0) in UCX's default mode (peer error
                   handling; UCX 1.13 then has no shared memory transport: TCP loopback)
  gradlink-tcp-2s  the same with 2 servers
  mpi-shm          build/bin/mpi_allreduce under mpirun -np N, --mca pml ob1 --mca btl self,vader
  mpi-tcp          the same with --mca btl self,tcp --mca btl_tcp_if_include lo
  gloo             bench/baselines/gloo_allreduce.py --local N (torch.distributed, 127.0.0.1)
A system whose dependency is missing (binary not built, mpirun or torch absent) is skipped, and
the output says so and why.

Each system runs --repeats times, interleaved (repeat 1 of every system, then repeat 2, ...), so
noise from the machine hits every system alike. One run gives, per size, the mean time of its
timed iterations (rank 0's clock, a barrier before each iteration, as gradlink-bench does);
the table reports per size and system the median of those times over the repeats, the fastest
single operation of all runs (the latency floor on a noisy machine), algbw = bytes / time and
busbw = algbw * 2(n-1)/n (nccl-tests), busbw min / median / max over the repeats, and the ratio of the best gradlink configuration's median busbw at that size to each
baseline's. In --results (bench/RESULTS.md) the run replaces the section between the lines
`<!-- compare:begin -->` and `<!-- compare:end -->` (added at the end if missing; nothing else in
the file changes): per size the best of gradlink's default and of all its configurations (the
non-defaults marked), their median busbw and its ratio to each baseline's, the commit, the
command line and the load average, the full table folded. The full output (with the systems' legend) is appended
to --history (default: history/RESULTS-YYYY-MM.md beside --results; bench/results_md.py). busbw
against size is plotted to --plot (matplotlib, if installed). --save-json keeps every run's
numbers.

Open MPI runs under mpirun --allow-run-as-root --oversubscribe (and OMPI_ALLOW_RUN_AS_ROOT=1,
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1: Debian's Open MPI 4.1 refuses root otherwise) with its default
process binding; --mpirun-args adds options (e.g. "--bind-to none").
"""
import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOO_SCRIPT = os.path.join(REPO, "bench", "baselines", "gloo_allreduce.py")


class Failure(Exception):
    """A system failed or returned a wrong value: the comparison stops."""


# ---------------------------------------------------------------------------------------------
# Sizes and arguments


def parse_size(text):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError("bad size '%s' (e.g. 4096, 4K, 64M)" % text)
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def sizes(begin, end, factor):
    """The rows every system runs (gradlink-bench's rule for fp32)."""
    out, b = [], max(begin, 4)
    while b <= end:
        out.append(b // 4 * 4)
        b = max(b + 4, int(b * factor))
    return out


def human(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


def positive_int(text):
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0, got %s" % text)
    return v


def nonneg_int(text):
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0, got %s" % text)
    return v


def factor_arg(text):
    v = float(text)
    if not v > 1:
        raise argparse.ArgumentTypeError("must be > 1, got %s" % text)
    return v


# ---------------------------------------------------------------------------------------------
# Systems


class System:
    def __init__(self, name, kind, label, servers=0, env=None, mca=(), args=()):
        self.name, self.kind, self.label = name, kind, label
        self.servers, self.env, self.mca, self.args = servers, dict(env or {}), list(mca), list(args)

    @property
    def is_gradlink(self):
        return self.kind == "gradlink"


SHM = {"GRADLINK_UCX_ERROR_MODE": "none"}
SERVERS_PATH = ["--local-arena", "0"]
SYSTEMS = [
    System("gradlink-default", "gradlink", "gradlink, no flags: the same-host path (workers sum through "
           "shared memory), 1 server started and idle, unpinned", 1),
    System("gradlink-local", "gradlink", "gradlink, the same-host path, workers pinned to a CPU "
           "each (--bind, as mpirun's default binding)", 1, args=["--bind"]),
    System("gradlink-shm-1s", "gradlink", "gradlink, the servers' path, 1 server, UCX shared memory "
           "(GRADLINK_UCX_ERROR_MODE=none)", 1, SHM, args=SERVERS_PATH),
    System("gradlink-shm-2s", "gradlink", "gradlink, the servers' path, 2 servers, UCX shared memory "
           "(GRADLINK_UCX_ERROR_MODE=none)", 2, SHM, args=SERVERS_PATH),
    System("gradlink-tcp-1s", "gradlink", "gradlink, the servers' path, 1 server (UCX over TCP "
           "loopback)", 1, args=SERVERS_PATH),
    System("gradlink-tcp-2s", "gradlink", "gradlink, the servers' path, 2 servers (UCX over TCP "
           "loopback)", 2, args=SERVERS_PATH),
    System("mpi-shm", "mpi", "Open MPI MPI_Allreduce, shared memory (--mca btl self,vader)",
           mca=["pml", "ob1", "btl", "self,vader"]),
    System("mpi-tcp", "mpi", "Open MPI MPI_Allreduce, TCP loopback (--mca btl self,tcp)",
           mca=["pml", "ob1", "btl", "self,tcp", "btl_tcp_if_include", "lo"]),
    System("gloo", "gloo", "Gloo all_reduce via torch.distributed, TCP on 127.0.0.1"),
]


def missing_dependency(system, a):
    """Why this system cannot run here, or None."""
    if system.kind == "gradlink":
        for b in ("gradlink-bench", "gradlink-server"):
            if not os.access(os.path.join(a.bin, b), os.X_OK):
                return "%s is not built (%s)" % (b, a.bin)
    elif system.kind == "mpi":
        if not os.access(os.path.join(a.bin, "mpi_allreduce"), os.X_OK):
            return ("mpi_allreduce is not built (%s; CMake builds it when it finds MPI: "
                    "apt-get install libopenmpi-dev openmpi-bin)" % a.bin)
        if not shutil.which(a.mpirun):
            return "%s not found (apt-get install openmpi-bin)" % a.mpirun
    elif system.kind == "gloo":
        probe = subprocess.run([a.python, "-c", "import torch.distributed as d; "
                                "assert d.is_available() and d.is_gloo_available()"],
                               capture_output=True, text=True, timeout=120)
        if probe.returncode != 0:
            return "%s cannot import torch.distributed with Gloo (apt-get install python3-torch)" % a.python
    return None


def size_args(a):
    return ["-b", str(a.minbytes), "-e", str(a.maxbytes), "-f", repr(a.stepfactor),
            "-n", str(a.iters), "--warmup", str(a.warmup)]


def command(system, a, corrupt):
    """argv and environment of one run of system."""
    env = dict(os.environ)
    env.update(system.env)
    if system.kind == "gradlink":
        if corrupt:
            raise Failure("--selftest-corrupt: gradlink-bench has no way to corrupt a result")
        argv = [os.path.join(a.bin, "gradlink-bench"), "-w", str(a.ranks), "-s", str(system.servers)]
        return argv + system.args + size_args(a), env
    extra = ["--corrupt"] if corrupt else []
    if system.kind == "mpi":
        # Debian's Open MPI 4.1 refuses root without both the flag and these two variables.
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
        argv = [a.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(a.ranks)]
        for k, v in zip(system.mca[::2], system.mca[1::2]):
            argv += ["--mca", k, v]
        argv += shlex.split(a.mpirun_args)
        return argv + [os.path.join(a.bin, "mpi_allreduce")] + size_args(a) + extra, env
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    argv = [a.python, GLOO_SCRIPT, "--local", str(a.ranks), "--timeout", str(min(a.timeout, 120))]
    return argv + size_args(a) + extra, env


def stop_group(p):
    """Stops the process group p leads: SIGTERM (mpirun and gloo_allreduce --local pass it on to
    their ranks), then SIGKILL to whatever is left after 5 s. Returns what p printed."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        out, err = p.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        out, err = "", ""
    try:
        os.killpg(p.pid, signal.SIGKILL)  # children that outlived their parent
    except ProcessLookupError:
        pass
    if p.poll() is None:
        p.kill()
    try:
        more_out, more_err = p.communicate(timeout=5)
        return out + (more_out or ""), err + (more_err or "")
    except (subprocess.TimeoutExpired, ValueError):
        return out, err


def run_process(argv, env, timeout):
    """Runs argv in its own process group; returns (rc, stdout, stderr); kills the group on timeout."""
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException as e:  # the timeout below; Ctrl-C or SIGTERM: stop the run's processes
        if not isinstance(e, subprocess.TimeoutExpired):
            stop_group(p)
            raise
        out, err = stop_group(p)
        raise Failure("did not finish within %d s (stopped): %s\n%s%s"
                      % (timeout, shlex.join(argv), tail(out), tail(err)))
    return p.returncode, out, err


def tail(text, lines=15):
    t = (text or "").rstrip("\n").splitlines()[-lines:]
    return "".join("  | %s\n" % line for line in t)


def parse_gradlink(out):
    """{bytes: (mean_us, min_us, check)} from gradlink-bench's table; columns found by their header."""
    cols = None
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if not f:
            continue
        if f[0] == "size(B)":
            cols = {name: i for i, name in enumerate(f)}
            continue
        if not f[0].isdigit():
            continue
        c = cols or {"size(B)": 0, "time(us)": 3, "min(us)": 4, "check": 7}  # the documented layout
        try:
            rows[int(f[c["size(B)"]])] = (float(f[c["time(us)"]]), float(f[c["min(us)"]]), f[c["check"]])
        except (KeyError, IndexError, ValueError):
            raise Failure("cannot read this gradlink-bench row: %r (header: %s)" % (line, cols))
    return rows


def parse_json_rows(out):
    """{bytes: (mean_us, min_us, check)} from the baselines' JSON lines."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                r = json.loads(line)
                rows[int(r["bytes"])] = (float(r["time_us"]), float(r["min_us"]), str(r["check"]))
            except (ValueError, KeyError, TypeError) as e:
                raise Failure("cannot read this result line (%s): %r" % (e, line))
    return rows


def run_system(system, a, rep, expected_sizes, corrupt):
    """One run; returns {bytes: (mean_us, min_us)}. Raises Failure on a failed run or any wrong value."""
    argv, env = command(system, a, corrupt)
    t0 = time.monotonic()
    try:
        rc, out, err = run_process(argv, env, a.timeout)
    except Failure as e:
        raise Failure("%s (repeat %d) %s" % (system.name, rep + 1, e))
    rows = parse_gradlink(out) if system.is_gradlink else parse_json_rows(out)
    where = "%s (repeat %d): %s" % (system.name, rep + 1, shlex.join(argv))
    wrong = ["%d bytes: %s" % (b, chk) for b, (_, _, chk) in sorted(rows.items()) if chk != "OK"]
    if wrong:
        raise Failure("WRONG VALUES from %s\n  %s\n%s" % (where, "\n  ".join(wrong), tail(err)))
    if rc != 0:
        raise Failure("%s exited with status %d\n%s%s" % (where, rc, tail(out), tail(err)))
    if sorted(rows) != expected_sizes:
        raise Failure("%s reported sizes %s, expected %s\n%s%s"
                      % (where, sorted(rows), expected_sizes, tail(out), tail(err)))
    print("compare: repeat %d %-16s %5.1f s  OK" % (rep + 1, system.name, time.monotonic() - t0),
          file=sys.stderr, flush=True)
    return {b: (t, t_min) for b, (t, t_min, _) in rows.items()}


# ---------------------------------------------------------------------------------------------
# Statistics and the table


def summarize(times, ranks):
    """times: {system: {bytes: [(mean_us, min_us) per repeat]}} -> {system: {bytes: stats}}."""
    factor = 2.0 * (ranks - 1) / ranks
    out = {}
    for name, per_size in times.items():
        out[name] = {}
        for b, runs in per_size.items():
            ts = [t for t, _ in runs]
            bus = sorted(b / (t * 1e3) * factor for t in ts)
            t_med = statistics.median(ts)
            out[name][b] = {"time_us": t_med, "algbw": b / (t_med * 1e3),
                            "busbw_min": bus[0], "busbw_med": statistics.median(bus),
                            "busbw_max": bus[-1], "runs": len(ts),
                            "fastest_us": min(t_min for _, t_min in runs)}
    return out


def best_gradlink(stats, systems, b):
    gl = [s.name for s in systems if s.is_gradlink]
    return max(gl, key=lambda n: stats[n][b]["busbw_med"]) if gl else None


def fmt_time(us):
    return "%.2f" % us if us < 100 else "%.1f" % us if us < 1e4 else "%.0f" % us


def fmt_bw(v):
    return "%.3f" % v if v >= 0.1 else "%.4f" % v if v >= 0.01 else "%.5f" % v


def fmt_ratio(r):
    return "%.2fx" % r if r >= 0.1 else "%.3fx" % r if r >= 0.01 else "%.4fx" % r


def render(stats, systems, sz, a):
    """The markdown table (and the ratio summary) as a list of lines."""
    ran = [s for s in systems if s.name in stats]
    gl = [s for s in ran if s.is_gradlink]
    base = [s for s in ran if not s.is_gradlink]
    lines = []
    lines.append("%d ranks (gradlink: %d workers + its servers), fp32 sum, sizes %s..%s, %d iters "
                 "(+%d warmup) per run, %d repeats interleaved. time = median over repeats of a "
                 "run's mean time per operation (us); fastest = the fastest single operation of all "
                 "runs (us); algbw = bytes / time; busbw = algbw * "
                 "2(n-1)/n (GB/s), min / median / max over repeats. Every element of every "
                 "result was checked: check = runs with all elements exact."
                 % (a.ranks, a.ranks, human(sz[0]), human(sz[-1]), a.iters, a.warmup, a.repeats))
    lines.append("")
    if gl and base:
        lines.append("Last column: the median busbw of the best gradlink configuration at that size "
                     "(the row marked `best`) divided by this baseline's median busbw "
                     "(> 1: gradlink is faster).")
        lines.append("")
    lines.append("| size | system | time (us) | fastest (us) | algbw (GB/s) | busbw (GB/s) min / median / max |"
                 " check | best gradlink ÷ this |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for b in sz:
        best = best_gradlink(stats, ran, b)
        for s in ran:
            st = stats[s.name][b]
            if s.is_gradlink:
                ratio = "best" if s.name == best else ""
            elif best:
                ratio = fmt_ratio(stats[best][b]["busbw_med"] / st["busbw_med"])
            else:
                ratio = ""
            lines.append("| %s | %s | %s | %s | %s | %s / %s / %s | OK %d/%d | %s |"
                         % (human(b), s.name, fmt_time(st["time_us"]), fmt_time(st["fastest_us"]),
                            fmt_bw(st["algbw"]),
                            fmt_bw(st["busbw_min"]), fmt_bw(st["busbw_med"]), fmt_bw(st["busbw_max"]),
                            st["runs"], a.repeats, ratio))
    if gl and base:
        lines += [""] + render_ratios(stats, ran, sz)
    return lines


def render_ratios(stats, ran, sz):
    """Ratios at a glance: best gradlink overall, and best gradlink over TCP (same transport as
    mpi-tcp and gloo), to each baseline."""
    base = [s.name for s in ran if not s.is_gradlink]
    tcp = [s for s in ran if s.name.startswith("gradlink-tcp")]
    head = "| size | best gradlink (busbw) |" + "".join(" ÷ %s |" % n for n in base)
    sep = "|---|---|" + "---|" * len(base)
    if tcp:
        tcp_base = [n for n in base if n != "mpi-shm"]
        head += " best gradlink-tcp (busbw) |" + "".join(" tcp ÷ %s |" % n for n in tcp_base)
        sep += "---|" + "---|" * len(tcp_base)
    lines = ["Ratios of median busbw (gradlink ÷ baseline; > 1: gradlink faster). `best gradlink`: "
             "the fastest gradlink configuration at that size; `best gradlink-tcp`: the fastest "
             "gradlink configuration over TCP loopback (the servers' path), against the baselines "
             "that also use TCP.", "",
             head, sep]
    for b in sz:
        best = best_gradlink(stats, ran, b)
        row = "| %s | %s (%s) |" % (human(b), best, fmt_bw(stats[best][b]["busbw_med"]))
        row += "".join(" %s |" % fmt_ratio(stats[best][b]["busbw_med"] / stats[n][b]["busbw_med"]) for n in base)
        if tcp:
            bt = max((s.name for s in tcp), key=lambda n: stats[n][b]["busbw_med"])
            row += " %s (%s) |" % (bt, fmt_bw(stats[bt][b]["busbw_med"]))
            row += "".join(" %s |" % fmt_ratio(stats[bt][b]["busbw_med"] / stats[n][b]["busbw_med"])
                           for n in tcp_base)
        lines.append(row)
    return lines


def plot(stats, systems, sz, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (apt-get install python3-matplotlib): no plot"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in systems:
        if s.name not in stats:
            continue
        med = [stats[s.name][b]["busbw_med"] for b in sz]
        lo = [m - stats[s.name][b]["busbw_min"] for m, b in zip(med, sz)]
        hi = [stats[s.name][b]["busbw_max"] - m for m, b in zip(med, sz)]
        ax.errorbar(sz, med, yerr=[lo, hi], marker="o", markersize=4, capsize=3,
                    linestyle="-" if s.is_gradlink else "--", label=s.name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sz)
    ax.set_xticklabels([human(b) for b in sz])
    ax.set_xlabel("size (fp32 sum)")
    ax.set_ylabel("busbw (GB/s), median; bars: min-max over repeats")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------
# bench/RESULTS.md: the summary section (replaced in place) and the history (appended)

SECTION = "compare"  # <!-- compare:begin --> ... <!-- compare:end -->
# gradlink configurations that are not what gradlink does by default; the summary marks them.
NOT_DEFAULT = {
    "gradlink-shm-1s": "1",
    "gradlink-shm-2s": "1",
    "gradlink-tcp-1s": "3",
    "gradlink-tcp-2s": "3",
    "gradlink-local": "2",
}
NOT_DEFAULT_NOTES = {
    "1": "the servers' path (`--local-arena 0`) with `GRADLINK_UCX_ERROR_MODE=none`: UCX shared "
         "memory, without UCX's peer-failure handling",
    "2": "workers pinned to a CPU each (`--bind`)",
    "3": "the servers' path (`--local-arena 0`: the same-host path off), over TCP loopback",
}
# tests/python/test_compare.py reads every row of the full table back from --results, so the
# summary keeps it, folded under <details>; the history has it too.
FULL_TABLE_IN_SUMMARY = True


def load_results_md():
    """bench/results_md.py (imported from bench/ whoever runs this file)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    try:
        import results_md
        return results_md
    finally:
        sys.path.remove(here)


def summary_order(systems):
    """gradlink's default configurations first, then its other ones, then the baselines."""
    gl = [s for s in systems if s.is_gradlink]
    return ([s for s in gl if s.name not in NOT_DEFAULT] + [s for s in gl if s.name in NOT_DEFAULT]
            + [s for s in systems if not s.is_gradlink])


def render_summary(stats, systems, sz, ranks, iters, warmup, repeats, heading, command_line,
                   note, full_table, history_link):
    """The compare section of bench/RESULTS.md (a string): per size, the best of gradlink's
    default configurations and the best of all of them (non-defaults marked), each with its
    median busbw and its ratio to each baseline's; the time at the smallest size; the full
    table folded."""
    ran = summary_order([s for s in systems if s.name in stats])
    gl = [s for s in ran if s.is_gradlink]
    default = [s for s in gl if s.name not in NOT_DEFAULT]
    base = [s for s in ran if not s.is_gradlink]
    mark = lambda n: n + (" (%s)" % NOT_DEFAULT[n] if n in NOT_DEFAULT else "")
    out = [heading, command_line + (" " + note if note else ""), ""]
    blocks = ([("best default gradlink", default)] if default else []) + (
        [("best gradlink (any)", gl)] if len(default) < len(gl) else [])
    cols = base if gl and base else []
    head, sep = "| size |", "|---|"
    for title, _ in blocks:
        head += " %s, busbw |" % title + "".join(" ÷ %s |" % s.name for s in cols)
        sep += "---|" + "---|" * len(cols)
    if not gl:
        head += " busbw: " + ", ".join(s.name for s in base) + " |"
        sep += "---|"
    out += ["Median busbw (GB/s) over %d repeat%s of %d iterations (+%d warmup), %d ranks, every "
            "element checked, and its ratio to each baseline's (> 1: gradlink faster):"
            % (repeats, "" if repeats == 1 else "s", iters, warmup, ranks), "", head, sep]
    for b in sz:
        row = "| %s |" % human(b)
        for _, group in blocks:
            best = max(group, key=lambda s: stats[s.name][b]["busbw_med"]).name
            bw = stats[best][b]["busbw_med"]
            row += " %s %s |" % (mark(best), fmt_bw(bw))
            row += "".join(" %s |" % fmt_ratio(bw / stats[s.name][b]["busbw_med"]) for s in cols)
        if not gl:
            row += " %s |" % " / ".join(fmt_bw(stats[s.name][b]["busbw_med"]) for s in base)
        out.append(row)
    notes = sorted({NOT_DEFAULT[s.name] for s in ran if s.name in NOT_DEFAULT})
    out += ["", " ".join("(%s) %s." % (k, NOT_DEFAULT_NOTES[k]) for k in notes)
            + (" " if notes else "") + "Median time per operation at %s (us): %s." % (
                human(sz[0]), ", ".join("%s %s" % (mark(s.name), fmt_time(stats[s.name][sz[0]]["time_us"]))
                                        for s in ran))]
    if FULL_TABLE_IN_SUMMARY and full_table:
        out += ["", "<details><summary>The full table of this run: every configuration's time, "
                "fastest operation, busbw min / median / max, checks</summary>", ""] + full_table + [
                "", "</details>"]
    if history_link:
        out += ["", "This run in full (with the systems' legend), and every earlier run: "
                "[%s](%s)." % (history_link, history_link)]
    return "\n".join(out) + "\n"


def main_table(table):
    """The lines of the main table (header to last row) among render()'s lines."""
    start = next((i for i, line in enumerate(table) if line.startswith("| size | system |")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(table)) if not table[i].startswith("|")), len(table))
    return table[start:end]


def write_results(a, stats, systems, sz, rev, cmdline, started, host, legend, table):
    """Appends the full output to --history, then replaces the compare section of --results;
    False (and why, on stderr) when that section could not be replaced."""
    rmd = load_results_md()
    heading = "%s — bench/compare: gradlink vs Open MPI vs Gloo, %d ranks on one host (fp32 sum)" % (
        rev, a.ranks)
    command_line = "Command: `%s` (started %s, %s)." % (
        cmdline, started.strftime("%Y-%m-%d %H:%M UTC"), host)
    history = None if a.history == "-" else (a.history or rmd.history_path(a.results, started))
    if history:
        section = ["", "## " + heading, "", command_line]
        if a.note:
            section += ["", a.note]
        section += [""] + legend + [""] + table + [""]
        rmd.append_history(history, "\n".join(section), os.path.basename(a.results))
        print("compare: full table appended to %s" % history, file=sys.stderr)
    link = None
    if history:
        link = os.path.relpath(os.path.abspath(history), os.path.dirname(os.path.abspath(a.results)))
    body = render_summary(stats, systems, sz, a.ranks, a.iters, a.warmup, a.repeats, "### " + heading,
                          command_line, a.note, main_table(table), link)
    try:
        rmd.update_section(a.results, SECTION, body)
    except (ValueError, OSError) as e:  # the history (if any) has the table; say why
        print("compare: section %s of %s NOT replaced: %s" % (SECTION, a.results, e), file=sys.stderr)
        return False
    print("compare: section %s of %s replaced" % (SECTION, a.results), file=sys.stderr)
    return True


def commit():
    try:
        h = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        return h + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown-commit"


# ---------------------------------------------------------------------------------------------


def parser():
    ap = argparse.ArgumentParser(prog="bench/compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin"),
                    help="where gradlink-bench, gradlink-server and mpi_allreduce are (default build/bin)")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    ap.add_argument("-f", "--stepfactor", type=factor_arg, default=4.0)
    ap.add_argument("-n", "--iters", type=positive_int, default=20, help="timed iterations per size and run")
    ap.add_argument("--warmup", type=nonneg_int, default=3, help="untimed iterations per size and run")
    ap.add_argument("--repeats", type=positive_int, default=3, help="runs of every system (interleaved)")
    ap.add_argument("--ranks", type=positive_int, default=2,
                    help="gradlink workers / MPI ranks / Gloo ranks (default 2)")
    ap.add_argument("--systems", default=",".join(s.name for s in SYSTEMS),
                    help="comma-separated subset of: " + ", ".join(s.name for s in SYSTEMS))
    ap.add_argument("--plot", default=os.path.join(REPO, "bench", "compare.png"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "RESULTS.md"),
                    help="replace this file's compare section with the run's summary (default "
                         "bench/RESULTS.md; '-' for none)")
    ap.add_argument("--history", default="", metavar="FILE",
                    help="append the full output here (default: history/RESULTS-YYYY-MM.md "
                         "beside --results; '-' for none)")
    ap.add_argument("--no-results", action="store_true", help="neither --results nor --history")
    ap.add_argument("--save-json", default="", metavar="FILE",
                    help="also write every run's time per size (us) and the summary as JSON")
    ap.add_argument("--timeout", type=positive_int, default=600, help="seconds for one run of one system")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--mpirun-args", default="", help="extra mpirun arguments (one string)")
    ap.add_argument("--python", default=sys.executable, help="the Python (with torch) for Gloo")
    ap.add_argument("--note", default="", help="a sentence to put under the heading in --results and --history")
    # Self-test of the checking: the named baseline corrupts one element of one result.
    ap.add_argument("--selftest-corrupt", default="", help=argparse.SUPPRESS)
    return ap


def on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_process, which stops the current run


def main(argv=None):
    signal.signal(signal.SIGTERM, on_sigterm)
    ap = parser()
    a = ap.parse_args(argv)
    if a.maxbytes < a.minbytes:
        ap.error("-e (%d) is smaller than -b (%d)" % (a.maxbytes, a.minbytes))
    if a.ranks < 2:
        ap.error("--ranks must be at least 2 (an all-reduce of one rank moves nothing)")
    by_name = {s.name: s for s in SYSTEMS}
    wanted = [n.strip() for n in a.systems.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        ap.error("--systems: unknown %s (known: %s)" % (", ".join(unknown) or "(empty)", ", ".join(by_name)))
    if a.selftest_corrupt and a.selftest_corrupt not in wanted:
        ap.error("--selftest-corrupt %s is not among --systems" % a.selftest_corrupt)
    a.bin = os.path.abspath(a.bin)
    cmdline = "bench/compare" + ("" if not (argv or sys.argv[1:]) else " " + shlex.join(argv or sys.argv[1:]))

    systems, skipped = [], []
    for n in wanted:
        why = missing_dependency(by_name[n], a)
        (skipped.append((n, why)) if why else systems.append(by_name[n]))
    for n, why in skipped:
        print("compare: skipped %s: %s" % (n, why), file=sys.stderr)
    if not systems:
        print("compare: nothing to run (every system skipped)", file=sys.stderr)
        return 1

    sz = sizes(a.minbytes, a.maxbytes, a.stepfactor)
    times = {s.name: {b: [] for b in sz} for s in systems}
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()[0]
    try:
        for rep in range(a.repeats):
            for s in systems:  # interleaved: noise hits every system alike
                for b, t in run_system(s, a, rep, sz, a.selftest_corrupt == s.name).items():
                    times[s.name][b].append(t)
    except Failure as e:
        print("compare: FAILED: %s" % e, file=sys.stderr)
        return 1

    stats = summarize(times, a.ranks)
    rev = commit()
    legend = ["Systems:"] + ["- `%s`: %s" % (s.name, s.label) for s in systems]
    legend += ["- skipped `%s`: %s" % (n, why) for n, why in skipped]
    table = render(stats, systems, sz, a)
    print("\n".join(legend + [""] + table))

    if a.save_json:
        with open(a.save_json, "w") as f:
            json.dump({"commit": rev, "command": cmdline, "ranks": a.ranks, "iters": a.iters,
                       "warmup": a.warmup, "repeats": a.repeats, "sizes": sz,
                       "systems": {s.name: s.label for s in systems},
                       "skipped": dict(skipped),
                       "runs_mean_min_us": {n: {str(b): ts for b, ts in v.items()} for n, v in times.items()},
                       "summary": {n: {str(b): st for b, st in v.items()} for n, v in stats.items()}},
                      f, indent=1)
    if not a.no_plot:
        why = plot(stats, systems, sz, a.plot,
                   "gradlink vs Open MPI vs Gloo, %d ranks, one host (%s)" % (a.ranks, rev))
        print("compare: " + (why or "plot written to %s" % a.plot), file=sys.stderr)
    if not a.no_results and a.results != "-":
        host = "%s, %d CPUs, 1-min load average %.1f at the start and %.1f at the end" % (
            socket.gethostname(), os.cpu_count() or 0, load_start, os.getloadavg()[0])
        if not write_results(a, stats, systems, sz, rev, cmdline, started, host, legend, table):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
