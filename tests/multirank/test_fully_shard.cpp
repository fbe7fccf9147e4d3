// fully_shard trained end to end against one device: an MLP with uneven and empty shards
// (1..4 ranks, uneven per-rank batches, SGD and AdamW), an embedding whose every row updates,
// a small CNN; the collectives per step; prefetching; each sharded parameter's local rows. Modes
// (HSDP, dp x domain, mixed precision, no_sync, state dicts, memory, errors) are in
// test_fully_shard_modes.cpp.
#include "fully_shard_helpers.h"

using namespace tessera;
using namespace tessera::fsdp_test;

namespace {

ShardTable batch_rows(int world) {
  switch (world) {
    case 1: return {10};
    case 2: return {7, 3};
    case 3: return {6, 0, 4};
    default: return {4, 3, 0, 3};
  }
}

// Every group: each child Linear of the MLP, then the root (which keeps `head`).
std::vector<std::shared_ptr<FSDPModule>> shard_mlp(MlpImpl& m, const DeviceMesh& mesh,
                                                   FullyShardOptions options = {}) {
  return {fully_shard(m.l0, mesh, options), fully_shard(m.l1, mesh, options),
          fully_shard(m.l2, mesh, options), fully_shard(m, mesh, options)};
}

}  // namespace

TEST(FullyShard, MlpTrainsLikeOneDeviceOnOneToFourRanks) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 31, at::kDouble), y = test::randn({10, 2}, 32, at::kDouble);
  for (Opt o : {Opt::Sgd, Opt::AdamW}) {
    auto ref = clone_of(proto);
    const auto expected = train(*ref, o, x, y, 10);
    for (int world : {1, 2, 3, 4}) {
      tessera::testing::run_ranks(
          world,
          [&](int rank) {
            at::set_num_threads(1);
            auto mesh = init_device_mesh("cpu", {world}, {"dp"});
            auto model = clone_of(proto);
            shard_mlp(*model, mesh);
            const auto rows = batch_rows(world);
            const auto dx = local_batch(x, mesh, rows), dy = local_batch(y, mesh, rows);
            const auto losses = train(*model, o, dx, dy, 10);
            const std::string ctx = "world " + std::to_string(world) + " optimizer " +
                                    std::to_string(static_cast<int>(o));
            expect_losses(losses, expected, ctx);
            expect_parameters(*model, *ref, world, rank, ctx);
          },
          {std::chrono::seconds(120)});
    }
  }
}

TEST(FullyShard, EmbeddingWithVocabFourNPlusOneUpdatesEveryRow) {
  constexpr int world = 4;
  const auto proto = make_embedding_model(4 * world + 1);
  // Every token appears, so every row (the short last shard's too) gets a gradient.
  const auto tokens = at::arange(4 * world + 1, at::kLong).repeat({2}).view({17, 2});
  const auto y = test::randn({17, 1}, 41, at::kDouble);
  {
    auto probe = clone_of(proto);
    at::mse_loss(probe->forward(tokens), y).backward();
    ASSERT_TRUE(probe->emb->weight.grad().abs().amax(1).gt(0).all().item<bool>())
        << "every row must get a gradient for this test to mean anything";
  }
  auto ref = clone_of(proto);
  const auto expected = train(*ref, Opt::AdamW, tokens, y, 5);
  tessera::testing::run_ranks(world,
                              [&](int rank) {
                                at::set_num_threads(1);
                                auto mesh = init_device_mesh("cpu", {world}, {"dp"});
                                auto model = clone_of(proto);
                                fully_shard(model->emb, mesh);
                                fully_shard(*model, mesh);
                                const ShardTable rows = {5, 4, 4, 4};
                                const auto losses =
                                    train(*model, Opt::AdamW, local_batch(tokens, mesh, rows),
                                          local_batch(y, mesh, rows), 5);
                                expect_losses(losses, expected, "embedding");
                                expect_parameters(*model, *ref, world, rank, "embedding");
                              },
                              {std::chrono::seconds(120)});
}

TEST(FullyShard, SmallCnnTrainsLikeOneDevice) {
  const auto proto = make_cnn();
  const auto x = test::randn({6, 2, 8, 8}, 51, at::kDouble),
             y = test::randn({6, 3}, 52, at::kDouble);
  auto ref = clone_of(proto);
  const auto expected = train(*ref, Opt::AdamW, x, y, 6);
  for (int world : {2, 3}) {
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          auto model = clone_of(proto);
          fully_shard(model->conv, mesh);
          fully_shard(model->norm, mesh);
          fully_shard(*model, mesh);
          const ShardTable rows = world == 2 ? ShardTable{4, 2} : ShardTable{1, 0, 5};
          const auto losses =
              train(*model, Opt::AdamW, local_batch(x, mesh, rows), local_batch(y, mesh, rows), 6);
          expect_losses(losses, expected, "cnn world " + std::to_string(world));
          expect_parameters(*model, *ref, world, rank, "cnn world " + std::to_string(world));
        },
        {std::chrono::seconds(120)});
  }
}

// One all-gather per group in forward. Forward frees every group but the root (touched last,
// kept for backward); backward gathers again only what it reads: not l0, whose input needs no
// gradient, so its weight is not read. One reduce-scatter per group.
TEST(FullyShard, CollectivesPerStepAreOnePerGroup) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 61, at::kDouble), y = test::randn({10, 2}, 62, at::kDouble);
  for (int world : {1, 4}) {
    for (bool keep_after_forward : {false, true}) {
      tessera::testing::run_ranks(
          world,
          [&](int) {
            at::set_num_threads(1);
            auto mesh = init_device_mesh("cpu", {world}, {"dp"});
            auto model = clone_of(proto);
            FullyShardOptions options;
            if (keep_after_forward) options.reshard_after_forward(false);
            const auto groups = shard_mlp(*model, mesh, options);
            const int64_t n_groups = static_cast<int64_t>(groups.size());
            const auto rows = batch_rows(world);
            const auto dx = local_batch(x, mesh, rows), dy = local_batch(y, mesh, rows);
            torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
            for (int step = 0; step < 2; ++step) {
              opt.zero_grad();
              CommDebugMode fwd;
              auto loss = at::mse_loss(model->forward(dx), dy);
              auto forward_counts = fwd.get_comm_counts();
              int64_t freed = 0;
              for (const auto& g : groups) freed += g->is_unsharded() ? 0 : 1;
              CommDebugMode bwd;
              loss.backward();
              auto backward_counts = bwd.get_comm_counts();
              opt.step();
              const std::string ctx = "world " + std::to_string(world) + " keep " +
                                      std::to_string(keep_after_forward) + " step " +
                                      std::to_string(step);
              if (world == 1) {
                EXPECT_EQ(forward_counts["all_gather"] + backward_counts["all_gather"] +
                              backward_counts["reduce_scatter"] + backward_counts["all_reduce"],
                          0)
                    << ctx << ": one rank needs no collective";
                continue;
              }
              EXPECT_EQ(forward_counts["all_gather"], n_groups) << ctx;
              EXPECT_EQ(freed, keep_after_forward ? 0 : n_groups - 1) << ctx;
              EXPECT_EQ(backward_counts["all_gather"], keep_after_forward ? 0 : freed - 1) << ctx;
              EXPECT_EQ(backward_counts["reduce_scatter"], n_groups) << ctx;
              EXPECT_EQ(backward_counts["all_reduce"], 0) << ctx << ": a 1-D mesh reduces once";
              for (const auto& g : groups) EXPECT_FALSE(g->is_unsharded()) << ctx;
            }
          },
          {std::chrono::seconds(60)});
    }
  }
}

// From the second step on, gathering a group starts the all-gather of the group that came
// next last time: after l0's forward two all-gathers have been started (l0's and l1's), and
// l1 is not yet unsharded; in backward, by the time l1's output gradient exists (l2's
// backward done, l1's not begun) l1's all-gather has been started too. Explicit lists replace
// the guess. Training still equals one device's.
TEST(FullyShard, PrefetchStartsTheNextGroupsAllGather) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 141, at::kDouble),
             y = test::randn({10, 2}, 142, at::kDouble);
  constexpr int kSteps = 5;
  auto ref = clone_of(proto);
  const auto expected = train(*ref, Opt::AdamW, x, y, kSteps);
  tessera::testing::run_ranks(
      3,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {3}, {"dp"});
        auto model = clone_of(proto);
        const auto groups = shard_mlp(*model, mesh);
        const ShardTable rows = {4, 0, 6};
        const auto dx = local_batch(x, mesh, rows), dy = local_batch(y, mesh, rows);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        std::vector<double> losses;
        for (int step = 0; step < kSteps; ++step) {
          const std::string ctx = "step " + std::to_string(step);
          if (step == 3) groups[0]->set_modules_to_forward_prefetch({});
          if (step == 4) groups[0]->set_modules_to_forward_prefetch({groups[1], groups[2]});
          opt->zero_grad();
          CommDebugMode forward;
          auto h = model->l0(dx);
          const int64_t after_l0 = forward.get_comm_counts()["all_gather"];
          const bool l1_gathered = groups[1]->is_unsharded();
          h = model->l1(at::relu(h));
          auto out = model->head(at::tanh(model->l2(at::relu(h))));
          auto loss = at::mse_loss(out, dy);
          const int64_t forward_gathers = forward.get_comm_counts()["all_gather"];
          CommDebugMode backward;
          int64_t before_l1_backward = -1;
          h.register_hook([&](const at::Tensor& g) {
            before_l1_backward = backward.get_comm_counts()["all_gather"];
            return g;
          });
          loss.backward();
          opt->step();
          losses.push_back(loss.item<double>());
          EXPECT_EQ(forward_gathers, 4) << ctx << ": one all-gather per group, prefetched or not";
          EXPECT_FALSE(l1_gathered) << ctx << ": a prefetch leaves the storage empty until a touch";
          const int64_t expect_after_l0 = step == 0 ? 1 : step == 3 ? 1 : step == 4 ? 3 : 2;
          EXPECT_EQ(after_l0, expect_after_l0) << ctx;
          // Backward gathers l2 and l1 (not l0: its input needs no gradient); l1's is started as
          // soon as l2 is gathered, from the second backward on.
          EXPECT_EQ(backward.get_comm_counts()["all_gather"], 2) << ctx;
          EXPECT_EQ(before_l1_backward, step == 0 ? 1 : 2) << ctx;
        }
        expect_losses(losses, expected, "prefetch");
        expect_parameters(*model, *ref, 3, rank, "prefetch");
      },
      {std::chrono::seconds(120)});
}

// A forward that no backward follows (evaluation) leaves the root gathered; an optimizer step
// then changes its sharded parameters, and the next forward must read the new values.
TEST(FullyShard, EvaluationBetweenBackwardAndStepReadsNoStaleWeights) {
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 131, at::kDouble),
             y = test::randn({10, 2}, 132, at::kDouble);
  auto run = [&](MlpImpl& model, const at::Tensor& dx, const at::Tensor& dy) {
    auto opt = make_optimizer(Opt::AdamW, model.parameters());
    std::vector<double> losses;
    for (int s = 0; s < 4; ++s) {
      opt->zero_grad();
      auto loss = at::mse_loss(model.forward(dx), dy);
      loss.backward();
      {
        at::NoGradGuard evaluation;
        losses.push_back(at::mse_loss(model.forward(dx), dy).item<double>());
      }
      opt->step();
      losses.push_back(loss.item<double>());
    }
    return losses;
  };
  auto ref = clone_of(proto);
  const auto expected = run(*ref, x, y);
  tessera::testing::run_ranks(
      2,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2}, {"dp"});
        auto model = clone_of(proto);
        const auto groups = shard_mlp(*model, mesh);
        const ShardTable rows = {3, 7};
        expect_losses(run(*model, local_batch(x, mesh, rows), local_batch(y, mesh, rows)), expected,
                      "evaluation between backward and step");
        expect_parameters(*model, *ref, 2, rank, "evaluation between backward and step");
      },
      {std::chrono::seconds(60)});
}

// mm has a typed fast-path kernel, which replays cached decisions without the fallback: it
// must gather a freed parameter before it reads the shard, on the first call (which it hands
// to the fallback and caches) and on the replayed ones after each reshard().
TEST(FullyShard, FallbackAndFastPathBothGatherFreedParameters) {
  torch::manual_seed(11);
  auto proto = std::make_shared<torch::nn::LinearImpl>(5, 7);
  proto->to(at::kDouble);
  const at::Tensor weight = proto->weight.detach().clone();
  const at::Tensor x = test::randn({3, 5}, 141, at::kDouble);
  tessera::testing::run_ranks(
      3,
      [&](int) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {3}, {"dp"});
        auto model = std::dynamic_pointer_cast<torch::nn::LinearImpl>(proto->clone());
        auto handle = fully_shard(*model, mesh);
        ASSERT_EQ(fsdp_module_of(*model), handle);
        const at::Tensor u = handle->unsharded_parameters().at(0);
        ASSERT_FALSE(handle->is_unsharded());
        const at::Tensor ut = u.detach().t();  // a view: aliases u's freed storage
        const at::Tensor dx = distribute_tensor(x, mesh, {Replicate()}, std::nullopt);
        for (int call = 0; call < 3; ++call) {
          handle->reshard();
          CommDebugMode comm;
          const at::Tensor y = at::mm(dx, ut);
          EXPECT_EQ(comm.get_comm_counts()["all_gather"], 1) << "call " << call;
          EXPECT_TRUE(handle->is_unsharded());
          EXPECT_TRUE(test::full_matches(y, at::mm(x, weight.t()), {1e-12, 1e-12}))
              << "call " << call;
        }
      },
      {std::chrono::seconds(60)});
}

// A group whose parameters are partly unused (no gradient) or frozen: the used ones are
// reduced by the backward's final callback, the others keep no gradient, as on one device.
TEST(FullyShard, UnusedAndFrozenParametersTrainLikeOneDevice) {
  struct PartlyUsedImpl : torch::nn::Cloneable<PartlyUsedImpl> {
    torch::nn::Linear used{nullptr}, frozen{nullptr}, spare{nullptr};
    PartlyUsedImpl() { reset(); }
    void reset() override {
      used = register_module("used", torch::nn::Linear(6, 5));
      frozen = register_module("frozen", torch::nn::Linear(5, 3));
      spare = register_module("spare", torch::nn::Linear(6, 3));
    }
    at::Tensor forward(const at::Tensor& x) { return frozen(at::relu(used(x))); }
  };
  torch::manual_seed(12);
  auto proto = std::make_shared<PartlyUsedImpl>();
  proto->to(at::kDouble);
  const auto x = test::randn({9, 6}, 151, at::kDouble), y = test::randn({9, 3}, 152, at::kDouble);
  auto ref = clone_of(proto);
  ref->frozen->weight.set_requires_grad(false);  // (clone() makes every parameter trainable)
  const auto expected = train(*ref, Opt::AdamW, x, y, 4);
  ASSERT_FALSE(ref->spare->weight.grad().defined());
  ASSERT_FALSE(ref->frozen->weight.grad().defined());
  tessera::testing::run_ranks(
      2,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2}, {"dp"});
        auto model = clone_of(proto);
        model->frozen->weight.set_requires_grad(false);
        auto handle = fully_shard(*model, mesh);
        const ShardTable rows = {2, 7};
        const auto dx = local_batch(x, mesh, rows), dy = local_batch(y, mesh, rows);
        {
          CommDebugMode comm;
          at::mse_loss(model->forward(dx), dy).backward();
          EXPECT_EQ(comm.get_comm_counts()["reduce_scatter"], 1) << "the final callback reduces";
          EXPECT_FALSE(handle->is_unsharded()) << "and reshards";
          for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
        }
        const auto losses = train(*model, Opt::AdamW, dx, dy, 4);
        expect_losses(losses, expected, "partly used");
        expect_parameters(*model, *ref, 2, rank, "partly used");
        EXPECT_FALSE(model->spare->weight.grad().defined());
        EXPECT_FALSE(model->frozen->weight.grad().defined());
        EXPECT_FALSE(model->frozen->weight.requires_grad());
      },
      {std::chrono::seconds(60)});
}
