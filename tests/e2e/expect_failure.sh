#!/usr/bin/env bash
# tessera-run must exit non-zero, name rank 2, and leave no rank process behind.
set -u
launcher=$1
prog=$2
out=$("$launcher" -n 4 --timeout 120 "$prog" 2>&1)
rc=$?
echo "$out"
if [ "$rc" -eq 0 ]; then echo "FAIL: launcher exited 0"; exit 1; fi
if [ "$rc" -eq 124 ]; then echo "FAIL: launcher timed out instead of stopping the ranks"; exit 1; fi
echo "$out" | grep -q "rank 2 failed" || { echo "FAIL: rank 2 not named"; exit 1; }
sleep 0.5
if pgrep -f "^$prog" >/dev/null; then echo "FAIL: rank processes left behind"; pgrep -af "^$prog"; exit 1; fi
echo "OK: exit $rc, rank 2 named, no process left"
