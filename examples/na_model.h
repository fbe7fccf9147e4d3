#pragma once
// The model of examples/na_transformer.cpp: a small neighbourhood-attention transformer on a
// 2-D field, channels last. x [B, H, W, c_in] -> [B, H, W, c_out]:
//   embed (Linear c_in -> dim, per pixel)
//   blocks: x = x + attn(norm1(x)); x = x + mlp(norm2(x))   (pre-norm, NAT's block)
//   head (Linear dim -> c_out), added to the input's first channel (the model learns a
//   correction of the field it is given).
// Every layer but the attention reads only its own pixel, so on a field cut into blocks only
// the attention needs rows from other blocks (its K/V halo).
//
// The per-pixel Linears (embedding, qkv, proj, MLP, head) run as 1x1 convolutions on a
// channels-first view, with the Linear modules' own weights: a Linear on a [B, H, W, C]
// activation folds B, H and W into one dim for its matrix product, and a block cut along H
// and W has no shard layout there, so Tessera would gather the whole activation first (see
// --module-forward in na_transformer.cpp). A 1x1 convolution keeps the blocks: it reads no
// neighbour. On plain tensors both forms compute the same values.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "tessera/nn/neighborhood_attention.h"

namespace na_model {

struct BlockConfig {
  int64_t kernel = 7;
  int64_t dilation = 1;
};

struct NAConfig {
  int64_t c_in = 1, c_out = 1;
  int64_t dim = 16, heads = 2, mlp_ratio = 2;
  std::vector<BlockConfig> blocks = {{7, 1}, {5, 2}};  // the second one dilated
  bool rpb = true;  // a relative positional bias per head (the windows' only sense of direction)
  // No qkv bias: the key part of it cannot change any softmax (it adds q.b to every logit of a
  // query alike), so its gradient is rounding noise, which AdamW scales up to steps of lr;
  // the two float32 runs would then differ there by up to lr.
  bool qkv_bias = false;
  // The MLP's own torch::nn::Linear forward instead of the 1x1-convolution form: the same
  // values; on blocks cut along H and W, each Linear then gathers its input.
  bool module_forward = false;
};

// linear(x, weight, bias) on the last dim of x [B, H, W, C_in], as a 1x1 convolution.
inline at::Tensor pixel_linear(const at::Tensor& x, const torch::nn::Linear& linear) {
  const auto& w = linear->weight;  // [C_out, C_in]
  return at::conv2d(x.permute({0, 3, 1, 2}), w.view({w.size(0), w.size(1), 1, 1}), linear->bias)
      .permute({0, 2, 3, 1});
}

struct NABlockImpl : torch::nn::Module {
  NABlockImpl(const NAConfig& c, const BlockConfig& b) {
    namespace nn = torch::nn;
    norm1 = register_module("norm1", nn::LayerNorm(nn::LayerNormOptions({c.dim})));
    attn = register_module("attn",
                           tessera::nn::NeighborhoodAttention2d(
                               tessera::nn::NeighborhoodAttentionOptions(c.dim, c.heads, {b.kernel})
                                   .dilation({b.dilation})
                                   .rpb(c.rpb)
                                   .qkv_bias(c.qkv_bias)));
    norm2 = register_module("norm2", nn::LayerNorm(nn::LayerNormOptions({c.dim})));
    fc1 = register_module("fc1", nn::Linear(c.dim, c.mlp_ratio * c.dim));
    fc2 = register_module("fc2", nn::Linear(c.mlp_ratio * c.dim, c.dim));
  }

  at::Tensor forward(at::Tensor x) {
    x = x + attn(norm1(x));  // the module keeps the field sharded itself
    if (module_forward) return x + fc2(torch::gelu(fc1(norm2(x))));
    return x + pixel_linear(torch::gelu(pixel_linear(norm2(x), fc1)), fc2);
  }

  bool module_forward = false;

  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  tessera::nn::NeighborhoodAttention2d attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(NABlock);

struct NATransformerImpl : torch::nn::Module {
  explicit NATransformerImpl(const NAConfig& c) : config(c) {
    namespace nn = torch::nn;
    embed = register_module("embed", nn::Linear(c.c_in, c.dim));
    for (size_t i = 0; i < c.blocks.size(); ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), NABlock(c, c.blocks[i])));
      blocks.back()->module_forward = c.module_forward;
    }
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({c.dim})));
    head = register_module("head", nn::Linear(c.dim, c.c_out));
  }

  // x [B, H, W, c_in] -> [B, H, W, c_out]
  at::Tensor forward(const at::Tensor& x) {
    const bool linear = config.module_forward;
    auto h = linear ? embed(x) : pixel_linear(x, embed);
    for (auto& block : blocks) h = block(h);
    h = norm(h);
    return x.narrow(-1, 0, config.c_out) + (linear ? head(h) : pixel_linear(h, head));
  }

  NAConfig config;
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<NABlock> blocks;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(NATransformer);

}  // namespace na_model
