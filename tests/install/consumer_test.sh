#!/usr/bin/env bash
# cmake --install into a fresh prefix, then what a C++ user does with it: find_package(gradlink)
# from a project outside the source tree (tests/install/consumer/, copied out) and a job run
# with the program it builds; the installed binaries run a job too.
#
# Usage: consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
work=$(mktemp -d /tmp/gradlink-install-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

echo "== cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" > "$work/install.log"
fail() { echo "FAIL: $*" >&2; exit 1; }
for f in include/gradlink/worker.h include/gradlink/server.h include/gradlink/export.h \
         lib/cmake/gradlink/gradlinkConfig.cmake lib/cmake/gradlink/gradlinkConfigVersion.cmake \
         lib/cmake/gradlink/gradlinkTargets.cmake bin/gradlink-scheduler bin/gradlink-server \
         bin/gradlink-bench bin/gradlink-run; do
  [ -e "$prefix/$f" ] || fail "not installed: $f"
done
lib=$(readlink -f "$prefix/lib/libgradlink.so")
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ -n "$soname" ] && [ -e "$prefix/lib/$soname" ] || fail "libgradlink: no SONAME link ($soname)"
echo "libgradlink: $(basename "$lib"), SONAME $soname, RUNPATH" \
     "$(readelf -d "$lib" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')"
# Nothing installed may point into the source tree or the build tree (the debug information
# of an unstripped installation names the sources: stripped copies are checked).
find "$prefix" -type f | while read -r f; do
  if head -c 4 "$f" | grep -q ELF; then strip -o "$work/stripped" "$f"; else cp "$f" "$work/stripped"; fi
  if grep -qF -e "$build" -e "$src" "$work/stripped"; then echo "FAIL: $f names the build or source tree" >&2; exit 1; fi
done

echo "== the consumer: find_package(gradlink) + gradlink::gradlink, outside the tree"
cp -r "$src/tests/install/consumer" "$work/consumer"
cmake -S "$work/consumer" -B "$work/consumer-build" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer-build" -j2 > "$work/build.log" || { cat "$work/build.log"; exit 1; }
readelf -d "$work/consumer-build/app" | grep -q "NEEDED.*\[$soname\]" ||
  fail "app does not link $soname"
cd "$work"  # neither tree
timeout 120 "$work/consumer-build/app"

echo "== the installed binaries: gradlink-bench's local job (its scheduler, gradlink-server x1, 2 workers)"
timeout 120 "$prefix/bin/gradlink-bench" -w 2 -s 1 -b 64K -e 64K -n 2 > "$work/bench.log" 2>&1 ||
  { cat "$work/bench.log"; fail "gradlink-bench from the prefix"; }
tail -3 "$work/bench.log"
echo "OK"
