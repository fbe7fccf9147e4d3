// Seeded randomized property test: random shapes (empty dims included), meshes, placements
// (nested and partial), uneven shard tables and chains of redistributes, checked at every
// step against the full tensor, plus the gradient through the whole chain.
// A failure prints the command that replays its case (support/property.h).
#include "helpers.h"

using namespace tessera;
using tessera::test::make_dtensor_from_full;
using tessera::test::Rng;
using tessera::test::shard_matches;

namespace {

Placement random_placement(Rng& rng, int64_t ndim, bool allow_partial) {
  switch (rng.uniform(0, allow_partial ? 3 : 2)) {
    case 0:
    case 1:
      if (ndim > 0) return Shard(rng.uniform(-ndim, ndim - 1));
      return Replicate();
    case 2: return Replicate();
    default: {
      static const PartialOp ops[] = {PartialOp::Sum, PartialOp::Avg, PartialOp::Max,
                                      PartialOp::Min};
      return Partial(ops[rng.uniform(0, 3)]);
    }
  }
}

Placements random_placements(Rng& rng, int64_t mesh_ndim, int64_t ndim, bool partial) {
  Placements p;
  for (int64_t d = 0; d < mesh_ndim; ++d) p.push_back(random_placement(rng, ndim, partial));
  return p;
}

std::vector<ShardTable> maybe_uneven(Rng& rng, const DeviceMesh& mesh, const Placements& p,
                                     const std::vector<int64_t>& shape) {
  if (rng.uniform(0, 3) == 0) return {};  // chunk layout
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

// One random case on `mesh`: a source layout and a chain of 1-4 redistributes, each step
// checked shard by shard, then the gradient through the chain.
void run_case(const DeviceMesh& mesh, Rng& rng, const std::string& label) {
  const int64_t ndim = rng.uniform(1, 3);
  std::vector<int64_t> shape;
  for (int64_t i = 0; i < ndim; ++i) shape.push_back(rng.uniform(0, 6));
  const auto dtype = rng.uniform(0, 3) == 0 ? at::kDouble : at::kFloat;
  const uint64_t data_seed = rng.bits();
  const auto full = tessera::test::randn(shape, data_seed, dtype);
  auto src_p = random_placements(rng, mesh.ndim(), ndim, /*partial=*/true);
  auto src_t = maybe_uneven(rng, mesh, src_p, shape);
  std::string ctx = label + ": mesh " + shape_str(mesh.shape()) + " shape " + shape_str(shape) +
                    " " + c10::toString(dtype) + " src " + to_string(src_p) + tables_str(src_t);
  auto x = make_dtensor_from_full(full, mesh, src_p, src_t).detach().requires_grad_();
  at::Tensor y = x;
  const int64_t steps = rng.uniform(1, 4);
  for (int64_t s = 0; s < steps; ++s) {
    auto p = random_placements(rng, mesh.ndim(), ndim, false);
    auto t = maybe_uneven(rng, mesh, p, shape);
    ctx += " -> " + to_string(p) + tables_str(t);
    y = redistribute(y, std::make_shared<DTensorSpec>(mesh, p, shape, dtype, t));
    ASSERT_TRUE(shard_matches(y, full)) << ctx;
  }
  const auto g = tessera::test::randn(shape, data_seed + 7919, dtype);
  to_local(y).backward(tessera::test::local_block(g, spec(y)));
  ASSERT_TRUE(tessera::test::full_matches(x.grad(), g)) << ctx << " (backward)";
}

}  // namespace

// 6 meshes x 200 cases = 1,200 random cases per run.
class RedistributeProperty : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(RedistributeProperty, RandomChainsMatchOneDevice) {
  tessera::test::Sweep sweep;
  const auto cases = sweep.cases(200);
  if (!cases.any()) return;
  tessera::test::on_mesh(GetParam(), [&](const DeviceMesh& mesh) {
    cases.run([&](Rng& rng, int64_t c) { run_case(mesh, rng, sweep.label(c)); });
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, RedistributeProperty,
                         ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                           std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                           std::vector<int64_t>{2, 2}, std::vector<int64_t>{2, 3}),
                         [](const auto& info) { return tessera::test::mesh_name(info.param); });
