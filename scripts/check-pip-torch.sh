#!/usr/bin/env bash
# Builds Tessera against the LibTorch inside PyPI's torch wheel (the one `pip install torch`
# gives new users: the newest release, built with CUDA) and runs the CPU test suite with it.
# No GPU is needed: the wheel's CPU parts run anywhere, and the NCCL path is compiled and
# linked (nothing CUDA runs here).
#
#   bash scripts/check-pip-torch.sh              # build + the CPU suite (ctest -LE gpu)
#   bash scripts/check-pip-torch.sh -R Redis     # extra arguments go to ctest
#
# TESSERA_PIP_TORCH   the torch version (default: the one pinned below)
# TESSERA_PIP_CACHE   where the virtual environment is kept (default /var/cache/tessera),
#                     so a second run downloads nothing
# BUILD_DIR           build folder (default build-pip)
# TESSERA_CMAKE_ARGS  more configure arguments (CI passes -DTESSERA_BUILD_BENCHMARKS=OFF)
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
# shellcheck disable=SC2086  # TESSERA_CMAKE_ARGS is a list of arguments
bash scripts/build.sh -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$VENV/bin/python" \
  "${cuda_args[@]}" ${TESSERA_CMAKE_ARGS:-} | tee "$BUILD_DIR.log" | grep -E "Tessera:|error|FAILED|warning: .*fmt" || true
grep -q "Tessera: NCCL path ON" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null ||
  grep -q "TESSERA_WITH_NCCL" "$BUILD_DIR/build.ninja" ||
  echo "check-pip-torch: note: built without the NCCL path"
cd "$BUILD_DIR"
# In parallel, as scripts/test.sh.
ctest --output-on-failure --timeout 1500 -j"${CTEST_JOBS:-$(nproc)}" -LE gpu "$@"
