// Everyday PyTorch habits that must never train silently wrong (docs/design.md, "Never silently
// wrong"): an optimizer built before replicate / fully_shard, fully_shard on a module that no
// shared_ptr holds, printing a distributed tensor, and a collective called on some ranks
// only. Each compares with one device or expects a clear error.
#include <sstream>
#include <thread>

#include <torch/optim/adam.h>

#include "fully_shard_helpers.h"

using namespace tessera;
using namespace tessera::fsdp_test;

namespace {

enum class Mode { Replicate, FullyShard };
enum class Order { OptimizerFirst, OptimizerAfter };
enum class Zero { InPlace, SetToNone };

const char* name(Mode m) { return m == Mode::Replicate ? "replicate" : "fully_shard"; }

std::unique_ptr<torch::optim::Optimizer> sgd_or_adam(bool adam, std::vector<at::Tensor> params) {
  if (!adam)
    return std::make_unique<torch::optim::SGD>(params,
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// zero_grad as LibTorch 1.13 does it (in place) or as 2.x does by default (set_to_none).
void zero(torch::optim::Optimizer& opt, Zero how) {
  if (how == Zero::InPlace) {
    opt.zero_grad();
    return;
  }
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
}

template <class Model>
std::vector<double> steps(Model& model, torch::optim::Optimizer& opt, Zero how, const at::Tensor& x,
                          const at::Tensor& y, int n) {
  std::vector<double> losses;
  for (int s = 0; s < n; ++s) {
    zero(opt, how);
    at::Tensor loss = at::mse_loss(model.forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

}  // namespace

// The PyTorch tutorial order (model, optimizer, then wrap) trains exactly like the order the
// docs recommend, and like one device: the optimizer's handles stay the parameters.
TEST(Habits, OptimizerBuiltBeforeReplicateOrFullyShardTrainsLikeOneDevice) {
  constexpr int world = 3;
  const ShardTable rows = {6, 0, 4};
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 51, at::kDouble), y = test::randn({10, 2}, 52, at::kDouble);
  for (bool adam : {false, true}) {
    auto ref = clone_of(proto);
    auto ref_opt = sgd_or_adam(adam, ref->parameters());
    const auto expected = steps(*ref, *ref_opt, Zero::InPlace, x, y, 3);
    for (Mode mode : {Mode::Replicate, Mode::FullyShard})
      for (Order order : {Order::OptimizerFirst, Order::OptimizerAfter})
        for (Zero how : {Zero::InPlace, Zero::SetToNone}) {
          const std::string ctx =
              std::string(name(mode)) + (adam ? " Adam" : " SGD") +
              (order == Order::OptimizerFirst ? ", optimizer first" : ", optimizer after") +
              (how == Zero::InPlace ? ", zero in place" : ", set_to_none");
          tessera::testing::run_ranks(
              world,
              [&](int rank) {
                at::set_num_threads(1);
                auto mesh = init_device_mesh("cpu", {world}, {"dp"});
                auto model = clone_of(proto);
                std::unique_ptr<torch::optim::Optimizer> opt;
                if (order == Order::OptimizerFirst) opt = sgd_or_adam(adam, model->parameters());
                std::shared_ptr<ReplicatedModule> ddp;
                if (mode == Mode::Replicate) {
                  ddp = replicate(*model, mesh);
                } else {
                  for (auto* m :
                       {model->l0.ptr().get(), model->l1.ptr().get(), model->l2.ptr().get()})
                    fully_shard(*m, mesh);
                  fully_shard(*model, mesh);
                }
                if (order == Order::OptimizerAfter) opt = sgd_or_adam(adam, model->parameters());
                const auto losses = steps(*model, *opt, how, local_batch(x, mesh, rows),
                                          local_batch(y, mesh, rows), 3);
                expect_losses(losses, expected, ctx);
                const auto params = model->named_parameters();  // (find points into it)
                for (const auto& item : ref->named_parameters()) {
                  const at::Tensor* p = params.find(item.key());
                  ASSERT_TRUE(p && is_dtensor(*p)) << ctx << " " << item.key();
                  ASSERT_TRUE(test::full_matches(*p, item.value().detach(), {1e-9, 1e-10}))
                      << ctx << " " << item.key() << " on rank " << rank;
                }
              },
              {std::chrono::seconds(120)});
        }
  }
}

// The same for distribute_module (domain and tensor parallelism swap parameters through it):
// the gradients reach the original objects through the parameters' own hooks.
TEST(Habits, OptimizerBuiltBeforeDistributeModuleTrainsLikeOneDevice) {
  constexpr int world = 2;
  const ShardTable rows = {3, 7};
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 56, at::kDouble), y = test::randn({10, 2}, 57, at::kDouble);
  for (bool adam : {false, true}) {
    auto ref = clone_of(proto);
    auto ref_opt = sgd_or_adam(adam, ref->parameters());
    const auto expected = steps(*ref, *ref_opt, Zero::InPlace, x, y, 3);
    for (Zero how : {Zero::InPlace, Zero::SetToNone}) {
      const std::string ctx = std::string("distribute_module") + (adam ? " Adam" : " SGD") +
                              (how == Zero::InPlace ? ", zero in place" : ", set_to_none");
      tessera::testing::run_ranks(
          world,
          [&](int rank) {
            at::set_num_threads(1);
            auto mesh = init_device_mesh("cpu", {world}, {"dp"});
            auto model = clone_of(proto);
            auto opt = sgd_or_adam(adam, model->parameters());
            distribute_module(*model, mesh);
            const auto losses =
                steps(*model, *opt, how, local_batch(x, mesh, rows), local_batch(y, mesh, rows), 3);
            expect_losses(losses, expected, ctx);
            const auto params = model->named_parameters();
            for (const auto& item : ref->named_parameters())
              ASSERT_TRUE(test::full_matches(*params.find(item.key()), item.value().detach(),
                                             {1e-9, 1e-10}))
                  << ctx << " " << item.key() << " on rank " << rank;
          },
          {std::chrono::seconds(120)});
    }
  }
}

// `Net net; fully_shard(net, mesh)`: a module no shared_ptr holds (LibTorch's named_modules
// with include_self refuses it) trains like one device.
TEST(Habits, FullyShardOnAModuleNotHeldByASharedPtr) {
  constexpr int world = 2;
  const ShardTable rows = {7, 3};
  const auto proto = make_mlp();
  const auto x = test::randn({10, 15}, 61, at::kDouble), y = test::randn({10, 2}, 62, at::kDouble);
  auto ref = clone_of(proto);
  const auto expected = train(*ref, Opt::AdamW, x, y, 3);
  // Built here (modules draw their initial values from the global generator, which rank
  // threads must not use), then given the prototype's values.
  MlpImpl nets[world];
  for (auto& net : nets) {
    net.to(at::kDouble);
    at::NoGradGuard no_grad;
    for (const auto& item : proto->named_parameters())
      net.named_parameters().find(item.key())->copy_(item.value());
  }
  tessera::testing::run_ranks(world,
                              [&](int rank) {
                                at::set_num_threads(1);
                                auto mesh = init_device_mesh("cpu", {world}, {"dp"});
                                MlpImpl& net = nets[rank];
                                fully_shard(net.l0, mesh);
                                fully_shard(net, mesh);
                                const auto losses =
                                    train(net, Opt::AdamW, local_batch(x, mesh, rows),
                                          local_batch(y, mesh, rows), 3);
                                expect_losses(losses, expected, "module on the stack");
                                expect_parameters(net, *ref, world, rank, "module on the stack");
                              },
                              {std::chrono::seconds(120)});
}

// `torch::nn::LinearImpl lin(...); parallelize_module(lin, mesh, ColwiseParallel())`: a
// module on the stack is parallelized like a held one (forward and gradients as one device).
TEST(Habits, ParallelizeModuleOnAModuleNotHeldByASharedPtr) {
  constexpr int world = 3;
  torch::manual_seed(8);
  torch::nn::Linear ref(7, 5);
  ref->to(at::kDouble);
  const auto x = test::randn({4, 7}, 63, at::kDouble);
  const at::Tensor want = ref(x);
  want.pow(2).sum().backward();
  std::vector<std::unique_ptr<torch::nn::LinearImpl>> lins;  // no shared_ptr holds them
  for (int r = 0; r < world; ++r) {
    lins.push_back(std::make_unique<torch::nn::LinearImpl>(7, 5));
    lins.back()->to(at::kDouble);
    at::NoGradGuard no_grad;
    lins.back()->weight.copy_(ref->weight);
    lins.back()->bias.copy_(ref->bias);
  }
  tessera::testing::run_ranks(world, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {world}, {"tp"});
    torch::nn::LinearImpl& lin = *lins[static_cast<size_t>(rank)];
    parallelize_module(lin, mesh, ColwiseParallel().use_local_output(false));
    const at::Tensor y = lin.forward(x);
    ASSERT_TRUE(test::full_matches(y, want.detach()));
    y.pow(2).sum().backward();
    ASSERT_TRUE(test::full_matches(lin.weight.grad(), ref->weight.grad()));
    ASSERT_TRUE(test::full_matches(lin.bias.grad(), ref->bias.grad()));
  });
}

// std::cout << dt cannot read a distributed tensor's data: every rank gets an error naming the
// ways out, and those give one device's value.
TEST(Habits, PrintingADistributedTensorNamesTheWayOut) {
  const auto full = test::randn({5, 3}, 71, at::kDouble);
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    for (auto dtype : {at::kDouble, at::kFloat}) {
      const at::Tensor dt = distribute_tensor(full.to(dtype), mesh, {Shard(0)});
      std::ostringstream os;
      try {
        os << dt;
        ADD_FAILURE() << "printing a distributed tensor did not raise";
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        for (const char* needle :
             {"distributed tensor", "tessera::to_string", "full_tensor", "collective"})
          EXPECT_NE(msg.find(needle), std::string::npos) << needle << " missing from: " << msg;
      }
      std::ostringstream got, want;
      got << full_tensor(dt);
      want << full.to(dtype);
      EXPECT_EQ(got.str(), want.str());
      EXPECT_NE(tessera::to_string(dt).find("DTensor("), std::string::npos);
    }
  });
}

// if (rank == 0) loss.item(): the waiting rank's error names the call and the likely cause.
TEST(Habits, CollectiveOnSomeRanksOnlyNamesTheCall) {
  const auto full = test::randn({6, 2}, 81, at::kDouble);
  struct Case {
    const char* call;
    std::function<void(const at::Tensor&)> run;
  };
  const std::vector<Case> cases = {
      {".item()", [](const at::Tensor& t) { (t * t).sum().item<double>(); }},
      {"full_tensor", [](const at::Tensor& t) { full_tensor(t); }},
  };
  for (const auto& c : cases) {
    tessera::testing::RunOptions options;
    options.timeout = std::chrono::seconds(60);
    options.collective_timeout = std::chrono::milliseconds(1500);
    std::string msg;
    try {
      tessera::testing::run_ranks(
          2,
          [&](int rank) {
            auto mesh = init_device_mesh("cpu", {2}, {"dp"});
            const at::Tensor dt = distribute_tensor(full, mesh, {Shard(0)});
            if (rank == 0) {
              c.run(dt);
            } else {
              // Alive but elsewhere, past the collective timeout.
              std::this_thread::sleep_for(std::chrono::seconds(4));
            }
          },
          options);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    ASSERT_FALSE(msg.empty()) << c.call << " on rank 0 only did not fail";
    EXPECT_NE(msg.find(c.call), std::string::npos) << msg;
    EXPECT_NE(msg.find("called on some ranks only?"), std::string::npos) << msg;
  }
}
