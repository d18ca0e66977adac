#!/usr/bin/env bash
# torch 2.x's C++ headers (Debian 13's libtorch-dev, from Debian's registry), unpacked into a
# cache: the torch.distributed backend (python/c10d/) is built against Debian 12's torch 1.13
# as a c10d::ProcessGroup, and make test also compiles it as torch 2.x's c10d::Backend against
# these headers (tests/c10d/torch2_build_check.sh), so that the 2.x variant cannot rot on a
# machine without torch 2.x. Nothing links or runs them here (their libraries need Debian 13's
# glibc). Safe to run again; without the network it warns and the check skips.
set -euo pipefail

version=2.6.0+dfsg-7
sha256=d63886ac7482184e96d38cbbbb346430f1cc3a68b59319eb2ca1ababd501535b
deb="libtorch-dev_${version}_amd64.deb"
url="http://deb.debian.org/debian/pool/main/p/pytorch/$deb"
prefix="${GRADLINK_TORCH2_PREFIX:-$HOME/.cache/gradlink/libtorch-dev-${version%%+*}}"

if [ -f "$prefix/.complete" ]; then exit 0; fi
if [ "$(dpkg --print-architecture 2>/dev/null)" != amd64 ]; then
  echo "torch2_headers: not amd64: the torch 2.x build check will skip" >&2
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "torch2_headers: fetching $deb (Debian 13) into $prefix"
if ! curl -fsSL --max-time 300 -o "$tmp/$deb" "$url"; then
  echo "torch2_headers: could not fetch $url: the torch 2.x build check will skip" >&2
  exit 0
fi
if ! echo "$sha256  $tmp/$deb" | sha256sum -c --quiet -; then
  echo "torch2_headers: $deb does not have the SHA-256 Debian 13 lists ($sha256)" >&2
  exit 1
fi
rm -rf "$prefix"
mkdir -p "$prefix"
dpkg -x "$tmp/$deb" "$prefix"
touch "$prefix/.complete"
