#!/usr/bin/env bash
# Configures and builds Tessera into ./build with Ninja and ccache: configured once, and again
# whenever configure arguments are given (this script's, or TESSERA_CMAKE_ARGS: CI's
# -DTESSERA_WERROR=ON, -DTESSERA_BUILD_BENCHMARKS=OFF), so an existing folder takes them.
# TARGETS="a b" builds just those targets.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# ccache hits across clones (CI builds a fresh clone): paths relative to the checkout, and
# the precompiled headers' time macros ignored.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
BUILD_TYPE=${BUILD_TYPE:-Release}
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ -n "${TESSERA_CMAKE_ARGS:-}" ] || [ $# -gt 0 ]; then
  # shellcheck disable=SC2086  # TESSERA_CMAKE_ARGS is a list of arguments
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" ${TESSERA_CMAKE_ARGS:-} "$@"
fi
targets=()
for t in ${TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" --parallel "${JOBS:-$(nproc)}" "${targets[@]}"
