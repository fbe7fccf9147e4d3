#!/usr/bin/env bash
# Faults on one host, with real processes: a rank SIGKILLed inside a collective, a rank that
# sleeps instead of joining one, and a node's launcher SIGKILLed in a two-launcher job on
# loopback. Each job must end non-zero within a bound, name the culprit, and leave no rank
# behind. Also: the 4-rank multi-node job on two loopback launchers (no root needed), and an
# unknown network interface.
#   faults.sh TESSERA_RUN FAULT_RANK MULTINODE_JOB
set -u
run=$1
fault=$2
job=$3
source "$(dirname "$0")/fault_lib.sh"
work=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
status=0

# 1. SIGKILL inside an all-reduce: the launcher sees the signal and names the rank.
mkdir "$work/kill"
t0=$(now)
out=$("$run" -n 4 --timeout 120 "$fault" kill 2 "$work/kill" 2>&1); rc=$?
[ -s "$work/kill/fault.time" ] && t0=$(cat "$work/kill/fault.time")  # time from the fault
secs=$(since "$t0")
echo "$out" | tail -n 8
expect_stop "rank killed" "$rc" "$secs" 15 "$out" "rank 2 failed \(signal 9\)" || status=1
no_rank_left "$work/kill" || status=1

# 2. A rank that never joins: the others' collective times out (5 s here) and their error
#    names the rank that stayed silent.
mkdir "$work/hang"
t0=$(now)
out=$("$run" -n 4 --timeout 120 --collective-timeout 5 "$fault" hang 2 "$work/hang" 2>&1); rc=$?
[ -s "$work/hang/fault.time" ] && t0=$(cat "$work/hang/fault.time")
secs=$(since "$t0")
echo "$out" | grep -m 3 -E "failed|silent|never" | cut -c 1-600
expect_stop "rank hangs" "$rc" "$secs" 25 "$out" "never failed in a collective within [0-9]+ ms: 2 \(hung" \
  "all_reduce failed on rank [013] of 4" || status=1
no_rank_left "$work/hang" || status=1

# 3. Two launchers on loopback, node 1's launcher SIGKILLed: node 0 stops the job and names
#    node 1; node 1's ranks die with their launcher.
mkdir "$work/launcher"
port=$(free_port)
"$run" -n 2 --nnodes 2 --node-rank 1 --master-port "$port" --rdzv-timeout 60 \
  "$fault" loop - "$work/launcher" >"$work/node1.out" 2>&1 &
node1=$!
"$run" -n 2 --nnodes 2 --node-rank 0 --master-port "$port" --rdzv-timeout 60 --timeout 120 \
  "$fault" loop - "$work/launcher" >"$work/node0.out" 2>&1 &
node0=$!
if ! wait_for_pids "$work/launcher" 4 60; then
  echo "FAIL [launcher killed]: the ranks did not start"; cat "$work"/node*.out; exit 1
fi
sleep 1
kill -9 "$node1"
t0=$(now)
wait "$node0"; rc=$?
secs=$(since "$t0")
out=$(cat "$work/node0.out")
echo "$out" | grep "tessera-run"
expect_stop "launcher killed" "$rc" "$secs" 15 "$out" "lost node 1: its launcher closed the connection" || status=1
sleep 0.5
no_rank_left "$work/launcher" || status=1

# 4. The multi-node job itself, two launchers on loopback.
port=$(free_port)
"$run" -n 2 --nnodes 2 --node-rank 1 --master-port "$port" --timeout 240 "$job" >"$work/job1.out" 2>&1 &
node1=$!
"$run" -n 2 --nnodes 2 --node-rank 0 --master-port "$port" --timeout 240 "$job" >"$work/job0.out" 2>&1
rc0=$?
wait "$node1"; rc1=$?
cat "$work/job0.out" "$work/job1.out"
if [ "$rc0" -ne 0 ] || [ "$rc1" -ne 0 ] || [ "$(cat "$work"/job*.out | grep -c 'ALL OK')" -ne 4 ]; then
  echo "FAIL [loopback job]: exit $rc0 / $rc1"; status=1
else
  echo "RESULT [loopback job]: 4 ranks on 2 launchers match one device"
fi

# 5. A network interface that does not exist: every rank says so instead of hanging.
mkdir "$work/ifname"
t0=$(now)
out=$("$run" -n 2 --timeout 120 --ifname nosuchif0 "$fault" loop - "$work/ifname" 2>&1); rc=$?
secs=$(since "$t0")
echo "$out" | grep -m 1 "cannot listen" | cut -c 1-300
expect_stop "unknown interface" "$rc" "$secs" 60 "$out" \
  "rank [01] cannot listen for Gloo connections on interface \"nosuchif0\"" || status=1

[ "$status" -eq 0 ] && echo "OK: every fault stopped the job, named its culprit, left no rank"
exit $status
