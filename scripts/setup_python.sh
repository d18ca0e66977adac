#!/usr/bin/env bash
# Sets up gradlink's Python layer on Debian 12: installs the Debian packages it needs (only the
# missing ones; no PyPI) and creates .venv from /usr/bin/python3 with --system-site-packages, so
# the venv sees the Debian torch/pybind11/pytest, plus a gradlink.pth putting <repo>/python on
# its path. Safe to run again.
#
#   scripts/setup_python.sh && .venv/bin/python -c "import gradlink.torch"
#
# The packages belong to /usr/bin/python3 (a `python3` earlier on PATH, e.g. pyenv's, does not
# see them): use /usr/bin/python3 or .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(python3-dev python3-pybind11 pybind11-dev python3-torch python3-pytest python3-venv)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup_python: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup_python: need root to install: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup_python: creating .venv (/usr/bin/python3, --system-site-packages)"
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/python" > "$site/gradlink.pth"
