// docs/neighborhood_attention.md: na2d with dilation and grouped-query heads on q, k, v
// sharded along H and W over a 2x2 mesh (rows 9 + 7, columns 5 + 7); the output and the
// gradients of q, k and v against na2d on the whole tensors on one device.
#include <torch/torch.h>

#include <tessera/tessera.h>
#include <tessera/nn/neighborhood_attention.h>

#include "doc_check.h"

int main() {
  tessera::init_process_group();
  auto mesh = tessera::init_device_mesh("cpu", {2, 2}, {"h", "w"});
  torch::manual_seed(0);  // same values on every rank
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const auto full_q = at::randn({2, 16, 12, 4, 8}, opts);
  const auto full_k = at::randn({2, 16, 12, 2, 8}, opts);
  const auto full_v = at::randn({2, 16, 12, 2, 6}, opts);
  const auto sizes = tessera::ShardSizes::Given({{}, {9, 7}, {5, 7}});
  auto shard = [&](const at::Tensor& t) {
    return tessera::distribute_tensor(t, mesh, {tessera::Shard(1), tessera::Shard(2)},
                                      std::nullopt, sizes)
        .requires_grad_();
  };
  const auto q = shard(full_q), k = shard(full_k), v = shard(full_v);

  {
    // doc:begin
#include <tessera/tessera.h>
#include <tessera/nn/neighborhood_attention.h>  // not in the umbrella header
namespace F = tessera::nn::functional;

// q [B, H, W, heads, D], k [B, H, W, kv_heads, D], v [B, H, W, kv_heads, Dv]
auto out = F::na2d(q, k, v, /*kernel_size=*/{7, 7},
                   F::NeighborhoodAttentionFuncOptions().dilation({2, 1}).is_causal({false, false}));
    // doc:end

    const auto ref_q = full_q.clone().requires_grad_(), ref_k = full_k.clone().requires_grad_(),
               ref_v = full_v.clone().requires_grad_();
    auto ref = F::na2d(ref_q, ref_k, ref_v, {7, 7},
                       F::NeighborhoodAttentionFuncOptions().dilation({2, 1}));
    doc::expect_close("output", out, ref);
    // A fixed, non-uniform weighting of the output, so every gradient path is exercised.
    const auto w = at::linspace(-1, 1, ref.numel(), opts).view(ref.sizes());
    (out * shard(w).detach()).sum().backward();
    (ref * w).sum().backward();
    doc::expect_close("q grad", q.grad(), ref_q.grad());
    doc::expect_close("k grad", k.grad(), ref_k.grad());
    doc::expect_close("v grad", v.grad(), ref_v.grad());
  }
  return doc::finish("docs/neighborhood_attention.md");
}
