#pragma once
// Models, training loops and checks shared by the fully_shard tests. The oracle is always the
// same model trained on one device; nothing here hard-codes an expected value.
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "helpers.h"

namespace tessera::fsdp_test {

using tessera::test::clone_of;

// Linears (16,15), (7,16), (17,7) and a head (2,17): uneven rows on 3 and 4 ranks, and the
// head's 2 rows leave ranks 2 and 3 of 4 with empty shards.
struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  torch::nn::Linear l0{nullptr}, l1{nullptr}, l2{nullptr}, head{nullptr};
  MlpImpl() { reset(); }
  void reset() override {
    l0 = register_module("l0", torch::nn::Linear(15, 16));
    l1 = register_module("l1", torch::nn::Linear(16, 7));
    l2 = register_module("l2", torch::nn::Linear(7, 17));
    head = register_module("head", torch::nn::Linear(17, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    return head(at::tanh(l2(at::relu(l1(at::relu(l0(x)))))));
  }
};

struct EmbeddingModelImpl : torch::nn::Cloneable<EmbeddingModelImpl> {
  int64_t vocab;
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear out{nullptr};
  explicit EmbeddingModelImpl(int64_t v) : vocab(v) { reset(); }
  void reset() override {
    emb = register_module("emb", torch::nn::Embedding(vocab, 3));
    out = register_module("out", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& tokens) { return out(emb(tokens).sum(1)); }
};

struct CnnImpl : torch::nn::Cloneable<CnnImpl> {
  torch::nn::Conv2d conv{nullptr};
  torch::nn::GroupNorm norm{nullptr};
  torch::nn::Linear fc{nullptr};
  CnnImpl() { reset(); }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 5, 3).padding(1)));
    norm = register_module("norm", torch::nn::GroupNorm(1, 5));
    fc = register_module("fc", torch::nn::Linear(5, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc(at::relu(norm(conv(x))).mean(std::vector<int64_t>{2, 3}));
  }
};

// Built on the test thread (the global generator is not for rank threads), in float64.
inline std::shared_ptr<MlpImpl> make_mlp() {
  torch::manual_seed(7);
  auto m = std::make_shared<MlpImpl>();
  m->to(at::kDouble);
  return m;
}
inline std::shared_ptr<EmbeddingModelImpl> make_embedding_model(int64_t vocab) {
  torch::manual_seed(8);
  auto m = std::make_shared<EmbeddingModelImpl>(vocab);
  m->to(at::kDouble);
  return m;
}
inline std::shared_ptr<CnnImpl> make_cnn() {
  torch::manual_seed(9);
  auto m = std::make_shared<CnnImpl>();
  m->to(at::kDouble);
  return m;
}

enum class Opt { Sgd, AdamW };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o,
                                                               std::vector<at::Tensor> params) {
  if (o == Opt::Sgd)
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(0.01).weight_decay(0.05));
}

template <class Model>
std::vector<double> train(Model& model, Opt o, const at::Tensor& x, const at::Tensor& y,
                          int steps) {
  auto opt = make_optimizer(o, model.parameters());
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    at::Tensor loss = at::mse_loss(model.forward(x), y);
    loss.backward();
    opt->step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// This rank's rows of the global batch, wrapped the way docs/fsdp.md tells users to:
// from_local over the root mesh, Shard(0) along the data-parallel dim.
inline at::Tensor local_batch(const at::Tensor& global, const DeviceMesh& mesh,
                              const ShardTable& rows) {
  const int64_t me = mesh.coordinate()[0];
  int64_t off = 0;
  for (int64_t r = 0; r < me; ++r) off += rows[r];
  return from_local(global.narrow(0, off, rows[me]).clone(), mesh, {Shard(0)},
                    {ShardSizes::Given(0, rows)});
}

inline void expect_losses(const std::vector<double>& got, const std::vector<double>& expected,
                          const std::string& ctx, double rtol = 1e-9) {
  ASSERT_EQ(got.size(), expected.size()) << ctx;
  for (size_t s = 0; s < got.size(); ++s)
    ASSERT_NEAR(got[s], expected[s], rtol * (1 + std::abs(expected[s]))) << ctx << " step " << s;
}

// Every registered parameter is the sharded one: its full value equals the reference's and
// its local rows are torch.chunk(reference, n, 0)[rank] (empty past the last chunk).
inline void expect_parameters(torch::nn::Module& model, torch::nn::Module& ref, int64_t n,
                              int64_t rank, const std::string& ctx,
                              test::Tolerance tol = {1e-9, 1e-10}) {
  const auto got = model.named_parameters();
  const auto want = ref.named_parameters();
  ASSERT_EQ(got.size(), want.size()) << ctx;
  for (const auto& item : want) {
    const at::Tensor* p = got.find(item.key());
    ASSERT_TRUE(p && is_dtensor(*p)) << ctx << " " << item.key() << " is not distributed";
    const at::Tensor expected = item.value().detach();
    ASSERT_TRUE(test::full_matches(*p, expected, tol)) << ctx << " " << item.key();
    const auto chunks = expected.chunk(n, 0);
    const at::Tensor rows = rank < static_cast<int64_t>(chunks.size())
                                ? chunks[rank]
                                : expected.narrow(0, expected.size(0), 0);
    ASSERT_TRUE(test::matches(to_local(p->detach()), rows, tol))
        << ctx << " " << item.key() << ": local rows differ from torch.chunk's";
  }
}

}  // namespace tessera::fsdp_test

using tessera::fsdp_test::CnnImpl;
using tessera::fsdp_test::EmbeddingModelImpl;
using tessera::fsdp_test::MlpImpl;
