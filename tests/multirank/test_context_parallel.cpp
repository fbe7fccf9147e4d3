// Scaled dot-product attention with the query's sequence dim sharded (context parallelism)
// against one device, forward and every gradient, float64, under both K/V exchanges (the ring
// and the all-gather, NOTE: [Ring attention]): causal and not, uneven and empty sequence
// shards on 1-5 ranks, batch and sequence on a 2x2 mesh, an empty batch shard, masks,
// cross-attention lengths, and the bytes each exchange moves. LibTorch 2.x only (the fused
// CPU op).
#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>

#include <torch/library.h>
#include <torch/version.h>

#include "helpers.h"
#include "ops/attention_ring.h"
#include "support/attention.h"

#if TORCH_VERSION_MAJOR >= 2  // LibTorch 1.13 has no scaled_dot_product_attention

using namespace tessera;
namespace attention = tessera::ops::attention;

namespace {

using test::has_fused_cpu_attention;

using KVMethod = ContextParallelMethod;

// Pins the K/V exchange for a scope (process-wide: every rank thread sees it).
struct PinMethod {
  explicit PinMethod(KVMethod m) : before(set_context_parallel_method(m)) {}
  ~PinMethod() { set_context_parallel_method(before); }
  KVMethod before;
};

// Pins the causal ring's load balancing for a scope (process-wide, as above).
struct PinBalance {
  explicit PinBalance(bool on) : before(set_context_parallel_load_balance(on)) {}
  ~PinBalance() { set_context_parallel_load_balance(before); }
  bool before;
};

// Pins the kernel of each block for a scope (NOTE: [Block kernels]; process-wide, as above).
// The matrix products run in tiles of at most `tile` scores over batch and heads (tiny by
// default, so that every block is cut into many tiles of rows and keys).
struct PinKernel {
  explicit PinKernel(attention::BlockKernel k, int64_t tile = 40)
      : before(attention::set_block_kernel(k)), tile_before(attention::set_products_tile(tile)) {}
  ~PinKernel() {
    attention::set_block_kernel(before);
    attention::set_products_tile(tile_before);
  }
  attention::BlockKernel before;
  int64_t tile_before;
};

const std::vector<attention::BlockKernel> kKernels = {attention::BlockKernel::kFusedOnCpu,
                                                      attention::BlockKernel::kProducts};
const char* kernel_name(attention::BlockKernel k) {
  return k == attention::BlockKernel::kProducts ? "matrix products" : "fused kernel";
}

// Runs `body` under the ring and under the all-gather, each with LibTorch's fused CPU kernel
// and with the matrix products other devices run; all must equal one device.
template <class Body>
void each_method(Body body) {
  for (const KVMethod m : {KVMethod::kRing, KVMethod::kAllGather}) {
    for (const auto kernel : kKernels) {
      SCOPED_TRACE(std::string(m == KVMethod::kRing ? "ring, " : "all-gather, ") +
                   kernel_name(kernel));
      PinMethod pin(m);
      PinKernel pin_kernel(kernel);
      body();
    }
  }
}

TEST(ContextParallel, SequenceShardedAttentionMatchesOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  each_method([&] {
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
  });
}

// One case: q, k, v [2, 3, 7, 4] laid out with `placements` / `tables` on `shape` (dims
// named `names`, or unnamed), `mask` (undefined: none) given whole to every rank, against one
// device.
void expect_one_device_with(const std::vector<int64_t>& shape, const Placements& placements,
                            const std::vector<ShardTable>& tables, bool causal,
                            const at::Tensor& mask, const std::string& desc,
                            const std::vector<std::string>& names = {}) {
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
    auto mesh = init_device_mesh("cpu", shape, names);
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

// The same under each K/V exchange.
void expect_one_device(const std::vector<int64_t>& shape, const Placements& placements,
                       const std::vector<ShardTable>& tables, bool causal, const at::Tensor& mask,
                       const std::string& desc, const std::vector<std::string>& names = {}) {
  each_method(
      [&] { expect_one_device_with(shape, placements, tables, causal, mask, desc, names); });
}

// Self-attention of `q` (requires grad) under the ring: no all-gather forward or backward,
// the output in q's layout, and K/V blocks received where `receives` (a rank with queries and
// a peer holding keys).
void expect_ring_only(const at::Tensor& q, int rank, bool receives) {
  at::Tensor out;
  {
    CommDebugMode comm;
    out = at::scaled_dot_product_attention(q, q, q);
    const auto counts = comm.get_comm_counts();
    EXPECT_EQ(counts.count("all_gather"), 0u) << "rank " << rank << ": " << comm.to_json();
    if (receives) {
      EXPECT_GT(counts.at("send_recv"), 0) << "rank " << rank;
    }
  }
  EXPECT_EQ(spec(out), spec(q));
  CommDebugMode comm;
  out.backward(at::ones_like(out));
  EXPECT_EQ(comm.get_comm_counts().count("all_gather"), 0u) << "rank " << rank << ": backward";
}

TEST(ContextParallel, BatchAndSequenceOnATwoByTwoMesh) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  for (bool causal : {false, true})
    expect_one_device({2, 2}, {Shard(0), Shard(2)}, {{2, 0}, {}, {3, 4}}, causal, {},
                      std::string("2x2, batch 2+0, sequence 3+4, ") + (causal ? "causal" : "full"));
}

// A float32 case as CUDA jobs run: q [2, 3, 13, 8], K/V with 3 heads or (gqa) 1, the
// sequence split as `rows` over a 1-D mesh, under the caller's block kernel: forward and every
// gradient against one device's float32 call.
struct Float32Case {
  KVMethod method;
  bool causal, balanced, masked, gqa = false;
  std::string str() const {
    return std::string(method == KVMethod::kRing ? "ring" : "all-gather") +
           (causal ? ", causal" : "") + (balanced ? ", balanced" : "") + (masked ? ", mask" : "") +
           (gqa ? ", 3 heads on 1" : "");
  }
};

void expect_float32_split_matches(const Float32Case& c, const ShardTable& rows,
                                  const std::string& what) {
  const test::Tolerance tol{2e-5, 2e-5};
  const int world = static_cast<int>(rows.size());
  const int64_t kv_heads = c.gqa ? 1 : 3;
  auto q = test::randn({2, 3, 13, 8}, 31).requires_grad_();
  auto k = test::randn({2, kv_heads, 13, 8}, 32).requires_grad_();
  auto v = test::randn({2, kv_heads, 13, 8}, 33).requires_grad_();
  const c10::optional<at::Tensor> m =
      c.masked ? c10::optional<at::Tensor>(test::randn({13, 13}, 34)) : c10::nullopt;
  auto expected = test::sdpa(q, k, v, m, c.causal, c.gqa);
  auto g = test::randn(expected.sizes(), 35);
  expected.backward(g);
  PinMethod pin(c.method);
  PinBalance balance(c.balanced);
  tessera::testing::run_ranks(world, [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {world});
    const std::vector<ShardTable> tables = {{}, {}, rows};
    auto lay = [&](const at::Tensor& t) {
      return test::make_dtensor_from_full(t.detach(), mesh, {Shard(2)}, tables).requires_grad_();
    };
    auto dq = lay(q), dk = lay(k), dv = lay(v);
    auto got = test::sdpa(dq, dk, dv, m, c.causal, c.gqa);
    EXPECT_TRUE(test::full_matches(got, expected, tol)) << what << ": output";
    got.backward(test::make_dtensor_from_full(g, mesh, {Shard(2)}, tables));
    EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << what << ": dq";
    EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << what << ": dk";
    EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << what << ": dv";
  });
}

// The matrix-product blocks (the kernels of non-CPU devices) in float32: the ring, causal
// balanced and not, masked all-gathers, tiles from one score to the whole block, on 3 ranks
// (one shard empty).
TEST(ContextParallel, MatrixProductBlocksInFloat32) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  // Tiles of scores over batch and heads (6 here): from one score to the whole block.
  for (const auto& [c, tile] :
       {std::pair{Float32Case{KVMethod::kRing, true, true, false}, 40},
        std::pair{Float32Case{KVMethod::kRing, true, false, false}, 1 << 24},
        std::pair{Float32Case{KVMethod::kRing, false, false, true}, 100},
        std::pair{Float32Case{KVMethod::kAllGather, false, false, true}, 1},
        std::pair{Float32Case{KVMethod::kAllGather, true, false, false}, 50}}) {
    PinKernel products(attention::BlockKernel::kProducts, tile);
    expect_float32_split_matches(c, {5, 0, 8}, c.str() + ", tiles of " + std::to_string(tile));
  }
}

// bfloat16, as mixed-precision training runs attention: the log-sum-exp the fused pair returns
// (and its backward takes) is float32 beside bfloat16 q / k / v / out. Sequence split (uneven,
// one shard empty) and heads split, causal and not, under each exchange and block kernel;
// forward and every gradient against one device's bfloat16 call.
TEST(ContextParallel, BFloat16MatchesOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{2e-2, 2e-2};
  auto q = test::randn({2, 4, 13, 8}, 51).to(at::kBFloat16).requires_grad_();
  auto k = test::randn({2, 4, 13, 8}, 52).to(at::kBFloat16).requires_grad_();
  auto v = test::randn({2, 4, 13, 8}, 53).to(at::kBFloat16).requires_grad_();
  struct Split {
    int64_t dim;
    ShardTable table;
  };
  each_method([&] {
    for (const bool causal : {true, false}) {
      for (const Split& split : {Split{2, {5, 0, 8}}, Split{1, {2, 0, 2}}}) {
        const std::string what = std::string(split.dim == 2 ? "sequence" : "heads") + " split" +
                                 (causal ? ", causal" : "");
        for (auto* t : {&q, &k, &v}) t->mutable_grad() = at::Tensor();
        auto expected = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
        auto g = test::randn(expected.sizes(), 54).to(at::kBFloat16);
        expected.backward(g);
        tessera::testing::run_ranks(3, [&](int) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {3});
          std::vector<ShardTable> tables(static_cast<size_t>(split.dim) + 1);
          tables.back() = split.table;
          const Placements p = {Shard(split.dim)};
          auto lay = [&](const at::Tensor& t) {
            return test::make_dtensor_from_full(t.detach(), mesh, p, tables).requires_grad_();
          };
          auto dq = lay(q), dk = lay(k), dv = lay(v);
          auto got = at::scaled_dot_product_attention(dq, dk, dv, {}, 0.0, causal);
          EXPECT_EQ(got.scalar_type(), at::kBFloat16) << what;
          EXPECT_TRUE(test::full_matches(got, expected, tol)) << what << ": output";
          got.backward(test::make_dtensor_from_full(g, mesh, p, tables));
          EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << what << ": dq";
          EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << what << ": dk";
          EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << what << ": dv";
        });
      }
    }
  });
}

// A stand-in on CPU for LibTorch's memory-efficient CUDA pair, with that pair's conventions
// and limits: log-sum-exp padded to a multiple of 32 rows (NaN in the padding, which nothing
// may read), backward reading it so; the output stored [B, L, H, E] and taken back so; no
// grouped heads, no bias, a head dim of whole 16 bytes, the last dim contiguous. Its blocks
// are the matrix products'.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_stand_in(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& bias, bool compute_lse, double dropout_p, bool causal,
    c10::optional<double> scale) {
  TORCH_CHECK(!bias && compute_lse && dropout_p == 0.0, "stand-in: bias, lse or dropout");
  TORCH_CHECK(q.size(1) == k.size(1) && k.size(1) == v.size(1), "stand-in: grouped heads");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->size(-1) % 4 == 0 && t->stride(-1) == 1, "stand-in: alignment");
  auto [out, lse] = attention::products_forward(q, k, v, {}, causal, scale);
  const int64_t rows = q.size(2), padded = (rows + 31) / 32 * 32;
  at::Tensor l = at::full({q.size(0), q.size(1), padded}, NAN, lse.options());
  l.narrow(-1, 0, rows).copy_(lse);
  const at::Tensor none = at::empty({}, at::dtype(at::kLong));
  return {out.transpose(1, 2).contiguous().transpose(1, 2), l, none, none};  // ([B, L, H, E])
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_backward_stand_in(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& bias, const at::Tensor& out, const at::Tensor& lse, const at::Tensor&,
    const at::Tensor&, double dropout_p, std::array<bool, 4> grad_input_mask, bool causal,
    c10::optional<double> scale) {
  TORCH_CHECK(!bias.defined() && dropout_p == 0.0 && !grad_input_mask[3], "stand-in: bias");
  TORCH_CHECK(q.size(1) == k.size(1) && k.size(1) == v.size(1), "stand-in: grouped heads");
  TORCH_CHECK(out.transpose(1, 2).is_contiguous(), "stand-in: out not stored [B, L, H, E]");
  TORCH_CHECK(
      lse.scalar_type() == at::kFloat && lse.size(-1) % 32 == 0 && lse.size(-1) >= q.size(2),
      "stand-in: log-sum-exp not padded to 32 rows: ", lse.sizes());
  auto [dq, dk, dv] = attention::products_backward(grad_out, q, k, v, out,
                                                   lse.narrow(-1, 0, q.size(2)), {}, causal, scale);
  return {dq, dk, dv, at::Tensor()};
}

TORCH_LIBRARY_IMPL(aten, CPU, m) {
  m.impl("_scaled_dot_product_efficient_attention", &efficient_stand_in);
  m.impl("_scaled_dot_product_efficient_attention_backward", &efficient_backward_stand_in);
}

// The route through LibTorch's memory-efficient pair (the CUDA block kernel, here its CPU
// stand-in) in float32: ring and all-gather, causal balanced and not, grouped-query heads,
// on 1-3 ranks (uneven, one shard empty), against one device; the pair computed the
// unmasked blocks, and a mask sends the blocks to the products.
TEST(ContextParallel, EfficientKernelBlocksMatchOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  for (const Float32Case& c : {Float32Case{KVMethod::kRing, true, true, false},
                               Float32Case{KVMethod::kRing, true, false, false},
                               Float32Case{KVMethod::kRing, false, false, false, true},
                               Float32Case{KVMethod::kRing, true, true, false, true},
                               Float32Case{KVMethod::kAllGather, true, false, false},
                               Float32Case{KVMethod::kAllGather, false, false, false, true},
                               Float32Case{KVMethod::kRing, false, false, true}}) {
    if (c.gqa && !test::kSdpaTakesGqa) continue;
    for (const ShardTable& rows : std::vector<ShardTable>{{13}, {6, 7}, {5, 0, 8}}) {
      const std::string what = c.str() + ", " + std::to_string(rows.size()) + " ranks";
      PinKernel efficient(attention::BlockKernel::kEfficient);
      const int64_t calls_before = attention::efficient_calls();
      expect_float32_split_matches(c, rows, what);
      if (c.masked) {
        EXPECT_EQ(attention::efficient_calls(), calls_before) << what;
      } else {
        EXPECT_GT(attention::efficient_calls(), calls_before) << what;
      }
    }
  }
}

// The sequence split over every dim of a mesh (nested Shard(2) on a 2x2 and a 2x3 mesh,
// uneven and empty pieces): one ring over the mesh's own group, in the table's order. Equal
// to one device under both exchanges, causal (balanced and not) and not, with a mask; and
// under the ring K/V go point to point (no all-gather) in forward and backward.
TEST(ContextParallel, SequenceOverAWholeMeshIsOneRing) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const auto mask = test::randn({7, 7}, 16, at::kDouble);
  const Placements seq2 = {Shard(2), Shard(2)};
  for (bool causal : {false, true}) {
    const std::string c = causal ? ", causal" : "";
    expect_one_device({2, 2}, seq2, {{}, {}, {2, 0, 3, 2}}, causal, {}, "2x2, 2+0+3+2" + c);
    expect_one_device({2, 3}, seq2, {{}, {}, {1, 2, 0, 1, 2, 1}}, causal, {}, "2x3" + c);
    for (bool on : {false, true}) {
      PinBalance balance(on);
      expect_one_device({2, 2}, seq2, {{}, {}, {1, 3, 3, 0}}, causal, {},
                        std::string("2x2, 1+3+3+0") + c + (on ? ", balanced" : ", natural"));
    }
  }
  expect_one_device({2, 2}, seq2, {{}, {}, {2, 2, 0, 3}}, false, mask, "2x2, mask");
  PinMethod ring(KVMethod::kRing);
  const auto x = test::randn({1, 2, 9, 4}, 17, at::kDouble);
  tessera::testing::run_ranks(4, [&](int rank) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {2, 2});
    auto q = test::make_dtensor_from_full(x, mesh, seq2, {{}, {}, {3, 2, 0, 4}}).requires_grad_();
    expect_ring_only(q, rank, /*receives=*/rank != 2);
  });
}

// The sequence split over some of a mesh's dims (two of three; the third splits the batch or
// the heads): one ring per slice of the others, over the slice's members in the table's
// order. Equal to one device under both exchanges, causal (balanced and not) and not, with a
// mask; under the ring K/V go point to point only, on a mesh with dim names or without.
TEST(ContextParallel, SequenceOverSomeMeshDimsIsARingPerSlice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const std::vector<int64_t> cube = {2, 2, 2};
  const std::vector<std::string> names = {"a", "b", "c"};
  const Placements batch_seq = {Shard(0), Shard(2), Shard(2)};
  const Placements seq_heads_seq = {Shard(2), Shard(1), Shard(2)};
  const auto mask = test::randn({7, 7}, 17, at::kDouble);
  for (bool causal : {false, true}) {
    const std::string c = causal ? ", causal" : "";
    expect_one_device(cube, batch_seq, {{1, 1}, {}, {2, 0, 3, 2}}, causal, {},
                      "batch over a, sequence over b c" + c, names);
    expect_one_device(cube, seq_heads_seq, {{}, {2, 1}, {1, 3, 3, 0}}, causal, {},
                      "sequence over a c, heads over b" + c, names);
    {
      PinBalance balance(false);
      expect_one_device(cube, batch_seq, {{2, 0}, {}, {1, 3, 3, 0}}, causal, {},
                        "batch 2+0, sequence over b c, natural" + c, names);
    }
    expect_one_device(cube, batch_seq, {{1, 1}, {}, {2, 0, 3, 2}}, causal, {}, "unnamed mesh" + c);
  }
  expect_one_device(cube, batch_seq, {{1, 1}, {}, {3, 1, 0, 3}}, false, mask, "mask", names);

  // Under the ring: no all-gather in forward or backward, and every rank with queries and a
  // peer holding keys receives blocks.
  PinMethod ring(KVMethod::kRing);
  auto x = test::randn({2, 3, 7, 4}, 18, at::kDouble);
  for (bool named : {true, false}) {
    tessera::testing::run_ranks(8, [&](int rank) {
      at::set_num_threads(1);
      auto mesh = named ? init_device_mesh("cpu", cube, names) : init_device_mesh("cpu", cube);
      auto q = test::make_dtensor_from_full(x, mesh, batch_seq, {{1, 1}, {}, {2, 2, 0, 3}})
                   .requires_grad_();
      expect_ring_only(q, rank, /*receives=*/rank % 4 != 2);
    });
  }
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
  // Row 2 hidden from every key (one device's fused kernel gives it 0), row 5 from all keys
  // but the last (so from every block but one).
  auto holes = keep.clone();
  holes[2].fill_(false);
  holes[5].fill_(false);
  holes[5][6] = true;
  expect_one_device({2}, {Shard(2)}, {{}, {}, {3, 4}}, false, holes, "rows hidden, 3+4");
  expect_one_device({3}, {Shard(2)}, {{}, {}, {2, 2, 3}}, false, holes, "rows hidden, 2+2+3");
  // A shape the fused kernel does not take (one device's math path), [H, L, S], and one it
  // takes, [L, 1], broadcast over the keys (every block sees the one column).
  expect_one_device({2}, {Shard(2)}, {{}, {}, {3, 4}}, false,
                    test::randn({3, 7, 7}, 24, at::kDouble), "[H, L, S] mask");
  expect_one_device({2}, {Shard(2)}, {{}, {}, {3, 4}}, false, test::randn({7, 1}, 25, at::kDouble),
                    "[L, 1] mask");
}

// A mask that requires grad (a learned bias, as T5's relative positions) takes LibTorch's
// math path on one device, which gives it a gradient; the sharded call gives it the same, for
// a mask given whole to every rank and for a replicated distributed one. Under both kernels:
// the products' (every device but the CPU) run LibTorch's math op by name.
TEST(ContextParallel, LearnedMaskGetsItsGradient) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  auto q = test::randn({2, 3, 7, 4}, 21, at::kDouble).requires_grad_();
  for (const auto kernel : kKernels)
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{7, 7}, {3, 7, 7}}) {
      PinKernel pin_kernel(kernel);
      auto bias = test::randn(shape, 22, at::kDouble).requires_grad_();
      q.mutable_grad() = at::Tensor();
      auto expected = at::scaled_dot_product_attention(q, q, q, bias);
      auto g = test::randn(expected.sizes(), 23, at::kDouble);
      expected.backward(g);
      ASSERT_TRUE(bias.grad().defined());
      for (bool distributed : {false, true}) {
        const std::string what = std::string(distributed ? "replicated distributed" : "plain") +
                                 " bias of " + std::to_string(shape.size()) + " dims, " +
                                 kernel_name(kernel);
        tessera::testing::run_ranks(2, [&](int) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {2});
          const std::vector<ShardTable> rows = {{}, {}, {4, 3}};
          auto dq =
              test::make_dtensor_from_full(q.detach(), mesh, {Shard(2)}, rows).requires_grad_();
          auto b = distributed ? distribute_tensor(bias.detach(), mesh, {Replicate()}, std::nullopt)
                               : bias.detach().clone();
          b.requires_grad_();
          auto got = at::scaled_dot_product_attention(dq, dq, dq, b);
          EXPECT_TRUE(test::full_matches(got, expected, tol)) << what << ": output";
          got.backward(test::make_dtensor_from_full(g, mesh, {Shard(2)}, rows));
          EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << what << ": dq";
          ASSERT_TRUE(b.grad().defined()) << what << ": the bias has no gradient";
          // (The plain bias's gradient arrives distributed; its global value is compared.)
          EXPECT_TRUE(test::full_matches(b.grad(), bias.grad(), tol)) << what << ": bias gradient";
        });
      }
    }
}

// Under c10::InferenceMode (no autograd keys) the call is routed as with them: sequence or
// heads split, plain and masked, under both kernels, equal to one device.
TEST(ContextParallel, InferenceModeAsOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  const auto q = test::randn({2, 3, 7, 4}, 51, at::kDouble);
  const auto k = test::randn({2, 3, 7, 4}, 52, at::kDouble);
  const auto v = test::randn({2, 3, 7, 4}, 53, at::kDouble);
  const auto mask = test::randn({2, 1, 7, 7}, 54, at::kDouble);
  const std::vector<std::pair<Placements, std::vector<ShardTable>>> layouts = {
      {{Shard(2)}, {{}, {}, {4, 3}}}, {{Shard(1)}, {{}, {1, 2}}}};
  for (const auto kernel : kKernels) {
    PinKernel pin_kernel(kernel);
    for (const bool masked : {false, true}) {
      const auto mk = masked ? c10::optional<at::Tensor>(mask) : c10::nullopt;
      const auto expected = at::scaled_dot_product_attention(q, k, v, mk, 0.0, !masked);
      for (const auto& [p, tables] : layouts) {
        const std::string what =
            p[0].str() + (masked ? ", mask, " : ", causal, ") + kernel_name(kernel);
        tessera::testing::run_ranks(2, [&](int) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {2});
          auto lay = [&](const at::Tensor& t) {
            return test::make_dtensor_from_full(t, mesh, p, tables);
          };
          c10::InferenceMode inference;
          auto got = at::scaled_dot_product_attention(lay(q), lay(k), lay(v), mk, 0.0, !masked);
          EXPECT_TRUE(test::full_matches(got, expected, tol)) << what;
        });
      }
    }
  }
}

// Attention dropout on distributed tensors takes LibTorch's math path, whose dropout draws one
// device's mask (docs/random.md): output and gradients equal one device seeded alike, with
// the sequence split unevenly or the heads split, under both kernels.
TEST(ContextParallel, DropoutDrawsOneDevicesMask) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  auto q = test::randn({2, 3, 7, 4}, 41, at::kDouble).requires_grad_();
  auto k = test::randn({2, 3, 7, 4}, 42, at::kDouble).requires_grad_();
  auto v = test::randn({2, 3, 7, 4}, 43, at::kDouble).requires_grad_();
  at::manual_seed(44);
  auto expected = at::scaled_dot_product_attention(q, k, v, {}, 0.3);
  const auto g = test::randn(expected.sizes(), 45, at::kDouble);
  expected.backward(g);
  const std::vector<std::pair<Placements, std::vector<ShardTable>>> layouts = {
      {{Shard(2)}, {{}, {}, {4, 3}}}, {{Shard(1)}, {{}, {1, 2}}}};
  for (const auto kernel : kKernels) {
    PinKernel pin_kernel(kernel);
    for (const auto& [p, tables] : layouts) {
      const std::string what = p[0].str() + ", " + kernel_name(kernel);
      tessera::testing::run_ranks(2, [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2});
        auto lay = [&](const at::Tensor& t) {
          return test::make_dtensor_from_full(t.detach(), mesh, p, tables).requires_grad_();
        };
        auto dq = lay(q), dk = lay(k), dv = lay(v);
        tessera::manual_seed(44 + rank);  // rank 0's seed is the one all ranks draw with
        auto got = at::scaled_dot_product_attention(dq, dk, dv, {}, 0.3);
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << what << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, spec(got).placements(),
                                                  spec(got).shard_tables()));
        EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << what << ": dq";
        EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << what << ": dk";
        EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << what << ": dv";
      });
    }
  }
}

// Calls LibTorch's scaled_dot_product_attention refuses or treats specially on one device (a
// mask with is_causal, mixed dtypes, query heads no multiple of the K/V heads, K/V with a
// batch of 1 broadcast, a float16 mask on float64): the sharded call does what one device
// does, the same error on every rank or the same values.
TEST(ContextParallel, RefusedCallsAsOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  struct Bad {
    std::string what;
    at::Tensor q, k, v, mask;
    bool causal, gqa;
  };
  const auto x = test::randn({2, 4, 7, 4}, 20, at::kDouble);
  const auto mask = test::randn({7, 7}, 19, at::kDouble);
  const std::vector<Bad> calls = {
      {"mask with is_causal", x, x, x, mask, true, false},
      {"float32 key", x, x.to(at::kFloat), x, {}, false, false},
      {"4 query heads on 3 K/V heads", x, x.narrow(1, 0, 3), x.narrow(1, 0, 3), {}, false, true},
      {"K/V batch 1, broadcast", x, x.narrow(0, 0, 1), x.narrow(0, 0, 1), {}, false, false},
      {"float16 mask", x, x, x, mask.to(at::kHalf), false, false},
  };
  for (const Bad& b : calls) {
    SCOPED_TRACE(b.what);
    const auto mask_of = [&](const at::Tensor& m) {
      return m.defined() ? c10::optional<at::Tensor>(m) : c10::nullopt;
    };
    const auto call = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      return at::scaled_dot_product_attention(q, k, v, mask_of(b.mask), 0.0, b.causal, c10::nullopt,
                                              b.gqa);
    };
    std::string refused;
    at::Tensor expected;
    try {
      expected = call(b.q, b.k, b.v);
    } catch (const c10::Error& e) {
      refused = e.what_without_backtrace();
    }
    const ShardTable rows = {3, 4};
    const auto lay = [&](const at::Tensor& t, const DeviceMesh& mesh) {
      return test::make_dtensor_from_full(t, mesh, {Shard(2)}, {{}, {}, rows});
    };
    each_method([&] {
      if (refused.empty()) {
        tessera::testing::run_ranks(2, [&](int) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {2});
          EXPECT_TRUE(test::full_matches(call(lay(b.q, mesh), lay(b.k, mesh), lay(b.v, mesh)),
                                         expected, {1e-6, 1e-6}));
        });
        return;
      }
      test::expect_error_everywhere(2,
                                    [&](int) {
                                      at::set_num_threads(1);
                                      auto mesh = init_device_mesh("cpu", {2});
                                      call(lay(b.q, mesh), lay(b.k, mesh), lay(b.v, mesh));
                                    },
                                    {refused.substr(0, refused.find('\n'))});
    });
  }
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
  for (const KVMethod method : {KVMethod::kRing, KVMethod::kAllGather}) {
    PinMethod pin(method);
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
}

// A random [2, 3, sum(rows), 4] float64 leaf, its sequence split by `rows`.
at::Tensor seq_sharded(const DeviceMesh& mesh, const ShardTable& rows, uint64_t seed,
                       int64_t heads = 3) {
  const int64_t seq = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  return test::make_dtensor_from_full(test::randn({2, heads, seq, 4}, seed, at::kDouble), mesh,
                                      {Shard(2)}, {{}, {}, rows})
      .requires_grad_();
}

// The natural ring's bytes on 2, 3 and 5 ranks (uneven and empty shards), causal and not,
// against the blocks each rank's queries see: `q_heads` query heads on `kv_heads` K/V heads
// (grouped-query attention when fewer; the bytes are the K/V heads').
void expect_ring_bytes(int64_t q_heads, int64_t kv_heads) {
  PinMethod pin(KVMethod::kRing);
  PinBalance natural(false);  // (the balanced ring also deals the chunks out and back)
  for (bool causal : {false, true}) {
    for (const ShardTable& rows : std::vector<ShardTable>{{4, 3}, {3, 0, 4}, {2, 1, 3, 2, 1}}) {
      const int world = static_cast<int>(rows.size());
      const int64_t row_bytes = 2 * kv_heads * 4 * 8;  // B x K/V heads x E doubles per row
      std::vector<int64_t> offset(world + 1, 0);
      for (int r = 0; r < world; ++r) offset[r + 1] = offset[r] + rows[r];
      // Whether rank m's queries see a key of rank j's block.
      const auto sees = [&](int m, int j) {
        if (rows[m] == 0 || rows[j] == 0) return false;
        return !causal || offset[m + 1] - 1 >= offset[j];
      };
      tessera::testing::run_ranks(world, [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {world});
        auto q = seq_sharded(mesh, rows, 61, q_heads), k = seq_sharded(mesh, rows, 62, kv_heads);
        auto v = seq_sharded(mesh, rows, 63, kv_heads);
        int64_t blocks = 0, seen_by = 0;
        for (int j = 0; j < world; ++j)
          if (j != rank && sees(rank, j)) blocks += rows[j];
        for (int m = 0; m < world; ++m)
          if (m != rank && sees(m, rank)) ++seen_by;
        const std::string desc = std::to_string(world) + " ranks, rank " + std::to_string(rank) +
                                 (causal ? ", causal" : "");
        at::Tensor out;
        {
          CommDebugMode comm;
          out = test::sdpa(q, k, v, c10::nullopt, causal, /*gqa=*/q_heads != kv_heads);
          EXPECT_EQ(comm.total_bytes_received(), 2 * blocks * row_bytes)
              << desc << ": forward " << comm.to_json();
        }
        CommDebugMode comm;
        out.backward(at::ones_like(out));
        EXPECT_EQ(comm.total_bytes_received(), 2 * (blocks + seen_by * rows[rank]) * row_bytes)
            << desc << ": backward " << comm.to_json();
        EXPECT_EQ(k.grad().sizes(), k.sizes()) << desc;
      });
    }
  }
}

// Bytes: the forward gathers K and V along the sequence and nothing else moves (queries stay);
// each rank receives at least the rows it lacks, (S - s_r) of K and of V, and at most the
// padded all-gather's (P - 1) x max(s) rows. The backward moves only dK and dV home, within
// the same bounds.
TEST(ContextParallel, BytesAreTheKeyValueGatherOnly) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  PinMethod pin(KVMethod::kAllGather);
  for (const ShardTable& rows : std::vector<ShardTable>{{4, 3}, {3, 0, 4}, {2, 2, 2}}) {
    const int world = static_cast<int>(rows.size());
    const int64_t seq = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    const int64_t row_bytes = 2 * 3 * 4 * 8;  // B x H x E doubles per sequence row
    const int64_t most = *std::max_element(rows.begin(), rows.end());
    tessera::testing::run_ranks(world, [&](int rank) {
      at::set_num_threads(1);
      auto mesh = init_device_mesh("cpu", {world});
      auto q = seq_sharded(mesh, rows, 31), k = seq_sharded(mesh, rows, 32);
      auto v = seq_sharded(mesh, rows, 33);
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

// Random sequence splits on 1-5 ranks (empty shards likely), causal or not, with or without
// an additive [L, S] mask, batch and heads of random sizes, under each exchange.
TEST(ContextParallel, RandomSplitsMatchOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  test::Sweep sweep;
  sweep.cases(16).run([&](test::Rng& rng, int64_t c) {
    const int world = static_cast<int>(rng.uniform(1, 5));
    const int64_t L = rng.uniform(1, 13), B = rng.uniform(1, 2), H = rng.uniform(1, 3);
    const int64_t E = rng.uniform(1, 5);
    const bool causal = rng.coin(), masked = !causal && rng.coin(0.6);
    const ShardTable rows = test::random_table(rng, L, world);
    auto q = test::randn({B, H, L, E}, 100 + c, at::kDouble).requires_grad_();
    auto k = test::randn({B, H, L, E}, 200 + c, at::kDouble).requires_grad_();
    auto v = test::randn({B, H, L, E}, 300 + c, at::kDouble).requires_grad_();
    const at::Tensor mask = masked ? test::randn({L, L}, 400 + c, at::kDouble) : at::Tensor();
    const c10::optional<at::Tensor> m = masked ? c10::optional<at::Tensor>(mask) : c10::nullopt;
    auto expected = at::scaled_dot_product_attention(q, k, v, m, 0.0, causal);
    auto g = test::randn(expected.sizes(), 500 + c, at::kDouble);
    expected.backward(g);
    std::string desc = sweep.label(c) + ": " + std::to_string(world) + " ranks, rows";
    for (auto r : rows) desc += " " + std::to_string(r);
    desc += causal ? ", causal" : "";
    desc += masked ? ", mask" : "";
    each_method([&] {
      tessera::testing::run_ranks(world, [&](int) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {world});
        const std::vector<ShardTable> tables = {{}, {}, rows};
        auto lay = [&](const at::Tensor& t) {
          return test::make_dtensor_from_full(t.detach(), mesh, {Shard(2)}, tables)
              .requires_grad_();
        };
        auto dq = lay(q), dk = lay(k), dv = lay(v);
        auto got = at::scaled_dot_product_attention(dq, dk, dv, m, 0.0, causal);
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << desc << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, {Shard(2)}, tables));
        EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << desc << ": dq";
        EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << desc << ": dk";
        EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << desc << ": dv";
      });
    });
  });
}

// The load-balanced causal ring (NOTE: [Load-balanced causal ring]) against one device:
// lengths that 2P does not divide and shorter than 2P (empty chunks), random natural splits
// (empty shards likely) on 1-5 ranks, and batch x sequence on a 2x2 mesh; balancing on and
// off. The tensors keep their natural layout around the call.
TEST(ContextParallel, LoadBalancedCausalRingMatchesOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  PinMethod ring(KVMethod::kRing);
  test::Sweep sweep;
  sweep.cases(14).run([&](test::Rng& rng, int64_t c) {
    const bool two_d = c % 5 == 4;
    const int world = two_d ? 4 : static_cast<int>(rng.uniform(1, 5));
    const int seq_ranks = two_d ? 2 : world;
    const int64_t L = c == 0 ? 0 : rng.uniform(1, 23), B = two_d ? 3 : rng.uniform(1, 2);
    const int64_t H = rng.uniform(1, 3), E = rng.uniform(1, 5);
    const ShardTable rows = test::random_table(rng, L, seq_ranks);
    auto q = test::randn({B, H, L, E}, 600 + c, at::kDouble).requires_grad_();
    auto k = test::randn({B, H, L, E}, 700 + c, at::kDouble).requires_grad_();
    auto v = test::randn({B, H, L, E}, 800 + c, at::kDouble).requires_grad_();
    auto expected = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
    auto g = test::randn(expected.sizes(), 900 + c, at::kDouble);
    expected.backward(g);
    std::string desc = sweep.label(c) + ": " + std::to_string(world) + " ranks, rows";
    for (auto r : rows) desc += " " + std::to_string(r);
    for (const auto& [on, kernel] : {std::pair{true, kKernels[0]}, std::pair{false, kKernels[0]},
                                     std::pair{true, kKernels[1]}}) {
      PinBalance balance(on);
      PinKernel pin_kernel(kernel);
      tessera::testing::run_ranks(world, [&](int) {
        at::set_num_threads(1);
        auto mesh = two_d ? init_device_mesh("cpu", {2, 2}) : init_device_mesh("cpu", {world});
        const Placements p = two_d ? Placements{Shard(0), Shard(2)} : Placements{Shard(2)};
        const std::vector<ShardTable> tables = two_d ? std::vector<ShardTable>{{2, 1}, {}, rows}
                                                     : std::vector<ShardTable>{{}, {}, rows};
        auto lay = [&](const at::Tensor& t) {
          return test::make_dtensor_from_full(t.detach(), mesh, p, tables).requires_grad_();
        };
        auto dq = lay(q), dk = lay(k), dv = lay(v);
        auto got = at::scaled_dot_product_attention(dq, dk, dv, {}, 0.0, true);
        const std::string d = desc + (on ? ", balanced, " : ", natural, ") + kernel_name(kernel);
        EXPECT_EQ(spec(got), spec(dq)) << d << ": the output keeps the query's layout";
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << d << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, p, tables));
        EXPECT_EQ(spec(dk.grad()), spec(dk)) << d << ": dk keeps the key's layout";
        EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << d << ": dq";
        EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << d << ": dk";
        EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << d << ": dv";
      });
    }
  });
}

// What the balancing is for: every rank scores the same query-key pairs (L a multiple of
// 2P: exactly; the natural split leaves the last rank about 2P - 1 times the first's).
TEST(ContextParallel, LoadBalancedRingEvensTheWork) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  PinMethod ring(KVMethod::kRing);
  const int64_t L = 120;  // a multiple of 2P for P = 2..5
  const auto x = test::randn({1, 2, L, 4}, 31, at::kDouble);
  for (int world = 2; world <= 5; ++world) {
    for (bool on : {true, false}) {
      PinBalance balance(on);
      std::vector<int64_t> scored(world);
      tessera::testing::run_ranks(world, [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {world});
        auto d = distribute_tensor(x, mesh, {Shard(2)});
        const int64_t before = ops::attention::scores_this_thread();
        (void)at::scaled_dot_product_attention(d, d, d, {}, 0.0, true);
        scored[rank] = ops::attention::scores_this_thread() - before;
      });
      const auto [lo, hi] = std::minmax_element(scored.begin(), scored.end());
      // Both count every visible pair once (per batch x head): the sum is one device's.
      EXPECT_EQ(std::accumulate(scored.begin(), scored.end(), int64_t{0}), L * (L + 1) / 2)
          << world << " ranks" << (on ? ", balanced" : "");
      if (on)
        EXPECT_EQ(*lo, *hi) << world << " ranks, balanced";
      else
        EXPECT_GT(*hi, 2 * *lo) << world << " ranks, natural";
    }
  }
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
// Grouped-query heads (enable_gqa, LibTorch 2.5 on): 4 query heads on 2 K/V heads and on 1
// (multi-query), random sequence splits on 1-4 ranks, causal or not, or with a mask ([L, L],
// one per query head, one per batch, one per batch and head, one broadcast over the keys);
// and on a 2x2 mesh with the heads split over one dim (unevenly too: a rank's query heads
// whole groups or not) and the sequence over the other.
TEST(ContextParallel, GroupedQueryHeadsMatchOneDevice) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  test::Sweep sweep;
  sweep.cases(16).run([&](test::Rng& rng, int64_t c) {
    const bool grid = c % 4 == 3;
    const int world = grid ? 4 : static_cast<int>(rng.uniform(1, 4));
    const int64_t L = rng.uniform(1, 11), kv_heads = grid ? 2 : rng.uniform(1, 2);
    // Fixed by the case, not drawn, so that every seed covers them: on one dim (cases i =
    // 0..11) each mask kind twice (-1: none, causal once); on the grid (j = 0..3) causal on
    // an uneven head split, the per-head mask on whole groups, the per-batch-and-head mask
    // on heads that are not whole groups, the key-broadcast mask.
    const int64_t i = c - c / 4, j = c / 4;
    const std::vector<ShardTable> head_tables = {{0, 4}, {2, 2}, {1, 3}, {4, 0}};
    const int64_t mask_kind = grid ? std::vector<int64_t>{-1, 1, 3, 4}[j] : i % 6 - 1;
    const bool causal = mask_kind < 0 && (grid || i < 6);
    const ShardTable rows = test::random_table(rng, L, grid ? 2 : world);
    const ShardTable heads = grid ? head_tables[j] : ShardTable{};
    auto q = test::randn({2, 4, L, 3}, 600 + c, at::kDouble).requires_grad_();
    auto k = test::randn({2, kv_heads, L, 3}, 700 + c, at::kDouble).requires_grad_();
    auto v = test::randn({2, kv_heads, L, 3}, 800 + c, at::kDouble).requires_grad_();
    const std::vector<std::vector<int64_t>> mask_shapes = {
        {L, L}, {1, 4, L, L}, {2, 1, L, L}, {2, 4, L, L}, {L, 1}};
    const at::Tensor mask =
        mask_kind < 0 ? at::Tensor() : test::randn(mask_shapes[mask_kind], 950 + c, at::kDouble);
    const auto mask_opt = mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt;
    auto expected = at::scaled_dot_product_attention(q, k, v, mask_opt, 0.0, causal, c10::nullopt,
                                                     /*enable_gqa=*/true);
    auto g = test::randn(expected.sizes(), 900 + c, at::kDouble);
    expected.backward(g);
    std::string desc = sweep.label(c) + ": " + std::to_string(world) + " ranks, " +
                       std::to_string(kv_heads) + " K/V heads, rows";
    for (auto r : rows) desc += " " + std::to_string(r);
    desc += causal ? ", causal" : "";
    desc += mask.defined() ? ", mask " + shape_str(mask.sizes().vec()) : "";
    desc += grid ? ", heads " + std::to_string(heads[0]) + "+" + std::to_string(heads[1]) +
                       " x sequence"
                 : "";
    each_method([&] {
      tessera::testing::run_ranks(world, [&](int) {
        at::set_num_threads(1);
        auto mesh = grid ? init_device_mesh("cpu", {2, 2}) : init_device_mesh("cpu", {world});
        const Placements p = grid ? Placements{Shard(1), Shard(2)} : Placements{Shard(2)};
        // K/V heads: as the query's where a rank's query heads are whole groups, else even.
        const int64_t per = 4 / kv_heads;  // query heads per K/V head
        ShardTable kv_table;
        if (grid && heads[0] % per == 0 && heads[1] % per == 0)
          kv_table = {heads[0] / per, heads[1] / per};
        auto lay = [&](const at::Tensor& t, const ShardTable& h) {
          return test::make_dtensor_from_full(t.detach(), mesh, p, {{}, h, rows}).requires_grad_();
        };
        auto dq = lay(q, heads), dk = lay(k, kv_table), dv = lay(v, kv_table);
        auto got = at::scaled_dot_product_attention(dq, dk, dv, mask_opt, 0.0, causal, c10::nullopt,
                                                    /*enable_gqa=*/true);
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << desc << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, spec(got).placements(),
                                                  spec(got).shard_tables()));
        EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << desc << ": dq";
        EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << desc << ": dk";
        EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << desc << ": dv";
      });
    });
  });
}

// Grouped-query heads on the ring: K and V travel with their own heads, not repeated for the
// query's: the same blocks as above at the K/V heads' bytes (1/4 of what repeated heads would
// move here), forward and backward.
TEST(ContextParallel, GroupedQueryRingMovesOnlyTheKVHeads) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  expect_ring_bytes(4, 1);
}
#endif

// Keys and values of another length than the queries (cross-attention, S != L), split along
// the same mesh dim by their own table, causal (top-left aligned) and not.
TEST(ContextParallel, CrossAttentionLengths) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  const test::Tolerance tol{1e-10, 1e-11};
  auto q = test::randn({1, 2, 7, 3}, 51, at::kDouble).requires_grad_();
  auto k = test::randn({1, 2, 5, 3}, 52, at::kDouble).requires_grad_();
  auto v = test::randn({1, 2, 5, 3}, 53, at::kDouble).requires_grad_();
  for (bool causal : {false, true}) {
    q.mutable_grad() = at::Tensor(), k.mutable_grad() = at::Tensor(),
    v.mutable_grad() = at::Tensor();
    auto expected = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
    auto g = test::randn(expected.sizes(), 54, at::kDouble);
    expected.backward(g);
    each_method([&] {
      tessera::testing::run_ranks(3, [&](int) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {3});
        auto dq = test::make_dtensor_from_full(q.detach(), mesh, {Shard(2)}, {{}, {}, {2, 0, 5}})
                      .requires_grad_();
        auto dk = test::make_dtensor_from_full(k.detach(), mesh, {Shard(2)}, {{}, {}, {1, 3, 1}})
                      .requires_grad_();
        auto dv = test::make_dtensor_from_full(v.detach(), mesh, {Shard(2)}, {{}, {}, {1, 3, 1}})
                      .requires_grad_();
        auto got = at::scaled_dot_product_attention(dq, dk, dv, {}, 0.0, causal);
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << causal << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, spec(got).placements(),
                                                  spec(got).shard_tables()));
        EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << causal << ": dq";
        EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << causal << ": dk";
        EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << causal << ": dv";
      });
    });
  }
}

// The ring's bytes, exactly: forward, each rank receives the K and V blocks its queries see
// (every other block; causal: only the blocks before its last row); backward, the same
// blocks again, plus its own block's dK and dV from every rank that saw it.
TEST(ContextParallel, RingBytesAreTheBlocksSeen) {
  if (!has_fused_cpu_attention()) GTEST_SKIP() << "no fused CPU attention in this LibTorch";
  expect_ring_bytes(3, 3);
}

// The automatic choice: the all-gather for small K/V, the ring once the gathered K and V pass
// 16 MiB per rank (and never on one rank).
TEST(ContextParallel, ExchangeChoice) {
  PinMethod pin(KVMethod::kAuto);
  EXPECT_EQ(ops::attention::kv_method_for(1 << 20, 4), KVMethod::kAllGather);
  EXPECT_EQ(ops::attention::kv_method_for(int64_t{64} << 20, 4), KVMethod::kRing);
  EXPECT_EQ(ops::attention::kv_method_for(int64_t{64} << 20, 1), KVMethod::kAllGather);
  PinMethod ring(KVMethod::kRing);
  EXPECT_EQ(ops::attention::kv_method_for(1, 4), KVMethod::kRing);
}

// The environment's start values: the words each switch takes; anything else is an error
// naming the variable (not silently the default: TESSERA_CP_LOAD_BALANCE=off turns it off).
TEST(ContextParallel, EnvironmentSwitches) {
  using ops::attention::load_balance_from;
  using ops::attention::method_from;
  EXPECT_TRUE(load_balance_from(nullptr));
  EXPECT_TRUE(load_balance_from(""));
  for (const char* off : {"0", "off", "false"}) EXPECT_FALSE(load_balance_from(off)) << off;
  for (const char* on : {"1", "on", "true"}) EXPECT_TRUE(load_balance_from(on)) << on;
  EXPECT_EQ(method_from(nullptr), KVMethod::kAuto);
  EXPECT_EQ(method_from("auto"), KVMethod::kAuto);
  EXPECT_EQ(method_from("ring"), KVMethod::kRing);
  EXPECT_EQ(method_from("allgather"), KVMethod::kAllGather);
  const auto raises = [](const std::function<void()>& f, const std::string& name) {
    try {
      f();
      ADD_FAILURE() << "no error for a bad " << name;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  for (const char* bad : {"no", "2", "On"})
    raises([&] { load_balance_from(bad); }, "TESSERA_CP_LOAD_BALANCE");
  for (const char* bad : {"gather", "Ring"}) raises([&] { method_from(bad); }, "TESSERA_CP_METHOD");
  using attention::block_kernel_from;
  using attention::BlockKernel;
  EXPECT_EQ(block_kernel_from(nullptr), BlockKernel::kFusedOnCpu);
  EXPECT_EQ(block_kernel_from("auto"), BlockKernel::kFusedOnCpu);
  EXPECT_EQ(block_kernel_from("products"), BlockKernel::kProducts);
  EXPECT_EQ(block_kernel_from("fused"), BlockKernel::kFused);
  EXPECT_EQ(block_kernel_from("efficient"), BlockKernel::kEfficient);
  for (const char* bad : {"flash", "Fused"})
    raises([&] { block_kernel_from(bad); }, "TESSERA_ATTENTION_BLOCKS");
}

// The head-tail dealing of a causal ring: under kAuto from 2,048 rows per rank, where it pays;
// a forced ring deals at any size; never on one rank or with the switch off.
TEST(ContextParallel, BalanceChoice) {
  using ops::attention::balances;
  PinBalance on(true);
  {
    PinMethod pin(KVMethod::kAuto);
    EXPECT_TRUE(balances(4096, 2));
    EXPECT_FALSE(balances(4095, 2));
    EXPECT_TRUE(balances(16384, 8));
    EXPECT_FALSE(balances(16383, 8));
    EXPECT_FALSE(balances(1 << 20, 1));
  }
  PinMethod ring(KVMethod::kRing);
  EXPECT_TRUE(balances(3, 2));
  EXPECT_FALSE(balances(3, 1));
  PinBalance off(false);
  EXPECT_FALSE(balances(1 << 20, 2));
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
