#!/usr/bin/env bash
# A rank SIGKILLed in the middle of a save: the run fails, the previous checkpoint loads
# intact on another number of ranks, the partial one is invisible and rejected.
set -u
launcher=$1
prog=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
out=$("$launcher" -n 3 --timeout 120 "$prog" save "$dir" 2>&1)
rc=$?
echo "$out"
if [ "$rc" -eq 0 ]; then echo "FAIL: the run with a killed rank exited 0"; exit 1; fi
if [ "$rc" -eq 124 ]; then echo "FAIL: the launcher timed out instead of stopping the ranks"; exit 1; fi
ls -a "$dir"
"$launcher" -n 2 --timeout 120 "$prog" verify "$dir" || { echo "FAIL: verify"; exit 1; }
echo "OK: killed save exit $rc; previous checkpoint intact, partial one invisible"
