#!/usr/bin/env bash
# README's first program (examples/quickstart.cpp) on 4 ranks: every rank prints
# "mean(x*x) = A (one device: B)"; fails unless all 4 print it and A equals B on each (to
# the 6 significant digits std::cout prints).
#   quickstart_matches.sh TESSERA_RUN QUICKSTART
set -uo pipefail
out=$("$1" -n 4 --timeout 240 "$2" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" -ne 0 ]; then
  echo "quickstart failed (exit $rc)" >&2
  exit 1
fi
printf '%s\n' "$out" | awk '
  /mean\(x\*x\) = .*\(one device: / {
    line = $0
    sub(/.*mean\(x\*x\) = /, "", line); got = line + 0
    sub(/.*\(one device: /, "", line); sub(/\).*/, "", line); want = line + 0
    d = got - want; if (d < 0) d = -d
    scale = want < 0 ? -want : want; if (scale < 1) scale = 1
    if (d > 1e-5 * scale) { print "mismatch: " $0 > "/dev/stderr"; bad = 1 }
    ++n
  }
  END {
    if (n != 4) { print "expected 4 result lines, got " n > "/dev/stderr"; exit 1 }
    if (bad) exit 1
    print "quickstart: 4 ranks match one device"
  }'
