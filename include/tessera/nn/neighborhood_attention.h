#pragma once
// Neighbourhood attention (NATTEN's na1d / na2d / na3d) on plain and distributed tensors.
//
// Layout is heads-last, as NATTEN's fused ops: query [B, *S, H, D], key [B, *S, H_kv, D],
// value [B, *S, H_kv, Dv]; the output is [B, *S, H, Dv]. Query i attends, along every
// spatial axis, to the k keys of its window (NATTEN's rule: centred on the query or its
// stride leader, shifted inward at the borders, every d-th row with dilation d; causal
// windows end at the query), and the neighbourhood is the Cartesian product of the axes.
// Grouped-query attention: H % H_kv == 0, query head h reads key/value head h / (H / H_kv).
//
// Beyond NATTEN:
//  - circular: an axis may wrap around (a periodic domain); windows are then centred on the
//    query (or its stride leader) and never shifted, rows taken modulo the extent;
//  - rpb: a relative positional bias [H, 2*k1-1 (, 2*k2-1, 2*k3-1)] with a gradient (NATTEN
//    0.17's layout: a pair's entry is (y - x) + k - 1 per axis, in dilation-group units);
//    not with a causal axis;
//  - float64 and CPU, forward and backward.
// additional_keys / additional_values ([B, N, H_kv, D / Dv]) are attended by every query,
// unmasked, in the same softmax.
//
// The op is `tessera::neighborhood_attention` (and `..._backward`) in the dispatcher; these
// functions call it, so distributed tensors reach their domain-parallel rule.
//
// Not included by tessera/tessera.h: a namespace tessera::nn visible through
// `using namespace tessera;` would make `nn::` ambiguous next to `namespace nn = torch::nn`.
// Include this header where it is used.
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace tessera::nn {

namespace functional {

// Per-axis lists take one entry per spatial axis, or one entry for every axis.
struct NeighborhoodAttentionFuncOptions {
  TORCH_ARG(std::vector<int64_t>, stride) = {1};
  TORCH_ARG(std::vector<int64_t>, dilation) = {1};
  TORCH_ARG(std::vector<bool>, is_causal) = {false};
  TORCH_ARG(std::vector<bool>, circular) = {false};
  // The softmax scale. nullopt (the default) means D^-0.5 with D the query's head dim; any
  // value given is used as is, 0 included (NATTEN reads 0 as "default"; we do not).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  // Undefined tensors mean "absent".
  TORCH_ARG(at::Tensor, rpb);
  TORCH_ARG(at::Tensor, additional_keys);
  TORCH_ARG(at::Tensor, additional_values);
};

// The spatial rank is q.dim() - 3 (1 to 3).
at::Tensor neighborhood_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  std::vector<int64_t> kernel_size,
                                  const NeighborhoodAttentionFuncOptions& options = {});
// Also returns the log-sum-exp of each query's logits, [B, *S, H] (float32; float64 for
// double inputs). Its gradient is ignored.
std::tuple<at::Tensor, at::Tensor> neighborhood_attention_with_lse(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::vector<int64_t> kernel_size,
    const NeighborhoodAttentionFuncOptions& options = {});

// Rank-checked forms: q must be [B, X, H, D], [B, X, Y, H, D], [B, X, Y, Z, H, D].
at::Tensor na1d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::vector<int64_t> kernel_size,
                const NeighborhoodAttentionFuncOptions& options = {});
at::Tensor na2d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::vector<int64_t> kernel_size,
                const NeighborhoodAttentionFuncOptions& options = {});
at::Tensor na3d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::vector<int64_t> kernel_size,
                const NeighborhoodAttentionFuncOptions& options = {});

}  // namespace functional

// A neighbourhood-attention layer (NAT's NeighborhoodAttention2D): qkv projection, NA over
// the spatial axes, output projection. x [B, *S, dim] -> [B, *S, dim].
struct NeighborhoodAttentionOptions {
  NeighborhoodAttentionOptions(int64_t dim, int64_t num_heads, std::vector<int64_t> kernel_size)
      : dim_(dim), num_heads_(num_heads), kernel_size_(std::move(kernel_size)) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, num_heads);
  TORCH_ARG(std::vector<int64_t>, kernel_size);  // one entry, or one per spatial axis
  TORCH_ARG(std::vector<int64_t>, stride) = {1};
  TORCH_ARG(std::vector<int64_t>, dilation) = {1};
  TORCH_ARG(std::vector<bool>, is_causal) = {false};
  TORCH_ARG(std::vector<bool>, circular) = {false};
  TORCH_ARG(bool, qkv_bias) = true;
  // A learnable relative positional bias [num_heads, 2*k1-1, ...], initialised from
  // N(0, 0.02^2) as NAT does.
  TORCH_ARG(bool, rpb) = false;
  // nullopt: head_dim^-0.5.
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
};

template <int64_t SpatialRank>
class NeighborhoodAttentionImpl
    : public torch::nn::Cloneable<NeighborhoodAttentionImpl<SpatialRank>> {
 public:
  static_assert(SpatialRank >= 1 && SpatialRank <= 3, "1 to 3 spatial axes");
  explicit NeighborhoodAttentionImpl(NeighborhoodAttentionOptions options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& x);

  NeighborhoodAttentionOptions options;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  at::Tensor rpb;  // undefined unless options.rpb()
};

extern template class NeighborhoodAttentionImpl<1>;
extern template class NeighborhoodAttentionImpl<2>;
extern template class NeighborhoodAttentionImpl<3>;

using NeighborhoodAttention1dImpl = NeighborhoodAttentionImpl<1>;
using NeighborhoodAttention2dImpl = NeighborhoodAttentionImpl<2>;
using NeighborhoodAttention3dImpl = NeighborhoodAttentionImpl<3>;
TORCH_MODULE(NeighborhoodAttention1d);
TORCH_MODULE(NeighborhoodAttention2d);
TORCH_MODULE(NeighborhoodAttention3d);

}  // namespace tessera::nn
