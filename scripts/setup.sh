#!/usr/bin/env bash
# Installs what gradlink needs on Debian 12, only what is missing. Safe to run again.
set -euo pipefail

packages=(
  build-essential cmake pkg-config clang
  libucx-dev ucx-utils
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  libssl-dev
  iproute2
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "setup: need root to install: apt-get install ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
