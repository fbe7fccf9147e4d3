#pragma once
// The tests' small U-Net (conv, group norm, max pool, nearest upsampling, a transposed conv,
// a skip concat), in plain torch::nn: domain and data parallel tests train it against one
// device.
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/upsampling.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

namespace tessera::test {

struct SmallUNetImpl : torch::nn::Cloneable<SmallUNetImpl> {
  torch::nn::detail::conv_padding_mode_t mode;
  torch::nn::Conv2d enc1{nullptr}, enc2{nullptr}, dec{nullptr}, head{nullptr};
  torch::nn::ConvTranspose2d up2{nullptr};
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  explicit SmallUNetImpl(torch::nn::detail::conv_padding_mode_t m = torch::kZeros) : mode(m) {
    reset();
  }
  void reset() override {
    using namespace torch::nn;
    enc1 = register_module("enc1", Conv2d(Conv2dOptions(1, 4, 3).padding(1).padding_mode(mode)));
    norm1 = register_module("norm1", GroupNorm(2, 4));
    enc2 = register_module("enc2", Conv2d(Conv2dOptions(4, 8, 3).padding(1).padding_mode(mode)));
    norm2 = register_module("norm2", GroupNorm(4, 8));
    up2 = register_module("up2", ConvTranspose2d(ConvTranspose2dOptions(8, 4, 2).stride(2)));
    dec = register_module("dec", Conv2d(Conv2dOptions(12, 4, 3).padding(1).padding_mode(mode)));
    head = register_module("head", Conv2d(Conv2dOptions(4, 1, 1)));
  }
  at::Tensor forward(const at::Tensor& x) {
    namespace F = torch::nn::functional;
    at::Tensor skip = at::relu(norm1(enc1(x)));
    at::Tensor low = at::relu(norm2(enc2(at::max_pool2d(skip, {2, 2}))));
    at::Tensor up = F::interpolate(
        low,
        F::InterpolateFuncOptions().scale_factor(std::vector<double>{2, 2}).mode(torch::kNearest));
    at::Tensor both = at::cat({up + up2(low).sum(1, true), skip}, 1);
    return head(at::relu(dec(both)));
  }
};
TORCH_MODULE(SmallUNet);

}  // namespace tessera::test
