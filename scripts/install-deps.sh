#!/usr/bin/env bash
# Installs Tessera's build and test dependencies from Debian 12's archive.
# Skips apt entirely when everything is already present, so CI stays fast.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev
  # LibTorch's matrix products through OpenBLAS: libtorch-dev alone brings the reference
  # BLAS, about ten times slower. The pthread build: the serial one is not safe to call from
  # several threads at once (ranks as threads gave wrong products).
  libopenblas0-pthread
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev libpng-dev zlib1g-dev
  iproute2  # the multi-host test joins two network namespaces
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
