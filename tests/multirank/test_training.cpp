// End to end: an MLP trained with torch::optim (SGD with momentum and weight decay, Adam,
// AdamW) on distributed parameters and inputs gives the losses and final parameters of the
// same training on one device: data parallel (uneven batch shards, replicated parameters)
// and tensor parallel (column/row sharded weights), on 1-D and 2-D meshes.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include "helpers.h"

using namespace tessera;

namespace {

struct Params {
  at::Tensor w1, b1, w2, b2;
  std::vector<at::Tensor> list() const { return {w1, b1, w2, b2}; }
};

Params init_params() {
  return {tessera::test::randn({16, 8}, 11) * 0.3, tessera::test::randn({16}, 12) * 0.1,
          tessera::test::randn({4, 16}, 13) * 0.3, tessera::test::randn({4}, 14) * 0.1};
}

at::Tensor forward(const Params& p, const at::Tensor& x) {
  return at::linear(at::linear(x, p.w1, p.b1).relu(), p.w2, p.b2);
}

enum class Opt { Sgd, Adam, AdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, std::vector<at::Tensor> params) {
  switch (o) {
    case Opt::Sgd:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
    case Opt::Adam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
    case Opt::AdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(0.01).weight_decay(0.05));
  }
  return nullptr;
}

// Trains `steps` steps; returns the losses. `wrap(param, which)` makes a parameter leaf.
std::vector<double> train(Opt o, Params p, const at::Tensor& x, const at::Tensor& y, int steps,
                          double clip_norm_type = 0) {
  auto opt = make_optimizer(o, p.list());
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    auto loss = at::mse_loss(forward(p, x), y);
    loss.backward();
    // A norm across all (sharded) gradients; 0.3 is small enough to clip every step.
    if (clip_norm_type != 0) torch::nn::utils::clip_grad_norm_(p.list(), 0.3, clip_norm_type);
    opt->step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

Params leafs(Params p) {
  for (auto* t : {&p.w1, &p.b1, &p.w2, &p.b2}) *t = t->detach().clone().requires_grad_();
  return p;
}

void expect_same_training(const DeviceMesh& mesh, const Placements& w1p, const Placements& b1p,
                          const Placements& w2p, const Placements& b2p, const Placements& xp,
                          const std::vector<ShardTable>& x_tables, const std::string& what,
                          double clip_norm_type = 0) {
  const auto full = init_params();
  const auto x = tessera::test::randn({10, 8}, 21);
  const auto y = tessera::test::randn({10, 4}, 22);
  for (Opt o : {Opt::Sgd, Opt::Adam, Opt::AdamW}) {
    auto ref = leafs(full);
    auto ref_losses = train(o, ref, x, y, 20, clip_norm_type);
    auto dist = leafs({distribute_tensor(full.w1, mesh, w1p, std::nullopt),
                       distribute_tensor(full.b1, mesh, b1p, std::nullopt),
                       distribute_tensor(full.w2, mesh, w2p, std::nullopt),
                       distribute_tensor(full.b2, mesh, b2p, std::nullopt)});
    auto dx = distribute_tensor(x, mesh, xp, std::nullopt, ShardSizes::Given(x_tables));
    auto dy = distribute_tensor(y, mesh, xp, std::nullopt, ShardSizes::Given(x_tables));
    auto losses = train(o, dist, dx, dy, 20, clip_norm_type);
    const std::string ctx = what + " optimizer " + std::to_string(int(o));
    for (size_t s = 0; s < losses.size(); ++s)
      ASSERT_NEAR(losses[s], ref_losses[s], 1e-4 * (1 + std::abs(ref_losses[s])))
          << ctx << " step " << s;
    auto a = ref.list(), b = dist.list();
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_TRUE(tessera::test::full_matches(b[i], a[i].detach(), {1e-4, 1e-5}))
          << ctx << " parameter " << i << " " << spec(b[i]).str();
  }
}

}  // namespace

TEST(Training, DataParallelUnevenBatch) {
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      ShardTable rows = world == 1   ? ShardTable{10}
                        : world == 2 ? ShardTable{7, 3}
                                     : ShardTable{6, 0, 4};
      Placements r = {Replicate()};
      expect_same_training(mesh, r, r, r, r, {Shard(0)}, {rows},
                           "dp world " + std::to_string(world));
    });
  }
}

TEST(Training, TensorParallelColwiseRowwise) {
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    // Megatron MLP: w1 by output features, w2 by input features; data replicated.
    expect_same_training(mesh, {Shard(0)}, {Shard(0)}, {Shard(1)}, {Replicate()}, {Replicate()}, {},
                         "tp colwise/rowwise");
  });
}

TEST(Training, TwoDimensionalMeshDataAndTensorParallel) {
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    expect_same_training(mesh, {Replicate(), Shard(0)}, {Replicate(), Shard(0)},
                         {Replicate(), Shard(1)}, {Replicate(), Replicate()},
                         {Shard(0), Replicate()}, {{7, 3}}, "2-D dp x tp");
  });
}

TEST(Training, GradientClippingAcrossShardedParameters) {
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      expect_same_training(mesh, {Replicate(), Shard(0)}, {Replicate(), Shard(0)},
                           {Replicate(), Shard(1)}, {Replicate(), Replicate()},
                           {Shard(0), Replicate()}, {{7, 3}},
                           "clip_grad_norm_ p=" + std::to_string(norm_type), norm_type);
    }
  });
}
