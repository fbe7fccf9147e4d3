#!/usr/bin/env bash
# One command for a GPU machine with PyTorch (CUDA) from pip: builds Tessera against that
# LibTorch, runs the GPU tier (tessera_gpu_tests), the CPU suite (tessera_tests) and any GPU
# benchmark (bench/ targets named *gpu*), and writes a log per step and summary.txt (pass /
# fail / skip counts, the GPU, torch's version) under ${OUT:-./gpu-check}. docs/gpu.md.
#
#   bash scripts/check-gpu.sh                 # everything
#   bash scripts/check-gpu.sh --no-build      # reuse $BUILD_DIR as it is, run the tests
#   bash scripts/check-gpu.sh --configure-only
#   bash scripts/check-gpu.sh --dry-run       # print the commands, run none of them
#   bash scripts/check-gpu.sh --gpu-only      # the GPU tier (and GPU benchmarks) alone
#   bash scripts/check-gpu.sh --cpu-only --no-bench   # the CPU suite alone
# (--no-bench builds the GPU benchmarks but does not run them: bench/gpu_compare.sh does.)
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python if present, else python3),
# BUILD_DIR (build-gpu), OUT (./gpu-check), JOBS (nproc), TESSERA_DEPS_DIR (./.deps:
# dependencies unpacked by scripts/gpu-deps.sh, used when present), GPU_SHARDS / CPU_SHARDS
# (parallel test processes), CPU_FILTER / GPU_FILTER (gtest filters), SHARD_TIMEOUT (s),
# BENCH_BUDGET_S / BENCH_TIMEOUT (each benchmark's time budget and limit, s),
# ALLOW_NO_GPU=1 (a GPU tier that only skipped is not a failure: for machines without one).
# No network and no package manager are used. Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD

DRY=0 BUILD=1 CONFIGURE_ONLY=0 GPU_SUITE=1 CPU_SUITE=1 BENCH=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --gpu-only) CPU_SUITE=0 ;;
    --cpu-only) GPU_SUITE=0 ;;
    --no-bench) BENCH=0 ;;
    --no-build) BUILD=0 ;;
    --configure-only) CONFIGURE_ONLY=1 ;;
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "check-gpu: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

NPROC=$(nproc 2>/dev/null || echo 4)
JOBS=${JOBS:-$NPROC}
BUILD_DIR=${BUILD_DIR:-build-gpu}
OUT=${OUT:-./gpu-check}
DEPS=$(realpath -m "${TESSERA_DEPS_DIR:-./.deps}")  # absolute: CMake reads it from build-gpu
GPU_SHARDS=${GPU_SHARDS:-4}
# One CPU shard per core: the suite's ranks are threads that mostly wait on each other.
CPU_SHARDS=${CPU_SHARDS:-$(( NPROC > 2 ? NPROC : 2 ))}
SHARD_TIMEOUT=${SHARD_TIMEOUT:-480}
if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python ]; then PYTHON=/opt/torch/.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac
case "$DEPS" in /*) ;; *) DEPS=$ROOT/${DEPS#./} ;; esac
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
FAILED_STEPS=()

say() { echo "$*" | tee -a "$SUMMARY"; }
now() { date +%s; }

# run_step NAME CMD...: the command's output goes to $OUT/NAME.log; its status is recorded.
run_step() {
  local name=$1; shift
  local log=$OUT/$name.log start rc
  if [ "$DRY" = 1 ]; then
    printf '[dry-run] %s:' "$name"; printf ' %q' "$@"; echo
    return 0
  fi
  echo "== $name: $*" | tee "$log" >/dev/null
  start=$(now)
  "$@" >> "$log" 2>&1
  rc=$?
  say "$(printf '%-16s %-6s %4ss  (%s)' "$name" "$([ $rc = 0 ] && echo ok || echo FAILED)" \
        "$(( $(now) - start ))" "$log")"
  [ $rc = 0 ] || { FAILED_STEPS+=("$name"); tail -n 25 "$log" | sed 's/^/    | /'; }
  return $rc
}

# ---- environment -----------------------------------------------------------------------
say "Tessera GPU check, $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname), $NPROC cores"
say "checkout:      $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'))"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
      paste -sd';' -)
say "gpu:           ${GPU:-none (nvidia-smi found no GPU)}"
if ! TORCH_INFO=$("$PYTHON" -c 'import torch, torch.utils
print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())
print(torch.utils.cmake_prefix_path)' 2>"$OUT/python.log"); then
  say "torch:         cannot import torch with $PYTHON (see $OUT/python.log)"
  exit 1
fi
read -r TORCH_VERSION TORCH_CUDA CUDA_OK CUDA_COUNT <<< "$(sed -n 1p <<< "$TORCH_INFO")"
TORCH_CMAKE=$(sed -n 2p <<< "$TORCH_INFO")
say "torch:         $TORCH_VERSION (CUDA $TORCH_CUDA; cuda available: $CUDA_OK, $CUDA_COUNT device(s)) from $PYTHON"
[ "$CUDA_OK" = True ] || say "warning:       torch sees no CUDA device: every GPU test will skip"

# cmake and ninja may come from pip, next to the Python that has torch.
PATH="$PATH:$(dirname "$(command -v "$PYTHON")")"
export PATH
missing=""
for tool in cmake ninja c++ timeout; do command -v "$tool" >/dev/null || missing+=" $tool"; done
if [ -n "$missing" ]; then
  say "tools:         missing:$missing (cmake and ninja may also be pip-installed next to $PYTHON)"
  [ "$DRY" = 1 ] || exit 1
else
  say "tools:         $(cmake --version | head -1), ninja $(ninja --version), $(c++ --version | head -1)"
fi

# torch's CMake config for a CUDA build looks for the CUDA toolkit (nvcc).
NVCC=$(command -v nvcc 2>/dev/null || true)
for c in /usr/local/cuda/bin/nvcc "$(dirname "$TORCH_CMAKE")"/../../nvidia/*/bin/nvcc; do
  [ -z "$NVCC" ] && [ -x "$c" ] && NVCC=$c
done
say "nvcc:          ${NVCC:-none found (the CMake config of a CUDA torch may ask for the CUDA toolkit)}"

PREFIX=$TORCH_CMAKE
# The GPU tier with its own precompiled header: it then builds even where the CPU suite
# does not.
CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_EXAMPLES=OFF -DTESSERA_GPU_OWN_PCH=ON)
if [ -d "$DEPS/usr" ]; then
  # Debian's CMake packages sit under lib/<multiarch>/cmake, which CMake searches only where
  # the compiler reports a multiarch; name those folders too, and the libraries' folder.
  PREFIX="$PREFIX;$DEPS/usr"
  for d in "$DEPS"/usr/lib/*/cmake; do [ -d "$d" ] && PREFIX="$PREFIX;$d"; done
  for d in "$DEPS"/usr/lib/*-linux-gnu; do [ -d "$d" ] && CMAKE_ARGS+=(-DCMAKE_LIBRARY_PATH="$d"); done
  CMAKE_ARGS+=(-DTESSERA_GLOO_INCLUDE_DIR="$DEPS/usr/include")
  say "dependencies:  $DEPS ($(wc -l < "$DEPS/PACKAGES" 2>/dev/null || echo '?') packages)"
else
  say "dependencies:  the system's ($DEPS not present)"
fi
CMAKE_ARGS+=(-DCMAKE_PREFIX_PATH="$PREFIX" -DPython3_EXECUTABLE="$(command -v "$PYTHON")")
if [ -n "$NVCC" ]; then
  CMAKE_ARGS+=(-DCMAKE_CUDA_COMPILER="$NVCC" -DCUDAToolkit_ROOT="$(dirname "$(dirname "$NVCC")")")
  PATH="$(dirname "$NVCC"):$PATH"
  export PATH
fi
say ""

# ---- configure and build -----------------------------------------------------------------
if [ "$BUILD" = 1 ]; then
  run_step configure cmake -S "$ROOT" -B "$BUILD_DIR" "${CMAKE_ARGS[@]}" || exit 1
  [ "$CONFIGURE_ONLY" = 1 ] && exit 0
  # GPU benchmarks: any bench/ target whose name contains "gpu" (there may be none).
  BENCH_TARGETS=()
  if [ "$DRY" = 0 ]; then
    mapfile -t BENCH_TARGETS < <(cmake --build "$BUILD_DIR" --target help 2>/dev/null |
      sed -n 's/^\([A-Za-z0-9_.-]*gpu[A-Za-z0-9_.-]*\):.*/\1/p' | grep -v '^tessera_gpu_tests$' |
      while read -r t; do grep -qs "add_executable($t\b" "$ROOT"/bench/CMakeLists.txt && echo "$t"; done)
  fi
  SUITE_TARGETS=()
  [ "$GPU_SUITE" = 1 ] && SUITE_TARGETS+=(tests/tessera_gpu_tests)
  [ "$CPU_SUITE" = 1 ] && SUITE_TARGETS+=(tests/tessera_tests)
  # Ninja keeps going past a failure, so one suite that does not compile leaves the others
  # to run; the binaries are removed first, so a stale one from an earlier build never runs.
  [ "$DRY" = 1 ] || rm -f "${SUITE_TARGETS[@]/#/$BUILD_DIR/}" "${BENCH_TARGETS[@]/#/$BUILD_DIR/bench/}"
  run_step build cmake --build "$BUILD_DIR" --parallel "$JOBS" \
    --target "${SUITE_TARGETS[@]#tests/}" "${BENCH_TARGETS[@]}" -- -k 0
else
  say "build:         reusing $BUILD_DIR"
  BENCH_TARGETS=()
  if [ "$BENCH" = 1 ]; then
    for f in "$BUILD_DIR"/bench/*gpu*; do [ -x "$f" ] && BENCH_TARGETS+=("$(basename "$f")"); done
  fi
fi

# ---- tests: gtest shards in parallel processes, counted from their summaries ---------------
# Both suites run at once (the GPU tier waits on the GPU and on Gloo, the CPU suite on the
# cores); every shard logs to $OUT/<suite>/shard-K.log and has a time limit.
declare -A SUITE_PIDS SUITE_START
start_suite() {  # NAME BINARY SHARDS FILTER
  local name=$1 bin=$2 shards=$3 filter=$4 dir=$OUT/$1 k
  if [ "$DRY" = 1 ]; then
    echo "[dry-run] $name: $shards shards of $bin --gtest_filter=$filter"
    return 0
  fi
  if [ ! -x "$bin" ]; then
    say "$(printf '%-16s %-6s (%s not built)' "$name" FAILED "$bin")"; FAILED_STEPS+=("$name")
    return 1
  fi
  rm -rf "$dir"; mkdir -p "$dir"
  SUITE_START[$name]=$(now)
  # Line-buffered output: a shard that crashes still shows the test it was in.
  local lines=()
  command -v stdbuf >/dev/null && lines=(stdbuf -oL -eL)
  for ((k = 0; k < shards; k++)); do
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$k \
      timeout -k 10 "$SHARD_TIMEOUT" "${lines[@]}" "$bin" --gtest_filter="$filter" --gtest_color=no \
      > "$dir/shard-$k.log" 2>&1 &
    SUITE_PIDS[$name]+="$! "
  done
}
finish_suite() {  # NAME
  local name=$1 dir=$OUT/$1 k=0 pid s rc=0 crashed="" passed failed skipped
  [ -n "${SUITE_PIDS[$name]:-}" ] || return 0
  for pid in ${SUITE_PIDS[$name]}; do
    wait "$pid"; s=$?
    # A shard that ends without gtest's summary crashed, or ran out of time (124).
    if [ $s != 0 ] && ! grep -q '^\[  FAILED  \] [0-9]* test' "$dir/shard-$k.log"; then
      crashed+=" shard-$k.log (exit $s)"
    fi
    [ $s = 0 ] || rc=1
    k=$((k + 1))
  done
  read -r passed failed skipped < <(awk '/^\[  PASSED  \] [0-9]+ test/ {p += $4}
                                         /^\[  FAILED  \] [0-9]+ test/ {f += $4}
                                         /^\[  SKIPPED \] [0-9]+ test/ {s += $4}
                                         END {print p + 0, f + 0, s + 0}' "$dir"/shard-*.log)
  cat "$dir"/shard-*.log > "$OUT/$name.log"
  # A GPU check in which no GPU test ran checked nothing: a failure, unless asked for.
  local note=""
  if [ "$name" = gpu-tests ] && [ "$passed" = 0 ] && [ "${ALLOW_NO_GPU:-0}" != 1 ]; then
    note="    no GPU test ran (ALLOW_NO_GPU=1 accepts that)"
    rc=1
  fi
  say "$(printf '%-16s %-6s %4ss  passed %s, failed %s, skipped %s  (%s)' "$name" \
        "$([ $rc = 0 ] && echo ok || echo FAILED)" "$(( $(now) - SUITE_START[$name] ))" \
        "$passed" "$failed" "$skipped" "$OUT/$name.log")"
  [ -z "$note" ] || say "$note"
  [ -z "$crashed" ] || say "    crashed or timed out:$crashed"
  # The failed tests, and why tests skipped (the line after gtest's "Skipped"), once each.
  grep -h '^\[  FAILED  \] [A-Za-z]' "$dir"/shard-*.log | sed 's/ ([0-9]* ms)$//' | sort -u |
    sed 's/^\[  FAILED  \] /    failed: /' | tee -a "$SUMMARY"
  grep -h -A1 ': Skipped$' "$dir"/shard-*.log | grep -v -e ': Skipped$' -e '^--$' | sort |
    uniq -c | sed 's/^ *\([0-9]*\) /    skipped (\1): /' | tee -a "$SUMMARY"
  [ $rc = 0 ] || FAILED_STEPS+=("$name")
}

say ""
[ "$GPU_SUITE" = 1 ] && start_suite gpu-tests "$BUILD_DIR/tests/tessera_gpu_tests" "$GPU_SHARDS" "${GPU_FILTER:-*}"
[ "$CPU_SUITE" = 1 ] && start_suite cpu-tests "$BUILD_DIR/tests/tessera_tests" "$CPU_SHARDS" "${CPU_FILTER:-*}"
finish_suite gpu-tests
finish_suite cpu-tests

# ---- GPU benchmarks -------------------------------------------------------------------------
if [ "$BENCH" = 0 ]; then
  say "benchmarks:    not asked for (--no-bench)"
elif [ "${#BENCH_TARGETS[@]}" = 0 ]; then
  say "benchmarks:    no bench/ target named *gpu*"
else
  # After the tests, alone on the machine, so the timings are undisturbed. A benchmark that
  # takes a time budget or writes JSON (bench_gpu does) gets both.
  for t in "${BENCH_TARGETS[@]}"; do
    bin=$BUILD_DIR/bench/$t
    args=()
    help=$("$bin" --help 2>&1 || true)
    grep -q -- '--budget-s' <<< "$help" && args+=(--budget-s "${BENCH_BUDGET_S:-45}")
    grep -q -- '--out' <<< "$help" && args+=(--out "$OUT/$t.json")
    run_step "bench-$t" timeout -k 10 "${BENCH_TIMEOUT:-120}" "$bin" "${args[@]}"
  done
fi

say ""
if [ "$DRY" = 1 ]; then
  say "result: dry run (nothing built or run)"
elif [ "${#FAILED_STEPS[@]}" = 0 ]; then
  say "result: ok"
else
  say "result: FAILED (${FAILED_STEPS[*]})"
  exit 1
fi
