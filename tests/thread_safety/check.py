#!/usr/bin/env python3
"""Checks src/ with clang's thread-safety analysis (ctest thread_safety_check).

Every src/**/*.cc in the build's compile_commands.json (CMake writes it) is compiled again with
clang++ -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror, with the project's own
include paths, defines and language standard: no objects, no second build. The build's own
warning flags (GCC's -Wall -Wextra -Werror) are dropped: the GCC build checks those. The locks and the annotations it checks
are in src/common/mutex.h, src/common/thread_annotations.h and src/worker/state_mutex.h.

First it compiles a small program with one unguarded access (probe below) and requires clang to
reject it: a clang that ignores the attributes, or macros that expand to nothing under clang,
would otherwise let every file pass.

Usage: check.py <build dir> <source dir> [clang++]   (exit 0: clean; 1: a finding; 77: no clang)
"""
import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

# Flags the analysis adds. -Wthread-safety is clang's stable set (attributes, analysis,
# precise, reference); -Wthread-safety-beta adds the lock-order checks (ACQUIRED_BEFORE).
CHECK_FLAGS = ["-fsyntax-only", "-Wthread-safety", "-Wthread-safety-beta", "-Werror"]

# What GCC takes and clang does not, or what only the real build needs.
DROP_PREFIXES = ("-W", "-o", "-M", "-fno-semantic-interposition", "-fconcepts-diagnostics")
DROP_WITH_ARG = {"-o", "-MF", "-MT", "-MQ"}

PROBE = r"""
#include "common/mutex.h"
struct Probe {
  gradlink::Mutex mu;
  int x GUARDED_BY(mu) = 0;
  int Unguarded() { return x; }
};
"""


def clang_args(entry, clang, file=None):
    """The entry's compile command for clang (of `file`, else the entry's own), without its
    output and warning flags."""
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    own = os.path.normpath(os.path.join(entry["directory"], entry["file"]))
    out = [clang]
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in DROP_WITH_ARG:
            skip = True
            continue
        if a == "-c" or a.startswith(DROP_PREFIXES):
            continue
        if os.path.normpath(os.path.join(entry["directory"], a)) == own:
            continue  # the source file: given last
        out.append(a)
    return out + CHECK_FLAGS + [file or own]


def check(entry, clang, file=None):
    cmd = clang_args(entry, clang, file)
    r = subprocess.run(cmd, cwd=entry["directory"], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    build, source = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    clang = sys.argv[3] if len(sys.argv) > 3 else (shutil.which("clang++") or "")
    if not clang or shutil.which(clang) is None:
        print("thread_safety_check: no clang++ (apt-get install clang): skipped")
        return 77
    with open(os.path.join(build, "compile_commands.json")) as f:
        db = json.load(f)
    src = os.path.join(source, "src") + os.sep
    entries, seen = [], set()
    for e in db:
        path = os.path.normpath(os.path.join(e["directory"], e["file"]))
        if path.startswith(src) and path.endswith(".cc") and path not in seen:
            seen.add(path)
            entries.append(dict(e, file=path))
    if not entries:
        print("thread_safety_check: no src/ file in compile_commands.json")
        return 1

    # The probe, with the first entry's flags (the include path to src/).
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.cc")
        with open(probe, "w") as f:
            f.write(PROBE)
        rc, text = check(entries[0], clang, probe)
        if rc == 0 or "requires holding mutex 'mu'" not in text:
            print("thread_safety_check: clang accepted an unguarded read of a GUARDED_BY field, "
                  "so the analysis is not running:\n" + text)
            return 1

    jobs = int(os.environ.get("GRADLINK_TSA_JOBS", "2"))
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for rc, text in pool.map(lambda e: check(e, clang), entries):
            if rc != 0:
                failed += 1
                sys.stdout.write(text)
    flags = " ".join(CHECK_FLAGS[1:])
    verdict = f"{failed} failed" if failed else "clean"
    print(f"thread_safety_check: {len(entries)} files of src/ checked with "
          f"{os.path.basename(clang)} {flags}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
