#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
cd build
# In parallel (CTEST_JOBS, default: one per core); the tests that measure time or start several
# processes run alone or take several processors (RUN_SERIAL / PROCESSORS in tests/).
ctest --output-on-failure --timeout 1500 -j"${CTEST_JOBS:-$(nproc)}" "$@"
