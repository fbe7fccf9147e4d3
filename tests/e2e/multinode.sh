#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces joined by a veth pair, one tessera-run in
# each with 2 ranks. Runs the 4-rank job across them (ranks may use only the namespaces'
# addresses: each namespace has nothing else but its loopback), then the faults that need
# two hosts: a rank killed on node 1, node 1's launcher killed, and the link taken down.
# Needs root and iproute2; exits 77 (CTest: skipped) where namespaces cannot be made.
#   multinode.sh TESSERA_RUN MULTINODE_JOB FAULT_RANK
set -u
run=$1
job=$2
fault=$3
source "$(dirname "$0")/fault_lib.sh"

tag=t$$
ns0=$tag-n0
ns1=$tag-n1
addr0=192.168.213.1
addr1=192.168.213.2
work=$(mktemp -d)
cleanup() {
  kill -9 $(jobs -p) 2>/dev/null
  ip netns del "$ns0" 2>/dev/null
  ip netns del "$ns1" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "network namespaces need root"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
command -v nsenter >/dev/null || skip "nsenter (util-linux) is not installed"
ip netns add "$ns0" 2>"$work/err" || skip "cannot create a network namespace: $(cat "$work/err")"
ip netns add "$ns1" || skip "cannot create a second network namespace"
ip link add "$tag-a" type veth peer name "$tag-b" 2>"$work/err" || skip "no veth support: $(cat "$work/err")"
ip link set "$tag-a" netns "$ns0"
ip link set "$tag-b" netns "$ns1"
# Work inside a namespace by entering its network only: `ip netns exec` and `ip -n` also
# remount / and /sys, which a chroot (the Debian 13 check) refuses.
netns_dir=/run/netns
[ -e "$netns_dir/$ns0" ] || netns_dir=/var/run/netns
in_ns() { local ns=$1; shift; nsenter --net="$netns_dir/$ns" "$@"; }
in_ns "$ns0" true 2>"$work/err" || skip "cannot enter the namespace: $(cat "$work/err")"
setup() { "$@" 2>"$work/err" || skip "'$*' failed: $(cat "$work/err")"; }
setup in_ns "$ns0" ip addr add "$addr0/24" dev "$tag-a"
setup in_ns "$ns1" ip addr add "$addr1/24" dev "$tag-b"
for ns in "$ns0" "$ns1"; do setup in_ns "$ns" ip link set lo up; done
setup in_ns "$ns0" ip link set "$tag-a" up
setup in_ns "$ns1" ip link set "$tag-b" up
echo "namespaces $ns0 ($addr0) and $ns1 ($addr1) joined by a veth pair"

# launch NAME NODE PROG ARGS...: one launcher in namespace NODE, in the background.
port=29400
launch() {
  local name=$1 node=$2
  shift 2
  local ns=$ns0
  [ "$node" -eq 1 ] && ns=$ns1
  # (nsenter itself, not a function, so that $! is the launcher: nsenter execs it)
  nsenter --net="$netns_dir/$ns" "$run" -n 2 --nnodes 2 --node-rank "$node" --master-addr "$addr0" \
    --master-port "$port" --rdzv-timeout 60 --timeout 240 "$@" >"$work/$name.$node.out" 2>&1 &
}
status=0

# 1. The job: redistribute chains, training steps and a halo conv, checked against one device.
launch job 1 "$job"; p1=$!
launch job 0 "$job"; p0=$!
wait "$p0"; rc0=$?
wait "$p1"; rc1=$?
cat "$work/job.0.out" "$work/job.1.out"
ok=$(cat "$work"/job.*.out | grep -c "ALL OK")
gloo=$(cat "$work"/job.*.out | grep -oE "gloo on [0-9.]+" | sort | uniq -c | tr '\n' ' ')
if [ "$rc0" -ne 0 ] || [ "$rc1" -ne 0 ] || [ "$ok" -ne 4 ]; then
  echo "FAIL [job]: exit $rc0 / $rc1, $ok of 4 ranks ALL OK"; status=1
elif [ "$gloo" != "      2 gloo on $addr0       2 gloo on $addr1 " ]; then
  echo "FAIL [job]: ranks' Gloo addresses are not the namespaces' own: $gloo"; status=1
else
  echo "RESULT [job]: 4 ranks on 2 namespaces match one device; Gloo on $addr0 and $addr1"
fi

# 2. A rank of node 1 SIGKILLed inside an all-reduce: node 0 names it.
port=$((port + 1))
mkdir "$work/kill"
t0=$(now)
launch kill 1 "$fault" kill 3 "$work/kill"; p1=$!
launch kill 0 "$fault" kill 3 "$work/kill"; p0=$!
wait "$p0"; rc=$?
[ -s "$work/kill/fault.time" ] && t0=$(cat "$work/kill/fault.time")  # time from the fault
secs=$(since "$t0")
wait "$p1"; rc1=$?
grep -h "tessera-run" "$work"/kill.*.out
expect_stop "rank 3 killed on node 1" "$rc" "$secs" 30 "$(cat "$work"/kill.0.out)" \
  "rank 3 on node 1 failed \(signal 9\)" || status=1
[ "$rc1" -ne 0 ] || { echo "FAIL: node 1 exited 0"; status=1; }
sleep 0.5
no_rank_left "$work/kill" || status=1

# 3. Node 1's launcher SIGKILLed: node 0 sees its connection close.
port=$((port + 1))
mkdir "$work/launcher"
launch launcher 1 "$fault" loop - "$work/launcher"; p1=$!
launch launcher 0 "$fault" loop - "$work/launcher"; p0=$!
wait_for_pids "$work/launcher" 4 60 || { echo "FAIL: ranks did not start"; cat "$work"/launcher.*.out; exit 1; }
sleep 1
kill -9 "$p1"
t0=$(now)
wait "$p0"; rc=$?
secs=$(since "$t0")
grep -h "tessera-run" "$work"/launcher.0.out
expect_stop "node 1's launcher killed" "$rc" "$secs" 15 "$(cat "$work"/launcher.0.out)" \
  "lost node 1: its launcher closed the connection" || status=1
sleep 0.5
no_rank_left "$work/launcher" || status=1

# 4. The link between the namespaces taken down: no connection closes, nothing arrives; the
#    launchers' heartbeats (3 s here) stop both sides.
port=$((port + 1))
mkdir "$work/link"
launch link 1 --heartbeat-timeout 3 --collective-timeout 60 "$fault" loop - "$work/link"; p1=$!
launch link 0 --heartbeat-timeout 3 --collective-timeout 60 "$fault" loop - "$work/link"; p0=$!
wait_for_pids "$work/link" 4 60 || { echo "FAIL: ranks did not start"; cat "$work"/link.*.out; exit 1; }
sleep 1
in_ns "$ns0" ip link set "$tag-a" down
t0=$(now)
wait "$p0"; rc0=$?
secs0=$(since "$t0")
wait "$p1"; rc1=$?
secs1=$(since "$t0")
grep -h "tessera-run" "$work"/link.*.out
expect_stop "link down, node 0" "$rc0" "$secs0" 20 "$(cat "$work"/link.0.out)" \
  "lost node 1: nothing heard from its launcher for 3 s" || status=1
expect_stop "link down, node 1" "$rc1" "$secs1" 20 "$(cat "$work"/link.1.out)" \
  "lost node 0 \(the launcher at $addr0\): nothing heard" || status=1
sleep 0.5
no_rank_left "$work/link" || status=1

[ "$status" -eq 0 ] && echo "OK: the job ran across namespaces; every fault stopped both nodes"
exit $status
