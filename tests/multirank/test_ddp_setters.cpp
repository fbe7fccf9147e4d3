// ReplicatedModule::set_requires_gradient_sync, called directly (the no_sync guard's test
// covers the guard): off, backward communicates nothing and requires_gradient_sync() says so;
// back on, the next backward reduces the accumulated sum, equal to one device.
#include <torch/nn/modules/linear.h>

#include "helpers.h"

using namespace tessera;

TEST(DdpSetters, RequiresGradientSyncOffThenOn) {
  constexpr int kWorld = 3;
  torch::manual_seed(41);
  torch::nn::Linear proto(6, 3);
  proto->to(at::kDouble);
  const at::Tensor xa = test::randn({2 * kWorld, 6}, 42, at::kDouble),
                   xb = test::randn({2 * kWorld, 6}, 43, at::kDouble);
  // One device: each rank's loss over its rows, averaged over the ranks, both micro-batches.
  auto ref = std::dynamic_pointer_cast<torch::nn::LinearImpl>(proto->clone());
  at::Tensor total = at::zeros({}, at::kDouble);
  for (int r = 0; r < kWorld; ++r)
    for (const auto* x : {&xa, &xb})
      total = total + ref->forward(x->narrow(0, 2 * r, 2)).pow(2).mean();
  (total / kWorld).backward();
  tessera::testing::run_ranks(kWorld, [&](int rank) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {kWorld}, {"dp"});
    auto model = std::dynamic_pointer_cast<torch::nn::LinearImpl>(proto->clone());
    auto ddp = replicate(*model, mesh, ReplicateOptions().local_batches(true));
    EXPECT_TRUE(ddp->requires_gradient_sync());
    ddp->set_requires_gradient_sync(false);
    EXPECT_FALSE(ddp->requires_gradient_sync());
    {
      CommDebugMode mode;
      model->forward(xa.narrow(0, 2 * rank, 2)).pow(2).mean().backward();
      EXPECT_EQ(mode.get_total_counts(), 0) << mode.table();
    }
    ddp->set_requires_gradient_sync(true);
    CommDebugMode mode;
    model->forward(xb.narrow(0, 2 * rank, 2)).pow(2).mean().backward();
    EXPECT_GT(mode.get_total_counts(), 0);
    ASSERT_TRUE(test::matches(model->weight.grad(), ref->weight.grad(), {1e-9, 1e-10}));
    ASSERT_TRUE(test::matches(model->bias.grad(), ref->bias.grad(), {1e-9, 1e-10}));
  });
}
