#!/usr/bin/env bash
# Installs what gradlink needs on Debian 12 (only what is missing) and makes .venv, whose
# python sees Debian's torch and the gradlink package. Safe to run again.
set -euo pipefail

packages=(
  build-essential cmake pkg-config clang
  libucx-dev ucx-utils
  # scripts/ucx/build.sh: Debian's UCX source with gradlink's wireup fixes.
  autoconf automake libtool curl
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  libssl-dev
  iproute2
  # The Python layer: Debian's torch/pybind11/pytest belong to /usr/bin/python3 (no PyPI).
  python3-dev python3-pybind11 pybind11-dev python3-torch libtorch-dev python3-pytest python3-venv
  # pip install . / pip wheel . (pyproject.toml, setup.py: setuptools builds through CMake);
  # binutils' nm, c++filt and readelf for tests/install; util-linux's unshare.
  python3-pip python3-setuptools python3-wheel binutils util-linux
  # make test-install's pip build reuses build/'s objects through it.
  ccache
  # The BLAS Debian's torch recommends (--no-install-recommends skips it): without it torch runs
  # the reference BLAS, 3.4x slower in bench/train_cluster's dense layers (a 4096 x 4096
  # matrix times 2 rows: 21 ms against 6.1 ms) and 19x in a 512 x 512 product. The OpenMP
  # build follows torch.set_num_threads, as torch's own kernels do.
  libopenblas0-openmp
  # bench/compare's baselines (Open MPI's MPI_Allreduce, Gloo via torch) and its plot.
  openmpi-bin libopenmpi-dev python3-mpi4py python3-matplotlib
  # Prometheus' promtool lints the metrics text (tests/unit/metrics); its server scrapes a job.
  prometheus
  # gradlink-top's interactive test drives it in a terminal (tests/integration, metrics).
  tmux
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need root to install: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The UCX gradlink links (cached in GRADLINK_UCX_PREFIX; built once, about 3 minutes).
scripts_dir="$(cd "$(dirname "$0")" && pwd)"
"$scripts_dir/ucx/build.sh"
# torch 2.x's headers, for make test's build check of the backend's torch 2.x variant.
"$scripts_dir/torch2_headers.sh"

# The project's virtual environment: Debian's interpreter, seeing Debian's packages.
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv (/usr/bin/python3, --system-site-packages)"
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/python" > "$site/gradlink.pth"
