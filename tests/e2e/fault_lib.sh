# Shared by the fault tests (faults.sh, multinode.sh): timing, waiting, and the check that a
# job left no rank process behind.

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# wait_for_pids DIR N SECONDS: until DIR holds N rank*.pid files (the ranks are up).
wait_for_pids() {
  local dir=$1 n=$2 until=$(( $(date +%s) + $3 ))
  while [ "$(ls "$dir" 2>/dev/null | grep -c '\.pid$')" -lt "$n" ]; do
    [ "$(date +%s)" -ge "$until" ] && return 1
    sleep 0.1
  done
}

# no_rank_left DIR: every pid recorded in DIR is gone (or a zombie awaiting its reaper).
no_rank_left() {
  local f pid state left=0
  for f in "$1"/*.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f")
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    if [ -n "$state" ] && [ "$state" != Z ]; then
      echo "FAIL: rank process $pid ($(basename "$f")) is still running"
      left=1
    fi
  done
  return $left
}

# expect_stop NAME RC SECONDS LIMIT OUTPUT PATTERN...: a failed job must end non-zero (not by
# the launcher's own --timeout, 124) within LIMIT seconds and name the culprit.
expect_stop() {
  local name=$1 rc=$2 secs=$3 limit=$4 out=$5
  shift 5
  if [ "$rc" -eq 0 ]; then echo "FAIL [$name]: the job exited 0"; return 1; fi
  if [ "$rc" -eq 124 ]; then echo "FAIL [$name]: the launcher's --timeout had to stop it"; return 1; fi
  if awk -v s="$secs" -v l="$limit" 'BEGIN { exit !(s > l) }'; then
    echo "FAIL [$name]: stopping took $secs s (limit $limit s)"; return 1
  fi
  local p
  for p in "$@"; do
    if ! grep -qE -- "$p" <<<"$out"; then echo "FAIL [$name]: no line matches /$p/"; return 1; fi
  done
  echo "RESULT [$name]: exit $rc after $secs s"
}

free_port() { echo $(( 20000 + (RANDOM * 32768 + RANDOM) % 30000 )); }
