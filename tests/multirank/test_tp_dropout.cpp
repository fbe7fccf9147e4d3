// Dropout in a tensor-parallel model (NOTE: [Plain dropout on local shards]): between a
// ColwiseParallel that hands out local shards and the RowwiseParallel that reads them back, a
// training-mode dropout raises on every rank, naming use_local_output(false); with that option
// it equals one device, forward and backward; eval mode, p = 0 and a dropout after the
// Rowwise module pass.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "helpers.h"

using namespace tessera;
using tessera::test::clone_of;

namespace {

constexpr double kTol = 1e-12;

// Linear(8, h) -> ReLU -> Dropout(p) -> Linear(h, 8) [-> Dropout(p) after, when `after`].
torch::nn::Sequential mlp(int64_t hidden, double p, bool after) {
  torch::manual_seed(5);
  torch::nn::Sequential m(torch::nn::Linear(8, hidden), torch::nn::ReLU(),
                          torch::nn::Dropout(after ? 0.0 : p), torch::nn::Linear(hidden, 8));
  if (after) m->push_back(torch::nn::Dropout(p));
  m->to(at::kDouble);
  return m;
}

struct Result {
  at::Tensor out;
  std::vector<at::Tensor> grads;
};

// One training-mode forward and backward; parameters' gradients as full values.
Result step(torch::nn::Sequential& m, const at::Tensor& x) {
  Result r;
  r.out = m->forward(x);
  (r.out * r.out).sum().backward();
  for (const auto& p : m->parameters())
    r.grads.push_back(is_dtensor(p) ? full_tensor(p.grad()) : p.grad());
  if (is_dtensor(r.out)) r.out = full_tensor(r.out);
  return r;
}

}  // namespace

// The default plan (use_local_output(true)) with a dropout on the Colwise output's shards.
TEST(TpDropout, DropoutOnLocalShardsRaisesOnEveryRank) {
  for (int world : {1, 2, 3}) {
    const at::Tensor x = test::randn({4, 8}, 31, at::kDouble);
    auto ref = mlp(2 * world + 1, 0.3, false);  // uneven hidden shards
    ref->eval();
    const at::Tensor want_eval = ref->forward(x);
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world}, {"tp"});
      auto m = clone_of(ref);
      parallelize_module(m, mesh, {{"0", ColwiseParallel()}, {"3", RowwiseParallel()}});
      m->train();
      try {
        (void)m->forward(x);
        ADD_FAILURE() << "dropout on local shards did not raise, world " << world;
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        for (const char* needle :
             {"aten::dropout", "'0'", "ColwiseParallel", "use_local_output(false)"})
          EXPECT_NE(msg.find(needle), std::string::npos) << needle << " missing from: " << msg;
      }
      // Eval mode draws nothing: the same plan runs and equals one device.
      m->eval();
      EXPECT_TRUE(at::allclose(m->forward(x), want_eval, kTol, kTol));
    });
  }
}

// use_local_output(false): the dropout is a random op on a distributed tensor and draws one
// device's mask; forward and gradients equal one device seeded alike, on uneven shards.
TEST(TpDropout, DistributedOutputDrawsOneDevicesMask) {
  for (int world : {1, 2, 3, 4}) {
    const int64_t hidden = 3 * world - 1;
    const at::Tensor x = test::randn({5, 8}, 32, at::kDouble);
    auto ref = mlp(hidden, 0.4, false);
    auto init = clone_of(ref);
    ref->train();
    at::manual_seed(77);
    const Result want = step(ref, x);
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world}, {"tp"});
      auto m = clone_of(init);
      parallelize_module(
          m, mesh, {{"0", ColwiseParallel().use_local_output(false)}, {"3", RowwiseParallel()}});
      m->train();
      tessera::manual_seed(77 + rank);  // rank 0's seed is the one all ranks draw with
      const Result got = step(m, x);
      EXPECT_TRUE(at::allclose(got.out, want.out, kTol, kTol)) << "world " << world;
      ASSERT_EQ(got.grads.size(), want.grads.size());
      for (size_t i = 0; i < want.grads.size(); ++i)
        EXPECT_TRUE(at::allclose(got.grads[i], want.grads[i], kTol, kTol)) << "grad " << i;
    });
  }
}

// A dropout after the Rowwise module (its input read the shards back) and p = 0 pass; a
// Colwise-only model leaves the window open until a style reads a plain input again.
TEST(TpDropout, DropoutOutsideTheShardedRegionPasses) {
  const at::Tensor x = test::randn({4, 8}, 33, at::kDouble);
  const auto with_after = mlp(6, 0.3, true), p_zero = mlp(6, 0.0, false);
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    auto after = clone_of(with_after);
    parallelize_module(after, mesh, {{"0", ColwiseParallel()}, {"3", RowwiseParallel()}});
    after->train();
    EXPECT_NO_THROW((void)after->forward(x));
    auto zero = clone_of(p_zero);
    parallelize_module(zero, mesh, {{"0", ColwiseParallel()}, {"3", RowwiseParallel()}});
    zero->train();
    EXPECT_NO_THROW((void)zero->forward(x));
    // The next forward's first module closes the window a Colwise-only model left open.
    auto colwise = clone_of(p_zero);
    parallelize_module(colwise, mesh, {{"0", ColwiseParallel()}});
    auto first = colwise[0]->as<torch::nn::Linear>();
    (void)first->forward(x);
    EXPECT_THROW((void)at::dropout(x, 0.5, true), c10::Error);
    (void)first->forward(x);
    EXPECT_THROW((void)at::dropout(x, 0.5, true), c10::Error);
    (void)after->forward(x);  // its Rowwise input reads the shards back
    EXPECT_NO_THROW((void)at::dropout(x, 0.5, true));
  });
}
