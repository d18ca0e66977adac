"""Builds gradlink's Python package with CMake (pyproject.toml: `pip install .`, `pip wheel .`).

The pure-Python package is python/gradlink/. Its compiled parts (_gradlink, _gradlink_c10d,
libgradlink, the binaries, gradlink's patched UCX) come from one CMake build in
<build_temp>/cmake (under build-pip/, setup.cfg; CMake's own build/ is never touched), installed
into the package directory with GRADLINK_PYTHON_PACKAGE=ON (cmake/install.cmake: the layout,
and $ORIGIN RUNPATHs, so that the installed package needs nothing outside itself).

Environment: GRADLINK_UCX_PREFIX (the patched UCX; default ~/.cache/gradlink/ucx-1.13.1-gl1,
scripts/ucx/build.sh), CMAKE_BUILD_PARALLEL_LEVEL (compile jobs; default: the CPUs),
GRADLINK_CMAKE_ARGS (more -D flags), CMAKE_CXX_COMPILER_LAUNCHER (e.g. ccache).
"""

import os
import shlex
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    """A module CMake builds (no sources for setuptools to compile)."""

    def __init__(self, name):
        super().__init__(name, sources=[])


class BuildWithCMake(build_ext):
    def run(self):
        build_dir = os.path.join(os.path.abspath(self.build_temp), "cmake")
        package_dir = os.path.join(os.path.abspath(self.build_lib), "gradlink")
        os.makedirs(build_dir, exist_ok=True)
        ucx = os.environ.get("GRADLINK_UCX_PREFIX",
                             os.path.expanduser("~/.cache/gradlink/ucx-1.13.1-gl1"))
        configure = [
            "cmake", "-S", ROOT, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo",  # what make build and the benchmarks use
            "-DGRADLINK_BUILD_TESTS=OFF",
            "-DGRADLINK_BUILD_PYTHON=ON",
            "-DGRADLINK_PYTHON_PACKAGE=ON",
            "-DGRADLINK_UCX_PREFIX=" + ucx,
            "-DPYTHON_EXECUTABLE=" + sys.executable,
        ] + shlex.split(os.environ.get("GRADLINK_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        targets = ["gradlink", "_gradlink", "gradlink-scheduler", "gradlink-server",
                   "gradlink-bench"]
        self.announce("gradlink: CMake build in " + build_dir, level=2)
        subprocess.check_call(configure)
        if self._has_target(build_dir, "_gradlink_c10d"):
            targets.append("_gradlink_c10d")
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs, "--target"] + targets)
        # --strip: the same code as the build's, without its debug information.
        subprocess.check_call(["cmake", "--install", build_dir, "--prefix", package_dir,
                               "--strip"])

    @staticmethod
    def _has_target(build_dir, target):
        help_text = subprocess.run(["cmake", "--build", build_dir, "--target", "help"],
                                   check=True, capture_output=True, text=True).stdout
        return (" " + target) in help_text or (target + ":") in help_text

    def get_outputs(self):
        # What run() installed (setuptools asks for the ext_modules' paths only).
        return []


os.makedirs(os.path.join(ROOT, "build-pip"), exist_ok=True)  # setup.cfg's egg_base
setup(
    packages=find_packages(where="python"),
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("gradlink._gradlink")],
    cmdclass={"build_ext": BuildWithCMake},
    zip_safe=False,
)
