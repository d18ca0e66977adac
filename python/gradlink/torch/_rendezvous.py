"""The rendezvous of the torch.distributed backend and of gradlink.torch.init() under torchrun:
through the Store torch hands over, rank 0 hosts the job's scheduler in this process and
publishes its address (found by probing when no address names it), the job name and a fresh
secret; the first rank of each host starts that host's gradlink-server processes (children that
end with the job); every rank learns its local rank. With GRADLINK_SCHEDULER set, the ranks join
that job instead. Also: the job's end at exit, and the names of the backend's subgroups.

This module imports nothing of gradlink.torch (the backend, _c10d.py, and init(), _init.py,
call it). Threads: the caller's (one rendezvous per process at a time).
"""

import atexit
import ctypes
import os
import signal
import subprocess
import time
import zlib

import torch.distributed as dist

import gradlink
from gradlink import InvalidArgumentError, _env

BACKEND = "gradlink"
_PREFIX = "gradlink/"

_job = {"scheduler": None, "servers": [], "groups": {}}


def _bin(name):
    """A gradlink binary: $GRADLINK_BIN_DIR, else the build directory's bin/."""
    dirs = [_env.bin_dir()] + [os.path.join(d, "bin") for d in gradlink._build_dirs()]
    for d in dirs:
        if d and os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    raise InvalidArgumentError(
        "gradlink: %s not found (looked in %s): build gradlink, or set GRADLINK_BIN_DIR"
        % (name, ", ".join(d for d in dirs if d)))


def _die_with_parent():
    # The server is this worker's child: it must not outlive it (PR_SET_PDEATHSIG).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _interface_addresses():
    """This machine's IPv4 addresses, loopback last."""
    import fcntl
    import socket
    import struct
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                  struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found.append(socket.inet_ntoa(raw[20:24]))
    return sorted(set(found), key=lambda a: (a.startswith("127."), a))


class _Probe:
    """A listening socket on rank 0 that the other ranks try each of rank 0's addresses
    against, to find one that reaches it (tcp:// and file:// init name no address for it)."""

    def __init__(self):
        import socket
        import threading
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            c.close()

    def close(self):
        import socket
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _reachable(candidates, port, timeout_s=2.0):
    import socket
    for a in candidates:
        try:
            socket.create_connection((a, port), timeout=timeout_s).close()
            return a
        except OSError:
            continue
    raise gradlink.UnavailableError(
        "gradlink: none of rank 0's addresses (%s) answers from this host; set "
        "GRADLINK_SCHEDULER_HOST (or MASTER_ADDR) to an address of rank 0's host that the other "
        "hosts reach" % ", ".join(candidates))


def rendezvous(store, rank, size, timeout_s):
    """Through `store` (torch's): starts the job's scheduler (rank 0) and servers (a host's
    first rank) unless GRADLINK_SCHEDULER names a running job; returns the scheduler's
    host:port, and sets this process's GRADLINK_JOB, GRADLINK_SECRET, GRADLINK_LOCAL_RANK and
    GRADLINK_LOCAL_SIZE for the worker."""
    from gradlink import _gradlink
    me = _gradlink.machine_name()
    store.set(_PREFIX + "host/%d" % rank, me)
    hosts = [store.get(_PREFIX + "host/%d" % r).decode() for r in range(size)]
    machines = []
    for h in hosts:  # numbered by their first rank
        if h not in machines:
            machines.append(h)
    local = [r for r in range(size) if hosts[r] == me]
    _env.set_variable("GRADLINK_LOCAL_RANK", str(local.index(rank)))
    _env.set_variable("GRADLINK_LOCAL_SIZE", str(len(local)))
    if _env.scheduler():
        return _env.scheduler()
    per_host = _env.servers_per_host()
    if rank == 0:
        job = "torch-%s" % _gradlink.generate_secret()[:12]
        secret = _env.secret() or _gradlink.generate_secret()
        single = len(machines) == 1
        sched = _gradlink.Scheduler(
            host="127.0.0.1" if single else "0.0.0.0",
            port=_env.scheduler_port(), workers=size,
            servers=per_host * len(machines), job=job, secret=secret,
            join_timeout=timeout_s)
        _job["scheduler"] = sched
        named = _env.scheduler_host()
        if single:
            hosts_ = "127.0.0.1"
        elif named:
            hosts_ = named
        else:  # the others find which of this host's addresses reaches it
            probe = _Probe()
            hosts_ = "probe:%d:%s" % (probe.port, ",".join(_interface_addresses()))
        store.set(_PREFIX + "job", "\n".join([hosts_, str(sched.port), job, secret]))
    hosts_, port, job, secret = store.get(_PREFIX + "job").decode().split("\n")
    if hosts_.startswith("probe:"):
        _, probe_port, candidates = hosts_.split(":", 2)
        host = "127.0.0.1" if rank == 0 else _reachable(candidates.split(","), int(probe_port))
        store.add(_PREFIX + "probed", 1)
        if rank == 0:
            end = time.monotonic() + timeout_s
            while store.add(_PREFIX + "probed", 0) < size and time.monotonic() < end:
                time.sleep(0.01)  # until every rank has found it
            probe.close()
    else:
        host = hosts_
    address = "%s:%s" % (host, port)
    _env.set_variable("GRADLINK_JOB", job)
    _env.set_variable("GRADLINK_SECRET", secret)
    if local[0] == rank:
        env = dict(os.environ, GRADLINK_SCHEDULER=address)
        machine = machines.index(me)
        for i in range(per_host):
            _job["servers"].append(subprocess.Popen(
                [_bin("gradlink-server"), "--scheduler", address, "--id",
                 str(machine * per_host + i)],
                env=env, preexec_fn=_die_with_parent))
    return address


def _end_job():
    """At exit, after the worker has left: the servers end with the job; rank 0 keeps the
    scheduler until every worker has left (or 30 s)."""
    sched = _job["scheduler"]
    if sched is not None:
        sched.wait(30.0)
        sched.stop()
        _job["scheduler"] = None
    for p in _job["servers"]:
        try:
            p.wait(10.0)
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait(5.0)
    _job["servers"] = []


def group_uid(members):
    """The group's name, alike on its members: its ranks, and how many gradlink groups of those
    ranks were made before (only members make a group, all in one order)."""
    ranks = ",".join(str(r) for r in members)
    if len(ranks) > 64:
        ranks = "%dx%08x" % (len(members), zlib.crc32(ranks.encode()))
    n = _job["groups"].get(ranks, 0)
    _job["groups"][ranks] = n + 1
    return "g%s.%d" % (ranks, n)


def init_from_store(store, rank, size, timeout_s):
    """gradlink.torch.init() beside another default group: the rendezvous through its store."""
    first = not _job["servers"] and _job["scheduler"] is None
    address = rendezvous(dist.PrefixStore("gradlink.torch", store), rank, size, timeout_s)
    if first:
        atexit.register(_end_job)
    return address
