// FSDPModule's setters that had no test, each checked by its observable effect and by
// training that still equals one device: set_reshard_after_backward (the group stays
// gathered after backward until reshard()), set_reshard_after_forward (the group stays
// gathered after forward, so backward gathers one group fewer), set_modules_to_backward_prefetch
// (which all-gather backward starts early, counted by CommDebugMode).
#include "fully_shard_helpers.h"

using namespace tessera;
using namespace tessera::fsdp_test;

namespace {

std::vector<std::shared_ptr<FSDPModule>> shard_mlp(MlpImpl& m, const DeviceMesh& mesh) {
  return {fully_shard(m.l0, mesh), fully_shard(m.l1, mesh), fully_shard(m.l2, mesh),
          fully_shard(m, mesh)};
}

int64_t all_gathers(const CommDebugMode& m) {
  auto c = m.get_comm_counts();
  auto it = c.find("all_gather");
  return it == c.end() ? 0 : it->second;
}

constexpr int kSteps = 3;
const ShardTable kRows = {4, 0, 6};

}  // namespace

TEST(FsdpSetters, ReshardAfterBackwardOffKeepsTheGroupGathered) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 201, at::kDouble),
             y = test::randn({10, 2}, 202, at::kDouble);
  auto ref = clone_of(proto);
  const auto expected = train(*ref, Opt::Sgd, x, y, kSteps);
  tessera::testing::run_ranks(3, [&](int rank) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {3}, {"dp"});
    auto model = clone_of(proto);
    const auto groups = shard_mlp(*model, mesh);
    groups[1]->set_reshard_after_backward(false);
    const auto dx = local_batch(x, mesh, kRows), dy = local_batch(y, mesh, kRows);
    auto opt = make_optimizer(Opt::Sgd, model->parameters());
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      opt->zero_grad();
      auto loss = at::mse_loss(model->forward(dx), dy);
      loss.backward();
      EXPECT_TRUE(groups[1]->is_unsharded()) << "step " << step << ": l1 stays gathered";
      EXPECT_FALSE(groups[2]->is_unsharded()) << "step " << step << ": l2 resharded (default)";
      groups[1]->reshard();  // before the step, as the setter's documentation asks
      EXPECT_FALSE(groups[1]->is_unsharded());
      opt->step();
      losses.push_back(loss.item<double>());
    }
    expect_losses(losses, expected, "reshard_after_backward(false)");
    expect_parameters(*model, *ref, 3, rank, "reshard_after_backward(false)");
  });
}

TEST(FsdpSetters, ReshardAfterForwardOffSkipsTheBackwardGather) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 203, at::kDouble),
             y = test::randn({10, 2}, 204, at::kDouble);
  auto ref = clone_of(proto);
  const auto expected = train(*ref, Opt::Sgd, x, y, kSteps);
  tessera::testing::run_ranks(3, [&](int rank) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {3}, {"dp"});
    auto model = clone_of(proto);
    const auto groups = shard_mlp(*model, mesh);
    const auto dx = local_batch(x, mesh, kRows), dy = local_batch(y, mesh, kRows);
    auto opt = make_optimizer(Opt::Sgd, model->parameters());
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      const bool keep = step > 0;  // step 0 is the default, for contrast
      groups[1]->set_reshard_after_forward(!keep);
      opt->zero_grad();
      auto loss = at::mse_loss(model->forward(dx), dy);
      EXPECT_EQ(groups[1]->is_unsharded(), keep) << "step " << step;
      EXPECT_FALSE(groups[2]->is_unsharded()) << "step " << step;
      CommDebugMode backward;
      loss.backward();
      // Backward gathers l2 and l1 (l0's input needs no gradient); l1 only if resharded.
      EXPECT_EQ(all_gathers(backward), keep ? 1 : 2) << "step " << step;
      opt->step();
      losses.push_back(loss.item<double>());
    }
    expect_losses(losses, expected, "reshard_after_forward(false)");
    expect_parameters(*model, *ref, 3, rank, "reshard_after_forward(false)");
  });
}

// By default backward starts l1's all-gather when l2 is gathered only from the second
// backward on (it follows the previous backward's order). Naming l1 on l2 starts it in the
// first backward; an empty list turns it off.
TEST(FsdpSetters, BackwardPrefetchFollowsTheGivenModules) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 205, at::kDouble),
             y = test::randn({10, 2}, 206, at::kDouble);
  auto ref = clone_of(proto);
  const auto expected = train(*ref, Opt::AdamW, x, y, kSteps);
  tessera::testing::run_ranks(3, [&](int rank) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {3}, {"dp"});
    auto model = clone_of(proto);
    const auto groups = shard_mlp(*model, mesh);
    const auto dx = local_batch(x, mesh, kRows), dy = local_batch(y, mesh, kRows);
    auto opt = make_optimizer(Opt::AdamW, model->parameters());
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      if (step == 0) groups[2]->set_modules_to_backward_prefetch({groups[1]});
      if (step == 1) groups[2]->set_modules_to_backward_prefetch({});
      opt->zero_grad();
      auto h = model->l1(at::relu(model->l0(dx)));
      auto loss = at::mse_loss(model->head(at::tanh(model->l2(at::relu(h)))), dy);
      CommDebugMode backward;
      int64_t before_l1_backward = -1;
      h.register_hook([&](const at::Tensor& g) {
        before_l1_backward = all_gathers(backward);
        return g;
      });
      loss.backward();
      opt->step();
      losses.push_back(loss.item<double>());
      EXPECT_EQ(all_gathers(backward), 2) << "step " << step;
      // step 0: l1's gather started with l2's (the list); steps 1, 2: not (the empty list),
      // where the default would have started it.
      EXPECT_EQ(before_l1_backward, step == 0 ? 2 : 1) << "step " << step;
    }
    expect_losses(losses, expected, "backward prefetch");
    expect_parameters(*model, *ref, 3, rank, "backward prefetch");
  });
}
