#!/usr/bin/env bash
# Compiles (does not run) Tessera with the NCCL path on, against Debian 13's CUDA build of
# LibTorch 2.6 (libtorch-cuda-dev, contrib, with the CUDA 12.4 packages from non-free), in a
# Debian 13 root of its own (libtorch-cuda-dev conflicts with libtorch-dev; its CMake config
# needs nvcc, from nvidia-cuda-toolkit), made once in $TESSERA_DEBIAN13_CACHE (default
# /var/cache/tessera) and reused.
#
#   bash scripts/check-nccl-build.sh
#
# Debian's nvidia-cudnn is a downloader package: its install script fetches cuDNN from
# NVIDIA's site, which this machine (and CI) cannot reach. An empty stand-in package takes
# its place (equivs), so no cuDNN library is present: the library's objects compile, but
# programs linked against libtorch_cuda cannot be linked here, so only the library target is
# built. Not part of CI (the root holds about 11 GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${TESSERA_DEBIAN13_CACHE:-/var/cache/tessera}
ROOT=$CACHE/debian13-cuda
source scripts/lib/debian-root.sh

root_lock check-nccl-build
root_create "$ROOT" ca-certificates,equivs
root_mount "$ROOT" "$CACHE/ccache-debian13-cuda"
if [ ! -f "$ROOT/.tessera-cuda-sources" ]; then
  echo "deb $MIRROR trixie main contrib non-free non-free-firmware" |
    $SUDO tee "$ROOT/etc/apt/sources.list" >/dev/null
  in_root "$ROOT" apt-get update -q
  # The stand-in for the cuDNN downloader (see above).
  in_root "$ROOT" bash -c 'mkdir -p /tmp/equivs && cd /tmp/equivs && printf "%s\n" \
    "Section: misc" "Priority: optional" "Standards-Version: 4.6.2" \
    "Package: nvidia-cudnn" "Version: 9.0.0.312~cuda12" \
    "Description: empty stand-in for the cuDNN downloader (no network here)" > cudnn.ctl &&
    equivs-build cudnn.ctl >/dev/null && dpkg -i nvidia-cudnn_*.deb'
  $SUDO touch "$ROOT/.tessera-cuda-sources"
fi
packages=(build-essential cmake ninja-build ccache pkg-config libtorch-cuda-dev libgloo-cuda-dev
  libnccl-dev nvidia-cuda-toolkit libcli11-dev nlohmann-json3-dev libfmt-dev)
in_root "$ROOT" bash -c 'for p in "$@"; do
    dpkg-query -W -f="\${Status}" "$p" 2>/dev/null | grep -q "install ok installed" || exit 1
  done' bash "${packages[@]}" ||
  in_root "$ROOT" apt-get install -y -q --no-install-recommends "${packages[@]}"

root_export "$ROOT"
in_root "$ROOT" bash -c '
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_TESTS=OFF \
    -DTESSERA_BUILD_EXAMPLES=OFF -DTESSERA_BUILD_BENCHMARKS=OFF | tee cmake.log &&
  grep -q "Tessera: NCCL path ON" cmake.log &&
  cmake --build build --target tessera &&
  echo "check-nccl-build: libtessera.so built with the NCCL path on"'
