// Dim-wise ops (cumsum, logcumsumexp, sort, flip, roll, tril / triu; NOTE: [Dim-wise ops]) along
// sharded and unsharded dims, on uneven and empty shard tables and 1-D and 2-D meshes, forward and
// backward, against the same code on one device.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::Operand;

namespace {

using Case = std::pair<std::string, tessera::test::Fn>;

// Every layout of a [5, 6, 7] tensor worth a case: replicated, partial, each dim sharded
// unevenly (an empty shard included), two dims sharded and one dim nested on a 2-D mesh.
std::vector<Operand> layouts(const DeviceMesh& mesh) {
  const std::vector<int64_t> shape{5, 6, 7};
  std::vector<Operand> out;
  if (mesh.ndim() == 1) {
    const int64_t n = mesh.size(0);
    out.push_back({shape, {Replicate()}});
    out.push_back({shape, {Partial()}});
    for (int64_t t = 0; t < 3; ++t) {
      ShardTable table(static_cast<size_t>(n), 0);
      table.back() = shape[static_cast<size_t>(t)] / 3;
      table.front() += shape[static_cast<size_t>(t)] - table.back();
      std::vector<ShardTable> tables(3);
      tables[static_cast<size_t>(t)] = table;
      out.push_back({shape, {Shard(t)}, tables});
    }
  } else {
    out.push_back({shape, {Shard(0), Shard(2)}});
    out.push_back({shape, {Shard(1), Shard(1)}});
    out.push_back({shape, {Shard(2), Partial()}});
    out.push_back({shape, {Replicate(), Shard(0)}});
  }
  return out;
}

void check(const std::vector<Case>& cases) {
  auto body = [&](const DeviceMesh& mesh) {
    for (const auto& layout : layouts(mesh))
      for (const auto& [name, fn] : cases)
        differential(mesh, {layout}, fn, name + " on " + to_string(layout.placements));
  };
  for (int world : {1, 2, 3})
    tessera::testing::run_ranks(world, [&](int) { body(init_device_mesh("cpu", {world})); });
  tessera::testing::run_ranks(4, [&](int) { body(init_device_mesh("cpu", {2, 2})); });
}

}  // namespace

TEST(DimWise, Scans) {
  check({
      {"cumsum(0)", [](auto& v) { return v[0].cumsum(0); }},
      {"cumsum(-1)", [](auto& v) { return v[0].cumsum(-1) * 0.5; }},
      {"logcumsumexp(2)", [](auto& v) { return v[0].logcumsumexp(2); }},
  });
}

TEST(DimWise, SortFlipRollTriangles) {
  check({
      {"sort(1)", [](auto& v) { return std::get<0>(v[0].sort(1)); }},
      {"sort(0, descending) indices", [](auto& v) { return std::get<1>(v[0].sort(0, true)); }},
      {"sort stable(2)", [](auto& v) { return std::get<0>(v[0].sort(true, 2, false)); }},
      {"flip(0, 2)",
       [](auto& v) {
         return v[0].flip({0, 2});
       }},
      {"roll(2, 1)", [](auto& v) { return v[0].roll({2}, {1}) * 3; }},
      {"roll(-3, 0) and (1, 2)",
       [](auto& v) {
         return v[0].roll({-3, 1}, {0, 2});
       }},
      {"roll flattened", [](auto& v) { return v[0].roll({4}); }},
      {"tril", [](auto& v) { return v[0].tril(); }},
      {"triu(-1)", [](auto& v) { return v[0].triu(-1); }},
  });
}
