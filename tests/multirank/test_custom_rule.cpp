// Users register sharding rules for their own ops (and for aten ops Tessera lacks), with a
// local kernel (pure, per shard) or a distributed one (communicates), and a rule that fails
// on one rank fails the whole program promptly instead of hanging it.
#include <atomic>

#include <torch/library.h>

#include "helpers.h"

using namespace tessera;

namespace {

// A custom op with only a CPU kernel: y = x * scale + row index (needs *global* row indices,
// so its rule must give the local kernel each shard's offset).
at::Tensor scale_and_index(const at::Tensor& x, double scale, int64_t row_offset) {
  auto rows = at::arange(row_offset, row_offset + x.size(0), x.options()).unsqueeze(1);
  return x * scale + rows;
}

// A custom op whose sharded form communicates: every shard divides by the *global* sum.
at::Tensor normalize(const at::Tensor& x) { return x / x.sum(); }

TORCH_LIBRARY(tessera_test, m) {
  m.def("scale_and_index(Tensor x, float scale, int row_offset) -> Tensor");
  m.def("normalize(Tensor x) -> Tensor");
  m.def("fragile(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(tessera_test, CPU, m) {
  m.impl("scale_and_index", scale_and_index);
  m.impl("normalize", normalize);
  m.impl("fragile", [](const at::Tensor& x) { return x + 1; });
}

at::Tensor call_scale_and_index(const at::Tensor& x, double scale, int64_t offset) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tessera_test::scale_and_index", "")
                       .typed<at::Tensor(const at::Tensor&, double, int64_t)>();
  return op.call(x, scale, offset);
}

// Rows may be sharded: each shard adds its own global offset to row_offset. The kernel is
// pure (the same code on every rank, no communication), so it is a local kernel; it captures
// plain values and reads and writes the op's arguments by schema name.
ops::OpPlan scale_and_index_rule(const ops::OpCall& call) {
  const auto layout = std::make_shared<DTensorSpec>(call.spec("x")->partial_as_replicate());
  ops::OpPlan plan(call);
  plan.input("x", layout).output(layout);
  const int64_t offset = layout->local_offsets()[0];
  plan.local_kernel = [offset](ops::KernelCall& k) {
    k.set("row_offset", k.arg<int64_t>("row_offset") + offset);
    k.call_op();
  };
  return plan;
}

// Any layout (Partial made whole first): the kernel sums its shard, all-reduces the sum over
// the mesh dims that shard x, and divides. It communicates, so it is a distributed kernel, handed
// the mesh at call time (a kernel never captures one).
ops::OpPlan normalize_rule(const ops::OpCall& call) {
  const auto layout = std::make_shared<DTensorSpec>(call.spec("x")->partial_as_replicate());
  ops::OpPlan plan(call);
  plan.input("x", layout).output(layout);
  std::vector<int64_t> sharded;
  for (int64_t m = 0; m < layout->mesh().ndim(); ++m)
    if (layout->placement(m).is_shard()) sharded.push_back(m);
  plan.distributed_kernel = [sharded](ops::KernelCall& k, const DeviceMesh& mesh) {
    const at::Tensor x = k.tensor("x");
    at::Tensor total = x.sum();
    for (int64_t m : sharded) total = comm::all_reduce(mesh.group(m), total, PartialOp::Sum);
    k.finish({x / total});
  };
  return plan;
}

std::atomic<int> fragile_calls{0};
ops::OpPlan fragile_rule(const ops::OpCall& call) {
  // Fails on one rank only: a bug in a user's rule.
  TORCH_CHECK(get_rank() != 1, "fragile: the rule refuses to run on rank 1");
  ops::OpPlan plan(call);
  plan.output(std::make_shared<DTensorSpec>(call.first()));
  return plan;
}

}  // namespace

TEST(CustomRule, UserOpWithRegisteredRuleMatchesOneDevice) {
  ops::register_rule("tessera_test::scale_and_index", scale_and_index_rule);
  const auto full = tessera::test::randn({7, 3}, 61);
  const auto expected = scale_and_index(full, 2.5, 10);
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      ShardTable rows(world, 0);
      rows[0] = 7 - (world - 1);
      for (int r = 1; r < world; ++r) rows[r] = 1;
      auto dx = distribute_tensor(full, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
      auto y = call_scale_and_index(dx, 2.5, 10);
      ASSERT_TRUE(is_dtensor(y));
      EXPECT_TRUE(at::allclose(full_tensor(y), expected)) << "world " << world;
    });
  }
}

TEST(CustomRule, DistributedKernelMatchesOneDevice) {
  ops::register_rule("tessera_test::normalize", normalize_rule);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tessera_test::normalize", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  const auto full = tessera::test::randn({5, 4}, 62).abs() + 1;
  const auto expected = normalize(full);
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      // Uneven rows; with three ranks, rank 1 holds none.
      ShardTable rows(world, 0);
      rows[0] = world == 1 ? 5 : 3;
      if (world == 3) rows[2] = 2;
      if (world == 2) rows[1] = 2;
      auto dx = distribute_tensor(full, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
      for (const auto& x : {dx, distribute_tensor(full, mesh, {Shard(1)}, std::nullopt),
                            distribute_tensor(full, mesh, {Replicate()}, std::nullopt)}) {
        auto y = op.call(x);
        ASSERT_TRUE(is_dtensor(y));
        EXPECT_TRUE(at::allclose(full_tensor(y), expected)) << "world " << world;
      }
    });
  }
}

TEST(CustomRule, CustomOpWithoutRuleRunsOnlyReplicated) {
  tessera::testing::run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto r = distribute_tensor(at::ones({4}), mesh, {Replicate()}, std::nullopt);
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("tessera_test::fragile", "")
                         .typed<at::Tensor(const at::Tensor&)>();
    // No rule registered yet: replicated inputs run locally everywhere.
    EXPECT_TRUE(at::equal(full_tensor(op.call(r)), at::full({4}, 2.f)));
    auto s = distribute_tensor(at::ones({4}), mesh, {Shard(0)}, std::nullopt);
    try {
      op.call(s);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("tessera_test::fragile"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("S(0)"), std::string::npos);
    }
  });
}

TEST(CustomRule, RuleFailingOnOneRankFailsEveryRankPromptly) {
  ops::register_rule("tessera_test::fragile", fragile_rule);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tessera_test::fragile", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  tessera::testing::RunOptions quick;
  quick.collective_timeout = std::chrono::seconds(10);
  quick.timeout = std::chrono::seconds(40);
  const auto start = std::chrono::steady_clock::now();
  try {
    tessera::testing::run_ranks(
        3,
        [](int) {
          auto mesh = init_device_mesh("cpu", {3});
          auto s = distribute_tensor(at::ones({6}), mesh, {Shard(0)}, std::nullopt);
          auto y = op.call(s);  // rank 1 throws here; the others go on...
          full_tensor(y);       // ...into a collective rank 1 never joins
        },
        quick);
    ADD_FAILURE() << "expected the run to fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("refuses to run on rank 1"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
}
