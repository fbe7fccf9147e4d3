#!/usr/bin/env bash
# Instructions per op, plain ATen vs distributed, counted by callgrind: repeatable on a
# shared, noisy machine where times are not. Needs valgrind and a built bench_dispatch.
#   bash bench/count_instructions.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build}/bench/bench_dispatch
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)"; exit 2; }
count() {  # case iterations -> instructions per iteration
  local out
  out=$(valgrind --tool=callgrind --callgrind-out-file=/dev/null --toggle-collect='*measured_loop*' \
        "$BIN" --count "$1" "$2" 2>&1 | sed -n 's/.*Collected : *\([0-9]*\).*/\1/p')
  echo $((out / $2))
}
printf '| op | plain Ir | distributed Ir | ratio |\n|---|---:|---:|---:|\n'
for op in add mul_scalar sum mm view detach add_ adam_step_50; do
  n=2000
  [ "$op" = adam_step_50 ] && n=20
  p=$(count "plain_$op" $n)
  d=$(count "dtensor_$op" $n)
  printf '| %s | %s | %s | %s |\n' "$op" "$p" "$d" "$(awk -v a="$d" -v b="$p" 'BEGIN{printf "%.2fx", a/b}')"
done
