#!/usr/bin/env bash
# Make Horovod 0.28.1's sdist build with today's compilers and torch; run on the unpacked
# source tree (scripts/bootstrap.sh does, before it builds the wheel). Idempotent.
#
#   bash scripts/horovod_source_fixes.sh SRC_DIR [--cxx-standard 17|20]
#
# 1. --cxx-standard N: Horovod 0.28.1 asks for C++14; torch 2.1 to 2.13's headers need
#    C++17, torch 2.14's C++20 (scripts/torch_cxx_standard.py says which). Upstream fixed
#    the first on master (horovod/horovod PR #3998, CMAKE_CXX_STANDARD 17), never released.
#    The torch extension (horovod/torch/CMakeLists.txt: torch's headers, and Horovod's common
#    sources, which it compiles too) gets N; the top level, whose standard third_party/gloo
#    inherits, gets 17 at most, as upstream's fix has it. Without the option nothing changes.
# 2. GCC 13 and newer (Ubuntu 24.04, Debian 13, Fedora 40+) no longer pull <string>,
#    <stdexcept> and <cstdint> in through other standard headers, and two Horovod headers
#    rely on that: group_table.h uses std::string and int32_t, common.h std::logic_error
#    (the GPU builds). Both get the includes they use, at the top of the file (the standard
#    headers are guarded, so older compilers see no change).
set -euo pipefail
usage='usage: horovod_source_fixes.sh SRC_DIR [--cxx-standard 17|20]'
src=${1:?$usage}
std=""
if (($# > 1)); then
  [[ "$2" == --cxx-standard && "${3:-}" =~ ^(17|20)$ ]] || { echo "$usage" >&2; exit 2; }
  std=$3
fi
set_standard() {  # FILE N: every `set(CMAKE_CXX_STANDARD ..)` line of FILE asks for N
  sed -i -E "s/^([[:space:]]*)set\(CMAKE_CXX_STANDARD [0-9]+\)[[:space:]]*$/\1set(CMAKE_CXX_STANDARD $2)/" "$1"
  grep -qE "^[[:space:]]*set\(CMAKE_CXX_STANDARD $2\)" "$1" || {
    echo "horovod_source_fixes: no set(CMAKE_CXX_STANDARD ..) line in $1" >&2; exit 1; }
}
if [[ -n "$std" ]]; then
  set_standard "$src/CMakeLists.txt" 17
  set_standard "$src/horovod/torch/CMakeLists.txt" "$std"
fi
marker='// horovod-powersgd: includes GCC 13 no longer pulls in'
for header in horovod/common/group_table.h horovod/common/common.h; do
  file="$src/$header"
  [[ -f "$file" ]] || { echo "horovod_source_fixes: no $header in $src" >&2; exit 1; }
  grep -qF "$marker" "$file" && continue
  { printf '%s\n#include <cstdint>\n#include <stdexcept>\n#include <string>\n' "$marker"
    cat "$file"; } > "$file.fixed"
  mv "$file.fixed" "$file"
done
