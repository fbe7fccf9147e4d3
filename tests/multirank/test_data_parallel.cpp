// Data parallelism with replicate() on unchanged torch::nn modules, against one device:
// distributed inputs (uneven and empty batch shards, exact global means, gradients summed)
// and local batches (torch DDP: gradients averaged); gradient buckets as configured, one
// all-reduce per bucket per step; no_sync accumulation; unused parameters; the domain U-Net
// on a dp x domain mesh; errors on every rank.
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/upsampling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "helpers.h"

using namespace tessera;
namespace F = torch::nn::functional;

namespace {

// Linears with awkward shapes ((16, 15), (17, 16), (7, 17)) and an optional branch that
// forward() can leave out.
struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, spare{nullptr};
  bool use_spare = false;
  MlpImpl() { reset(); }
  void reset() override {
    l1 = register_module("l1", torch::nn::Linear(15, 16));
    l2 = register_module("l2", torch::nn::Linear(16, 17));
    spare = register_module("spare", torch::nn::Linear(17, 17));
    l3 = register_module("l3", torch::nn::Linear(17, 7));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(l2(at::relu(l1(x))));
    if (use_spare) h = h + spare(h);
    return l3(h);
  }
};
TORCH_MODULE(Mlp);

std::shared_ptr<MlpImpl> mlp_clone(const Mlp& m) {
  auto c = std::dynamic_pointer_cast<MlpImpl>(m->clone());
  c->to(at::kDouble);
  return c;
}

enum class Opt { Sgd, AdamW };
std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, std::vector<at::Tensor> params) {
  if (o == Opt::Sgd)
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(0.01).weight_decay(0.05));
}

// The batch rows of step s (the same on every rank: ranks cut their part out of it).
at::Tensor batch(int64_t rows, int64_t cols, int s, int which) {
  return test::randn({rows, cols}, 1000 + 10 * s + which, at::kDouble);
}

// Every parameter of `model` (distributed or not) equals the reference's.
void expect_parameters_match(torch::nn::Module& model, torch::nn::Module& ref,
                             const std::string& what, double tol = 1e-10) {
  for (const auto& p : ref.named_parameters()) {
    at::Tensor mine = *model.named_parameters().find(p.key());
    if (is_dtensor(mine)) {
      ASSERT_TRUE(test::full_matches(mine, p.value().detach(), {tol, tol}))
          << what << ": " << p.key();
    } else {
      ASSERT_TRUE(at::allclose(mine.detach(), p.value().detach(), tol, tol))
          << what << ": " << p.key();
    }
  }
}

// A backward's all-reduces, counted on this rank.
int64_t all_reduces(const CommDebugMode& mode) {
  auto counts = mode.get_comm_counts();
  auto it = counts.find("all_reduce");
  return it == counts.end() ? 0 : it->second;
}

// Distributed inputs: batch rows split by `table` over a 1-D mesh; Tessera's mse_loss is the
// exact global mean, so the model trains as one device on the whole batch.
void distributed_inputs_case(const std::vector<int64_t>& table, Opt opt, double first_cap_mb,
                             double cap_mb) {
  const int n = static_cast<int>(table.size());
  int64_t rows = 0;
  for (int64_t t : table) rows += t;
  torch::manual_seed(7);
  Mlp proto;
  auto ref = mlp_clone(proto);
  std::vector<double> expected;
  {
    auto o = make_optimizer(opt, ref->parameters());
    for (int s = 0; s < 10; ++s) {
      o->zero_grad();
      at::Tensor loss = at::mse_loss(ref->forward(batch(rows, 15, s, 0)), batch(rows, 7, s, 1));
      loss.backward();
      o->step();
      expected.push_back(loss.item<double>());
    }
  }
  const std::string what = "ranks " + std::to_string(n) + " table " + shape_str(table);
  tessera::testing::run_ranks(n, [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {n}, {"dp"});
    auto model = mlp_clone(proto);
    auto ddp = replicate(
        *model, mesh, ReplicateOptions().first_bucket_cap_mb(first_cap_mb).bucket_cap_mb(cap_mb));
    auto o = make_optimizer(opt, model->parameters());
    for (int s = 0; s < 10; ++s) {
      // (after the first step the buckets follow the order gradients became ready)
      const int64_t buckets = static_cast<int64_t>(ddp->bucket_parameter_names().size());
      o->zero_grad();
      auto sizes = ShardSizes::Given(0, table);
      at::Tensor x =
          distribute_tensor(batch(rows, 15, s, 0), mesh, {Shard(0)}, std::nullopt, sizes);
      at::Tensor y = distribute_tensor(batch(rows, 7, s, 1), mesh, {Shard(0)}, std::nullopt, sizes);
      at::Tensor loss = at::mse_loss(model->forward(x), y);
      {
        CommDebugMode mode;
        loss.backward();
        // Step 0 also agrees on the rebuilt bucket order (one broadcast).
        if (n > 1) {
          ASSERT_EQ(all_reduces(mode), buckets) << what << " step " << s << "\n" << mode.table();
        }
        if (s > 0 && n > 1) {
          ASSERT_EQ(mode.get_total_counts(), buckets) << what << "\n" << mode.table();
        }
      }
      o->step();
      ASSERT_NEAR(loss.item<double>(), expected[s], 1e-12 * (1 + std::abs(expected[s])))
          << what << " step " << s;
    }
    expect_parameters_match(*model, *ref, what);
  });
}

}  // namespace

TEST(DataParallel, DistributedInputsEqualOneDevice) {
  // Uneven and empty batch shards; tiny buckets (several per step) and one big bucket.
  distributed_inputs_case({6}, Opt::Sgd, 1, 25);
  distributed_inputs_case({5, 8}, Opt::Sgd, 0.0005, 0.001);
  distributed_inputs_case({3, 0, 9}, Opt::AdamW, 0.0005, 0.002);
  distributed_inputs_case({4, 1, 6, 2}, Opt::AdamW, 1, 25);
}

TEST(DataParallel, BucketsFollowCapacitiesInReverseOrder) {
  tessera::testing::run_ranks(2, [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    torch::manual_seed(1);
    Mlp model;
    model->to(at::kDouble);
    // Parameter bytes in reverse registration order, and the buckets those caps give.
    std::vector<std::pair<std::string, int64_t>> reversed;
    for (const auto& p : model->named_parameters())
      reversed.insert(reversed.begin(), {p.key(), p.value().numel() * 8});
    const double first = 0.0008, rest = 0.002;  // MiB
    std::vector<std::vector<std::string>> expected(1);
    int64_t bytes = 0;
    for (const auto& [name, b] : reversed) {
      if (expected.back().empty() && bytes != 0) bytes = 0;
      expected.back().push_back(name);
      bytes += b;
      if (double(bytes) >= (expected.size() == 1 ? first : rest) * 1024 * 1024) {
        expected.emplace_back();
        bytes = 0;
      }
    }
    if (expected.back().empty()) expected.pop_back();
    auto ddp =
        replicate(model, mesh, ReplicateOptions().first_bucket_cap_mb(first).bucket_cap_mb(rest));
    ASSERT_EQ(ddp->bucket_parameter_names(), expected);
    ASSERT_GT(expected.size(), 2u);
  });
}

TEST(DataParallel, LocalBatchesAverageLikeTorchDDP) {
  for (int n : {1, 2, 3}) {
    torch::manual_seed(11);
    Mlp proto;
    auto ref = mlp_clone(proto);
    const int64_t per_rank = 4;
    std::vector<double> expected;
    {
      auto o = make_optimizer(Opt::Sgd, ref->parameters());
      for (int s = 0; s < 10; ++s) {
        o->zero_grad();
        // The mean of equal-sized local means is the global mean.
        at::Tensor loss =
            at::mse_loss(ref->forward(batch(n * per_rank, 15, s, 0)), batch(n * per_rank, 7, s, 1));
        loss.backward();
        o->step();
        expected.push_back(loss.item<double>());
      }
    }
    tessera::testing::run_ranks(n, [&](int rank) {
      at::set_num_threads(1);
      auto mesh = init_device_mesh("cpu", {n}, {"dp"});
      auto model = mlp_clone(proto);
      // Ranks start from different values: replicate() broadcasts the first rank's.
      if (rank > 0) {
        at::NoGradGuard g;
        for (auto& p : model->parameters()) p.add_(1.0);
      }
      auto ddp = replicate(
          *model, mesh,
          ReplicateOptions().local_batches(true).first_bucket_cap_mb(0.0005).bucket_cap_mb(0.001));
      const int64_t buckets = static_cast<int64_t>(ddp->bucket_parameter_names().size());
      for (const auto& p : model->parameters()) ASSERT_FALSE(is_dtensor(p));
      auto o = make_optimizer(Opt::Sgd, model->parameters());
      for (int s = 0; s < 10; ++s) {
        o->zero_grad();
        at::Tensor x = batch(n * per_rank, 15, s, 0).narrow(0, rank * per_rank, per_rank);
        at::Tensor y = batch(n * per_rank, 7, s, 1).narrow(0, rank * per_rank, per_rank);
        at::Tensor loss = at::mse_loss(model->forward(x), y);
        CommDebugMode mode;
        loss.backward();
        if (n > 1) {
          ASSERT_EQ(all_reduces(mode), buckets);
        }
        o->step();
        // The global loss is the mean of the ranks' losses.
        at::Tensor global =
            comm::all_reduce(mesh.group(0), loss.detach().reshape({1}), PartialOp::Avg);
        ASSERT_NEAR(global.item<double>(), expected[s], 1e-12 * (1 + std::abs(expected[s])))
            << "n " << n << " step " << s;
      }
      expect_parameters_match(*model, *ref, "local batches, n " + std::to_string(n));
    });
  }
}

// Two micro-batches, the first under no_sync: no communication in its backward, and the
// step equals one device accumulating both.
TEST(DataParallel, NoSyncAccumulatesThenReducesOnce) {
  for (bool local : {false, true}) {
    torch::manual_seed(5);
    Mlp proto;
    auto ref = mlp_clone(proto);
    const int n = 2;
    const int64_t per_rank = 3;
    auto o_ref = make_optimizer(Opt::AdamW, ref->parameters());
    for (int s = 0; s < 3; ++s) {
      o_ref->zero_grad();
      for (int micro = 0; micro < 2; ++micro)
        at::mse_loss(ref->forward(batch(n * per_rank, 15, 2 * s + micro, 0)),
                     batch(n * per_rank, 7, 2 * s + micro, 1))
            .backward();
      o_ref->step();
    }
    tessera::testing::run_ranks(n, [&](int rank) {
      at::set_num_threads(1);
      auto mesh = init_device_mesh("cpu", {n}, {"dp"});
      auto model = mlp_clone(proto);
      auto ddp = replicate(*model, mesh, ReplicateOptions().local_batches(local));
      auto o = make_optimizer(Opt::AdamW, model->parameters());
      auto input = [&](int step, int which, int64_t cols) {
        at::Tensor full = batch(n * per_rank, cols, step, which);
        if (local) return full.narrow(0, rank * per_rank, per_rank);
        return distribute_tensor(full, mesh, {Shard(0)}, std::nullopt);
      };
      for (int s = 0; s < 3; ++s) {
        o->zero_grad();
        {
          auto guard = ddp->no_sync();
          CommDebugMode mode;
          at::mse_loss(model->forward(input(2 * s, 0, 15)), input(2 * s, 1, 7)).backward();
          ASSERT_EQ(mode.get_total_counts(), 0) << (local ? "local" : "distributed") << "\n"
                                                << mode.table();
        }
        CommDebugMode mode;
        at::mse_loss(model->forward(input(2 * s + 1, 0, 15)), input(2 * s + 1, 1, 7)).backward();
        ASSERT_EQ(all_reduces(mode), static_cast<int64_t>(ddp->bucket_parameter_names().size()));
        o->step();
      }
      expect_parameters_match(*model, *ref,
                              local ? "no_sync, local batches" : "no_sync, distributed inputs");
    });
  }
}

// A branch no rank uses keeps undefined gradients; with local batches, a branch only rank 0
// uses gets rank 0's gradient averaged over the ranks.
TEST(DataParallel, UnusedParameters) {
  torch::manual_seed(9);
  Mlp proto;
  const int n = 3;
  tessera::testing::run_ranks(n, [&](int rank) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {n}, {"dp"});
    for (bool local : {false, true}) {
      auto model = mlp_clone(proto);
      auto ddp = replicate(
          *model, mesh,
          ReplicateOptions().local_batches(local).bucket_cap_mb(0.001).first_bucket_cap_mb(0.0005));
      at::Tensor x = batch(6, 15, 0, 0), y = batch(6, 7, 0, 1);
      if (local) {
        x = x.narrow(0, 2 * rank, 2);
        y = y.narrow(0, 2 * rank, 2);
      } else {
        x = distribute_tensor(x, mesh, {Shard(0)}, std::nullopt);
        y = distribute_tensor(y, mesh, {Shard(0)}, std::nullopt);
      }
      at::mse_loss(model->forward(x), y).backward();
      ASSERT_FALSE(model->spare->weight.grad().defined()) << "unused everywhere, local " << local;
      ASSERT_TRUE(model->l1->weight.grad().defined());
      if (!local) continue;
      // Rank 0 alone takes the spare branch.
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      model->use_spare = rank == 0;
      at::mse_loss(model->forward(x), y).backward();
      auto solo = mlp_clone(proto);
      solo->use_spare = true;
      at::mse_loss(solo->forward(batch(6, 15, 0, 0).narrow(0, 0, 2)),
                   batch(6, 7, 0, 1).narrow(0, 0, 2))
          .backward();
      ASSERT_TRUE(model->spare->weight.grad().defined());
      ASSERT_TRUE(
          at::allclose(model->spare->weight.grad(), solo->spare->weight.grad() / n, 1e-12, 1e-12));
    }
  });
}

namespace {

using UNetImpl = test::SmallUNetImpl;
using UNet = test::SmallUNet;

}  // namespace

// ShardTensor's layout: batch over "dp", the field's rows over "domain"; every weight
// gradient (Partial over both) is summed in one bucket over the whole mesh, instead of one
// all-reduce per parameter per mesh dim.
TEST(DataParallel, DomainUNetOnDpByDomainMesh) {
  torch::manual_seed(3);
  UNet proto;
  const at::Tensor x = test::randn({3, 1, 12, 8}, 5), y = test::randn({3, 1, 12, 8}, 6);
  auto ref = std::dynamic_pointer_cast<UNetImpl>(proto->clone());
  std::vector<double> expected;
  {
    torch::optim::AdamW o(ref->parameters(), torch::optim::AdamWOptions(0.01));
    for (int s = 0; s < 6; ++s) {
      o.zero_grad();
      at::Tensor loss = at::mse_loss(ref->forward(x), y);
      loss.backward();
      o.step();
      expected.push_back(loss.item<double>());
    }
  }
  tessera::testing::run_ranks(4, [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "domain"});
    const Placements layout = {Shard(0), Shard(2)};
    const auto tables = ShardSizes::Given({{1, 2}, {}, {4, 8}, {}});  // uneven batch and rows
    auto dx = distribute_tensor(x, mesh, layout, std::nullopt, tables);
    auto dy = distribute_tensor(y, mesh, layout, std::nullopt, tables);
    // Per-parameter reductions (distribute_module alone) against replicate()'s bucket, and
    // the all-reduces backward makes for no weight at all (group norm's own sums).
    int64_t per_parameter = 0, bucketed = 0, without_weights = 0;
    {
      auto frozen = std::dynamic_pointer_cast<UNetImpl>(proto->clone());
      for (auto& p : frozen->parameters()) p.requires_grad_(false);
      distribute_module(*frozen, mesh);
      at::Tensor input = dx.detach().requires_grad_();
      at::Tensor loss = at::mse_loss(frozen->forward(input), dy);
      CommDebugMode mode;
      loss.backward();
      without_weights = all_reduces(mode);
    }
    {
      auto plain = std::dynamic_pointer_cast<UNetImpl>(proto->clone());
      distribute_module(*plain, mesh);
      at::Tensor loss = at::mse_loss(plain->forward(dx), dy);
      CommDebugMode mode;
      loss.backward();
      per_parameter = all_reduces(mode);
    }
    auto model = std::dynamic_pointer_cast<UNetImpl>(proto->clone());
    auto ddp = replicate(*model, mesh["dp"]);
    ASSERT_EQ(ddp->bucket_parameter_names().size(), 1u);
    const int64_t params = static_cast<int64_t>(model->parameters().size());
    torch::optim::AdamW o(model->parameters(), torch::optim::AdamWOptions(0.01));
    for (int s = 0; s < 6; ++s) {
      o.zero_grad();
      at::Tensor loss = at::mse_loss(model->forward(dx), dy);
      {
        CommDebugMode mode;
        loss.backward();
        bucketed = all_reduces(mode);
      }
      // One all-reduce for every weight gradient, over the whole mesh.
      ASSERT_EQ(bucketed, without_weights + 1) << "step " << s;
      ASSERT_GE(per_parameter, without_weights + params) << "step " << s;
      o.step();
      ASSERT_NEAR(loss.item<double>(), expected[s], 1e-5 * (1 + std::abs(expected[s])))
          << "step " << s;
    }
    expect_parameters_match(*model, *ref, "dp x domain U-Net", 1e-4);
  });
}

TEST(DataParallel, ErrorsOnEveryRank) {
  tessera::testing::run_ranks(2, [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    // Tied parameters with distributed inputs: one tensor registered twice.
    struct Tied : torch::nn::Module {
      torch::nn::Linear a{nullptr};
      Tied() {
        a = register_module("a", torch::nn::Linear(3, 3));
        register_parameter("shared", a->weight);
      }
    };
    Tied holder;
    try {
      auto ddp = replicate(holder, mesh);
      FAIL() << "tied parameters accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("tied parameters"), std::string::npos) << e.what();
    }
    // A parameter on another mesh.
    auto other = init_device_mesh("cpu", {2}, {"other"});
    torch::nn::Linear b(3, 3);
    distribute_module(*b, other);
    try {
      auto ddp = replicate(b, mesh);
      FAIL() << "a parameter on another mesh accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("distribute it on that mesh"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW((void)replicate(b, mesh, ReplicateOptions().bucket_cap_mb(0)), c10::Error);
  });
}
