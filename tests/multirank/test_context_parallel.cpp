// Scaled dot-product attention with the query's sequence dim sharded (issue 28, the K/V
// all-gather variant) against one device, forward and every gradient, float64: causal and
// not, uneven and empty sequence shards on 1-3 ranks, batch and sequence on a 2x2 mesh, an
// empty batch shard, and a masked call (which keeps LibTorch's composite path). LibTorch 2.x
// only (the fused CPU op).
#include <algorithm>
#include <numeric>

#include <torch/version.h>

#include "helpers.h"

#if TORCH_VERSION_MAJOR >= 2  // LibTorch 1.13 has no scaled_dot_product_attention

using namespace tessera;

namespace {

bool has_fused_cpu_attention() {
  return c10::Dispatcher::singleton()
      .findOp({"aten::_scaled_dot_product_flash_attention_for_cpu", ""})
      .has_value();
}

TEST(ContextParallel, SequenceShardedAttentionMatchesOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  for (bool causal : {false, true}) {
    for (const ShardTable& rows : std::vector<ShardTable>{{7}, {4, 3}, {3, 0, 4}}) {
      const int world = static_cast<int>(rows.size());
      auto q = test::randn({2, 3, 7, 4}, 1, at::kDouble).requires_grad_();
      auto k = test::randn({2, 3, 7, 4}, 2, at::kDouble).requires_grad_();
      auto v = test::randn({2, 3, 7, 4}, 3, at::kDouble).requires_grad_();
      auto expected = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
      auto g = test::randn(expected.sizes(), 4, at::kDouble);
      expected.backward(g);
      const std::string desc =
          std::string(causal ? "causal" : "full") + ", " + std::to_string(world) + " ranks";
      tessera::testing::run_ranks(world, [&](int) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {world});
        const std::vector<ShardTable> tables = {{}, {}, rows};
        auto dq =
            test::make_dtensor_from_full(q.detach(), mesh, {Shard(2)}, tables).requires_grad_();
        auto dk =
            test::make_dtensor_from_full(k.detach(), mesh, {Shard(2)}, tables).requires_grad_();
        auto dv =
            test::make_dtensor_from_full(v.detach(), mesh, {Shard(2)}, tables).requires_grad_();
        auto got = at::scaled_dot_product_attention(dq, dk, dv, {}, 0.0, causal);
        EXPECT_EQ(spec(got).placements(), Placements{Shard(2)}) << desc;
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << desc << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, {Shard(2)}, tables));
        EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << desc << ": dq";
        EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << desc << ": dk";
        EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << desc << ": dv";
      });
    }
  }
}

// One case: q, k, v [2, 3, 7, 4] laid out with `placements` / `tables` on `shape`, `mask`
// (undefined: none) given whole to every rank, against one device.
void expect_one_device(const std::vector<int64_t>& shape, const Placements& placements,
                       const std::vector<ShardTable>& tables, bool causal, const at::Tensor& mask,
                       const std::string& desc) {
  const test::Tolerance tol{1e-10, 1e-11};
  auto q = test::randn({2, 3, 7, 4}, 11, at::kDouble).requires_grad_();
  auto k = test::randn({2, 3, 7, 4}, 12, at::kDouble).requires_grad_();
  auto v = test::randn({2, 3, 7, 4}, 13, at::kDouble).requires_grad_();
  const c10::optional<at::Tensor> m =
      mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt;
  auto expected = at::scaled_dot_product_attention(q, k, v, m, 0.0, causal);
  auto g = test::randn(expected.sizes(), 14, at::kDouble);
  expected.backward(g);
  tessera::testing::run_ranks(test::mesh_world(shape), [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", shape);
    auto lay = [&](const at::Tensor& t) {
      return test::make_dtensor_from_full(t.detach(), mesh, placements, tables).requires_grad_();
    };
    auto dq = lay(q), dk = lay(k), dv = lay(v);
    auto got = at::scaled_dot_product_attention(dq, dk, dv, m, 0.0, causal);
    EXPECT_TRUE(test::full_matches(got, expected, tol)) << desc << ": output";
    got.backward(
        test::make_dtensor_from_full(g, mesh, spec(got).placements(), spec(got).shard_tables()));
    EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << desc << ": dq";
    EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << desc << ": dk";
    EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << desc << ": dv";
  });
}

TEST(ContextParallel, BatchAndSequenceOnATwoByTwoMesh) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  for (bool causal : {false, true})
    expect_one_device({2, 2}, {Shard(0), Shard(2)}, {{2, 0}, {}, {3, 4}}, causal, {},
                      std::string("2x2, batch 2+0, sequence 3+4, ") + (causal ? "causal" : "full"));
}

TEST(ContextParallel, EmptyBatchShardAndHeadShards) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  expect_one_device({3}, {Shard(0)}, {{0, 2, 0}}, true, {}, "batch 0+2+0");
  expect_one_device({2}, {Shard(1)}, {{}, {3, 0}}, false, {}, "heads 3+0");
}

TEST(ContextParallel, MaskedCallsEqualOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const auto mask = test::randn({7, 7}, 15, at::kDouble);
  expect_one_device({2}, {Shard(2)}, {{}, {}, {5, 2}}, false, mask, "[L, S] mask, 5+2");
  expect_one_device({3}, {Shard(2)}, {{}, {}, {0, 3, 4}}, false, mask, "[L, S] mask, 0+3+4");
  const auto full = test::randn({2, 1, 7, 7}, 16, at::kDouble);
  expect_one_device({2, 2}, {Shard(0), Shard(2)}, {{1, 1}, {}, {4, 3}}, false, full,
                    "[B, 1, L, S] mask on 2x2");
  const auto keep = test::randn({7, 7}, 17, at::kDouble).gt(-1.0);  // boolean, no empty rows
  expect_one_device({2}, {Shard(2)}, {{}, {}, {2, 5}}, false, keep, "boolean mask, 2+5");
}

// K and V in other layouts than the query's split heads (replicated, sequence shards, batch
// shards) are brought to the query's batch and heads split first.
TEST(ContextParallel, KeysAndValuesFollowTheQuerysHeads) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  auto q = test::randn({2, 4, 6, 4}, 41, at::kDouble).requires_grad_();
  auto k = test::randn({2, 4, 6, 4}, 42, at::kDouble).requires_grad_();
  auto v = test::randn({2, 4, 6, 4}, 43, at::kDouble).requires_grad_();
  auto expected = at::scaled_dot_product_attention(q, k, v);
  expected.sum().backward();
  const test::Tolerance tol{1e-10, 1e-11};
  for (const Placements& kv :
       {Placements{Replicate()}, Placements{Shard(2)}, Placements{Shard(0)}}) {
    tessera::testing::run_ranks(2, [&](int) {
      at::set_num_threads(1);
      auto mesh = init_device_mesh("cpu", {2});
      auto dq = distribute_tensor(q.detach(), mesh, {Shard(1)}).requires_grad_();
      auto dk = distribute_tensor(k.detach(), mesh, kv).requires_grad_();
      auto dv = distribute_tensor(v.detach(), mesh, kv).requires_grad_();
      auto got = at::scaled_dot_product_attention(dq, dk, dv);
      EXPECT_TRUE(test::full_matches(got, expected, tol)) << kv[0].str();
      got.sum().backward();
      EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << kv[0].str() << ": dq";
      EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << kv[0].str() << ": dk";
      EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << kv[0].str() << ": dv";
    });
  }
}

// Bytes: the forward gathers K and V along the sequence and nothing else moves (queries stay);
// each rank receives at least the rows it lacks, (S - s_r) of K and of V, and at most the
// padded all-gather's (P - 1) x max(s) rows. The backward moves only dK and dV home, within
// the same bounds.
TEST(ContextParallel, BytesAreTheKeyValueGatherOnly) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  for (const ShardTable& rows : std::vector<ShardTable>{{4, 3}, {3, 0, 4}, {2, 2, 2}}) {
    const int world = static_cast<int>(rows.size());
    const int64_t seq = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    const int64_t row_bytes = 2 * 3 * 4 * 8;  // B x H x E doubles per sequence row
    const int64_t most = *std::max_element(rows.begin(), rows.end());
    tessera::testing::run_ranks(world, [&](int rank) {
      at::set_num_threads(1);
      auto mesh = init_device_mesh("cpu", {world});
      const std::vector<ShardTable> tables = {{}, {}, rows};
      auto lay = [&](uint64_t seed) {
        return test::make_dtensor_from_full(test::randn({2, 3, seq, 4}, seed, at::kDouble), mesh,
                                            {Shard(2)}, tables)
            .requires_grad_();
      };
      auto q = lay(31), k = lay(32), v = lay(33);
      const int64_t least = 2 * (seq - rows[rank]) * row_bytes;
      const int64_t padded = 2 * (world - 1) * most * row_bytes;
      const std::string desc = std::to_string(world) + " ranks, rank " + std::to_string(rank);
      at::Tensor out;
      {
        CommDebugMode comm;
        const at::Tensor query =
            std::getenv("CP_BYTES_MUTANT") ? redistribute(q, {Replicate()}) : q;
        out = at::scaled_dot_product_attention(query, k, v, c10::nullopt, 0.0, true);
        EXPECT_GE(comm.total_bytes_received(), least) << desc << ": forward";
        EXPECT_LE(comm.total_bytes_received(), padded) << desc << ": forward";
        EXPECT_EQ(comm.get_comm_counts().count("all_to_all"), 0u) << desc << comm.to_json();
      }
      CommDebugMode comm;
      out.backward(at::ones_like(out));
      EXPECT_GE(comm.total_bytes_received(), least) << desc << ": backward";
      EXPECT_LE(comm.total_bytes_received(), padded) << desc << ": backward " << comm.to_json();
    });
  }
}

// The fused kernel's own dropout would draw per rank: a direct call with dropout raises on
// every rank, whatever the layout (scaled_dot_product_attention keeps the composite path).
TEST(ContextParallel, FusedKernelDropoutRaises) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const auto q = test::randn({2, 3, 6, 4}, 21, at::kDouble);
  for (const Placements& p : {Placements{Replicate()}, Placements{Shard(2)}}) {
    tessera::testing::run_ranks(2, [&](int) {
      auto mesh = init_device_mesh("cpu", {2});
      auto d = distribute_tensor(q, mesh, p);
      try {
        at::_scaled_dot_product_flash_attention_for_cpu(d, d, d, 0.5);
        ADD_FAILURE() << "no error for dropout on " << p[0].str();
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("dropout inside the fused attention kernel"),
                  std::string::npos)
            << e.what();
      }
    });
  }
}

}  // namespace

#endif  // TORCH_VERSION_MAJOR >= 2
