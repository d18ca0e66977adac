"""gradlink: parameter-server gradient aggregation (PS-AllReduce) for data-parallel training.

The package is pure Python around the compiled module ``_gradlink`` (pybind11 over the C++
worker). CMake builds that module into ``<build>/python/gradlink/``; this package finds it in

1. ``$GRADLINK_BUILD_DIR/python/gradlink`` if GRADLINK_BUILD_DIR is set (gradlink-run sets it),
2. ``<repo>/build/python/gradlink`` (the default build directory) in a source tree,
3. next to this file (an installed package: ``pip install .``, whose compiled parts and
   binaries, in ``bin/``, are all inside the package; it never looks for a build directory).

Errors are exceptions: :class:`GradlinkError` is the base; each C++ status code has a subclass
(:class:`MismatchError`, :class:`PeerLostError`, :class:`TimeoutError` (also a builtin
TimeoutError), :class:`AbortedError`, :class:`InvalidArgumentError` (also a ValueError),
:class:`ProtocolError`, :class:`UnavailableError`, :class:`AuthFailedError`,
:class:`ResourceExhaustedError`, :class:`InternalError`).

For PyTorch use :mod:`gradlink.torch`.
"""

import os as _os

from . import _env  # the GRADLINK_* environment (pure Python: before the extension)

_here = _os.path.dirname(_os.path.abspath(__file__))
_repo = _os.path.dirname(_os.path.dirname(_here))
# An installed package (cmake/install.cmake's GRADLINK_PYTHON_PACKAGE layout) has its binaries
# in bin/ here; a source tree's python/gradlink/ has none.
_installed = _os.path.isdir(_os.path.join(_here, "bin"))


def _build_dirs():
    """Directories with python/gradlink/ (the compiled modules) and bin/ (the binaries)."""
    dirs = []
    env = _env.build_dir()
    if env:
        dirs.append(_os.path.abspath(env))
    dirs.append(_here if _installed else _os.path.join(_repo, "build"))
    return dirs


for _d in _build_dirs():
    _p = _os.path.join(_d, "python", "gradlink")
    if _os.path.isdir(_p) and _p not in __path__:
        __path__.append(_p)

try:
    from . import _gradlink  # noqa: E402
except ImportError as _e:  # pragma: no cover - depends on the build
    raise ImportError(
        "gradlink: the compiled module _gradlink was not found (looked in %s and %s). Build it "
        "with `cmake -S . -B build && cmake --build build -j2 --target _gradlink` "
        "(needs python3-pybind11), or set GRADLINK_BUILD_DIR to your build directory. "
        "Use /usr/bin/python3 (or the project's .venv): the module is built for it. (%s)"
        % (", ".join(_build_dirs()), _here, _e)
    ) from _e

from ._gradlink import (  # noqa: E402,F401
    AbortedError,
    AuthFailedError,
    GradlinkError,
    Handle,
    InternalError,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    ResourceExhaustedError,
    Tensor,
    TimeoutError,
    UnavailableError,
    Worker,
    code_name,
    dtype_size,
)

__all__ = [
    "AbortedError",
    "AuthFailedError",
    "GradlinkError",
    "Handle",
    "InternalError",
    "InvalidArgumentError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "ResourceExhaustedError",
    "Tensor",
    "TimeoutError",
    "UnavailableError",
    "Worker",
    "bin_dir",
    "code_name",
    "dtype_size",
]


def bin_dir():
    """The directory with gradlink-scheduler and gradlink-server ($GRADLINK_BIN_DIR, else the
    build directory's bin/, or the installed package's)."""
    env = _env.bin_dir()
    if env:
        return env
    for d in _build_dirs():
        b = _os.path.join(d, "bin")
        if _os.path.exists(_os.path.join(b, "gradlink-scheduler")):
            return b
    return _os.path.join(_repo, "build", "bin")
