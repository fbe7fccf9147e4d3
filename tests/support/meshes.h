#pragma once
// Meshes for tests: the standard set of multi-rank meshes, and meshes for pure (unit) tests
// that need no process group.
#include <chrono>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "tessera/mesh/device_mesh.h"
#include "tessera/runtime/world.h"
#include "tessera/testing/run_ranks.h"

namespace tessera::test {

// 1, 2 and 3 ranks in a line, and 4 as 2 x 2.
inline const std::vector<std::vector<int64_t>>& standard_meshes() {
  static const std::vector<std::vector<int64_t>> shapes = {{1}, {2}, {3}, {2, 2}};
  return shapes;
}

// "mesh2x3": a gtest parameter name for a mesh shape.
inline std::string mesh_name(const std::vector<int64_t>& shape) {
  std::string s = "mesh";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
  return s;
}

inline int mesh_world(const std::vector<int64_t>& shape) {
  return static_cast<int>(
      std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>()));
}

// body(mesh) on every rank of a mesh of this shape.
inline void on_mesh(const std::vector<int64_t>& shape,
                    const std::function<void(const DeviceMesh&)>& body) {
  tessera::testing::run_ranks(mesh_world(shape),
                              [&](int) { body(init_device_mesh("cpu", shape)); });
}

// body(mesh) on every rank of each standard mesh.
inline void on_meshes(const std::function<void(const DeviceMesh&)>& body) {
  for (const auto& shape : standard_meshes()) on_mesh(shape, body);
}

// A mesh seen from a rank outside it: the world has one rank more than the mesh, and this
// thread is that rank, so no process group is ever made. Specs, tables, the redistribute
// planner and its costs work on it at any explicit coordinate; coordinate() is empty.
inline DeviceMesh detached_mesh(const std::vector<int64_t>& shape) {
  const int n = mesh_world(shape);
  auto store = c10::make_intrusive<c10d::HashStore>();
  ScopedWorld scope(std::make_shared<World>(store, n, n + 1, std::chrono::seconds(1)));
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  return DeviceMesh("cpu", shape, ranks);
}

}  // namespace tessera::test
