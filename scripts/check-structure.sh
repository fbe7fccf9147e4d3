#!/usr/bin/env bash
# The house's structure, checked (docs/design.md "Layers"): every #include in src/ and
# include/tessera/ points down the layer order or within its layer; public headers include no
# internal ones; no function in src/ or the launcher is longer than MAX_FUNCTION_LINES. Prints the layer graph
# with -v. Exit 1 on a violation. Run by CTest (structure.layers) and so by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_FUNCTION_LINES=${MAX_FUNCTION_LINES:-100}
verbose=${1:-}

# Bottom to top. A layer may include its own and lower layers only.
declare -A rank=(
  [compat]=0 [compat_autograd]=0 [compat_c10d]=0
  [comm]=1
  [runtime]=2
  [mesh]=3
  [placement]=4
  [redistribute]=5
  [tensor]=6
  [ops]=7
  [parallel]=8 [checkpoint]=8
  [nn]=9 [tools]=9 [testing]=9
  [tessera]=10
)

layer_of_path() {  # src/<layer>/... | include/tessera/<layer>/... | include/tessera/<name>.h
  local p=$1
  case $p in
    src/*) p=${p#src/}; echo "${p%%/*}" ;;
    include/tessera/*/*) p=${p#include/tessera/}; echo "${p%%/*}" ;;
    include/tessera/*) p=${p#include/tessera/}; echo "${p%.h}" ;;
  esac
}

status=0
declare -A edges=()
while IFS= read -r file; do
  from=$(layer_of_path "$file")
  [ -n "${rank[$from]+x}" ] || { echo "structure: $file: unknown layer '$from' (add it to scripts/check-structure.sh and docs/design.md)"; status=1; continue; }
  while IFS= read -r inc; do
    case $inc in
      tessera/*) to=$(layer_of_path "include/$inc") ;;
      *)
        if [[ $file == include/* ]]; then
          echo "structure: public header $file includes \"$inc\", which is not public"
          status=1
          continue
        fi
        resolved=$(realpath -m --relative-to=. "$(dirname "$file")/$inc")
        [ -e "$resolved" ] || resolved=$(realpath -m --relative-to=. "src/$inc")
        [ -e "$resolved" ] || continue
        to=$(layer_of_path "$resolved")
        ;;
    esac
    [ -n "$to" ] && [ "$to" != "$from" ] || continue
    edges["$from -> $to"]=1
    if [ "${rank[$to]:-99}" -gt "${rank[$from]}" ]; then
      echo "structure: back-edge $from -> $to: $file includes \"$inc\""
      status=1
    fi
  done < <(sed -n 's/^[[:space:]]*#include[[:space:]]*"\([^"]*\)".*/\1/p' "$file")
done < <(find src include/tessera -name '*.h' -o -name '*.cpp' | sort)

# Function length: from the first line of a definition at column 0 to its closing brace.
long=$(find src $(ls -d launcher tools 2>/dev/null) -name '*.cpp' | sort | xargs awk -v max="$MAX_FUNCTION_LINES" '
  FNR == 1 { start = 0; cand = 0 }
  /^(namespace|using|struct|class|enum|template|typedef|static_assert|extern|#|\/\/|}|TORCH_|TEST)/ { cand = 0; if ($0 !~ /^}/) next }
  /^}/ { if (start) { n = FNR - start + 1; if (n > max) printf "%s:%d: %d lines: %s\n", FILENAME, start, n, name }
         start = 0; cand = 0; next }
  !start && /^[A-Za-z_]/ { cand = FNR; name = $0 }
  !start && cand && /;[[:space:]]*$/ { cand = 0 }
  !start && cand && /[{][[:space:]]*$/ { start = cand; cand = 0 }
')
if [ -n "$long" ]; then
  echo "structure: functions over $MAX_FUNCTION_LINES lines (split them into named steps):"
  echo "$long"
  status=1
fi

if [ "$verbose" = -v ]; then
  for e in "${!edges[@]}"; do echo "$e"; done | sort
fi
[ $status -eq 0 ] && echo "structure: layers clean, no function over $MAX_FUNCTION_LINES lines"
exit $status
