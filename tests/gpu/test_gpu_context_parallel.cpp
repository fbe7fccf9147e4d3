// Context parallelism on CUDA shards: scaled_dot_product_attention on queries whose sequence
// is split over the mesh, under the ring and the all-gather, causal (balanced) and not, with a
// mask, with grouped-query heads (3 query heads on 1 K/V head), in float64 and float32; and
// attention with the heads split and the sequence whole. Forward and every gradient against
// one device's SDPA on the GPU. Off the CPU each block runs as matrix products by default
// (NOTE: [Block kernels] in src/ops/attention_ring.h); the tier pins that kernel so its CPU run
// checks the same path, and checks LibTorch's memory-efficient pair as the block kernel too.
#include <torch/version.h>

#include "gpu_helpers.h"
#include "ops/attention_ring.h"
#include "support/attention.h"

#if TORCH_VERSION_MAJOR >= 2  // LibTorch 1.13 has no scaled_dot_product_attention

using namespace tessera;
using gpu_test::GpuMesh;
namespace attention = tessera::ops::attention;

namespace {

struct Pins {
  Pins(ContextParallelMethod m, bool balance,
       attention::BlockKernel k = attention::BlockKernel::kProducts)
      : method(set_context_parallel_method(m)),
        balanced(set_context_parallel_load_balance(balance)),
        kernel(attention::set_block_kernel(k)) {}
  ~Pins() {
    set_context_parallel_method(method);
    set_context_parallel_load_balance(balanced);
    attention::set_block_kernel(kernel);
  }
  ContextParallelMethod method;
  bool balanced;
  attention::BlockKernel kernel;
};

struct Case {
  ContextParallelMethod method;
  bool causal, masked, gqa = false, balanced = true;
};

// q [2, 4, 13, 16], K/V with 4 heads or (gqa) 2, in `dtype` on the GPU, the sequence split
// over the mesh (13 rows, one shard empty where there are three), under case `c` with each
// block computed by `kernel`: forward and every gradient against one device's SDPA on the GPU
// in the same dtype; under the ring no K/V all-gather.
void expect_sequence_split_matches(const GpuMesh& m, at::ScalarType dtype,
                                   const test::Tolerance& tol, const Case& c,
                                   attention::BlockKernel kernel) {
  const int world = m.world();
  const ShardTable rows = world == 1   ? ShardTable{13}
                          : world == 2 ? ShardTable{6, 7}
                                       : ShardTable{5, 0, 8};
  const bool ring = c.method == ContextParallelMethod::kRing;
  const std::string what = m.name() + ", " + c10::toString(dtype) +
                           (ring ? ", ring" : ", all-gather") + (c.causal ? ", causal" : "") +
                           (c.causal && !c.balanced ? " unbalanced" : "") +
                           (c.masked ? ", mask" : "") + (c.gqa ? ", 4 heads on 2" : "");
  const auto dev = gpu_test::cuda();
  const int64_t kv_heads = c.gqa ? 2 : 4;
  auto q = gpu_test::randn({2, 4, 13, 16}, 61, dev, dtype).requires_grad_();
  auto k = gpu_test::randn({2, kv_heads, 13, 16}, 62, dev, dtype).requires_grad_();
  auto v = gpu_test::randn({2, kv_heads, 13, 16}, 63, dev, dtype).requires_grad_();
  const auto mask = c.masked ? c10::optional<at::Tensor>(gpu_test::randn({13, 13}, 64, dev, dtype))
                             : c10::nullopt;
  auto expected = test::sdpa(q, k, v, mask, c.causal, c.gqa);
  auto g = gpu_test::randn(expected.sizes(), 65, dev, dtype);
  expected.backward(g);
  Pins pins(c.method, c.balanced, kernel);
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    const std::vector<ShardTable> tables = {{}, {}, rows};
    auto lay = [&](const at::Tensor& t) {
      return test::make_dtensor_from_full(t.detach(), mesh, {Shard(2)}, tables).requires_grad_();
    };
    auto dq = lay(q), dk = lay(k), dv = lay(v);
    CommDebugMode comm;
    auto got = test::sdpa(dq, dk, dv, mask, c.causal, c.gqa);
    if (ring && world > 1) {
      EXPECT_EQ(comm.get_comm_counts().count("all_gather"), 0u) << what << ": K/V gathered";
    }
    ASSERT_TRUE(gpu_test::on_mesh_device(got, mesh)) << what;
    EXPECT_TRUE(test::full_matches(got, expected, tol)) << what << ": output";
    got.backward(test::make_dtensor_from_full(g, mesh, {Shard(2)}, tables));
    EXPECT_TRUE(gpu_test::on_mesh_device(dq.grad(), mesh)) << what;
    EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << what << ": dq";
    EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << what << ": dk";
    EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << what << ": dv";
  });
}

}  // namespace

class GpuContextParallel : public ::testing::TestWithParam<GpuMesh> {};

// Each block by matrix products (the default off the CPU), float64 and float32, ring and
// all-gather, causal and masked, grouped-query heads.
TEST_P(GpuContextParallel, SequenceShardedAttentionMatchesOneDevice) {
  TESSERA_REQUIRE_GPU_MESH(GetParam());
  if (!test::has_fused_cpu_attention()) GTEST_SKIP() << "no fused attention in this LibTorch";
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    const test::Tolerance tol =
        dtype == at::kDouble ? test::Tolerance{1e-10, 1e-11} : test::Tolerance{2e-5, 2e-5};
    for (const Case& c : {Case{ContextParallelMethod::kRing, true, false},
                          Case{ContextParallelMethod::kRing, false, true},
                          Case{ContextParallelMethod::kAllGather, true, false},
                          Case{ContextParallelMethod::kAllGather, false, true},
                          Case{ContextParallelMethod::kRing, true, false, true},
                          Case{ContextParallelMethod::kAllGather, false, true, true}}) {
      if (c.gqa && !test::kSdpaTakesGqa) continue;
      expect_sequence_split_matches(GetParam(), dtype, tol, c, attention::BlockKernel::kProducts);
    }
  }
}

// LibTorch's memory-efficient pair as the block kernel (BlockKernel::kFused, NOTE: [Block
// kernels]): 13 rows, so its log-sum-exp comes padded; the ring (causal balanced and not,
// grouped-query heads) and the all-gather, in float32, bfloat16 and float16; on a GPU the
// pair must have run. Until this has passed on a GPU the default stays the products.
TEST_P(GpuContextParallel, FusedBlocksMatchOneDevice) {
  TESSERA_REQUIRE_GPU_MESH(GetParam());
  if (!test::has_fused_cpu_attention()) GTEST_SKIP() << "no fused attention in this LibTorch";
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const test::Tolerance tol = dtype == at::kFloat      ? test::Tolerance{1e-4, 1e-4}
                                : dtype == at::kBFloat16 ? test::Tolerance{6e-2, 6e-2}
                                                         : test::Tolerance{1e-2, 1e-2};
    for (const Case& c : {Case{ContextParallelMethod::kRing, true, false},
                          Case{ContextParallelMethod::kRing, true, false, false, false},
                          Case{ContextParallelMethod::kRing, false, false},
                          Case{ContextParallelMethod::kRing, true, false, true},
                          Case{ContextParallelMethod::kAllGather, true, false},
                          Case{ContextParallelMethod::kAllGather, false, false, true}}) {
      if (c.gqa && !test::kSdpaTakesGqa) continue;
      const int64_t calls = attention::efficient_calls();
      expect_sequence_split_matches(GetParam(), dtype, tol, c, attention::BlockKernel::kFused);
      if (!gpu_test::on_cpu_instead()) {  // (on the tier's CPU run kFused takes the CPU pair)
        EXPECT_GT(attention::efficient_calls(), calls)
            << GetParam().name() << ", " << c10::toString(dtype) << ": the fused pair did not run";
      }
    }
  }
}

// Heads split, the sequence whole (tensor-parallel attention): on CUDA, LibTorch's backend
// choice would send the call to its flash / efficient / cuDNN kernels, which have no sharding
// rules; the call takes the fused op pair's rule (matrix products per rank) and equals one
// device, in float32 (which those kernels would take) and float64, causal and with a mask,
// and under InferenceMode.
TEST_P(GpuContextParallel, HeadShardedAttentionMatchesOneDevice) {
  TESSERA_REQUIRE_GPU_MESH(GetParam());
  if (!test::has_fused_cpu_attention()) GTEST_SKIP() << "no fused attention in this LibTorch";
  const GpuMesh& m = GetParam();
  const int world = m.world();
  const ShardTable heads = world == 1   ? ShardTable{4}
                           : world == 2 ? ShardTable{1, 3}
                                        : ShardTable{2, 0, 2};
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const test::Tolerance tol =
        dtype == at::kDouble ? test::Tolerance{1e-10, 1e-11} : test::Tolerance{2e-5, 2e-5};
    const auto dev = gpu_test::cuda();
    auto q = gpu_test::randn({2, 4, 13, 8}, 71, dev, dtype).requires_grad_();
    auto k = gpu_test::randn({2, 4, 13, 8}, 72, dev, dtype).requires_grad_();
    auto v = gpu_test::randn({2, 4, 13, 8}, 73, dev, dtype).requires_grad_();
    const auto mask = gpu_test::randn({13, 13}, 74, dev, dtype);
    for (const bool causal : {true, false}) {
      const std::string what =
          m.name() + ", " + c10::toString(dtype) + (causal ? ", causal" : ", mask");
      for (auto* t : {&q, &k, &v}) t->mutable_grad() = at::Tensor();
      const auto mk = causal ? c10::nullopt : c10::optional<at::Tensor>(mask);
      auto expected = at::scaled_dot_product_attention(q, k, v, mk, 0.0, causal);
      auto g = gpu_test::randn(expected.sizes(), 75, dev, dtype);
      expected.backward(g);
      Pins pins(ContextParallelMethod::kAuto, /*balance=*/true);  // (the products on CPU too)
      gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
        const std::vector<ShardTable> tables = {{}, heads};
        auto lay = [&](const at::Tensor& t) {
          return test::make_dtensor_from_full(t.detach(), mesh, {Shard(1)}, tables)
              .requires_grad_();
        };
        auto dq = lay(q), dk = lay(k), dv = lay(v);
        auto got = at::scaled_dot_product_attention(dq, dk, dv, mk, 0.0, causal);
        ASSERT_TRUE(gpu_test::on_mesh_device(got, mesh)) << what;
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << what << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, {Shard(1)}, tables));
        EXPECT_TRUE(test::full_matches(dq.grad(), q.grad(), tol)) << what << ": dq";
        EXPECT_TRUE(test::full_matches(dk.grad(), k.grad(), tol)) << what << ": dk";
        EXPECT_TRUE(test::full_matches(dv.grad(), v.grad(), tol)) << what << ": dv";
        c10::InferenceMode inference;  // (no autograd keys: routed alike)
        auto again = at::scaled_dot_product_attention(dq, dk, dv, mk, 0.0, causal);
        EXPECT_TRUE(test::full_matches(again, expected.detach(), tol)) << what << ": inference";
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuContextParallel,
                         ::testing::Values(GpuMesh{"cuda:gloo", {2}}, GpuMesh{"cuda:gloo", {3}},
                                           GpuMesh{"cuda", {1}}, GpuMesh{"cuda", {2}}),
                         gpu_test::mesh_param_name);

#endif
