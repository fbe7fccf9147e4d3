#!/usr/bin/env bash
# The peer benchmark, Tessera vs PyTorch's own DTensor, in one run on this machine:
#   bash bench/peer/run.sh [compare.py options, e.g. --only ops --iters 30]
# By default it runs inside the Debian 13 root (scripts/check-debian13.sh), where Debian's
# python3-torch 2.6 and libtorch-dev 2.6 both install, builds Tessera's side against that
# LibTorch (build-peer) and runs bench/peer/compare.py with python3.
#
#   PEER_PYTHON=/var/cache/tessera/torch-venv/bin/python bash bench/peer/run.sh ...
# runs on this host instead, with that interpreter's torch as the PyTorch side (it needs numpy
# too: torch.distributed.tensor.debug imports it) and Tessera's side built against the
# LibTorch inside that torch (build-peer-<major.minor>, or PEER_BUILD), so both sides run the
# same ATen, as in the Debian 13 run.
set -euo pipefail
case ${PEER_PYTHON:-} in  # a relative path keeps meaning the caller's directory
  */*) PEER_PYTHON=$(cd "$(dirname "$PEER_PYTHON")" && pwd)/$(basename "$PEER_PYTHON") ;;
esac
cd "$(dirname "$0")/../.."
if [ -n "${PEER_PYTHON:-}" ]; then
  "$PEER_PYTHON" -c 'import torch, numpy' 2>/dev/null || {
    echo "run.sh: $PEER_PYTHON cannot import torch and numpy ($PEER_PYTHON -m pip install numpy?)" >&2
    exit 1
  }
  prefix=$("$PEER_PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  version=$("$PEER_PYTHON" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))' 2>/dev/null)
  build=${PEER_BUILD:-build-peer-$version}
  cuda_args=()  # a CUDA wheel's CMake files look for nvcc
  if [ -x /usr/local/cuda/bin/nvcc ]; then cuda_args=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc); fi
  BUILD_DIR=$build TARGETS="tessera-run tessera_peer" bash scripts/build.sh \
    -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$PEER_PYTHON" "${cuda_args[@]}" >&2
  exec "$PEER_PYTHON" bench/peer/compare.py --build "$build" "$@"
fi
if ! grep -q '^13' /etc/debian_version 2>/dev/null; then
  exec bash scripts/check-debian13.sh -- bash bench/peer/run.sh "$@"
fi
bash scripts/install-deps.sh >&2
python3 -c 'import torch' 2>/dev/null || {
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends python3-torch python3-numpy >&2
}
BUILD_DIR=build-peer TARGETS="tessera-run tessera_peer" bash scripts/build.sh >&2
python3 bench/peer/compare.py --build build-peer "$@"
