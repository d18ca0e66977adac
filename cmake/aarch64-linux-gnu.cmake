# Cross-compiling for aarch64 Linux with Debian's cross toolchain (g++-aarch64-linux-gnu), the
# target's libraries from /usr/aarch64-linux-gnu (libc6-dev-arm64-cross). ctest runs the target's
# binaries (and gtest_discover_tests lists their tests) through qemu-user.
# Used by `make test-arm` (scripts/test-arm.sh) with -DGRADLINK_REDUCE_ONLY=ON.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Look for the target's headers, libraries and packages under the cross sysroot only, never the
# host's. (A package from elsewhere, such as Debian's multiarch libbenchmark-dev:arm64, can be
# named explicitly: -Dbenchmark_DIR=/usr/lib/aarch64-linux-gnu/cmake/benchmark.)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/usr/aarch64-linux-gnu)
