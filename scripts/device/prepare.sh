#!/usr/bin/env bash
# Here (Debian 12): gathers into .device/ what the lent GPU machine lacks to build gradlink
# (it has torch 2.x with CUDA, Python 3.12, CMake, pybind11 and pytest, and no package
# registry): the UCX gradlink links (scripts/ucx/build.sh's prefix) and Debian's packages of
# OpenSSL's headers, CLI11, googletest and pkg-config, unpacked there by scripts/device/cuda_check.sh.
# Then: the device tool's run with carry [".device"] and the command
#   bash scripts/device/cuda_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
rm -rf .device
mkdir -p .device/debs
ucx="${GRADLINK_UCX_PREFIX:-$HOME/.cache/gradlink/ucx-1.13.1-gl1}"
[ -f "$ucx/.gradlink-ucx" ] || scripts/ucx/build.sh
cp -a "$ucx" .device/ucx
(cd .device/debs && apt-get download libssl-dev libcli11-dev libgtest-dev libgmock-dev googletest \
  pkgconf-bin libpkgconf3)
du -sh .device
