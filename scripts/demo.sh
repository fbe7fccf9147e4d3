#!/usr/bin/env bash
# Installs dependencies, builds the examples, and runs the main demo on 4 local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# Every example the README runs, so each of its commands works after this script.
TARGETS="tessera-run domain_demo quickstart redistribute_tour tp_transformer na_transformer" \
  bash scripts/build.sh
exec ./build/tessera-run -n 4 ./build/examples/domain_demo --out domain_demo.png
