#!/usr/bin/env bash
# Size figures of the code base, for design reviews: lines of library code, the largest
# functions, and how many preprocessed lines the umbrella header, one header on the rule
# path and one rule file cost a translation unit. Needs the Debian LibTorch headers.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(-std=gnu++17 -Iinclude -Isrc -isystem /usr/include/torch/csrc/api/include
       -DUSE_C10D_GLOO -DUSE_DISTRIBUTED -DUSE_RPC -DUSE_TENSORPIPE -D_GLIBCXX_USE_CXX11_ABI=1)
pp_lines() { echo "#include \"$1\"" | c++ "${flags[@]}" -x c++ -E -P - 2>/dev/null | wc -l; }
echo "library lines (src + include): $(cat $(find src include -name '*.cpp' -o -name '*.h') | wc -l)"
echo "largest functions in src/:"
MAX_FUNCTION_LINES=0 bash scripts/check-structure.sh 2>/dev/null | grep -E '^src/.*: [0-9]+ lines' |
  sort -t: -k3 -rn | awk -F': ' '{print $2" "$1}' | sort -rn | head -5 | sed 's/^/  /'  || true
echo "preprocessed lines:"
echo "  tessera/tessera.h: $(pp_lines tessera/tessera.h)"
echo "  tessera/placement/spec.h: $(pp_lines tessera/placement/spec.h)"
echo "  src/ops/pointwise.cpp: $(c++ "${flags[@]}" -E -P src/ops/pointwise.cpp 2>/dev/null | wc -l)"
