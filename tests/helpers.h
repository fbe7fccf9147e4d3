#pragma once
// Shared test helpers: building distributed tensors with any placements (Partial included)
// and any shard tables from a full tensor, cutting a rank's block out of a full tensor,
// and random layouts. Everything is deterministic from a seed, so all ranks agree.
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <gtest/gtest.h>

#include "support/compare.h"
#include "support/property.h"
#include "tessera/tessera.h"
#include "tessera/testing/run_ranks.h"

namespace tessera::test {

// Ranks are threads: never use the global generator in tests (threads would interleave on
// it); every rank makes its own generator from the same seed.
inline at::Generator generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}
inline at::Tensor randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  auto g = generator(seed);
  if (at::isIntegralType(dtype, true)) return at::randint(-50, 50, shape, g, at::kLong).to(dtype);
  return at::randn(shape, g, at::TensorOptions().dtype(dtype));
}

// The block of `full` this rank holds under `spec` (partial dims ignored).
inline at::Tensor local_block(const at::Tensor& full, const DTensorSpec& spec) {
  auto off = spec.local_offsets();
  auto len = spec.local_sizes();
  at::Tensor b = full;
  for (int64_t t = 0; t < spec.ndim(); ++t) b = b.narrow(t, off[t], len[t]);
  return b;
}

// Offsets whose sum over a mesh dim is 0 (avg terms) and weights whose sum is exactly 1.
inline double avg_offset(int64_t c, int64_t n) {
  static const double o2[] = {-1, 1}, o3[] = {-1, 0, 1}, o4[] = {-1, 1, -2, 2};
  if (n == 1) return 0;
  if (n == 2) return o2[c];
  if (n == 3) return o3[c];
  if (n == 4) return o4[c];
  return 0;  // larger mesh dims: equal terms
}
inline double sum_weight(int64_t c, int64_t n) {
  // Powers of two, so terms add back exactly in floating point.
  if (n == 1) return 1;
  if (n == 2) return 0.5;
  if (n == 3) return c == 2 ? 0.5 : 0.25;
  if (n == 4) return 0.25;
  return c == 0 ? 1.0 : 0.0;
}

// A distributed tensor with `placements` and `tables` whose global value is `full` (on
// every rank). Partial mesh dims get terms that reduce back to `full` exactly.
inline at::Tensor make_dtensor_from_full(const at::Tensor& full, const DeviceMesh& mesh,
                                         const Placements& placements,
                                         std::vector<ShardTable> tables = {}) {
  DTensorSpec spec(mesh, placements, full.sizes().vec(), full.scalar_type(), tables);
  at::Tensor local = local_block(full, spec).clone();
  const bool integral = at::isIntegralType(full.scalar_type(), true);
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    const auto& p = placements[d];
    if (!p.is_partial()) continue;
    const int64_t c = mesh.coordinate()[d], n = mesh.size(d);
    switch (p.reduce_op()) {
      case PartialOp::Sum:
        if (integral)
          local = c == 0 ? local - 7 * (n - 1) : at::full_like(local, 7);
        else
          local = local * sum_weight(c, n);
        break;
      case PartialOp::Avg: local = local + avg_offset(c, n) * (integral ? 2 : 1); break;
      case PartialOp::Max: local = c == 0 ? local : local - 3; break;
      case PartialOp::Min: local = c == 0 ? local : local + 3; break;
    }
  }
  local = local.to(full.scalar_type());
  return from_local(local, mesh, placements, {ShardSizes::Given(spec.shard_tables())});
}

// Random shard sizes summing to `total` over `parts` pieces; zero-size pieces are likely.
inline ShardTable random_table(Rng& rng, int64_t total, int64_t parts) {
  ShardTable t(parts, 0);
  for (int64_t i = 0; i < total; ++i) t[rng.uniform(0, parts - 1)]++;
  return t;
}

// Random tables for every tensor dim that `placements` shards.
inline std::vector<ShardTable> random_tables(Rng& rng, const DeviceMesh& mesh,
                                             const Placements& placements,
                                             const std::vector<int64_t>& sizes) {
  std::vector<ShardTable> tables(sizes.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    int64_t parts = 1;
    bool sharded = false;
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].is_shard(static_cast<int64_t>(t))) parts *= mesh.size(m), sharded = true;
    if (sharded) tables[t] = random_table(rng, sizes[t], parts);
  }
  return tables;
}

inline std::string describe(const at::Tensor& dt) { return spec(dt).str(); }

// Compare with a tolerance that is exact for integers.
inline bool same_values(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (at::isIntegralType(a.scalar_type(), true)) return at::equal(a, b);
  return at::allclose(a, b, 1e-5, 1e-6);
}

using Fn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

struct Operand {
  std::vector<int64_t> shape;
  Placements placements;
  std::vector<ShardTable> tables = {};
};

// Runs fn on distributed operands and on the full tensors; compares value and gradients
// (a mismatch names the first differing index and the ranks that hold it).
inline void differential(const DeviceMesh& mesh, const std::vector<Operand>& ops, const Fn& fn,
                         const std::string& what, uint64_t seed = 7) {
  std::vector<at::Tensor> full, dist;
  for (size_t i = 0; i < ops.size(); ++i) {
    full.push_back(tessera::test::randn(ops[i].shape, seed + i).requires_grad_());
    dist.push_back(
        make_dtensor_from_full(full.back().detach(), mesh, ops[i].placements, ops[i].tables)
            .detach()
            .requires_grad_());
  }
  auto expected = fn(full);
  auto got = fn(dist);
  ASSERT_TRUE(is_dtensor(got)) << what << ": result is not distributed";
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  ASSERT_TRUE(full_matches(got, expected)) << what << " (forward)";
  if (!at::isFloatingType(expected.scalar_type())) return;
  auto g = tessera::test::randn(expected.sizes(), seed + 100);
  expected.backward(g);
  // Feed the same global gradient in the result's layout.
  auto gd = distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(), std::nullopt,
                              ShardSizes::Given(spec(got).shard_tables()));
  got.backward(gd);
  for (size_t i = 0; i < ops.size(); ++i) {
    ASSERT_TRUE(dist[i].grad().defined()) << what << " operand " << i << " has no gradient";
    ASSERT_TRUE(full_matches(dist[i].grad(), full[i].grad()))
        << what << " (gradient of operand " << i << ")";
  }
}

}  // namespace tessera::test
