#!/usr/bin/env bash
# Make Horovod 0.28.1's sdist build with today's compilers and torch; run on the unpacked
# source tree (scripts/bootstrap.sh does, before it builds the wheel). Idempotent.
#
#   bash scripts/horovod_source_fixes.sh SRC_DIR [--cxx17]
#
# 1. --cxx17: torch >= 2.1's headers need C++17, Horovod 0.28.1 asks for C++14. Upstream
#    fixed it on master (horovod/horovod PR #3998, CMAKE_CXX_STANDARD 17), never released.
# 2. GCC 13 and newer (Ubuntu 24.04, Debian 13, Fedora 40+) no longer pull <string>,
#    <stdexcept> and <cstdint> in through other standard headers, and two Horovod headers
#    rely on that: group_table.h uses std::string and int32_t, common.h std::logic_error
#    (the GPU builds). Both get the includes they use, at the top of the file (the standard
#    headers are guarded, so older compilers see no change).
set -euo pipefail
src=${1:?usage: horovod_source_fixes.sh SRC_DIR [--cxx17]}
if [[ "${2:-}" == --cxx17 ]]; then
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
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
