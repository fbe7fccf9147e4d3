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
#include <torch/version.h>

#include "tessera/nn/neighborhood_attention.h"
#include "tessera/tessera.h"

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
  // A global self-attention block over every pixel after the NA blocks (GlobalAttention).
  bool global_block = false;
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

// Global self-attention over every pixel of the field, pre-norm with a residual:
// x + proj(attention(norm(x))), the pixels of the field as one sequence, no position
// information (the NA blocks before it carry the positions). On a field cut into blocks over
// the 2x2 mesh, each rank's block of pixels becomes its share of one sequence split over both
// mesh dims (Shard(1) on each: they nest, row-major over the mesh), and
// scaled_dot_product_attention on it is context parallel: each rank keeps its query pixels
// and K/V come to it (docs/context_parallel.md). A block's pixels are not a contiguous run of
// the whole field's row-major order, and need not be: attention without positions gives every
// query the same result whatever order the keys come in, so the one-device model on the whole
// field ([B, H * W, C], row-major) computes the same values.
struct GlobalAttentionImpl : torch::nn::Module {
  explicit GlobalAttentionImpl(const NAConfig& c) : heads(c.heads) {
    namespace nn = torch::nn;
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({c.dim})));
    qkv = register_module("qkv", nn::Linear(nn::LinearOptions(c.dim, 3 * c.dim).bias(false)));
    proj = register_module("proj", nn::Linear(c.dim, c.dim));
  }

  at::Tensor forward(const at::Tensor& x) { return x + from_tokens(attend(to_tokens(norm(x))), x); }

  // [B, N, C] -> [B, N, C]: multi-head attention over the N tokens.
  at::Tensor attend(const at::Tensor& t) {
    const int64_t B = t.size(0), N = t.size(1), C = t.size(2), d = C / heads;
    const auto split = [&](const at::Tensor& u) {
      return u.view({B, N, heads, d}).transpose(1, 2);
    };
    const auto parts = qkv(t).chunk(3, -1);
    const at::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
#if TORCH_VERSION_MAJOR >= 2
    const at::Tensor o = at::scaled_dot_product_attention(q, k, v);
#else
    const at::Tensor o =
        at::softmax(q.matmul(k.transpose(-2, -1)) / std::sqrt(double(d)), -1).matmul(v);
#endif
    return proj(o.transpose(1, 2).reshape({B, N, C}));
  }

  // The field's pixels as tokens: [B, H, W, C] -> [B, H * W, C]; on a distributed field,
  // each rank's block of pixels as its shard of the sequence.
  at::Tensor to_tokens(const at::Tensor& x) const {
    if (!tessera::is_dtensor(x)) return x.reshape({x.size(0), x.size(1) * x.size(2), x.size(3)});
    const at::Tensor local = tessera::to_local(x);
    tessera::FromLocalOptions opts;
    opts.sizes = tessera::ShardSizes::Given(1, pixels_per_rank(tessera::spec(x)));
    return tessera::from_local(
        local.reshape({local.size(0), local.size(1) * local.size(2), local.size(3)}),
        tessera::device_mesh(x), {tessera::Shard(1), tessera::Shard(1)}, opts);
  }

  // Back to `like`'s field layout. The ops in between may have changed the tokens' layout
  // (the matmul-softmax form does): they go back to one block of pixels per rank first.
  at::Tensor from_tokens(const at::Tensor& t, const at::Tensor& like) const {
    if (!tessera::is_dtensor(t)) return t.view(like.sizes());
    const tessera::DTensorSpec& field = tessera::spec(like);
    const auto tokens = std::make_shared<tessera::DTensorSpec>(
        field.mesh(), tessera::Placements{tessera::Shard(1), tessera::Shard(1)}, t.sizes().vec(),
        t.scalar_type(), std::vector<tessera::ShardTable>{{}, pixels_per_rank(field), {}});
    const at::Tensor block = tessera::to_local(like);
    tessera::FromLocalOptions opts;
    opts.sizes = tessera::ShardSizes::Given(field.shard_tables());
    return tessera::from_local(
        tessera::to_local(tessera::redistribute(t, tokens)).view(block.sizes()), field.mesh(),
        field.placements(), opts);
  }

  // Every rank's pixel count, row-major over the field's mesh (the nesting of two Shard(1)).
  tessera::ShardTable pixels_per_rank(const tessera::DTensorSpec& s) const {
    const auto& shape = s.mesh().shape();
    TORCH_CHECK(shape.size() == 2, "GlobalAttention: the field's mesh must be 2-D");
    tessera::ShardTable n;
    for (int64_t i = 0; i < shape[0]; ++i)
      for (int64_t j = 0; j < shape[1]; ++j) {
        const auto l = s.local_sizes({i, j});
        n.push_back(l[1] * l[2]);
      }
    return n;
  }

  int64_t heads;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(GlobalAttention);

struct NATransformerImpl : torch::nn::Module {
  explicit NATransformerImpl(const NAConfig& c) : config(c) {
    namespace nn = torch::nn;
    embed = register_module("embed", nn::Linear(c.c_in, c.dim));
    for (size_t i = 0; i < c.blocks.size(); ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), NABlock(c, c.blocks[i])));
      blocks.back()->module_forward = c.module_forward;
    }
    if (c.global_block) global = register_module("global", GlobalAttention(c));
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({c.dim})));
    head = register_module("head", nn::Linear(c.dim, c.c_out));
  }

  // x [B, H, W, c_in] -> [B, H, W, c_out]
  at::Tensor forward(const at::Tensor& x) {
    const bool linear = config.module_forward;
    auto h = linear ? embed(x) : pixel_linear(x, embed);
    for (auto& block : blocks) h = block(h);
    if (global) h = global(h);
    h = norm(h);
    return x.narrow(-1, 0, config.c_out) + (linear ? head(h) : pixel_linear(h, head));
  }

  NAConfig config;
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<NABlock> blocks;
  GlobalAttention global{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(NATransformer);

}  // namespace na_model
