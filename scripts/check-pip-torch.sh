#!/usr/bin/env bash
# Builds Tessera against the LibTorch inside PyPI's torch wheel (the one `pip install torch`
# gives new users: the newest release, built with CUDA) and runs the CPU test suite with it.
# No GPU is needed: the wheel's CPU parts run anywhere, and the NCCL path is compiled and
# linked (nothing CUDA runs here).
#
#   bash scripts/check-pip-torch.sh              # build + the CPU suite (ctest -LE gpu)
#   bash scripts/check-pip-torch.sh -R Redis     # extra arguments go to ctest
#   TESSERA_PIP_SUITE=binaries bash scripts/check-pip-torch.sh
#       # builds only the test binaries and runs them directly (tessera_tests in two
#       # concurrent gtest shards, CTEST_JOBS of them, then its timing cases alone, the launcher tests, the GPU tier on host meshes), one LibTorch
#       # start per process instead of one per test; no examples, e2e programs or benchmarks
#   TESSERA_PIP_SUITE=tier bash scripts/check-pip-torch.sh
#       # CI's form: the library and the GPU tier's binary (the NCCL and CUDA paths compile and
#       # link), and the tier run on host meshes (TESSERA_GPU_TIER_ON_CPU=1)
#
# TESSERA_PIP_TORCH   the torch version (default: the one pinned below)
# TESSERA_PIP_CACHE   where the virtual environment is kept (default /var/cache/tessera),
#                     so a second run downloads nothing
# BUILD_DIR           build folder (default build-pip)
# TESSERA_CMAKE_ARGS  more configure arguments (scripts/build.sh reads them)
# TESSERA_PIP_SUITE   ctest (default), binaries or tier (above)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TESSERA_PIP_TORCH:-2.15.0}
CACHE=${TESSERA_PIP_CACHE:-/var/cache/tessera}
VENV=$CACHE/torch-venv
export BUILD_DIR=${BUILD_DIR:-build-pip}

bash scripts/install-deps.sh
# The wheel's CMake files look for Python and for the CUDA toolkit's nvcc.
if ! command -v python3 >/dev/null || ! python3 -c 'import venv' 2>/dev/null; then
  apt-get install -y -q --no-install-recommends python3 python3-venv
fi
installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$installed" != "$TORCH_VERSION" ]; then
  echo "check-pip-torch: installing torch==$TORCH_VERSION into $VENV"
  mkdir -p "$CACHE"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION"
fi
prefix=$("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
echo "check-pip-torch: LibTorch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') from $prefix"

# The README's commands for a pip-installed PyTorch (README: "LibTorch from pip").
cuda_args=()
if [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_args=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
suite=${TESSERA_PIP_SUITE:-ctest}
tier_args=()
case $suite in
  binaries) export TARGETS="tessera_tests tessera_gpu_tests tessera_launcher_tests" ;;
  # (its own precompiled header: by default it reuses tessera_tests', which would build that)
  tier)
    export TARGETS="tessera_gpu_tests"
    tier_args=(-DTESSERA_GPU_OWN_PCH=ON)
    ;;
  ctest) ;;
  *) echo "check-pip-torch: TESSERA_PIP_SUITE is ctest, binaries or tier, not '$suite'" >&2; exit 2 ;;
esac
# (pipefail: a failed build fails the pipeline, whatever the filter shows)
if ! bash scripts/build.sh -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$VENV/bin/python" \
  "${cuda_args[@]}" "${tier_args[@]}" | tee "$BUILD_DIR.log" |
  { grep -E "Tessera:|error|FAILED|warning: .*fmt" || true; }; then
  echo "check-pip-torch: the build failed (log: $BUILD_DIR.log)" >&2
  exit 1
fi
grep -q "Tessera: NCCL path ON" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null ||
  grep -q "TESSERA_WITH_NCCL" "$BUILD_DIR/build.ninja" ||
  echo "check-pip-torch: note: built without the NCCL path"
cd "$BUILD_DIR"
if [ "$suite" != ctest ]; then
  # run LOG CMD...: one binary under a timeout, its log kept; prints the log's failures.
  run() {
    local log=$1 rc=0
    shift
    timeout --signal=KILL "${TESSERA_PIP_TIMEOUT:-2400}" "$@" >"$log" 2>&1 || rc=$?
    echo "check-pip-torch: $log: exit $rc, $(grep -oE '^\[  PASSED  \] [0-9]+ tests?' "$log" || echo 'none passed')"
    [ "$rc" -eq 0 ] || { grep -E '^\[  FAILED  \]|Failure|error' "$log" | head -40 || true; tail -20 "$log"; }
    return "$rc"
  }
  if [ "$suite" = tier ]; then
    TESSERA_GPU_TIER_ON_CPU=1 run gpu-tier-on-cpu.log tests/tessera_gpu_tests
    exit
  fi
  # The cases that measure time or run with a collective timeout of a few seconds run alone
  # afterwards, as under CTest (tests/ctest_resources.cmake's RUN_SERIAL list).
  serial='ErrorsFromLocal.*:Errors*.*:*FuzzLayout*.*:CustomRule.RuleFailingOnOneRankFailsEveryRankPromptly'
  serial+=':Habits.CollectiveOnSomeRanksOnlyNamesTheCall:RandomSync.MeshWithoutWorldRankZero'
  serial+=':LossParallel.WrongShardDimRaisesOnEveryRank'
  shards=${CTEST_JOBS:-2}
  pids=()
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
      run "tests-shard$i.log" tests/tessera_tests --gtest_filter="*-$serial" &
    pids+=($!)
  done
  status=0
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  run tests-serial.log tests/tessera_tests --gtest_filter="$serial" || status=1
  run launcher-tests.log tests/launcher/tessera_launcher_tests || status=1
  TESSERA_GPU_TIER_ON_CPU=1 run gpu-tier-on-cpu.log tests/tessera_gpu_tests || status=1
  exit $status
fi
# In parallel, as scripts/test.sh.
ctest --output-on-failure --timeout 1500 -j"${CTEST_JOBS:-$(nproc)}" -LE gpu "$@"
