// NeighborhoodAttention{1,2,3}d: qkv projection, neighbourhood attention, output projection.
#include <ostream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include "tessera/nn/neighborhood_attention.h"
#include "tessera/parallel/module.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::nn {

template <int64_t SpatialRank>
NeighborhoodAttentionImpl<SpatialRank>::NeighborhoodAttentionImpl(
    NeighborhoodAttentionOptions options_)
    : options(std::move(options_)) {
  reset();
}

template <int64_t SpatialRank>
void NeighborhoodAttentionImpl<SpatialRank>::reset() {
  const int64_t dim = options.dim(), heads = options.num_heads();
  TORCH_CHECK(dim > 0 && heads > 0 && dim % heads == 0, "tessera::nn::NeighborhoodAttention",
              SpatialRank, "d: dim (", dim, ") must be a positive multiple of num_heads (", heads,
              ")");
  const auto& ks = options.kernel_size();
  TORCH_CHECK(ks.size() == 1 || static_cast<int64_t>(ks.size()) == SpatialRank,
              "tessera::nn::NeighborhoodAttention", SpatialRank, "d: kernel_size has ", ks.size(),
              " entries; give one, or one per spatial axis (", SpatialRank, ")");
  qkv = this->register_module(
      "qkv", torch::nn::Linear(torch::nn::LinearOptions(dim, 3 * dim).bias(options.qkv_bias())));
  proj = this->register_module("proj", torch::nn::Linear(dim, dim));
  if (options.rpb()) {
    std::vector<int64_t> shape = {heads};
    for (int64_t a = 0; a < SpatialRank; ++a)
      shape.push_back(2 * ks[ks.size() == 1 ? 0 : static_cast<size_t>(a)] - 1);
    at::Tensor init;
    {
      at::NoGradGuard no_grad;
      init = at::randn(shape).mul_(0.02).clamp_(-2.0, 2.0);
    }
    rpb = this->register_parameter("rpb", init);
  } else {
    rpb = at::Tensor();
  }
}

template <int64_t SpatialRank>
void NeighborhoodAttentionImpl<SpatialRank>::pretty_print(std::ostream& stream) const {
  stream << "tessera::nn::NeighborhoodAttention" << SpatialRank << "d(dim=" << options.dim()
         << ", num_heads=" << options.num_heads()
         << ", kernel_size=" << at::IntArrayRef(options.kernel_size())
         << ", stride=" << at::IntArrayRef(options.stride())
         << ", dilation=" << at::IntArrayRef(options.dilation())
         << ", rpb=" << (options.rpb() ? "true" : "false") << ")";
}

namespace {
// A Linear applied at every position of [B, *S, C]. On a field sharded along S, Linear's own
// form flattens [B, *S] into rows, which uneven spatial shards cannot follow, so the field
// would be gathered; the same map as a 1x1 convolution on the channels-first view keeps every
// shard where it is (and is exact: the same sums per position).
at::Tensor per_position(const torch::nn::LinearImpl& lin, const at::Tensor& x) {
  if (!is_dtensor(x) || x.dim() < 3 || x.dim() > 5)
    return const_cast<torch::nn::LinearImpl&>(lin).forward(x);
  const int64_t n = x.dim();
  std::vector<int64_t> to_first = {0, n - 1}, back = {0};
  for (int64_t d = 1; d < n - 1; ++d) to_first.push_back(d);
  for (int64_t d = 2; d < n; ++d) back.push_back(d);
  back.push_back(1);
  std::vector<int64_t> wshape = lin.weight.sizes().vec();
  wshape.resize(static_cast<size_t>(n), 1);
  const std::vector<int64_t> ones(static_cast<size_t>(n - 2), 1),
      zeros(static_cast<size_t>(n - 2), 0);
  at::Tensor y = at::convolution(x.permute(to_first), lin.weight.view(wshape), lin.bias, ones,
                                 zeros, ones, false, zeros, 1);
  return y.permute(back);
}
}  // namespace

template <int64_t SpatialRank>
at::Tensor NeighborhoodAttentionImpl<SpatialRank>::forward(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == SpatialRank + 2 && x.size(-1) == options.dim(),
              "tessera::nn::NeighborhoodAttention", SpatialRank, "d: input must be [B, ",
              SpatialRank, " spatial dims, ", options.dim(), "], got ", x.sizes());
  const int64_t heads = options.num_heads(), hd = options.dim() / heads;
  std::vector<int64_t> split = x.sizes().vec();
  split.back() = 3;
  split.push_back(heads);
  split.push_back(hd);
  const at::Tensor qkv_ = per_position(*qkv, x).view(split);  // [B, *S, 3, heads, hd]
  functional::NeighborhoodAttentionFuncOptions o;
  o.stride(options.stride())
      .dilation(options.dilation())
      .is_causal(options.is_causal())
      .circular(options.circular())
      .scale(options.scale())
      .rpb(rpb);
  const at::Tensor y = functional::neighborhood_attention(
      qkv_.select(-3, 0), qkv_.select(-3, 1), qkv_.select(-3, 2), options.kernel_size(), o);
  return per_position(*proj, y.flatten(-2));
}

template class NeighborhoodAttentionImpl<1>;
template class NeighborhoodAttentionImpl<2>;
template class NeighborhoodAttentionImpl<3>;

namespace {
// distribute_module swaps parameters for distributed ones in the registry and in the member
// that forward() reads; `rpb` is such a member.
template <int64_t R>
at::Tensor* rpb_member(NeighborhoodAttentionImpl<R>& m, const std::string& name) {
  return name == "rpb" ? &m.rpb : nullptr;
}
const bool kAccessorsRegistered = [] {
  register_member_accessor<NeighborhoodAttentionImpl<1>>(rpb_member<1>);
  register_member_accessor<NeighborhoodAttentionImpl<2>>(rpb_member<2>);
  register_member_accessor<NeighborhoodAttentionImpl<3>>(rpb_member<3>);
  return true;
}();
}  // namespace

}  // namespace tessera::nn
