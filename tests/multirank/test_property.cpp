// Seeded randomized property test: random shapes (empty dims included), meshes, placements
// (nested and partial), uneven shard tables and chains of redistributes, checked at every
// step against the full tensor, plus the gradient through the whole chain.
// Reproduce a failure with TESSERA_PROPERTY_SEED=<seed> and the printed case index.
#include <cstdlib>

#include "helpers.h"

using namespace tessera;
using tessera::test::local_block;
using tessera::test::make_dtensor_from_full;
using tessera::test::same_values;

namespace {

uint64_t base_seed() {
  const char* s = std::getenv("TESSERA_PROPERTY_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 20261121;
}

Placement random_placement(std::mt19937& rng, int64_t ndim, bool allow_partial) {
  const int kinds = allow_partial ? 4 : 3;
  switch (std::uniform_int_distribution<int>(0, kinds - 1)(rng)) {
    case 0:
    case 1:
      if (ndim > 0) return Shard(std::uniform_int_distribution<int64_t>(-ndim, ndim - 1)(rng));
      return Replicate();
    case 2: return Replicate();
    default: {
      static const PartialOp ops[] = {PartialOp::Sum, PartialOp::Avg, PartialOp::Max,
                                      PartialOp::Min};
      return Partial(ops[std::uniform_int_distribution<int>(0, 3)(rng)]);
    }
  }
}

Placements random_placements(std::mt19937& rng, int64_t mesh_ndim, int64_t ndim, bool partial) {
  Placements p;
  for (int64_t d = 0; d < mesh_ndim; ++d) p.push_back(random_placement(rng, ndim, partial));
  return p;
}

std::vector<ShardTable> maybe_uneven(std::mt19937& rng, const DeviceMesh& mesh,
                                     const Placements& p, const std::vector<int64_t>& shape) {
  if (std::uniform_int_distribution<int>(0, 3)(rng) == 0) return {};  // chunk layout
  Placements norm;
  for (auto& x : p) norm.push_back(x.normalized(static_cast<int64_t>(shape.size())));
  return tessera::test::random_tables(rng, mesh, norm, shape);
}

std::string tables_str(const std::vector<ShardTable>& t) {
  std::string s = "{";
  for (size_t i = 0; i < t.size(); ++i)
    if (!t[i].empty()) s += std::to_string(i) + ":" + shape_str(t[i]) + " ";
  return s + "}";
}

// Runs `cases` random cases on one mesh; returns through gtest assertions.
void run_cases(const std::vector<int64_t>& mesh_shape, int cases, uint64_t seed) {
  int world = 1;
  for (auto s : mesh_shape) world *= static_cast<int>(s);
  tessera::testing::run_ranks(world, [&](int) {
    auto mesh = init_device_mesh("cpu", mesh_shape);
    std::mt19937 rng(static_cast<unsigned>(seed));  // same stream on every rank
    for (int c = 0; c < cases; ++c) {
      const int64_t ndim = std::uniform_int_distribution<int64_t>(1, 3)(rng);
      std::vector<int64_t> shape;
      for (int64_t i = 0; i < ndim; ++i)
        shape.push_back(std::uniform_int_distribution<int64_t>(0, 6)(rng));
      const auto dtype = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? at::kDouble : at::kFloat;
      const auto full = tessera::test::randn(shape, seed + c, dtype);
      auto src_p = random_placements(rng, mesh.ndim(), ndim, /*partial=*/true);
      auto src_t = maybe_uneven(rng, mesh, src_p, shape);
      std::string ctx = "seed " + std::to_string(seed) + " case " + std::to_string(c) + ": mesh " +
                        shape_str(mesh_shape) + " shape " + shape_str(shape) + " " +
                        c10::toString(dtype) + " src " + to_string(src_p) + tables_str(src_t);
      auto x = make_dtensor_from_full(full, mesh, src_p, src_t).detach().requires_grad_();
      at::Tensor y = x;
      const int steps = std::uniform_int_distribution<int>(1, 4)(rng);
      for (int s = 0; s < steps; ++s) {
        auto p = random_placements(rng, mesh.ndim(), ndim, false);
        auto t = maybe_uneven(rng, mesh, p, shape);
        ctx += " -> " + to_string(p) + tables_str(t);
        y = redistribute(y, std::make_shared<DTensorSpec>(mesh, p, shape, dtype, t));
        ASSERT_TRUE(same_values(to_local(y), local_block(full, spec(y)))) << ctx;
      }
      const auto g = tessera::test::randn(shape, seed + 7919 * c, dtype);
      to_local(y).backward(local_block(g, spec(y)));
      ASSERT_TRUE(same_values(full_tensor(x.grad()), g)) << ctx << " (backward)";
    }
  });
}

}  // namespace

// 6 meshes x 200 cases = 1,200 random cases per run.
class RedistributeProperty : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(RedistributeProperty, RandomChainsMatchOneDevice) {
  const auto& shape = GetParam();
  uint64_t seed = base_seed();
  for (auto s : shape) seed = seed * 10 + static_cast<uint64_t>(s);
  run_cases(shape, 200, seed);
}

INSTANTIATE_TEST_SUITE_P(Meshes, RedistributeProperty,
                         ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                           std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                           std::vector<int64_t>{2, 2},
                                           std::vector<int64_t>{2, 3}),
                         [](const auto& info) {
                           std::string s = "mesh";
                           for (auto d : info.param) s += std::to_string(d) + "x";
                           s.pop_back();
                           return s;
                         });
