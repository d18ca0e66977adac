#!/usr/bin/env bash
# There (the lent GPU machine, from the repository root, with .device/ carried: see
# scripts/device/prepare.sh): builds gradlink for the machine's python3 and torch, then runs
# the CUDA tests (tests/python/test_cuda.py: push_pull of CUDA tensors exact against the host
# path, every dtype; training on the GPU against single-process training), the staging
# pipeline's CPU tests beside them, and bench/cuda_staging.py. Output under $OUT (log.txt).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
set -x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'

# UCX where the build (and its pkg-config file) expects it; the Debian packages' files in a
# prefix of their own (never over /).
ucx="$HOME/.cache/gradlink/ucx-1.13.1-gl1"
mkdir -p "$(dirname "$ucx")"
rm -rf "$ucx" && cp -a .device/ucx "$ucx"
sed -i "s|^prefix *=.*|prefix = $ucx|" "$ucx"/lib/pkgconfig/*.pc
deps=/opt/gl-deps
mkdir -p $deps
for f in .device/debs/*.deb; do dpkg -x "$f" $deps; done
ssl_lib=$(ls /usr/lib/x86_64-linux-gnu/libssl.so.3 /lib/x86_64-linux-gnu/libssl.so.3 2>/dev/null | head -1)
crypto_lib=$(ls /usr/lib/x86_64-linux-gnu/libcrypto.so.3 /lib/x86_64-linux-gnu/libcrypto.so.3 2>/dev/null | head -1)

pkgconf=$(command -v pkg-config || echo $deps/usr/bin/pkgconf)
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

py=$(command -v python3)
cmake -S . -B build-device -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADLINK_UCX_PREFIX="$ucx" -DPYTHON_EXECUTABLE="$py" -DGRADLINK_BUILD_TESTS=OFF \
  -DPKG_CONFIG_EXECUTABLE="$pkgconf" \
  -DCMAKE_PREFIX_PATH="$deps/usr;$deps/usr/lib/x86_64-linux-gnu/cmake;$(python3 -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DOPENSSL_INCLUDE_DIR=$deps/usr/include -DOPENSSL_SSL_LIBRARY="$ssl_lib" \
  -DOPENSSL_CRYPTO_LIBRARY="$crypto_lib" -DGTEST_ROOT=$deps/usr \
  || { echo "DEVICE CHECK: configure failed"; exit 1; }
cmake --build build-device -j"$(nproc)" --target gradlink-scheduler gradlink-server _gradlink \
  _gradlink_c10d gradlink-run || { echo "DEVICE CHECK: build failed"; exit 1; }

export PYTHONPATH="$PWD/python:$PWD/build-device/python${PYTHONPATH:+:$PYTHONPATH}"
export GRADLINK_BUILD_DIR="$PWD/build-device"
python3 -m pytest -v -p no:cacheprovider tests/python/test_cuda.py \
  "tests/python/test_torch.py::test_staging_pipeline_with_the_cpu_copy_engine" 2>&1 \
  | tee "$OUT/pytest.txt"
build-device/bin/gradlink-run -n 2 -s 2 -- python3 bench/cuda_staging.py --sizes 4M,64M,256M,1G \
  2>&1 | tee "$OUT/cuda_staging.txt"
echo "DEVICE CHECK: done"
