#!/usr/bin/env bash
# Installs the build into a scratch prefix and builds examples/quickstart.cpp as an outside
# project with find_package(Tessera), then runs it on 2 ranks.
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > /dev/null
mkdir -p "$work/app"
cat > "$work/app/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(Tessera REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer PRIVATE tessera::tessera)
CMAKE
cp "$src/examples/quickstart.cpp" "$work/app/main.cpp"
launcher=""
command -v ccache > /dev/null && launcher="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
cmake -S "$work/app" -B "$work/app/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" $launcher > /dev/null
cmake --build "$work/app/build" > /dev/null
LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" \
  "$work/prefix/bin/tessera-run" -n 4 --timeout 120 "$work/app/build/consumer"
