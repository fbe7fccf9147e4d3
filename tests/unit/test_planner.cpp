// The redistribute planner and its byte model (include/tessera/redistribute/redistribute.h)
// without communication: plans are built on detached meshes and checked against the
// primitives the header documents (which placement change each step makes, what it costs).
#include <map>

#include "helpers.h"

using namespace tessera;
using tessera::test::Rng;

namespace {

Placement random_placement(Rng& rng, int64_t ndim, bool partial) {
  static const PartialOp ops[] = {PartialOp::Sum, PartialOp::Avg, PartialOp::Max, PartialOp::Min};
  const int64_t k = rng.uniform(0, partial ? 5 : 4);
  if (k < 3) return Shard(rng.uniform(0, ndim - 1));
  if (k < 5) return Replicate();
  return Partial(ops[rng.uniform(0, 3)]);
}

SpecPtr random_spec(Rng& rng, const DeviceMesh& mesh, const std::vector<int64_t>& sizes,
                    c10::ScalarType dtype, bool partial) {
  Placements p;
  for (int64_t m = 0; m < mesh.ndim(); ++m)
    p.push_back(random_placement(rng, static_cast<int64_t>(sizes.size()), partial));
  auto tables =
      rng.coin(0.6) ? tessera::test::random_tables(rng, mesh, p, sizes) : std::vector<ShardTable>{};
  return std::make_shared<DTensorSpec>(mesh, p, sizes, dtype, tables);
}

c10::ScalarType random_dtype(Rng& rng) {
  static const std::vector<c10::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kLong,
                                                      at::kHalf};
  return rng.pick(dtypes);
}

// The placement change each primitive makes on its mesh dim.
bool step_matches(StepKind k, const Placement& a, const Placement& b) {
  switch (k) {
    case StepKind::AllGather: return a.is_shard() && b.is_replicate();
    case StepKind::LocalSlice: return a.is_replicate() && b.is_shard();
    case StepKind::AllReduce: return a.is_partial() && b.is_replicate();
    case StepKind::ReduceScatter: return a.is_partial() && b.is_shard();
    case StepKind::AllToAll: return a.is_shard() && b.is_shard();
    case StepKind::ToPartial: return a.is_replicate() && b.is_partial();
    case StepKind::Relayout:
      return a.is_shard() && b.is_shard() && a.dim() == b.dim() &&
             a.is_head_tail() != b.is_head_tail();
  }
  return false;
}

// Bytes one rank sends for a step (per the header), B = the average local bytes before it.
double step_bytes(const RedistributeStep& st) {
  const DTensorSpec& s = *st.before;
  double shards = 1;
  for (int64_t m = 0; m < s.mesh().ndim(); ++m)
    if (s.placement(m).is_shard()) shards *= static_cast<double>(s.mesh().size(m));
  const double elem =
      static_cast<double>(at::empty({}, at::TensorOptions().dtype(s.dtype())).element_size());
  const double b = static_cast<double>(s.numel()) * elem / shards;
  const double n = static_cast<double>(s.mesh().size(st.mesh_dim));
  switch (st.kind) {
    case StepKind::AllGather: return (n - 1) * b;
    case StepKind::AllReduce: return 2 * (n - 1) / n * b;
    case StepKind::ReduceScatter:
    case StepKind::AllToAll:
    case StepKind::Relayout: return (n - 1) / n * b;
    default: return 1e-3;  // free steps carry a token cost so that fewer steps win
  }
}

std::vector<int64_t> random_sizes(Rng& rng) {
  std::vector<int64_t> sizes(rng.uniform(1, 3));
  for (auto& s : sizes) s = rng.uniform(0, 9);
  return sizes;
}

std::string describe(const DTensorSpec& from, const DTensorSpec& to, const RedistributePlan& plan) {
  return from.str() + " -> " + to.str() + ": " + plan.str();
}

}  // namespace

// On one mesh dim the plan is one primitive per placement change (two via Replicate where
// the target is Partial, or from one Partial op to another).
TEST(Planner, OneMeshDimTakesTheDirectPrimitive) {
  tessera::test::Sweep sweep;
  sweep.cases(500).run([](Rng& rng, int64_t) {
    const auto mesh = tessera::test::detached_mesh({rng.uniform(1, 4)});
    const auto sizes = random_sizes(rng);
    const auto dtype = random_dtype(rng);
    const auto from = random_spec(rng, mesh, sizes, dtype, true);
    const auto to = random_spec(rng, mesh, sizes, dtype, rng.coin(0.2));
    const auto plan = plan_redistribute(from, to);
    const Placement &a = from->placement(0), &b = to->placement(0);
    std::vector<StepKind> expected;
    if (*from == *to)
      expected = {};
    else if (a.is_partial() && b.is_shard())
      expected = {StepKind::ReduceScatter};
    else if (a.is_partial())
      expected = {StepKind::AllReduce};
    else if (a.is_shard() && b.is_shard())
      expected = {StepKind::AllToAll};
    else if (a.is_shard())
      expected = {StepKind::AllGather};
    else if (b.is_shard())
      expected = {StepKind::LocalSlice};
    if (b.is_partial() && a != b) expected.push_back(StepKind::ToPartial);
    std::vector<StepKind> got;
    for (const auto& st : plan->steps) got.push_back(st.kind);
    EXPECT_EQ(got, expected) << describe(*from, *to, *plan);
  });
}

// Any mesh: the steps chain from the source to the target, each changes only its own mesh
// dim's placement in the way its primitive does, no mesh dim moves more than twice, the
// modelled bytes are the steps' bytes, and plans are cached.
TEST(Planner, PlansAreChainsOfPrimitives) {
  tessera::test::Sweep sweep;
  sweep.cases(500).run([](Rng& rng, int64_t) {
    std::vector<int64_t> mesh_shape(rng.uniform(1, 3));
    for (auto& s : mesh_shape) s = rng.uniform(1, 3);
    const auto mesh = tessera::test::detached_mesh(mesh_shape);
    const auto sizes = random_sizes(rng);
    const auto dtype = random_dtype(rng);
    const auto from = random_spec(rng, mesh, sizes, dtype, true);
    const auto to = random_spec(rng, mesh, sizes, dtype, rng.coin(0.2));
    const auto plan = plan_redistribute(from, to);
    const std::string what = describe(*from, *to, *plan);
    EXPECT_EQ(plan_redistribute(from, to), plan) << "not cached: " << what;

    const DTensorSpec* cur = from.get();
    std::map<int64_t, int> moves;
    double bytes = 0;
    for (const auto& st : plan->steps) {
      ASSERT_TRUE(*st.before == *cur)
          << "the chain breaks before " << to_string(st.kind) << ": " << what;
      for (int64_t m = 0; m < mesh.ndim(); ++m) {
        if (m == st.mesh_dim) continue;
        EXPECT_EQ(st.before->placement(m), st.after->placement(m))
            << to_string(st.kind) << " on mesh dim " << st.mesh_dim << " changed mesh dim " << m
            << ": " << what;
      }
      EXPECT_TRUE(step_matches(st.kind, st.before->placement(st.mesh_dim),
                               st.after->placement(st.mesh_dim)))
          << to_string(st.kind) << " from " << st.before->str() << " to " << st.after->str() << ": "
          << what;
      ++moves[st.mesh_dim];
      bytes += step_bytes(st);
      cur = st.after.get();
    }
    EXPECT_TRUE(*cur == *to) << "ends at " << cur->str() << ": " << what;
    for (auto [m, n] : moves) EXPECT_LE(n, 2) << "mesh dim " << m << ": " << what;
    const double cost = redistribute_cost(from, to);
    EXPECT_NEAR(cost, *from == *to ? 0.0 : bytes, 1e-9 * std::max(1.0, bytes)) << what;
  });
}
