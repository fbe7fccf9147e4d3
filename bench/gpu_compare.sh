#!/usr/bin/env bash
# Tessera vs PyTorch on one GPU, one run: bench_gpu (bench/bench_gpu.cpp) and
# bench/peer/gpu_peer.py back to back on the same device, merged by bench/peer/gpu_report.py
# into ${OUT:-.}/gpu_bench.json and ${OUT:-.}/gpu_bench.md (tables for BENCHMARKS.md).
#
#   bash bench/gpu_compare.sh
#
# Environment:
#   OUT        where the results go (default .; relative paths from the repository root):
#              gpu_bench.json, gpu_bench.md, each side's JSON and log (progress, then its
#              table), and build_gpu.log when it builds: 7 files at most
#   PYTHON     the Python that has torch with CUDA (default python3)
#   BENCH_GPU  a built bench_gpu (default $BUILD_DIR/bench/bench_gpu)
#   BUILD_DIR  where bench_gpu is built when BENCH_GPU does not exist (default build-gpu),
#              against the LibTorch inside $PYTHON's torch (its CMake prefix), tests and
#              examples off; needs nvcc, CMake, Ninja and Tessera's other dependencies
#              (Gloo's headers, CLI11, nlohmann_json, fmt, zlib). BUILD=0: never build.
#   DEVICE     cuda (default); cpu runs both programs on CPU to check this pipeline on a
#              machine without a GPU (not a benchmark)
#   ARGS       more arguments for both programs (e.g. "--na-sizes 16 --iters 3")
#   JOBS       build jobs (default nproc)
#   COMMIT     Tessera's commit for the report (default: git rev-parse, where .git exists)
#   CMAKE_ARGS more configure arguments (e.g. -DTESSERA_GLOO_INCLUDE_DIR=... where the
#              LibTorch has no Gloo headers, as the pip wheel)
# Time: each side stops starting cases after its budget (TESSERA_BUDGET_S 45,
# PYTORCH_BUDGET_S 95) and is killed at its limit (TESSERA_LIMIT_S 60, PYTORCH_LIMIT_S 110),
# so the run stays under 3 minutes plus the build. Both sides rewrite their JSON after every
# row: a side that is cut keeps what it measured, a side that fails leaves its rows empty,
# and the other side is still reported. No GPU: both sides print a skip and exit 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build-gpu}
BENCH_GPU=${BENCH_GPU:-$BUILD_DIR/bench/bench_gpu}
TESSERA_BUDGET_S=${TESSERA_BUDGET_S:-45}
TESSERA_LIMIT_S=${TESSERA_LIMIT_S:-60}
PYTORCH_BUDGET_S=${PYTORCH_BUDGET_S:-95}
PYTORCH_LIMIT_S=${PYTORCH_LIMIT_S:-110}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

log() { echo "gpu_compare: $*" >&2; }

device=""
if command -v nvidia-smi >/dev/null 2>&1; then
  device=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
           head -1 | sed 's/, /, driver /')
fi
log "device: ${device:-none found by nvidia-smi}"
"$PYTHON" -c 'import torch; print("gpu_compare: torch", torch.__version__, "CUDA", torch.version.cuda,
      "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' >&2 || log "no torch in $PYTHON"

# --- Tessera's side: build (if needed), then run.
if [ ! -x "$BENCH_GPU" ] && [ "${BUILD:-1}" = 1 ]; then
  t0=$(date +%s)
  prefix=$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
  log "building bench_gpu in $BUILD_DIR against ${prefix:-the LibTorch CMake finds}"
  if [ ! -f "$BUILD_DIR/build.ninja" ]; then
    args=(-DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_EXAMPLES=OFF)
    [ -n "$prefix" ] && args+=(-DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$(command -v "$PYTHON")")
    # The wheel's CMake files look for the CUDA toolkit's nvcc.
    for nvcc in "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
      if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then args+=(-DCMAKE_CUDA_COMPILER="$nvcc"); break; fi
    done
    # shellcheck disable=SC2086  # CMAKE_ARGS: words on purpose
    cmake -S . -B "$BUILD_DIR" -G Ninja "${args[@]}" ${CMAKE_ARGS:-} >"$OUT/build_gpu.log" 2>&1 ||
      log "configure failed: see $OUT/build_gpu.log"
  fi
  if [ -f "$BUILD_DIR/build.ninja" ]; then
    cmake --build "$BUILD_DIR" --parallel "${JOBS:-$(nproc)}" --target bench_gpu >>"$OUT/build_gpu.log" 2>&1 ||
      log "build failed: see $OUT/build_gpu.log"
  fi
  log "build: $(($(date +%s) - t0)) s"
  tail -n 5 "$OUT/build_gpu.log" >&2 || true
fi
if [ -x "$BENCH_GPU" ]; then
  log "tessera: $BENCH_GPU"
  # shellcheck disable=SC2086  # ARGS: words on purpose
  timeout "$TESSERA_LIMIT_S" "$BENCH_GPU" --device "${DEVICE:-cuda}" --budget-s "$TESSERA_BUDGET_S" ${ARGS:-} \
    --out "$OUT/tessera_gpu.json" \
    >"$OUT/tessera_gpu.log" 2>&1
  rc=$?
  log "tessera: exit $rc$([ $rc = 124 ] && echo ' (cut at its limit)') (progress and table in $OUT/tessera_gpu.log)"
  grep -h "no CUDA device" "$OUT/tessera_gpu.log" >&2
else
  log "tessera: no bench_gpu at $BENCH_GPU; its rows stay empty"
fi

# --- PyTorch's side.
log "pytorch: bench/peer/gpu_peer.py"
# shellcheck disable=SC2086
timeout "$PYTORCH_LIMIT_S" "$PYTHON" bench/peer/gpu_peer.py --device "${DEVICE:-cuda}" --budget-s "$PYTORCH_BUDGET_S" ${ARGS:-} \
  --out "$OUT/pytorch_gpu.json" >"$OUT/pytorch_gpu.log" 2>&1
rc=$?
log "pytorch: exit $rc$([ $rc = 124 ] && echo ' (cut at its limit)') (progress and table in $OUT/pytorch_gpu.log)"
grep -h "no CUDA device" "$OUT/pytorch_gpu.log" >&2
grep -h "Traceback\|Error" "$OUT/pytorch_gpu.log" | grep -v "^gpu_peer: " | tail -n 3 >&2

# --- One report, ratios within this run.
"$PYTHON" bench/peer/gpu_report.py --tessera "$OUT/tessera_gpu.json" --pytorch "$OUT/pytorch_gpu.json" \
  --device "$device" --command "bash bench/gpu_compare.sh" --commit "${COMMIT:-}" \
  --json "$OUT/gpu_bench.json" --md "$OUT/gpu_bench.md" >/dev/null
log "wrote $OUT/gpu_bench.json and $OUT/gpu_bench.md"
cat "$OUT/gpu_bench.md"
