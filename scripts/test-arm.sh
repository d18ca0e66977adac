#!/usr/bin/env bash
# Cross-builds the element-wise reducers for aarch64 (their NEON kernels) with their unit test
# and runs it under qemu-user: `make test-arm`. Installs what is missing first (Debian 12, as
# root): the cross compiler, qemu-user and googletest's sources (built for aarch64 here). Not
# part of scripts/setup.sh: `make test` does not need any of it.
#
#   BUILD_ARM   build folder (default build-arm)
#   ARM_BENCH=1 also build reduce_bench and run it once under qemu as a smoke check: installs
#               Debian's libbenchmark-dev:arm64, which adds arm64 to dpkg's architectures.
#               Timings under qemu say nothing about Arm hardware.
#   JOBS        parallel build jobs (default 2)
set -euo pipefail

cd "$(dirname "$0")/.."
unset MAKEFLAGS MFLAGS MAKELEVEL  # run from make: keep the inner build's output plain
BUILD_ARM=${BUILD_ARM:-build-arm}
JOBS=${JOBS:-2}
ARM_BENCH=${ARM_BENCH:-0}
SYSROOT=/usr/aarch64-linux-gnu
BENCH_DIR=/usr/lib/aarch64-linux-gnu/cmake/benchmark

apt_install() {
  if [[ $(id -u) -ne 0 ]]; then
    echo "test-arm: missing $*; install them as root (apt-get install $*)" >&2
    exit 1
  fi
  echo "test-arm: installing $*"
  if [[ -z ${TEST_ARM_APT_UPDATED:-} ]]; then
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    TEST_ARM_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "$@"
}

missing=()
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
[[ -f /usr/src/googletest/CMakeLists.txt ]] || missing+=(googletest)
command -v cmake >/dev/null || missing+=(cmake)
if ((${#missing[@]})); then apt_install "${missing[@]}"; fi

bench_flags=()
if [[ $ARM_BENCH == 1 ]]; then
  if [[ ! -f $BENCH_DIR/benchmarkConfig.cmake ]]; then
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
      [[ $(id -u) -eq 0 ]] || { echo "test-arm: ARM_BENCH=1 needs root (dpkg --add-architecture arm64)" >&2; exit 1; }
      dpkg --add-architecture arm64
      unset TEST_ARM_APT_UPDATED
    fi
    apt_install libbenchmark-dev:arm64
  fi
  bench_flags=(-Dbenchmark_DIR="$BENCH_DIR")
fi

cmake -S . -B "$BUILD_ARM" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DGRADLINK_REDUCE_ONLY=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo "${bench_flags[@]}"
targets=(--target reduce_test)
[[ $ARM_BENCH == 1 ]] && targets+=(--target reduce_bench)
cmake --build "$BUILD_ARM" -j"$JOBS" "${targets[@]}"

# The test binary must be aarch64 code, or this would prove nothing about NEON.
file_out=$(file -b "$BUILD_ARM/bin/reduce_test" 2>/dev/null || true)
if [[ -n $file_out && $file_out != *aarch64* ]]; then
  echo "test-arm: $BUILD_ARM/bin/reduce_test is not an aarch64 binary: $file_out" >&2
  exit 1
fi

# ctest runs each test through CMAKE_CROSSCOMPILING_EMULATOR (qemu-aarch64 -L $SYSROOT).
# (The test names are gtest's: Isa/ReduceTest.*, ReduceConversionTest.*, ReduceDispatchTest.*.)
(cd "$BUILD_ARM" && ctest --output-on-failure --timeout 900 -j"$JOBS" --no-tests=error -R Reduce)

# The dispatch tests print which implementation "auto" picked (it must be NEON) and how many
# vector runs they compared with the scalar kernels.
dispatch=$(qemu-aarch64 -L "$SYSROOT" "$BUILD_ARM/bin/reduce_test" --gtest_filter='ReduceDispatchTest.*')
grep -E '^(reduce ISA in use|compared|NaN)' <<<"$dispatch" || true
if ! grep -q 'reduce ISA in use: Neon' <<<"$dispatch"; then
  echo "test-arm: the aarch64 build did not pick the NEON kernels" >&2
  exit 1
fi

if [[ $ARM_BENCH == 1 ]]; then
  echo "test-arm: reduce_bench under qemu (a smoke check: emulated timings mean nothing)"
  qemu-aarch64 -L "$SYSROOT" "$BUILD_ARM/bin/reduce_bench" --benchmark_min_time=0.01 \
    --benchmark_filter='_Isa/bytes:4194304'
fi
echo "test-arm: OK (NEON reducers match the scalar ones under qemu-aarch64)"
