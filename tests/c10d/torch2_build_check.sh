#!/usr/bin/env bash
# Compiles the torch.distributed backend (python/c10d/) against torch 2.x's headers, as the
# c10d::Backend it is there, with the flags of the real build (-Wall -Wextra -Werror), plus
# tests/c10d/torch2_check.cc's static checks. Exit 77 (ctest: skipped) when the headers are
# not there (scripts/torch2_headers.sh fetches them).
# Usage: torch2_build_check.sh CXX REPO TORCH2_INCLUDE PYTHON_INCLUDE
set -euo pipefail
cxx=$1 repo=$2 torch=$3 python=$4
if [ ! -f "$torch/torch/csrc/distributed/c10d/Backend.hpp" ]; then
  echo "SKIP: no torch 2.x headers in $torch (scripts/torch2_headers.sh fetches them)"
  exit 77
fi
flags=(-std=c++20 -O0 -fPIC -Wall -Wextra -Werror -I "$repo/include" -I "$repo"
       -isystem "$torch" -isystem "$torch/torch/csrc/api/include" -isystem "$python")
for src in python/c10d/process_group.cc python/c10d/p2p.cc python/c10d/collectives.cc \
           python/c10d/sparse.cc python/c10d/tensors.cc \
           python/c10d/module.cc tests/c10d/torch2_check.cc; do
  echo "compiling $src against $torch"
  "$cxx" "${flags[@]}" -c "$repo/$src" -o /dev/null
done
echo "torch 2.x build check passed"
