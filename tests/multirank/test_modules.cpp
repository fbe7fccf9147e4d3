// Unchanged torch::nn modules on distributed parameters and inputs: an MLP and a small CNN
// (Sequential of Conv2d, ReLU, MaxPool2d, AdaptiveAvgPool2d, Flatten, Linear) trained 20 steps
// with torch::optim equal the same training on one device. Parameters are swapped in with
// distribute_module / distribute_parameter; the module code is not touched.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "helpers.h"

using namespace tessera;
namespace nn = torch::nn;

namespace {

torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::ReLU(),
                               torch::nn::Linear(12, 3));
}

torch::nn::Sequential make_cnn() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)), torch::nn::ReLU(),
      torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3)), torch::nn::ReLU(),
      torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions(1)), torch::nn::Flatten(),
      torch::nn::Linear(4, 3));
}

// Train `model` 20 steps on (x, y); returns the losses.
std::vector<double> train(torch::nn::Sequential model, const at::Tensor& x, const at::Tensor& y,
                          bool adam) {
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (adam)
    opt =
        std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.01));
  else
    opt = std::make_unique<torch::optim::SGD>(model->parameters(),
                                              torch::optim::SGDOptions(0.05).momentum(0.9));
  std::vector<double> losses;
  for (int s = 0; s < 20; ++s) {
    opt->zero_grad();
    auto loss = at::mse_loss(model->forward(x), y);
    loss.backward();
    opt->step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

void compare(torch::nn::Sequential ref, torch::nn::Sequential dist, const std::vector<double>& a,
             const std::vector<double>& b, const std::string& what) {
  for (size_t s = 0; s < a.size(); ++s)
    ASSERT_NEAR(a[s], b[s], 1e-4 * (1 + std::abs(a[s]))) << what << " step " << s;
  auto pa = ref->named_parameters(), pb = dist->named_parameters();
  for (const auto& item : pa) {
    auto got = *pb.find(item.key());
    ASSERT_TRUE(is_dtensor(got)) << what << " " << item.key() << " is not distributed";
    ASSERT_TRUE(tessera::test::full_matches(got, item.value().detach(), {1e-4, 1e-5}))
        << what << " parameter " << item.key();
  }
}

}  // namespace

TEST(Modules, DataParallelMlpAndCnn) {
  torch::manual_seed(0);  // on the test thread, before any rank thread exists
  const auto mlp = make_mlp();
  const auto cnn = make_cnn();
  const auto x_mlp = tessera::test::randn({9, 6}, 1), y_mlp = tessera::test::randn({9, 3}, 2);
  const auto x_cnn = tessera::test::randn({5, 2, 8, 8}, 3), y_cnn = tessera::test::randn({5, 3}, 4);
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      for (bool adam : {false, true}) {
        for (bool conv : {false, true}) {
          auto proto = conv ? cnn : mlp;
          auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(proto->clone());
          auto dist = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(proto->clone());
          distribute_module(*dist, mesh);  // every parameter replicated
          const auto& x = conv ? x_cnn : x_mlp;
          const auto& y = conv ? y_cnn : y_mlp;
          // Uneven batch shards: everything but one sample on the last rank.
          ShardTable rows(world, 0);
          rows.back() = x.size(0) - (world > 1 ? 1 : 0);
          if (world > 1) rows[0] = 1;
          auto dx =
              distribute_tensor(x, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
          auto dy =
              distribute_tensor(y, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
          auto a = train(torch::nn::Sequential(ref), x, y, adam);
          auto b = train(torch::nn::Sequential(dist), dx, dy, adam);
          compare(torch::nn::Sequential(ref), torch::nn::Sequential(dist), a, b,
                  std::string(conv ? "cnn" : "mlp") + (adam ? " adam" : " sgd") + " world " +
                      std::to_string(world));
        }
      }
    });
  }
}

TEST(Modules, TensorParallelMlpOnTwoDimensionalMesh) {
  torch::manual_seed(1);
  const auto mlp = make_mlp();
  const auto x = tessera::test::randn({8, 6}, 5), y = tessera::test::randn({8, 3}, 6);
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(mlp->clone());
    auto dist = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(mlp->clone());
    // Colwise first layer, rowwise second, replicated over dp; data sharded over dp.
    distribute_module(*dist, mesh,
                      [](const std::string& name, torch::nn::Module& m, const DeviceMesh& mesh) {
                        if (name == "0") {
                          distribute_parameter(m, "weight", mesh, {Replicate(), Shard(0)});
                          distribute_parameter(m, "bias", mesh, {Replicate(), Shard(0)});
                        } else if (name == "2") {
                          distribute_parameter(m, "weight", mesh, {Replicate(), Shard(1)});
                          distribute_parameter(m, "bias", mesh, {Replicate(), Replicate()});
                        }
                      });
    auto dx = distribute_tensor(x, mesh, {Shard(0), Replicate()}, std::nullopt);
    auto dy = distribute_tensor(y, mesh, {Shard(0), Replicate()}, std::nullopt);
    auto a = train(torch::nn::Sequential(ref), x, y, true);
    auto b = train(torch::nn::Sequential(dist), dx, dy, true);
    compare(torch::nn::Sequential(ref), torch::nn::Sequential(dist), a, b, "2-D tp mlp");
  });
}

TEST(Modules, ReplaceParameterRejectsUnknownEntries) {
  tessera::testing::run_ranks(1, [](int) {
    auto mesh = init_device_mesh("cpu", {1});
    torch::nn::Linear lin(2, 2);
    EXPECT_THROW(distribute_parameter(*lin, "nope", mesh, {Replicate()}), c10::Error);
    distribute_parameter(*lin, "weight", mesh, {Shard(0)});
    EXPECT_TRUE(is_dtensor(lin->weight));
    EXPECT_TRUE(lin->weight.is_same(*lin->named_parameters().find("weight")));
    EXPECT_TRUE(lin->weight.requires_grad());
  });
}
