#!/usr/bin/env bash
# A rank prints two lines without flushing and aborts: tessera-run's output must hold both.
set -u
launcher=$1
prog=$2
out=$("$launcher" -n 2 --timeout 120 "$prog" 2>&1)
rc=$?
echo "$out"
if [ "$rc" -eq 0 ]; then echo "FAIL: launcher exited 0"; exit 1; fi
for line in "[rank 1] cout line before the crash" "[rank 1] printf line before the crash"; do
  echo "$out" | grep -qF "$line" || { echo "FAIL: missing '$line'"; exit 1; }
done
echo "OK: exit $rc, both lines kept"
