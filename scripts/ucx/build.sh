#!/usr/bin/env bash
# Builds the UCX gradlink links: Debian 12's UCX 1.13.1 (its source package, with Debian's own
# patches and configure flags) plus the two fixes in this directory, which keep a process
# alive when a peer dies while its connection is being set up (docs/operations.md, "UCX"):
#   wireup-msg-purge-assertion.patch  backport of UCX 1.14's fix for openucx/ucx#8175
#   tcp-ep-failed-before-tx.patch     a TCP endpoint that fails before it has TX capability
# Installs into PREFIX (default: ~/.cache/gradlink/ucx-1.13.1-gl1) and does nothing when
# PREFIX already holds this build (its stamp names the sources, patches and flags). About
# 3 minutes on 2 cores. Needs build-essential, autoconf, automake, libtool, curl or wget.
#
# Usage: scripts/ucx/build.sh [PREFIX]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
prefix=${1:-${GRADLINK_UCX_PREFIX:-$HOME/.cache/gradlink/ucx-1.13.1-gl1}}
pool=http://deb.debian.org/debian/pool/main/u/ucx
orig=ucx_1.13.1.orig.tar.xz
orig_sha=1a88e09ca1b406c046a469c2ae271d2c330050b5664c0bcd9890e26c6ef09f3c
deb=ucx_1.13.1-1.debian.tar.xz
deb_sha=e0a407539b44d3aa81e3f11fc43a3ad512550944a59227e2105317446fd2e0ff
ours=(wireup-msg-purge-assertion.patch tcp-ep-failed-before-tx.patch)
# Debian's flags (debian/rules) for what this machine has: no verbs, rdmacm, CUDA, Java.
flags=(--enable-mt --disable-backtrace-detail --disable-logging --enable-cma
       --without-verbs --without-rdmacm --without-cuda --without-rocm --without-knem
       --without-xpmem --without-ugni --without-java --without-go --disable-doxygen-doc
       --disable-examples)

stamp=$( { echo "$orig_sha $deb_sha ${flags[*]}"; for p in "${ours[@]}"; do cat "$here/$p"; done; } |
         sha256sum | cut -d' ' -f1)
if [ -f "$prefix/.gradlink-ucx" ] && [ "$(cat "$prefix/.gradlink-ucx")" = "$stamp" ] &&
   [ -f "$prefix/lib/pkgconfig/ucx.pc" ]; then
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fetch() {
  if command -v curl > /dev/null; then curl -fsSL -o "$work/$1" "$pool/$1"
  else wget -q -O "$work/$1" "$pool/$1"; fi
}
echo "ucx: building Debian's UCX 1.13.1 with gradlink's fixes into $prefix (about 3 minutes)"
fetch "$orig"
fetch "$deb"
echo "$orig_sha  $work/$orig" | sha256sum -c --quiet
echo "$deb_sha  $work/$deb" | sha256sum -c --quiet
tar -C "$work" -xf "$work/$orig"
src="$work/ucx-1.13.1"
tar -C "$src" -xf "$work/$deb"
while read -r p; do
  case "$p" in ''|'#'*) continue ;; esac
  patch -d "$src" -p1 -s < "$src/debian/patches/$p"
done < "$src/debian/patches/series"
for p in "${ours[@]}"; do patch -d "$src" -p1 -s < "$here/$p"; done
log="$work/build.log"
if ! ( cd "$src" && ./autogen.sh && ./configure --prefix="$prefix" "${flags[@]}" &&
       make -j"$(nproc)" && rm -rf "$prefix" && make install ) > "$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "ucx: the build failed (the lines above end its log)" >&2
  exit 1
fi
echo "$stamp" > "$prefix/.gradlink-ucx"
echo "ucx: installed in $prefix"
