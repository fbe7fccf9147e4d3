// replicate() with its default options fed the way torch DDP is fed: each rank its own plain
// batch (uneven sizes, an empty one included). The model must train as DDP does: gradients
// averaged over the ranks' local gradients, BatchNorm's running statistics taken from the
// first rank. The oracle runs the ranks' batches one after the other on one model.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "helpers.h"

using namespace tessera;

namespace {

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  NetImpl() { reset(); }
  void reset() override {
    // (no bias before BatchNorm: its gradient is zero up to rounding, which Adam would amplify)
    l1 = register_module("l1", torch::nn::Linear(torch::nn::LinearOptions(5, 8).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    l2 = register_module("l2", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return l2(at::tanh(bn(l1(x)))); }
};
TORCH_MODULE(Net);

std::shared_ptr<NetImpl> clone_double(const Net& m) {
  auto c = std::dynamic_pointer_cast<NetImpl>(m->clone());
  c->to(at::kDouble);
  return c;
}

std::unique_ptr<torch::optim::Optimizer> optimizer(bool adam, std::vector<at::Tensor> params) {
  if (adam) return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

at::Tensor data(int64_t rows, int64_t cols, int step, int rank, int which) {
  return test::randn({rows, cols}, 5000 + 100 * step + 10 * rank + which, at::kDouble);
}

}  // namespace

TEST(ReplicatePlainBatches, TrainsAsTorchDDP) {
  // Per-rank batch sizes: even, uneven, and one rank with a batch of 2 (BatchNorm needs 2+).
  const std::vector<std::vector<int64_t>> cases = {{4}, {4, 4}, {5, 2, 3}, {2, 6}};
  for (const auto& rows : cases) {
    for (bool adam : {false, true}) {
      const int n = static_cast<int>(rows.size());
      torch::manual_seed(3);
      Net proto;
      auto ref = clone_double(proto);
      const int steps = 3;
      std::vector<std::vector<double>> expected_loss(steps, std::vector<double>(n));
      {
        auto o = optimizer(adam, ref->parameters());
        for (int s = 0; s < steps; ++s) {
          o->zero_grad();
          // DDP: every rank's forward from the same parameters and running statistics;
          // gradients averaged; the first rank's running statistics kept.
          auto buffers = ref->buffers();
          std::vector<at::Tensor> before, first;
          for (auto& b : buffers) before.push_back(b.clone());
          for (int r = 0; r < n; ++r) {
            at::NoGradGuard no_grad;
            for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(before[i]);
            at::AutoGradMode grad_on(true);
            auto loss =
                at::mse_loss(ref->forward(data(rows[r], 5, s, r, 0)), data(rows[r], 3, s, r, 1));
            (loss / n).backward();
            expected_loss[s][r] = loss.item<double>();
            if (r == 0)
              for (auto& b : buffers) first.push_back(b.clone());
          }
          for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(first[i]);
          o->step();
        }
      }
      const std::string what = "rows " + shape_str(rows) + (adam ? " adam" : " sgd");
      tessera::testing::run_ranks(n, [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {n}, {"dp"});
        auto model = clone_double(proto);
        auto ddp = replicate(*model, mesh);  // default options, as a DDP user writes it
        auto o = optimizer(adam, model->parameters());
        for (int s = 0; s < steps; ++s) {
          o->zero_grad();
          auto loss = at::mse_loss(model->forward(data(rows[rank], 5, s, rank, 0)),
                                   data(rows[rank], 3, s, rank, 1));
          loss.backward();
          o->step();
          // Each rank's loss is its own batch's, as under DDP.
          const double mine =
              is_dtensor(loss) ? to_local(loss).item<double>() : loss.item<double>();
          ASSERT_NEAR(mine, expected_loss[s][rank], 1e-10)
              << what << " step " << s << " rank " << rank;
        }
        for (const auto& p : ref->named_parameters()) {
          at::Tensor got = *model->named_parameters().find(p.key());
          got = is_dtensor(got) ? to_local(got) : got;
          ASSERT_TRUE(at::allclose(got.detach(), p.value().detach(), 1e-9, 1e-9))
              << what << ": " << p.key() << " on rank " << rank;
        }
        for (const auto& b : ref->named_buffers()) {
          at::Tensor got = *model->named_buffers().find(b.key());
          got = is_dtensor(got) ? to_local(got) : got;
          ASSERT_TRUE(at::allclose(got.to(at::kDouble), b.value().to(at::kDouble), 1e-9, 1e-9))
              << what << ": buffer " << b.key() << " on rank " << rank;
        }
      });
    }
  }
}
