"""The environment as gradlink's Python layer reads it: the one module that reads (or sets)
GRADLINK_* variables, and torchrun's RANK, WORLD_SIZE, ... where gradlink falls back to them.

Two kinds of variable, one parser each:

* Those that set a role's options (WorkerOptions, ServerOptions, SchedulerOptions: scheduler,
  job, rank, partition and fusion sizes, timeouts, the secret, ...) are parsed by the C++
  mapping, gradlink::ApplyEnvironment (include/gradlink/env.h), which the extension exposes as
  ``_gradlink.environment_options(role)``: options() here. Python never parses them again.
* Those only the Python layer reads (the launcher's sizes and local ranks, fail-fast, the
  staging pipeline, the torch.distributed rendezvous) are parsed here: PYTHON_ONLY lists them.

A malformed value raises InvalidArgumentError (a ValueError) naming the variable and its value.

gradlink-run loads this file by its path (gradlink's package needs the compiled extension; the
launcher does not) and calls check() before it starts anything, so that it reports a bad value
in the words gradlink.torch.init() would. Hence nothing of gradlink is imported at the top.
The variables and what they set: docs/operations.md, "Environment".
"""

import os


def _invalid(message):
    """gradlink.InvalidArgumentError when gradlink's package is loaded (it is a ValueError),
    else ValueError (gradlink-run without the extension)."""
    try:
        from gradlink import InvalidArgumentError
    except ImportError:
        return ValueError(message)
    return InvalidArgumentError(message)


def text(*names, default=None):
    """The first of `names` that is set and not empty; else `default`."""
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return default


def is_set(name):
    """Whether `name` is set to something (not empty)."""
    return text(name) is not None


def integer(*names, default=None):
    """The first of `names` that is set, as an int; `default` when none is."""
    v = text(*names)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise _invalid("%s=%r is not an integer" % ("/".join(names), v)) from None


def count(name, default):
    """A whole number >= 1 (how many of something)."""
    n = integer(name, default=default)
    if n < 1:
        raise _invalid("%s=%d: at least 1" % (name, n))
    return n


def byte_size(name, default, minimum):
    """A byte count in digits, at least `minimum`."""
    v = os.environ.get(name)
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < minimum:
        raise _invalid("%s=%r: expected bytes >= %d" % (name, v, minimum))
    return n


def switch(name, default, off):
    """On unless the variable is one of `off` ("" included there where an empty value turns it
    off); `default` when unset."""
    v = os.environ.get(name)
    if v is None:
        return default
    return v not in off


def set_variable(name, value):
    """Sets `name` for this process and the children it starts (the rendezvous hands the worker
    and servers its job, secret and local ranks this way)."""
    os.environ[name] = value


def under_torchrun():
    """torchrun's (env://) variables are all set."""
    return all(text(n) is not None for n in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))


# -- Variables of gradlink's own Python layer (not options of the C++ roles) --------------------

STAGING_CHUNK_DEFAULT = 4 << 20
STAGING_CHUNK_MIN = 1024


def workers():
    """GRADLINK_WORKERS (gradlink-run), else torchrun's WORLD_SIZE; None when neither is set."""
    return integer("GRADLINK_WORKERS", "WORLD_SIZE")


def local_rank():
    return integer("GRADLINK_LOCAL_RANK", "LOCAL_RANK", default=0)


def local_size():
    return integer("GRADLINK_LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=1)


def launched_by_gradlink_run():
    """GRADLINK_LAUNCHER=gradlink-run: gradlink-run started this worker and ends its job once
    every worker has exited."""
    return text("GRADLINK_LAUNCHER") == "gradlink-run"


def fail_fast():
    """GRADLINK_FAIL_FAST: on unless 0 or false (unset or empty: on)."""
    return text("GRADLINK_FAIL_FAST", default="1") not in ("0", "false")


def staging_chunk_bytes():
    """GRADLINK_STAGING_CHUNK_BYTES: the staging pipeline's chunk (4 MiB; at least 1 KiB)."""
    return byte_size("GRADLINK_STAGING_CHUNK_BYTES", STAGING_CHUNK_DEFAULT, STAGING_CHUNK_MIN)


def stage_host():
    """GRADLINK_STAGE_HOST: host tensors through the staging pipeline too (on unless 0/empty)."""
    return switch("GRADLINK_STAGE_HOST", False, off=("", "0"))


def servers_per_host():
    """GRADLINK_SERVERS_PER_HOST: servers the torch.distributed rendezvous starts per host."""
    return count("GRADLINK_SERVERS_PER_HOST", 1)


def c10d_slots():
    """GRADLINK_C10D_SLOTS: keys per collective signature of the torch.distributed backend."""
    return count("GRADLINK_C10D_SLOTS", 1)


def scheduler_port():
    """GRADLINK_SCHEDULER_PORT: the port of the scheduler the rendezvous starts (0: a free one)."""
    return integer("GRADLINK_SCHEDULER_PORT", default=0)


def scheduler():
    """GRADLINK_SCHEDULER (host:port of a running job), as the C++ reads it: set and not empty;
    else None. (For the rendezvous, which decides before any worker exists whether to join
    that job; init() takes it from options().)"""
    return text("GRADLINK_SCHEDULER")


def scheduler_host():
    """The address of rank 0's host that the rendezvous names (GRADLINK_SCHEDULER_HOST, else
    torchrun's MASTER_ADDR); None: found by probing."""
    return text("GRADLINK_SCHEDULER_HOST", "MASTER_ADDR")


def secret():
    """GRADLINK_SECRET as set (the rendezvous passes it on; the C++ side reads and checks it)."""
    return text("GRADLINK_SECRET")


def secret_given():
    """Whether a job secret is set (GRADLINK_SECRET or GRADLINK_SECRET_FILE)."""
    return is_set("GRADLINK_SECRET") or is_set("GRADLINK_SECRET_FILE")


def build_dir():
    """GRADLINK_BUILD_DIR: the build whose extension and binaries to use; None when unset."""
    return text("GRADLINK_BUILD_DIR")


def bin_dir():
    """GRADLINK_BIN_DIR: where gradlink-scheduler and gradlink-server are; None when unset."""
    return text("GRADLINK_BIN_DIR")


# name -> its parser: every Python-only variable that can be malformed (check() runs them).
PYTHON_ONLY = {
    "GRADLINK_WORKERS": workers,
    "GRADLINK_LOCAL_RANK": local_rank,
    "GRADLINK_LOCAL_SIZE": local_size,
    "GRADLINK_STAGING_CHUNK_BYTES": staging_chunk_bytes,
    "GRADLINK_SERVERS_PER_HOST": servers_per_host,
    "GRADLINK_C10D_SLOTS": c10d_slots,
    "GRADLINK_SCHEDULER_PORT": scheduler_port,
}


# -- Variables of the C++ roles' options: parsed by the extension ------------------------------

def options(role="worker"):
    """The options of `role` ("worker", "server", "scheduler") with the GRADLINK_* environment
    applied over the C++ defaults, as gradlink::ApplyEnvironment parses it (durations in
    seconds). Raises InvalidArgumentError naming a malformed variable and its value."""
    from gradlink import _gradlink
    return _gradlink.environment_options(role)


def check(skip=(), roles=("scheduler", "server", "worker")):
    """Parses every variable a job's members will read: the C++ roles' (when the extension can
    be loaded; else the members report them when they start) and PYTHON_ONLY. `skip`: names the
    caller sets for its members itself (their values here are not what the members get).
    Raises InvalidArgumentError (ValueError) for the first malformed one. Not thread-safe: it
    unsets `skip` for the C++ parser meanwhile (gradlink-run calls it before any thread)."""
    for name, parse in PYTHON_ONLY.items():
        if name not in skip:
            parse()
    try:
        from gradlink import _gradlink  # noqa: F401
    except ImportError:
        return
    hidden = {n: os.environ.pop(n) for n in skip if n in os.environ}
    try:
        for role in roles:
            options(role)
    finally:
        os.environ.update(hidden)
