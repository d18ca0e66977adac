#!/usr/bin/env bash
# make test-install: gradlink as pip installs it (README, "Installing").
#
# 1. `pip install .` (Debian's setuptools, wheel, pybind11 and CMake; --no-build-isolation, no
#    index) into a fresh venv made with --system-site-packages (Debian's torch).
# 2. With the checkout and ~/.cache/gradlink (the patched UCX) hidden under a tmpfs
#    (unshare -m), from another directory: the package, its subpackages and its commands are
#    the venv's; `gradlink-run -n 2 -s 2 -- python installed_job.py` sums through 2 servers and
#    every library it loads (UCX's modules included) is the venv's; a torch.distributed job on
#    the "gradlink" backend starts its server from the package.
# 3. `pip wheel .`: what the wheel holds ($ORIGIN RUNPATHs, UCX and its modules, no path into
#    the build), installed into a second fresh venv, then step 2's job again with it.
#
# The pip build is CMake's in build-pip/ (setup.cfg, setup.py), never build/; the second build
# (pip wheel) reuses it. Needs root (unshare, mount). About a minute when ccache holds build/'s
# objects (make test-install), else 10-15 minutes of compiling on 2 cores.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
ucx=${GRADLINK_UCX_PREFIX:-$HOME/.cache/gradlink/ucx-1.13.1-gl1}
cache=$HOME/.cache/gradlink  # hidden with the checkout (the UCX must be in it)
case "$ucx" in "$cache"/*) ;; *) echo "FAIL: $ucx is not in $cache" >&2; exit 1 ;; esac
work=$(mktemp -d /tmp/gradlink-pip-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root (unshare -m, mount)"
case "$work" in "$src"/*|"$HOME/.cache/gradlink"/*) fail "work dir $work is inside what is hidden" ;; esac
build_before=$(stat -c %Y "$src/build" 2>/dev/null || echo none)

pip_in() {  # VENV ARGS...: pip of that venv, offline
  local venv=$1; shift
  "$venv/bin/python" -m pip --disable-pip-version-check "$@"
}

# The checks of step 2, in VENV, with the checkout and ~/.cache/gradlink hidden.
run_hidden() {
  local venv=$1 what=$2
  mkdir -p "$work/run"
  cp "$src/tests/install/installed_job.py" "$src/tests/install/installed_c10d.py" "$work/run/"
  cat > "$work/run/checks.sh" <<CHECKS
set -euo pipefail
export PATH="$venv/bin:\$PATH" GRADLINK_TEST_VENV="$venv"
unset GRADLINK_BUILD_DIR GRADLINK_BIN_DIR PYTHONPATH
cd "$work/run"
[ -z "\$(ls -A "$src")" ] && [ -z "\$(ls -A "$cache")" ] || { echo "not hidden"; exit 1; }
python - <<'PY'
import os, shutil
import gradlink, gradlink.torch, gradlink.byteps.torch, gradlink.torch._c10d
import torch.distributed as dist
venv = os.path.realpath(os.environ["GRADLINK_TEST_VENV"]) + os.sep
for m in (gradlink, gradlink.torch, gradlink.byteps.torch, gradlink.torch._c10d):
    assert os.path.realpath(m.__file__).startswith(venv), m.__file__
assert hasattr(dist.Backend, "GRADLINK"), "no torch.distributed backend 'gradlink'"
for c in ("gradlink-run", "gradlink-scheduler", "gradlink-server", "gradlink-bench"):
    assert os.path.realpath(shutil.which(c) or "/").startswith(venv), (c, shutil.which(c))
print("gradlink.__file__ =", gradlink.__file__)
PY
gradlink-scheduler --help > /dev/null
timeout 180 gradlink-run -n 2 -s 2 -- python installed_job.py > job.log 2>&1 || { cat job.log; exit 1; }
grep "INSTALLED JOB OK" job.log
[ "\$(grep -c "INSTALLED JOB OK" job.log)" -eq 2 ] || { cat job.log; exit 1; }
(timeout 180 python installed_c10d.py 0 2 "$work/run/store" > c10d0.log 2>&1 & echo \$! > c10d0.pid)
timeout 180 python installed_c10d.py 1 2 "$work/run/store" > c10d1.log 2>&1 || { cat c10d0.log c10d1.log; exit 1; }
while kill -0 \$(cat c10d0.pid) 2> /dev/null; do sleep 0.2; done
cat c10d0.log c10d1.log | grep "INSTALLED C10D OK"
[ "\$(cat c10d0.log c10d1.log | grep -c "INSTALLED C10D OK")" -eq 2 ] || { cat c10d0.log c10d1.log; exit 1; }
CHECKS
  echo "== $what: under unshare -m, $src and $cache hidden, in $work/run"
  unshare -m --propagation private bash -c \
    "mount -t tmpfs none '$src' && mount -t tmpfs none '$cache' && bash '$work/run/checks.sh'" ||
    fail "$what"
  rm -rf "$work/run"
}

echo "== pip install . (fresh venv: /usr/bin/python3 -m venv --system-site-packages)"
/usr/bin/python3 -m venv --system-site-packages "$work/venv1"
(cd "$src" && pip_in "$work/venv1" install --no-build-isolation --no-index --no-deps . \
   > "$work/pip-install.log" 2>&1) || { tail -40 "$work/pip-install.log"; fail "pip install ."; }
tail -2 "$work/pip-install.log"
run_hidden "$work/venv1" "pip install ."

echo "== pip wheel ."
(cd "$src" && pip_in "$work/venv1" wheel --no-build-isolation --no-index --no-deps \
   -w "$work/wheels" . > "$work/pip-wheel.log" 2>&1) || { tail -40 "$work/pip-wheel.log"; fail "pip wheel ."; }
wheel=$(ls "$work"/wheels/gradlink-*.whl)
echo "$(basename "$wheel"): $(du -h "$wheel" | cut -f1)"
mkdir "$work/unzipped"
python3 -m zipfile -e "$wheel" "$work/unzipped"
for f in gradlink/lib/libgradlink.so.0.1 gradlink/lib/libucp.so.0 gradlink/lib/libuct.so.0 \
         gradlink/lib/libucs.so.0 gradlink/lib/libucm.so.0 gradlink/lib/ucx/libuct_cma.so.0 \
         gradlink/bin/gradlink-scheduler gradlink/bin/gradlink-server gradlink/bin/gradlink-bench \
         gradlink/bin/gradlink-run gradlink/torch/__init__.py gradlink/byteps/torch/__init__.py; do
  [ -e "$work/unzipped/$f" ] || fail "the wheel lacks $f"
done
ls "$work/unzipped/gradlink/" | grep -q '^_gradlink\..*\.so$' || fail "the wheel lacks _gradlink"
ls "$work/unzipped/gradlink/" | grep -q '^_gradlink_c10d\..*\.so$' || fail "the wheel lacks _gradlink_c10d"
echo "RUNPATHs in the wheel:"
(cd "$work/unzipped" && find gradlink -name '*.so*' -o -path '*/bin/gradlink-[sb]*' | sort |
   while read -r f; do
     rp=$(readelf -d "$f" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
     printf '  %-58s %s\n' "$f" "$rp"
     case "$rp" in
       '$ORIGIN'*) ;;
       '')  # none: then it may need nothing the wheel carries (libucm needs libc alone)
         for n in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
           [ ! -e "gradlink/lib/$n" ] || { echo "FAIL: $f needs $n with no RUNPATH" >&2; exit 1; }
         done ;;
       *) echo "FAIL: $f: RUNPATH '$rp' is not \$ORIGIN-relative" >&2; exit 1 ;;
     esac
   done)
# (libucs names its build's prefix, its last place to look for modules and ucx.conf, after
# <directory of libucs>/ucx; the job under unshare shows which it loads.)
if grep -rlF -e "$src" "$work/unzipped" > "$work/leaks"; then
  cat "$work/leaks" >&2
  fail "files in the wheel name the source tree"
fi

echo "== the wheel, installed into a second fresh venv"
/usr/bin/python3 -m venv --system-site-packages "$work/venv2"
pip_in "$work/venv2" install --no-index --no-deps "$wheel" > "$work/pip-wheel-install.log" 2>&1 ||
  { cat "$work/pip-wheel-install.log"; fail "pip install the wheel"; }
tail -1 "$work/pip-wheel-install.log"
run_hidden "$work/venv2" "the wheel"

[ "$(stat -c %Y "$src/build" 2>/dev/null || echo none)" = "$build_before" ] ||
  fail "the pip build touched CMake's build/"
echo "OK: pip install ., pip wheel . and the wheel elsewhere"
