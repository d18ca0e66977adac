#!/usr/bin/env bash
# Runs gradlink's torch.distributed backend on torch 2.x: Debian 13 (trixie) in a chroot, whose
# python3-torch is 2.6 (Debian 12's is 1.13; trixie's libraries need trixie's glibc, so they run
# only there). As root:
#
#   scripts/torch2_chroot.sh            # setup + build + test (each step does nothing it need not)
#   scripts/torch2_chroot.sh setup      # the chroot and its packages (debootstrap, apt-get)
#   scripts/torch2_chroot.sh build      # gradlink in <repo>/build-torch2, from inside the chroot
#   scripts/torch2_chroot.sh test [PYTEST ARGS]  # tests/python/test_c10d.py there (ARGS: pytest's
#                                                # options; a test path given replaces the file)
#   scripts/torch2_chroot.sh shell [CMD]         # a shell (or CMD) in the chroot, mounts up
#   scripts/torch2_chroot.sh umount     # unmounts what a killed run left mounted
#
# What it does:
#   - debootstrap trixie (minbase) into GRADLINK_TRIXIE_ROOT (/var/cache/gradlink/trixie), from
#     GRADLINK_TRIXIE_MIRROR (http://deb.debian.org/debian); downloaded .debs are kept in
#     GRADLINK_TRIXIE_ROOT/var/cache/apt/archives (and the debootstrap cache beside the root).
#   - apt-get installs what gradlink's build and the c10d tests need (only what is missing).
#   - UCX: gradlink's own (scripts/ucx/build.sh: Debian 12's 1.13.1 with its wireup fixes),
#     built on the host (GRADLINK_UCX_PREFIX, default ~/.cache/gradlink/ucx-1.13.1-gl1, stamped
#     .gradlink-ucx) and bind-mounted read-only at the same path: built against Debian 12's
#     glibc, it runs on trixie's newer one. Without it, trixie's libucx-dev (1.18; CMake warns
#     that it lacks the wireup fixes). UCX 1.13.1 does not build with trixie's GCC 14
#     (-Werror=enum-int-mismatch in uct_md.c), so it is not built in the chroot.
#     GRADLINK_TRIXIE_UCX=host|system forces one.
#   - Mounts /proc, /sys, /dev, /dev/pts, a /dev/shm of its own, and the repository at
#     /src/gradlink for the time it runs; a trap unmounts them all on exit (`umount` unmounts
#     what an interrupted run may have left).
#   - build: cmake -DCMAKE_BUILD_TYPE=RelWithDebInfo in /src/gradlink/build-torch2 (ignored by
#     .gitignore's build*/; GRADLINK_TRIXIE_CMAKE_FLAGS adds flags), only the targets the c10d
#     tests use (the Python modules, the backend, scheduler and server), -j$JOBS (2).
#   - test: python3 -m pytest -q -p no:cacheprovider tests/python/test_c10d.py with
#     GRADLINK_BUILD_DIR=/src/gradlink/build-torch2, after printing torch's and Python's versions.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
root=${GRADLINK_TRIXIE_ROOT:-/var/cache/gradlink/trixie}
root=${root%/}
mirror=${GRADLINK_TRIXIE_MIRROR:-http://deb.debian.org/debian}
jobs=${JOBS:-2}
ucx_prefix=${GRADLINK_UCX_PREFIX:-${HOME:-/root}/.cache/gradlink/ucx-1.13.1-gl1}
ucx_mode=${GRADLINK_TRIXIE_UCX:-auto}
build_rel=build-torch2
inside=/src/gradlink

# What the build and the c10d tests need (scripts/setup.sh's list for Debian 12, less UCX's
# build tools and the benchmarks' baselines). libucx-dev: the fallback UCX, and libnuma1, which
# gradlink's UCX links.
packages=(
  build-essential cmake pkg-config ca-certificates
  libssl-dev libcli11-dev libgtest-dev libgmock-dev
  libucx-dev libnuma1
  python3 python3-dev python3-pybind11 pybind11-dev python3-torch libtorch-dev
  python3-pytest python3-numpy
  procps iproute2
)

say() { echo "torch2_chroot: $*"; }
die() { echo "torch2_chroot: error: $*" >&2; exit 1; }

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap, chroot and mounts need it)"
case "$root" in
  /|/usr|/var|/var/cache|"") die "GRADLINK_TRIXIE_ROOT=$root: choose a directory of its own" ;;
esac

# --- mounts ---------------------------------------------------------------------------------

mounted=()  # what this run mounted, in order; unmounted in reverse by the trap
mount_one() {  # mount_one TARGET MOUNT-ARGS...
  local target=$1; shift
  mkdir -p "$target"
  if mountpoint -q "$target"; then return 0; fi  # another run of this script holds it
  mount "$@" "$target"
  mounted+=("$target")
}
unmount_all() {
  local i t
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    t=${mounted[i]}
    umount "$t" 2>/dev/null || umount -l "$t" 2>/dev/null ||
      echo "torch2_chroot: warning: could not unmount $t" >&2
  done
  mounted=()
}
# Everything mounted under the root (deepest first), this run's or an earlier one's.
leftover_mounts() {
  awk -v r="$root/" 'index($5 "/", r) == 1 { print $5 }' /proc/self/mountinfo | sort -r
}
unmount_leftovers() {
  local t
  for t in $(leftover_mounts); do
    umount "$t" 2>/dev/null || umount -l "$t"
    say "unmounted $t"
  done
}

lock_fd=
take_lock() {  # one run at a time per root: they share mounts and the build directory
  mkdir -p "$(dirname "$root")"
  exec {lock_fd}> "$root.lock"
  if ! flock -n "$lock_fd"; then
    say "waiting for another run on $root to finish"
    flock "$lock_fd"
  fi
}

mount_all() {
  mount_one "$root/proc" -t proc proc
  mount_one "$root/sys" --bind /sys
  mount_one "$root/dev" --bind /dev
  mount_one "$root/dev/pts" --bind /dev/pts
  # A /dev/shm of its own (UCX's and the same-host path's segments), not the host's.
  mount_one "$root/dev/shm" -t tmpfs -o mode=1777,nosuid,nodev shm
  mount_one "$root$inside" --bind "$repo"
  if [ "$ucx_source" = host ]; then
    mount_one "$root$ucx_prefix" --bind -o ro "$ucx_prefix"
  fi
  # Name resolution for apt, and this host's name for torchrun/gradlink.
  cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  cp -L /etc/hosts "$root/etc/hosts" 2>/dev/null || true
}

# Runs a command in the chroot with a clean environment (no host PATH, venv or GRADLINK_*).
in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive "$@"
}

# --- setup ----------------------------------------------------------------------------------

ensure_debootstrap() {
  if command -v debootstrap > /dev/null && [ -f /usr/share/debootstrap/scripts/trixie ]; then
    return 0
  fi
  say "installing debootstrap on the host (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=900 update -qq
  apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends debootstrap
  [ -f /usr/share/debootstrap/scripts/trixie ] ||
    die "this debootstrap does not know trixie (/usr/share/debootstrap/scripts/trixie)"
}

bootstrap() {
  if [ -f "$root/.gradlink-debootstrap" ]; then return 0; fi
  ensure_debootstrap
  if [ -e "$root" ]; then
    # An interrupted debootstrap: start again, but never through a mount (the repository!).
    if [ -n "$(leftover_mounts)" ]; then
      die "$root has mounts under it ($(leftover_mounts | tr '\n' ' ')); run '$0 umount' first"
    fi
    say "removing the unfinished chroot in $root"
    rm -rf --one-file-system "$root"
  fi
  local cache="$root.debs"
  mkdir -p "$cache"
  say "debootstrap trixie (minbase) into $root from $mirror (a few minutes; .debs cached in $cache)"
  local t0=$SECONDS
  debootstrap --variant=minbase --cache-dir="$cache" trixie "$root" "$mirror"
  date -u +%FT%TZ > "$root/.gradlink-debootstrap"
  say "debootstrap done in $((SECONDS - t0)) s"
}

install_packages() {
  local want stamp missing=() p
  want=$(printf '%s\n' "${packages[@]}" | sort | sha256sum | cut -d' ' -f1)
  stamp="$root/.gradlink-packages"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  for p in "${packages[@]}"; do
    if ! in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "apt-get install in the chroot: ${missing[*]} (python3-torch and libtorch-dev are large)"
    local t0=$SECONDS
    echo "deb $mirror trixie main" > "$root/etc/apt/sources.list"
    in_root apt-get update -qq
    in_root apt-get install -y -qq --no-install-recommends "${missing[@]}"
    say "apt-get done in $((SECONDS - t0)) s"
  fi
  echo "$want" > "$stamp"
}

# Which UCX the build links: sets ucx_source to host or system.
ucx_source=
choose_ucx() {
  local have_host=no
  if [ -f "$ucx_prefix/.gradlink-ucx" ] && [ -f "$ucx_prefix/lib/pkgconfig/ucx.pc" ]; then
    have_host=yes
  fi
  case "$ucx_mode" in
    host)
      [ $have_host = yes ] ||
        die "GRADLINK_TRIXIE_UCX=host, but $ucx_prefix holds no gradlink UCX (run scripts/ucx/build.sh on the host)"
      ucx_source=host ;;
    system) ucx_source=system ;;
    auto)
      if [ $have_host = yes ]; then
        ucx_source=host
      else
        echo "torch2_chroot: warning: no gradlink UCX in $ucx_prefix (scripts/ucx/build.sh on the host builds it): using trixie's libucx-dev, which lacks gradlink's wireup fixes" >&2
        ucx_source=system
      fi ;;
    *) die "GRADLINK_TRIXIE_UCX=$ucx_mode: host, system or auto" ;;
  esac
}

# --- build and test -------------------------------------------------------------------------

build() {
  local ucx_arg=("-DGRADLINK_UCX_PREFIX=$ucx_prefix")
  if [ "$ucx_source" = system ]; then ucx_arg=("-DGRADLINK_UCX_PREFIX=/nonexistent"); fi
  local t0=$SECONDS
  say "configuring gradlink in $inside/$build_rel (UCX: $ucx_source)"
  in_root cmake -S "$inside" -B "$inside/$build_rel" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -Wno-dev -DPYTHON_EXECUTABLE=/usr/bin/python3 "${ucx_arg[@]}" ${GRADLINK_TRIXIE_CMAKE_FLAGS:-} > "$root/tmp/gradlink-cmake.log" ||
    { cat "$root/tmp/gradlink-cmake.log"; die "cmake failed"; }
  grep -E "gradlink: (torch|UCX)|system's UCX" "$root/tmp/gradlink-cmake.log" || true
  if ! grep -q "torch.distributed backend built against torch 2" "$root/tmp/gradlink-cmake.log"; then
    die "cmake did not configure the torch 2.x backend (_gradlink_c10d); see above"
  fi
  say "building _gradlink _gradlink_c10d gradlink-scheduler gradlink-server gradlink-run (-j$jobs)"
  in_root cmake --build "$inside/$build_rel" -j"$jobs" --target _gradlink _gradlink_c10d \
    gradlink-scheduler gradlink-server gradlink-run
  say "build done in $((SECONDS - t0)) s"
}

run_tests() {
  if ! ls "$root$inside/$build_rel"/python/gradlink/_gradlink_c10d*.so > /dev/null 2>&1; then
    die "no torch 2.x build in $repo/$build_rel: run '$0 build' (or '$0', which builds and tests)"
  fi
  # Options alone (-v, -k EXPR, ...) apply to tests/python/test_c10d.py; naming a test file or
  # node (tests/..., *.py, ...::name) replaces it.
  local args=("$@") a named=no
  for a in "$@"; do
    case "$a" in tests/*|*.py|*::*) named=yes ;; esac
  done
  if [ $named = no ]; then args=(tests/python/test_c10d.py "$@"); fi
  in_root /usr/bin/python3 -c 'import sys, torch; print("torch2_chroot: torch %s, Python %s (%s)" % (torch.__version__, sys.version.split()[0], open("/etc/debian_version").read().strip()))'
  local t0=$SECONDS rc=0
  in_root /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$inside" \
    /usr/bin/env GRADLINK_BUILD_DIR="$inside/$build_rel" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider "${args[@]}" || rc=$?
  say "tests ended (exit $rc) in $((SECONDS - t0)) s"
  return $rc
}

# --- main -----------------------------------------------------------------------------------

cmd=${1:-all}
[ $# -gt 0 ] && shift
case "$cmd" in
  -h|--help|help) usage 0 ;;
  umount|unmount)
    take_lock
    unmount_leftovers
    exit 0 ;;
  all|setup|build|test|shell) ;;
  *) echo "torch2_chroot: unknown command '$cmd'" >&2; usage 2 ;;
esac

take_lock
trap unmount_all EXIT
trap 'exit 130' INT TERM
[ -n "$(leftover_mounts)" ] && unmount_leftovers  # an earlier run killed before its trap ran
bootstrap
choose_ucx
mount_all
install_packages
case "$cmd" in
  setup) say "chroot ready in $root" ;;
  build) build ;;
  test) run_tests "$@" ;;
  shell)
    if [ $# -eq 0 ]; then set -- /bin/bash; fi
    in_root /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$inside" \
      /usr/bin/env GRADLINK_BUILD_DIR="$inside/$build_rel" "$@" ;;
  all)
    build
    run_tests "$@" ;;
esac
