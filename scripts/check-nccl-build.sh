#!/usr/bin/env bash
# Compiles (does not run) Tessera with the NCCL path on, against Debian 13's CUDA build of
# LibTorch 2.6 (libtorch-cuda-dev, contrib, with the CUDA 12.4 packages from non-free), in a
# Debian 13 root of its own (libtorch-cuda-dev conflicts with libtorch-dev; its CMake config
# needs nvcc, from nvidia-cuda-toolkit), made once in
# $TESSERA_DEBIAN13_CACHE (default /var/cache/tessera) and reused.
#
#   bash scripts/check-nccl-build.sh
#
# Debian's nvidia-cudnn is a downloader package: its install script fetches cuDNN from
# NVIDIA's site, which this machine (and CI) cannot reach. An empty stand-in package takes
# its place (equivs), so no cuDNN library is present: the library and every object file
# compile, but programs linked against libtorch_cuda cannot be linked here, so only the
# library target is built. Not part of CI (a cold root is ~3 GB of packages).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${TESSERA_DEBIAN13_CACHE:-/var/cache/tessera}
ROOT=$CACHE/debian13-cuda
MIRROR=${TESSERA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
in_root() { $SUDO chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  DEBIAN_FRONTEND=noninteractive CCACHE_DIR=/ccache "$@"; }

$SUDO mkdir -p "$CACHE"
exec 9>"$CACHE/.check-nccl-build.lock"
flock 9

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do $SUDO umount -l "${mounted[$i]}" || true; done
}
trap cleanup EXIT
mount_root() {
  $SUDO mount -t proc proc "$ROOT/proc" && mounted+=("$ROOT/proc")
  $SUDO mount --bind /dev "$ROOT/dev" && mounted+=("$ROOT/dev")
  $SUDO mkdir -p "$CACHE/ccache-debian13-cuda" "$ROOT/ccache"
  $SUDO mount --bind "$CACHE/ccache-debian13-cuda" "$ROOT/ccache" && mounted+=("$ROOT/ccache")
  $SUDO cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
}

if [ ! -f "$ROOT/.tessera-root-ready" ]; then
  command -v debootstrap >/dev/null || {
    $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends debootstrap; }
  if [ ! -f "$ROOT/etc/debian_version" ]; then
    $SUDO rm -rf "$ROOT.partial"
    $SUDO debootstrap --variant=minbase --include=ca-certificates,equivs trixie "$ROOT.partial" "$MIRROR"
    $SUDO mv "$ROOT.partial" "$ROOT"
  fi
  echo "deb $MIRROR trixie main contrib non-free non-free-firmware" | $SUDO tee "$ROOT/etc/apt/sources.list" >/dev/null
  mount_root
  in_root apt-get update -q
  # The stand-in for the cuDNN downloader (see above).
  in_root bash -c 'mkdir -p /tmp/equivs && cd /tmp/equivs && printf "%s\n" \
    "Section: misc" "Priority: optional" "Standards-Version: 4.6.2" \
    "Package: nvidia-cudnn" "Version: 9.0.0.312~cuda12" \
    "Description: empty stand-in for the cuDNN downloader (no network here)" > cudnn.ctl &&
    equivs-build cudnn.ctl >/dev/null && dpkg -i nvidia-cudnn_*.deb'
  $SUDO touch "$ROOT/.tessera-root-ready"
else
  mount_root
fi
packages="build-essential cmake ninja-build ccache pkg-config libtorch-cuda-dev libgloo-cuda-dev
  libnccl-dev nvidia-cuda-toolkit libcli11-dev nlohmann-json3-dev libfmt-dev"
in_root bash -c "for p in $(echo $packages); do
    dpkg-query -W -f='\${Status}' \$p 2>/dev/null | grep -q 'install ok installed' || exit 1; done" ||
  in_root apt-get install -y -q --no-install-recommends $packages

$SUDO rm -rf "$ROOT/work/tessera"
$SUDO mkdir -p "$ROOT/work/tessera"
git ls-files -z --cached --others --exclude-standard |
  (while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) |
  tar --null -T - -cf - | $SUDO tar -xf - -C "$ROOT/work/tessera"
in_root bash -c 'cd /work/tessera &&
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_TESTS=OFF \
    -DTESSERA_BUILD_EXAMPLES=OFF -DTESSERA_BUILD_BENCHMARKS=OFF | tee cmake.log &&
  grep -q "Tessera: NCCL path ON" cmake.log &&
  cmake --build build --target tessera &&
  echo "check-nccl-build: libtessera.so built with the NCCL path on"'
