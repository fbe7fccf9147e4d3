#pragma once
// The tests' helpers, the one header test files include: building distributed tensors with
// any placements (Partial included) and any shard tables from a full tensor, cutting a rank's
// block out of a full tensor, random layouts, meshes (support/meshes.h), comparisons
// (support/compare.h), seeded cases (support/property.h), the small U-Net
// (support/small_unet.h), errors expected on every rank, module copies, temporary folders.
// Everything is deterministic from a seed, so all ranks agree.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <gtest/gtest.h>

#include "support/compare.h"
#include "support/meshes.h"
#include "support/property.h"
#include "support/small_unet.h"
#include "tessera/tessera.h"
#include "tessera/testing/run_ranks.h"

namespace tessera::test {

// Whether this LibTorch has the fused CPU attention pair (2.x) that context parallelism's
// sharding rule sits on.
inline bool has_fused_cpu_attention() {
  return c10::Dispatcher::singleton()
      .findOp({"aten::_scaled_dot_product_flash_attention_for_cpu", ""})
      .has_value();
}

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
  return block_at(full, spec, spec.mesh().coordinate());
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

// Runs body(rank) on `world` ranks (collective timeout 10 s): every rank must throw a
// c10::Error within `within` (well before a collective times out) whose message contains
// every needle. Errors, not hangs.
inline void expect_error_everywhere(int world, const std::function<void(int)>& body,
                                    const std::vector<std::string>& needles,
                                    std::chrono::seconds within = std::chrono::seconds(5)) {
  std::atomic<int> threw{0};
  std::mutex mu;
  std::vector<std::string> messages(world);
  tessera::testing::RunOptions quick;
  quick.collective_timeout = std::chrono::seconds(10);
  quick.timeout = std::chrono::seconds(40);
  tessera::testing::run_ranks(
      world,
      [&](int rank) {
        const auto start = std::chrono::steady_clock::now();
        std::string msg;
        try {
          body(rank);
          ADD_FAILURE() << "rank " << rank << ": no error";
        } catch (const c10::Error& e) {
          msg = e.what_without_backtrace();
          ++threw;
        } catch (const std::exception& e) {
          ADD_FAILURE() << "rank " << rank << ": not a c10::Error: " << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, within)
            << "rank " << rank << " raised only after a collective timed out: " << msg;
        std::lock_guard<std::mutex> lock(mu);
        messages[rank] = msg;
      },
      quick);
  EXPECT_EQ(threw.load(), world);
  for (int r = 0; r < world; ++r) {
    if (messages[r].empty()) continue;
    for (const auto& n : needles)
      EXPECT_NE(messages[r].find(n), std::string::npos)
          << "rank " << r << "'s message lacks \"" << n << "\": " << messages[r];
  }
}

// A copy of a module with its own parameters (module->clone()), as the holder or the
// pointer it was given.
template <class Holder>
Holder clone_of(const Holder& m) {
  using Impl = typename Holder::ContainedType;
  return Holder(std::dynamic_pointer_cast<Impl>(m->clone()));
}
template <class Impl>
std::shared_ptr<Impl> clone_of(const std::shared_ptr<Impl>& m) {
  return std::dynamic_pointer_cast<Impl>(m->clone());
}

// A new empty directory under the system's temporary directory (made on the test thread, so
// every rank gets the same path).
inline std::string fresh_dir(const std::string& what) {
  static std::atomic<int> counter{0};
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() /
      ("tessera-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" + what);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

}  // namespace tessera::test
