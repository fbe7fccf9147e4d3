#!/usr/bin/env bash
# Builds Tessera's tests with sanitizers and runs them.
#
#   bash scripts/sanitize.sh [asan|tsan|all]     (default: all)
#
# asan: AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer included), in
#       build-asan. Runs the whole tessera_tests binary (unit and multi-rank tests) and
#       tessera_launcher_tests.
# tsan: ThreadSanitizer, in build-tsan. Ranks are threads of one process, each with its own
#       Gloo group, so a race between ranks on Tessera's shared state shows. Runs a subset of
#       the multi-rank tests (TSAN_FILTER below): TSan slows this code 5-15x and the full
#       binary would take about an hour on two cores; the subset covers every piece of
#       state that ranks share (the world registry, mesh and plan caches, the op registry,
#       the random generators, the module/FSDP/TP registries, the async checkpoint writer)
#       while leaving out the large single-threaded sweeps (OpSweep, property tables).
#
# Both build RelWithDebInfo at -O1 with their own build folder; LibTorch and Gloo are not
# instrumented. Suppressions (scripts/sanitizers/*.supp) cover only LibTorch/Gloo internals.
# Environment: JOBS (build parallelism), ASAN_FILTER / TSAN_FILTER (gtest filters),
# SANITIZE_TIMEOUT (seconds per test binary, default 3600).
# Not run here: the e2e tests (real processes through tessera-run running the examples):
# they run the same library code as the multi-rank tests, and building the examples would
# double the sanitizer build time.
# Exits non-zero if any test fails or any sanitizer reports.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SUPP=$ROOT/scripts/sanitizers

flavours=${1:-all}
case "$flavours" in
  all) flavours="asan tsan" ;;
  asan | tsan) ;;
  *) echo "usage: $0 [asan|tsan|all]" >&2; exit 2 ;;
esac

bash scripts/install-deps.sh || exit 1

ASAN_FILTER=${ASAN_FILTER:-*}
TSAN_FILTER=${TSAN_FILTER:-Smoke.*:Mesh*:RandomSync.*:Checkpoint.*:DataParallel.*:FullyShard.*:TensorParallel.*:Training.*:Dispatch.*:CustomRule.*:Errors*:Halo.*:DomainTraining.*:LossParallel.*:CreationDistribute.ShardSizes*:CreationScatter.*:CreationRedistribute.*:RedistributePlan.*:Modules.*:-*/*}
TIMEOUT=${SANITIZE_TIMEOUT:-3600}

declare -A summary
status=0

now() { date +%s; }

# configure_build FLAVOUR CXXFLAGS LDFLAGS TARGETS
configure_build() {
  local dir=build-$1 t0
  t0=$(now)
  echo "=== $1: building in $dir"
  BUILD_DIR=$dir BUILD_TYPE=RelWithDebInfo TARGETS="$4" JOBS=${JOBS:-$(nproc)} \
    bash scripts/build.sh \
      -DCMAKE_CXX_FLAGS="$2" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
      -DCMAKE_EXE_LINKER_FLAGS="$3" -DCMAKE_SHARED_LINKER_FLAGS="$3" \
      -DTESSERA_BUILD_EXAMPLES=OFF -DTESSERA_BUILD_BENCHMARKS=OFF
  local rc=$?
  summary[$1.build]="$(( $(now) - t0 )) s"
  return $rc
}

# run_binary FLAVOUR NAME BINARY [ARGS...]: runs one test binary, log in build-FLAVOUR/sanitize-NAME.log
run_binary() {
  local flavour=$1 name=$2 bin=$3 t0 rc reports
  shift 3
  local log=$ROOT/build-$flavour/sanitize-$name.log
  echo "=== $flavour: $name $* (log: ${log#$ROOT/})"
  t0=$(now)
  timeout --signal=KILL "$TIMEOUT" "$bin" "$@" >"$log" 2>&1
  rc=$?
  reports=$(grep -cE "^(==[0-9]+==ERROR: |WARNING: ThreadSanitizer|SUMMARY: (Address|Leak|Thread|UndefinedBehavior)Sanitizer)|runtime error: " "$log")
  local tests
  tests=$(grep -oE "^\[  PASSED  \] [0-9]+ tests?" "$log" | grep -oE "[0-9]+")
  summary[$flavour.$name]="exit $rc, ${tests:-0} tests passed, $reports sanitizer report lines, $(( $(now) - t0 )) s"
  if [ "$rc" -ne 0 ] || [ "$reports" -ne 0 ]; then
    status=1
    grep -nE "^\[  FAILED  \]|ERROR: |WARNING: ThreadSanitizer|SUMMARY: |runtime error: " "$log" | head -40
  fi
}

for f in $flavours; do
  case $f in
    asan)
      if configure_build asan "-fsanitize=address,undefined -fno-omit-frame-pointer" \
           "-fsanitize=address,undefined" "tessera_tests tessera_launcher_tests tessera-run"; then
        export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1:abort_on_error=0:suppressions=$SUPP/asan.supp"
        export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
        export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SUPP/ubsan.supp"
        run_binary asan tessera_tests build-asan/tests/tessera_tests --gtest_filter="$ASAN_FILTER"
        run_binary asan launcher_tests build-asan/tests/launcher/tessera_launcher_tests
        unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS
      else
        status=1; summary[asan.build]+=" (failed)"
      fi
      ;;
    tsan)
      if configure_build tsan "-fsanitize=thread -fno-omit-frame-pointer" "-fsanitize=thread" \
           "tessera_tests"; then
        export TSAN_OPTIONS="halt_on_error=0:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$SUPP/tsan.supp"
        run_binary tsan tessera_tests build-tsan/tests/tessera_tests --gtest_filter="$TSAN_FILTER"
        unset TSAN_OPTIONS
      else
        status=1; summary[tsan.build]+=" (failed)"
      fi
      ;;
  esac
done

echo "=== sanitize summary"
for k in $(printf '%s\n' "${!summary[@]}" | sort); do printf '  %-22s %s\n' "$k" "${summary[$k]}"; done
[ $status -eq 0 ] && echo "=== clean" || echo "=== FINDINGS or failures (see the logs above)"
exit $status
