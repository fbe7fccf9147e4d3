#!/usr/bin/env bash
# Fetches the build dependencies a bare GPU machine lacks (CLI11, nlohmann-json, GoogleTest
# and GoogleMock, Gloo's headers, zlib, fmt, Google Benchmark) as this Debian machine's
# packages and unpacks them into ./.deps (TESSERA_DEPS_DIR); copied along with the checkout,
# scripts/check-gpu.sh builds against them there (docs/gpu.md). No root needed: apt-get
# download and dpkg -x only. The runtime packages behind the -dev packages' library links
# (zlib1g, libfmt9, libbenchmark1debian) come too, so those links resolve inside .deps.
#
#   bash scripts/gpu-deps.sh            # then copy the checkout, .deps included
set -euo pipefail
cd "$(dirname "$0")/.."
DEPS=${TESSERA_DEPS_DIR:-.deps}
packages=(libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev libgloo-dev zlib1g-dev
  libfmt-dev libbenchmark-dev zlib1g libfmt9 libbenchmark1debian)

if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "gpu-deps: needs apt-get and dpkg (run it on a Debian or Ubuntu machine)" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # for apt's download user; as root apt may still warn it ran unsandboxed (harmless)
(cd "$work" && apt-get download "${packages[@]}")

rm -rf "$DEPS"
mkdir -p "$DEPS"
for deb in "$work"/*.deb; do
  dpkg -x "$deb" "$DEPS"
  dpkg-deb -f "$deb" Package Version | sed 's/^[A-Za-z]*: //' | paste -sd' ' >> "$DEPS/PACKAGES"
done

# Absolute links (/usr/lib/...) would point at the machine's own files: make those that
# have a target inside .deps relative, and report any that stay dangling.
abs_deps=$(cd "$DEPS" && pwd)
while IFS= read -r link; do
  target=$(readlink "$link")
  case "$target" in
    /*) if [ -e "$abs_deps$target" ]; then
          ln -sfn "$(realpath --relative-to="$(dirname "$link")" "$abs_deps$target")" "$link"
        fi ;;
  esac
done < <(find "$abs_deps" -type l)
dangling=$(find "$abs_deps" -xtype l | sed "s|^$abs_deps/||")
if [ -n "$dangling" ]; then
  echo "gpu-deps: links without a target in $DEPS (not needed by the build):"
  sed 's/^/  /' <<< "$dangling"
fi

# What check-gpu.sh looks for.
for f in usr/include/CLI/CLI.hpp usr/include/nlohmann/json.hpp usr/include/gtest/gtest.h \
         usr/include/gloo/algorithm.h usr/include/zlib.h usr/include/fmt/format.h \
         usr/include/benchmark/benchmark.h; do
  [ -e "$DEPS/$f" ] || { echo "gpu-deps: $DEPS/$f is missing" >&2; exit 1; }
done
echo "gpu-deps: $(wc -l < "$DEPS/PACKAGES") packages in $DEPS ($(du -sh "$DEPS" | cut -f1)):"
sed 's/^/  /' "$DEPS/PACKAGES"
