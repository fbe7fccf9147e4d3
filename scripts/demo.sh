#!/usr/bin/env bash
# Installs dependencies, builds, and runs the main demo on 4 local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
TARGETS="tessera-run domain_demo" bash scripts/build.sh
exec ./build/tessera-run -n 4 ./build/examples/domain_demo --out domain_demo.png
