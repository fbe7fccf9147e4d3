// Domain parallelism end to end with unchanged torch::nn modules: a U-Net-like model (conv,
// group norm, max pool, upsample, skip concat, transposed conv) trained 10 steps with Adam
// on a field split H x W over a 2x2 mesh with uneven shards equals the same training on one
// device, with zero and with periodic (circular) boundaries. Conv modules with every
// padding mode, "same" / "valid" padding, even kernels, dilation, and 1-D / 3-D variants
// match one device forward and backward. Bad configurations fail on every rank.
#include <torch/nn/functional/padding.h>
#include <torch/nn/functional/upsampling.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adam.h>

#include "helpers.h"

using namespace tessera;
using tessera::test::clone_of;
namespace nn = torch::nn;
namespace F = torch::nn::functional;

namespace {

using UNetImpl = test::SmallUNetImpl;
using UNet = test::SmallUNet;

std::vector<double> train(UNetImpl& model, const at::Tensor& x, const at::Tensor& y, int steps) {
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    at::Tensor loss = at::mse_loss(model.forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

void train_and_compare(torch::nn::detail::conv_padding_mode_t mode,
                       const std::vector<ShardTable>& tables, const std::string& what) {
  torch::manual_seed(3);  // on the test thread, before any rank thread exists
  UNet proto(mode);
  const at::Tensor x = test::randn({2, 1, 20, 16}, 5), y = test::randn({2, 1, 20, 16}, 6);
  auto ref = clone_of(proto);
  const auto expected = train(*ref, x, y, 10);
  tessera::testing::run_ranks(4, [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {2, 2}, {"h", "w"});
    auto model = clone_of(proto);
    distribute_module(*model, mesh);
    const Placements hw = {Shard(2), Shard(3)};
    auto dx = distribute_tensor(x, mesh, hw, std::nullopt, ShardSizes::Given(tables));
    auto dy = distribute_tensor(y, mesh, hw, std::nullopt, ShardSizes::Given(tables));
    const auto got = train(*model, dx, dy, 10);
    for (size_t s = 0; s < got.size(); ++s)
      ASSERT_NEAR(got[s], expected[s], 1e-4 * (1 + std::abs(expected[s]))) << what << " step " << s;
    for (const auto& p : ref->named_parameters()) {
      at::Tensor mine = *model->named_parameters().find(p.key());
      ASSERT_TRUE(is_dtensor(mine)) << what << " " << p.key();
      ASSERT_TRUE(tessera::test::full_matches(mine, p.value().detach(), {1e-4, 1e-5}))
          << what << ": parameter " << p.key() << " after 10 steps";
    }
  });
}

// One module (or functional op) on a sharded input against one device, forward and backward.
void check_module(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& x,
                  const DeviceMesh& mesh, const Placements& p,
                  const std::vector<ShardTable>& tables, const std::string& what) {
  at::Tensor xr = x.clone().requires_grad_();
  at::Tensor expected = fn(xr);
  at::Tensor dx =
      distribute_tensor(x, mesh, p, std::nullopt, ShardSizes::Given(tables)).requires_grad_();
  at::Tensor got = fn(dx);
  ASSERT_TRUE(tessera::test::full_matches(got, expected, {1e-9, 1e-10})) << what << " forward";
  at::Tensor g = test::randn(expected.sizes(), 9, at::kDouble);
  expected.backward(g);
  got.backward(distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(),
                                 std::nullopt, ShardSizes::Given(spec(got).shard_tables())));
  ASSERT_TRUE(tessera::test::full_matches(dx.grad(), xr.grad(), {1e-9, 1e-10}))
      << what << " input gradient";
}

}  // namespace

TEST(DomainTraining, UNetEqualsOneDeviceZeroBoundary) {
  // Even cuts: pooling halves each shard and upsampling doubles it back onto the skip.
  train_and_compare(torch::kZeros, {{}, {}, {8, 12}, {6, 10}}, "zeros, even cuts");
}

TEST(DomainTraining, UNetEqualsOneDevicePeriodicBoundary) {
  train_and_compare(torch::kCircular, {{}, {}, {12, 8}, {10, 6}}, "circular, even cuts");
}

TEST(DomainTraining, UNetEqualsOneDeviceOddCuts) {
  // Odd cuts: the upsampled branch and the skip get different tables; the concat lines them
  // up (a redistribution), still exact.
  train_and_compare(torch::kZeros, {{}, {}, {7, 13}, {9, 7}}, "zeros, odd cuts");
}

TEST(DomainTraining, ConvModulesEveryPaddingMode) {
  const std::vector<torch::nn::detail::conv_padding_mode_t> modes = {
      torch::kZeros, torch::kReflect, torch::kReplicate, torch::kCircular};
  const char* names[] = {"zeros", "reflect", "replicate", "circular"};
  std::vector<torch::nn::Conv2d> protos;  // built on the test thread: one global generator
  torch::manual_seed(11);
  for (auto mode : modes)
    for (int64_t pad : {1, 2}) {
      protos.emplace_back(
          torch::nn::Conv2dOptions(2, 3, 2 * pad + 1).padding(pad).padding_mode(mode));
      protos.back()->to(at::kDouble);
    }
  const at::Tensor x = test::randn({2, 2, 9, 7}, 21, at::kDouble);
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    for (size_t i = 0; i < protos.size(); ++i) {
      auto ref = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(protos[i]->clone());
      auto conv = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(protos[i]->clone());
      distribute_module(*conv, mesh);
      check_module(
          [&](const at::Tensor& t) { return is_dtensor(t) ? conv->forward(t) : ref->forward(t); },
          x, mesh, {Shard(2), Shard(3)}, {{}, {}, {3, 6}, {5, 2}},
          std::string("Conv2d padding_mode ") + names[i / 2] + " pad " + std::to_string(i % 2 + 1));
    }
  });
}

TEST(DomainTraining, ConvSameValidEvenKernelsDilationAndDims) {
  tessera::testing::run_ranks(3, [&](int) {
    auto mesh = init_device_mesh("cpu", {3});
    at::Tensor x1 = test::randn({2, 2, 13}, 31, at::kDouble);
    at::Tensor x2 = test::randn({1, 2, 11, 6}, 32, at::kDouble);
    at::Tensor x3 = test::randn({1, 2, 7, 5, 4}, 33, at::kDouble);
    at::Tensor w1 = test::randn({3, 2, 4}, 34, at::kDouble),
               w2 = test::randn({3, 2, 4, 3}, 35, at::kDouble),
               w3 = test::randn({2, 2, 3, 2, 3}, 36, at::kDouble);
    auto rep = [&](const at::Tensor& w) {
      return distribute_tensor(w, mesh, {Replicate()}, std::nullopt);
    };
    auto pick = [&](const at::Tensor& t, const at::Tensor& w) {
      return is_dtensor(t) ? rep(w) : w;
    };
    check_module([&](const at::Tensor& t) { return at::conv1d(t, pick(t, w1), {}, 1, "same", 2); },
                 x1, mesh, {Shard(2)}, {{}, {}, {4, 0, 9}}, "conv1d same, even kernel, dilation 2");
    check_module([&](const at::Tensor& t) { return at::conv2d(t, pick(t, w2), {}, 1, "same", 1); },
                 x2, mesh, {Shard(2)}, {{}, {}, {2, 1, 8}}, "conv2d same, even kernel, thin shard");
    // One cut dim, stride 1, "same": the interior-and-rim path, with a shard thinner than
    // the rim and an empty one.
    at::Tensor w33 = test::randn({3, 2, 3, 3}, 38, at::kDouble),
               w55 = test::randn({3, 2, 5, 3}, 39, at::kDouble);
    check_module([&](const at::Tensor& t) { return at::conv2d(t, pick(t, w33), {}, 1, 1); }, x2,
                 mesh, {Shard(2)}, {{}, {}, {4, 1, 6}}, "conv2d 3x3 pad 1, rim path, thin shard");
    check_module(
        [&](const at::Tensor& t) {
          return at::conv2d(t, pick(t, w55), {}, 1, at::IntArrayRef{2, 1});
        },
        x2, mesh, {Shard(2)}, {{}, {}, {0, 5, 6}}, "conv2d 5x3 pad (2, 1), rim path, empty shard");
    check_module([&](const at::Tensor& t) { return at::conv2d(t, pick(t, w2), {}, 1, "valid", 1); },
                 x2, mesh, {Shard(3)}, {{}, {}, {}, {1, 4, 1}}, "conv2d valid");
    check_module([&](const at::Tensor& t) { return at::conv3d(t, pick(t, w3), {}, 2, 1, 1); }, x3,
                 mesh, {Shard(2)}, {{}, {}, {3, 3, 1}}, "conv3d stride 2");
    check_module(
        [&](const at::Tensor& t) { return at::conv_transpose2d(t, pick(t, w2), {}, 2, 1, 1); },
        test::randn({1, 3, 11, 6}, 37, at::kDouble), mesh, {Shard(2)}, {{}, {}, {5, 0, 6}},
        "conv_transpose2d stride 2, output_padding 1");
  });
}

TEST(DomainTraining, BadConfigurationsFailOnEveryRank) {
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor full = test::randn({1, 1, 4, 6}, 41, at::kDouble);
    auto x = distribute_tensor(full, mesh, {Shard(2)}, std::nullopt, ShardSizes::Given(2, {1, 3}));
    // Reflection padding must be smaller than the dim (as on one device) ...
    try {
      (void)at::reflection_pad2d(x, {0, 0, 4, 0});
      ADD_FAILURE() << "reflection padding wider than the dim was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("reflection_pad2d"), std::string::npos) << e.what();
    }
    // ... a kernel larger than the padded input is rejected naming the op and the dim ...
    try {
      (void)at::conv2d(x, distribute_tensor(test::randn({1, 1, 7, 1}, 42, at::kDouble), mesh,
                                            {Replicate()}, std::nullopt));
      ADD_FAILURE() << "a kernel larger than the input was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("convolution"), std::string::npos) << e.what();
    }
    // ... pooling padding wider than half the kernel, circular padding wider than the
    // domain, and cropping more rows than there are ...
    auto expect_error = [&](const std::function<void()>& f, const std::string& needle,
                            const char* what) {
      try {
        f();
        ADD_FAILURE() << what << " was accepted";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expect_error(
        [&] {
          (void)at::max_pool2d(x, {2, 2}, {2, 2}, {2, 2});
        },
        "max_pool2d", "pooling padding wider than half the kernel");
    expect_error(
        [&] {
          (void)at::_pad_circular(x, {0, 0, 5, 0});
        },
        "circular padding", "circular padding wider than the domain");
    expect_error(
        [&] {
          (void)at::constant_pad_nd(x, {0, 0, -3, -2});
        },
        "constant_pad_nd", "cropping more rows than the dim has");
    // ... and the ranks are still in step afterwards.
    EXPECT_TRUE(tessera::test::full_matches(at::max_pool2d(x, {2, 2}), at::max_pool2d(full, {2, 2}),
                                            {1e-5, 1e-8}));
  });
}
