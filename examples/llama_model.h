#pragma once
// A small Llama-style decoder in plain torch::nn, shared by examples/tp_transformer.cpp,
// the tensor-parallel tests (tests/multirank/test_tp_llama.cpp) and the peer benchmark
// (bench/peer/tessera_peer.cpp; bench/peer/dtensor_tp.py is the same model in PyTorch).
//
//   token embedding -> n_layers x [RMSNorm -> attention (RoPE, causal) -> residual,
//                                  RMSNorm -> SwiGLU feed-forward -> residual]
//   -> RMSNorm -> output projection
//
// Nothing here knows about distribution. The code only keeps two habits that tensor
// parallelism relies on (as Llama code written for torchtitan does):
//  * attention infers its head count from the projection (view(B, S, -1, head_dim)), so it
//    runs on a rank's local slice of heads as well as on all of them;
//  * batch and sequence sizes are read from the block's input, which is the whole (global)
//    tensor whether it is plain or distributed.
// Everything is LibTorch 1.13 compatible (no complex RoPE); scaled_dot_product_attention is
// used only where LibTorch has it (2.0 on) and the config asks for it.
#include <cmath>
#include <limits>
#include <string>

#include <torch/torch.h>
#include <torch/version.h>

// Whether this LibTorch has at::scaled_dot_product_attention.
#define LLAMA_HAS_SDPA (TORCH_VERSION_MAJOR >= 2)

namespace llama {

namespace nn = torch::nn;

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t dim = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t ffn_hidden = 172;  // SwiGLU hidden width
  int64_t max_seq_len = 64;
  double dropout = 0.0;  // attention-probability and residual dropout
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  // true: attention is one at::scaled_dot_product_attention(is_causal) call (LibTorch 2.0
  // on), which a sequence split runs without gathering K and V (context parallelism's ring);
  // false: matmul, softmax, matmul with an additive mask.
  bool fused_attention = false;

  int64_t head_dim() const { return dim / n_heads; }
};

// y = x / sqrt(mean(x^2) + eps) * weight, over the last dim. Its one parameter is named
// `weight`, as in torchtitan and LayerNorm.
struct RMSNormImpl : nn::Module {
  RMSNormImpl(int64_t dim, double eps) : eps(eps) {
    weight = register_parameter("weight", torch::ones({dim}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
  }
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// Rotary position embedding ("rotate half" form) on x [B, S, H, D] with cos/sin [S, D/2].
inline torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos,
                                  const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const auto c = cos.view({1, cos.size(0), 1, half});
  const auto s = sin.view({1, sin.size(0), 1, half});
  const auto x1 = x.narrow(-1, 0, half);
  const auto x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
}

struct AttentionImpl : nn::Module {
  explicit AttentionImpl(const LlamaConfig& c)
      : head_dim(c.head_dim()), dropout(c.dropout), fused(c.fused_attention) {
    TORCH_CHECK(!fused || LLAMA_HAS_SDPA, "llama: fused_attention needs LibTorch 2.0 or later");
    auto proj = [&](int64_t in, int64_t out) {
      return nn::Linear(nn::LinearOptions(in, out).bias(false));
    };
    wq = register_module("wq", proj(c.dim, c.n_heads * head_dim));
    wk = register_module("wk", proj(c.dim, c.n_heads * head_dim));
    wv = register_module("wv", proj(c.dim, c.n_heads * head_dim));
    wo = register_module("wo", proj(c.n_heads * head_dim, c.dim));
  }

  // x [B, S, dim]; cos/sin [S, head_dim / 2]; mask [S, S] (0 or -inf), added to the scores
  // (undefined with fused attention).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask) {
    const int64_t B = x.size(0), S = x.size(1);
    // -1: the heads this projection holds (all of them, or a rank's share).
    auto q = wq(x).view({B, S, -1, head_dim});
    auto k = wk(x).view({B, S, -1, head_dim});
    auto v = wv(x).view({B, S, -1, head_dim});
    q = apply_rotary(q, cos, sin).transpose(1, 2);  // [B, H, S, D]
    k = apply_rotary(k, cos, sin).transpose(1, 2);
    v = v.transpose(1, 2);
    torch::Tensor attended;
#if LLAMA_HAS_SDPA
    if (fused)
      attended = at::scaled_dot_product_attention(q, k, v, {}, is_training() ? dropout : 0.0,
                                                  /*is_causal=*/true);
#endif
    if (!fused) {
      auto scores =
          torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
      auto probs = torch::softmax(scores + mask, -1);
      if (dropout > 0) probs = torch::dropout(probs, dropout, is_training());
      attended = torch::matmul(probs, v);
    }
    // [B, H, S, D] -> [B, S, H, D] -> [B, S, H * D]
    auto out = attended.transpose(1, 2).clone(torch::MemoryFormat::Contiguous);
    out = wo(out.view({B, S, -1}));
    if (dropout > 0) out = torch::dropout(out, dropout, is_training());
    return out;
  }

  int64_t head_dim;
  double dropout;
  bool fused;
  nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
};
TORCH_MODULE(Attention);

// SwiGLU: w2(silu(w1 x) * w3 x).
struct FeedForwardImpl : nn::Module {
  explicit FeedForwardImpl(const LlamaConfig& c) : dropout(c.dropout) {
    w1 = register_module("w1", nn::Linear(nn::LinearOptions(c.dim, c.ffn_hidden).bias(false)));
    w2 = register_module("w2", nn::Linear(nn::LinearOptions(c.ffn_hidden, c.dim).bias(false)));
    w3 = register_module("w3", nn::Linear(nn::LinearOptions(c.dim, c.ffn_hidden).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = w2(torch::silu(w1(x)) * w3(x));
    if (dropout > 0) out = torch::dropout(out, dropout, is_training());
    return out;
  }
  double dropout;
  nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

struct TransformerBlockImpl : nn::Module {
  explicit TransformerBlockImpl(const LlamaConfig& c) {
    attention_norm = register_module("attention_norm", RMSNorm(c.dim, c.norm_eps));
    attention = register_module("attention", Attention(c));
    ffn_norm = register_module("ffn_norm", RMSNorm(c.dim, c.norm_eps));
    feed_forward = register_module("feed_forward", FeedForward(c));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask) {
    auto h = x + attention(attention_norm(x), cos, sin, mask);
    return h + feed_forward(ffn_norm(h));
  }
  RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};
};
TORCH_MODULE(TransformerBlock);

struct TransformerImpl : nn::Module {
  explicit TransformerImpl(const LlamaConfig& c) : config(c) {
    TORCH_CHECK(c.dim % c.n_heads == 0 && c.head_dim() % 2 == 0, "llama: dim ", c.dim,
                " must split into ", c.n_heads, " heads of an even size");
    tok_embeddings = register_module("tok_embeddings", nn::Embedding(c.vocab_size, c.dim));
    layers = register_module("layers", nn::ModuleList());
    for (int64_t i = 0; i < c.n_layers; ++i) layers->push_back(TransformerBlock(c));
    norm = register_module("norm", RMSNorm(c.dim, c.norm_eps));
    output =
        register_module("output", nn::Linear(nn::LinearOptions(c.dim, c.vocab_size).bias(false)));
    // Rotary tables for every position: angle(p, i) = p * theta^(-2i / head_dim).
    const int64_t half = c.head_dim() / 2;
    const auto inv_freq =
        torch::pow(c.rope_theta, -torch::arange(0, half, torch::kDouble) * 2.0 / c.head_dim());
    const auto angles = torch::outer(torch::arange(0, c.max_seq_len, torch::kDouble), inv_freq);
    rope_cos = register_buffer("rope_cos", torch::cos(angles).to(torch::kFloat));
    rope_sin = register_buffer("rope_sin", torch::sin(angles).to(torch::kFloat));
  }

  // tokens [B, S] (int64) -> logits [B, S, vocab_size].
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t S = tokens.size(1);
    TORCH_CHECK(S <= config.max_seq_len, "llama: sequence of ", S, " tokens > max_seq_len ",
                config.max_seq_len);
    auto h = tok_embeddings(tokens);
    if (config.dropout > 0) h = torch::dropout(h, config.dropout, is_training());
    const auto cos = rope_cos.narrow(0, 0, S).to(h.scalar_type());
    const auto sin = rope_sin.narrow(0, 0, S).to(h.scalar_type());
    // The causal mask of the matmul form (the fused form takes is_causal instead: no S x S).
    torch::Tensor mask;
    if (!config.fused_attention)
      mask = torch::full({S, S}, -std::numeric_limits<double>::infinity(),
                         torch::TensorOptions().dtype(h.scalar_type()).device(h.device()))
                 .triu(1);
    for (const auto& layer : *layers) h = layer->as<TransformerBlock>()->forward(h, cos, sin, mask);
    return output(norm(h));
  }

  LlamaConfig config;
  nn::Embedding tok_embeddings{nullptr};
  nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
  nn::Linear output{nullptr};
  torch::Tensor rope_cos, rope_sin;
};
TORCH_MODULE(Transformer);

}  // namespace llama
