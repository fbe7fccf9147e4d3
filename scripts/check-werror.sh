#!/usr/bin/env bash
# Builds the library (and the launcher) with warnings as errors (-DTESSERA_WERROR=ON) in its own
# folder, build-werror (BUILD_DIR overrides). Only those targets: no tests, examples or
# benchmarks. Its objects differ from build/'s by -Werror, so ccache shares nothing between the
# two; a second run of CI hits the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
export BUILD_DIR=${BUILD_DIR:-build-werror}
# (configured every time, so that an existing folder gets the option too)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
  -DTESSERA_WERROR=ON -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_EXAMPLES=OFF \
  -DTESSERA_BUILD_BENCHMARKS=OFF "$@" >/dev/null
TARGETS="tessera tessera-run" bash scripts/build.sh
echo "check-werror: the library and the launcher build without warnings"
