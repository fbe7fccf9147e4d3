#pragma once
// The demo's model, shared by examples/domain_demo.cpp and bench/bench_domain.cpp: an
// encoder-decoder with one skip connection (a one-level U-Net) of unchanged torch::nn
// modules: conv, group norm, max pool, upsample, skip concat.
#include <vector>

#include <torch/torch.h>

namespace heat {

namespace nn = torch::nn;

struct HeatNetImpl : nn::Module {
  HeatNetImpl() {
    encode = register_module("encode", nn::Conv2d(nn::Conv2dOptions(1, 8, 3).padding(1)));
    encode_norm = register_module("encode_norm", nn::GroupNorm(nn::GroupNormOptions(2, 8)));
    pool = register_module("pool", nn::MaxPool2d(nn::MaxPool2dOptions(2)));
    coarse = register_module("coarse", nn::Conv2d(nn::Conv2dOptions(8, 16, 3).padding(1)));
    coarse_norm = register_module("coarse_norm", nn::GroupNorm(nn::GroupNormOptions(4, 16)));
    upsample = register_module(
        "upsample",
        nn::Upsample(
            nn::UpsampleOptions().scale_factor(std::vector<double>{2, 2}).mode(torch::kNearest)));
    decode = register_module("decode", nn::Conv2d(nn::Conv2dOptions(16 + 8, 8, 3).padding(1)));
    head = register_module("head", nn::Conv2d(nn::Conv2dOptions(8, 1, 1)));
  }

  at::Tensor forward(const at::Tensor& field) {
    const auto skip = torch::relu(encode_norm(encode(field)));
    const auto low = torch::relu(coarse_norm(coarse(pool(skip))));
    const auto merged = torch::cat({upsample(low), skip}, /*dim=*/1);
    return head(torch::relu(decode(merged)));
  }

  nn::Conv2d encode{nullptr}, coarse{nullptr}, decode{nullptr}, head{nullptr};
  nn::GroupNorm encode_norm{nullptr}, coarse_norm{nullptr};
  nn::MaxPool2d pool{nullptr};
  nn::Upsample upsample{nullptr};
};
TORCH_MODULE(HeatNet);

}  // namespace heat
