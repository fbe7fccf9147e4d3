#!/usr/bin/env bash
# The peer benchmark, Tessera vs PyTorch's own DTensor, in one run on this machine:
#   bash bench/peer/run.sh [compare.py options, e.g. --only ops --iters 30]
# Inside the Debian 13 root (scripts/check-debian13.sh), where Debian's python3-torch 2.6 and
# libtorch-dev 2.6 both install, it builds Tessera's side and runs bench/peer/compare.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
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
