#!/usr/bin/env bash
# Builds Tessera's tests with sanitizers and runs them.
#
#   bash scripts/sanitize.sh [asan|tsan|all]     (default: all)
#
# asan: AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer included), in
#       build-asan: all of tessera_tests (unit and multi-rank tests), tessera_launcher_tests,
#       and the e2e CTest tests (real processes through tessera-run) except
#       e2e.find_package_consumer, which builds an outside project against an installed
#       (uninstrumented) package and tests packaging, not code.
# tsan: ThreadSanitizer, in build-tsan: all of tessera_tests. Ranks are threads of one
#       process, each with its own Gloo group, so races between ranks on Tessera's shared
#       state show. (TSan's processes are not run through the launcher: one rank per
#       process has nothing for TSan to find that a rank thread does not show.)
#
# Test binaries run directly (one process, --gtest_filter), not through CTest, which would
# start LibTorch once per test. On 2 cores each flavour's run takes 8-15 minutes (TSan slows
# this code less than its usual 5-15x: most time is in uninstrumented LibTorch kernels and
# Gloo), so both run everything; ASAN_FILTER / TSAN_FILTER narrow them.
# Both build RelWithDebInfo at -O1 -g1 in their own build folder; LibTorch and Gloo are not
# instrumented. Suppressions (scripts/sanitizers/*.supp) are only for LibTorch/Gloo internals;
# TSan runs with ignore_noninstrumented_modules=1 (see scripts/sanitizers/tsan.supp for why).
# Environment: JOBS (build parallelism), ASAN_FILTER / TSAN_FILTER (gtest filters),
# SANITIZE_TIMEOUT (seconds per test binary, default 3600).
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
TSAN_FILTER=${TSAN_FILTER:-*}
TIMEOUT=${SANITIZE_TIMEOUT:-3600}
# The examples and programs the e2e tests start (all but find_package_consumer, which builds
# its own): tests/CMakeLists.txt lists them in its e2e_programs target.
E2E_TARGETS="e2e_programs"

declare -A summary
status=0

now() { date +%s; }

# configure_build FLAVOUR CXXFLAGS LDFLAGS EXAMPLES(ON|OFF) TARGETS
configure_build() {
  local dir=build-$1 t0
  t0=$(now)
  echo "=== $1: building in $dir"
  # (configured every time, so that a changed flag here reaches an existing build folder)
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS="$2" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DCMAKE_EXE_LINKER_FLAGS="$3" -DCMAKE_SHARED_LINKER_FLAGS="$3" \
    -DTESSERA_BUILD_EXAMPLES="$4" -DTESSERA_BUILD_BENCHMARKS=OFF >/dev/null &&
    BUILD_DIR=$dir TARGETS="$5" JOBS=${JOBS:-$(nproc)} bash scripts/build.sh
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
  reports=$(grep -cE "==[0-9]+==ERROR: |WARNING: ThreadSanitizer|SUMMARY: (Address|Leak|Thread|UndefinedBehavior)Sanitizer|runtime error: " "$log")
  local tests
  tests=$(grep -oE "^\[  PASSED  \] [0-9]+ tests?" "$log" | grep -oE "[0-9]+")
  [ -n "$tests" ] || tests=$(grep -oE "[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+" "$log" |
                             sed -E 's/^[0-9]+% tests passed, ([0-9]+) tests failed out of ([0-9]+)/\2 ctest tests, \1 failed/')
  summary[$flavour.$name]="exit $rc, passed: ${tests:-none}, $reports sanitizer report lines, $(( $(now) - t0 )) s"
  if [ "$rc" -ne 0 ] || [ "$reports" -ne 0 ]; then
    status=1
    grep -nE "^\[  FAILED  \]|ERROR: |WARNING: ThreadSanitizer|SUMMARY: |runtime error: " "$log" | head -40
  fi
}

for f in $flavours; do
  case $f in
    asan)
      if configure_build asan "-fsanitize=address,undefined -fno-omit-frame-pointer" \
           "-fsanitize=address,undefined" ON "tessera_tests tessera_launcher_tests tessera-run $E2E_TARGETS"; then
        export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1:abort_on_error=0:suppressions=$SUPP/asan.supp"
        export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
        export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SUPP/ubsan.supp"
        run_binary asan tessera_tests build-asan/tests/tessera_tests --gtest_filter="$ASAN_FILTER"
        run_binary asan launcher_tests build-asan/tests/launcher/tessera_launcher_tests
        run_binary asan e2e ctest --test-dir build-asan -V -R '^e2e[.]' -E find_package
        unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS
      else
        status=1; summary[asan.build]+=" (failed)"
      fi
      ;;
    tsan)
      if configure_build tsan "-fsanitize=thread -fno-omit-frame-pointer" "-fsanitize=thread" \
           OFF "tessera_tests"; then
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
