// loss_parallel: cross entropy on class-sharded logits against the same op on one device
// (at::cross_entropy_loss on the whole logits), value and logits gradient, with the
// collectives counted: forward all-reduces as documented in loss_parallel.h, backward none.
#include "helpers.h"

#include <atomic>
#include <mutex>
#include <thread>

#include <torch/nn/functional/loss.h>

using namespace tessera;
namespace F = torch::nn::functional;
using tessera::test::expect_error_everywhere;
using tessera::test::Rng;

namespace {

struct Case {
  std::vector<int64_t> shape;           // logits; classes at dim 1 (dim 0 of a 1-D input)
  Placements logits;                    // the logits' placements
  std::vector<ShardTable> tables = {};  // per logits dim (empty: chunk)
  // The target: plain (whole on every rank) unless given; its tables follow the logits'.
  std::optional<Placements> target = std::nullopt;
  at::ScalarType dtype = at::kFloat;
  int64_t reduction = at::Reduction::Mean;
  bool weighted = false;
  bool weight_distributed = false;  // a replicated distributed weight, else a plain one
  bool ignore = true;               // every third target is ignore_index
  int64_t ignore_index = -100;
  double smoothing = 0;
  bool functional = false;  // through torch::nn::functional::cross_entropy
  uint64_t seed = 1;
};

int64_t class_dim(const Case& c) { return c.shape.size() >= 2 ? 1 : 0; }

// The number of forward all-reduces documented in loss_parallel.h: two per mesh dim that
// shards the classes (two in all when they shard every dim of a multi-dim mesh), plus one
// per row-sharding mesh dim for mean.
int64_t documented_all_reduces(const Case& c) {
  int64_t cls = 0, rows = 0;
  for (const auto& p : c.logits) {
    if (p.is_shard(class_dim(c)))
      ++cls;
    else if (p.is_shard())
      ++rows;
  }
  const int64_t per = cls == static_cast<int64_t>(c.logits.size()) && cls > 1 ? 1 : cls;
  return 2 * per + (c.reduction == at::Reduction::Mean ? rows : 0);
}

std::string describe(const Case& c) {
  std::string s = "logits " + shape_str(c.shape) + " " + to_string(c.logits);
  for (size_t t = 0; t < c.tables.size(); ++t)
    if (!c.tables[t].empty()) s += " table[" + std::to_string(t) + "]=" + shape_str(c.tables[t]);
  s += c.target ? " target " + to_string(*c.target) : " plain target";
  s += std::string(" ") + c10::toString(c.dtype) + " reduction " + std::to_string(c.reduction);
  if (c.weighted) s += c.weight_distributed ? " weight(R)" : " weight(plain)";
  if (c.ignore) s += " ignore_index " + std::to_string(c.ignore_index);
  if (c.smoothing > 0) s += " smoothing " + std::to_string(c.smoothing);
  if (c.functional) s += " (F::cross_entropy)";
  return s;
}

tessera::test::Tolerance tolerance(at::ScalarType dtype) {
  // NaN where one device gets NaN too: a mean whose every row is ignored is 0 / 0.
  if (dtype == at::kDouble) return {1e-10, 1e-12, /*equal_nan=*/true};
  return {2e-5, 2e-6, /*equal_nan=*/true};
}

// The target's placements and tables that line up with the logits' (row dims only).
std::vector<ShardTable> target_tables(const Case& c) {
  std::vector<ShardTable> out(c.shape.size() > 0 ? c.shape.size() - 1 : 0);
  const int64_t cdim = class_dim(c);
  for (size_t t = 0; t < c.tables.size(); ++t) {
    if (static_cast<int64_t>(t) == cdim || c.tables[t].empty()) continue;
    const int64_t tt = static_cast<int64_t>(t) < cdim ? t : t - 1;
    // Only where the target is sharded like the logits on the same mesh dims.
    bool same = true;
    for (size_t m = 0; m < c.logits.size(); ++m)
      same = same && (c.logits[m].is_shard(t) == (*c.target)[m].is_shard(tt));
    if (same) out[tt] = c.tables[t];
  }
  return out;
}

struct Counts {
  int64_t forward_all_reduce = 0, forward_total = 0, backward_total = 0;
};

// Runs one case on this rank and compares with one device; returns the collectives counted.
Counts check_case(const DeviceMesh& mesh, const Case& c, const std::string& what) {
  Counts counts;
  const int64_t cdim = class_dim(c);
  const int64_t C = c.shape[cdim];
  const auto logits = tessera::test::randn(c.shape, c.seed, c.dtype) * 2;
  std::vector<int64_t> row_shape = c.shape;
  row_shape.erase(row_shape.begin() + cdim);
  at::Tensor target = at::randint(0, C, row_shape, tessera::test::generator(c.seed + 1), at::kLong);
  if (c.ignore) {
    auto flat = target.view({-1});
    for (int64_t i = 1; i < flat.numel(); i += 3) flat[i] = c.ignore_index;
  }
  const auto weight = (at::rand({C}, tessera::test::generator(c.seed + 2)) + 0.5).to(c.dtype);

  auto ref_x = logits.clone().requires_grad_();
  auto ref = at::cross_entropy_loss(ref_x, target, c.weighted ? weight : at::Tensor(), c.reduction,
                                    c.ignore_index, c.smoothing);

  auto dx = distribute_tensor(logits, mesh, c.logits, std::nullopt, ShardSizes::Given(c.tables))
                .detach()
                .requires_grad_();
  at::Tensor dt = c.target ? distribute_tensor(target, mesh, *c.target, std::nullopt,
                                               ShardSizes::Given(target_tables(c)))
                           : target;
  at::Tensor dw;
  if (c.weighted)
    dw = c.weight_distributed
             ? distribute_tensor(weight, mesh, Placements(mesh.ndim(), Replicate()), std::nullopt)
             : weight;

  at::Tensor got;
  {
    LossParallel scope;
    CommDebugMode comm;
    if (c.functional) {
      auto opts =
          F::CrossEntropyFuncOptions().ignore_index(c.ignore_index).label_smoothing(c.smoothing);
      if (dw.defined()) opts.weight(dw);
      if (c.reduction == at::Reduction::None)
        opts.reduction(torch::kNone);
      else if (c.reduction == at::Reduction::Sum)
        opts.reduction(torch::kSum);
      else
        opts.reduction(torch::kMean);
      got = F::cross_entropy(dx, dt, opts);
    } else {
      got = at::cross_entropy_loss(dx, dt, dw, c.reduction, c.ignore_index, c.smoothing);
    }
    counts.forward_all_reduce = comm.get_comm_counts()["all_reduce"];
    counts.forward_total = comm.get_total_counts();
  }
  EXPECT_TRUE(is_dtensor(got)) << what;
  EXPECT_EQ(got.sizes(), ref.sizes()) << what;
  EXPECT_TRUE(tessera::test::full_matches(got, ref, tolerance(c.dtype))) << what << " (forward)";

  // The same global gradient in the result's layout; no communication to build it.
  const at::Tensor g = c.reduction == at::Reduction::None
                           ? tessera::test::randn(ref.sizes(), c.seed + 3, c.dtype)
                           : at::full({}, 0.75, logits.options());
  const at::Tensor gd =
      distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(), std::nullopt,
                        ShardSizes::Given(spec(got).shard_tables()));
  ref.backward(g);
  {
    CommDebugMode comm;
    got.backward(gd);
    counts.backward_total = comm.get_total_counts();
  }
  EXPECT_TRUE(dx.grad().defined()) << what << ": no gradient";
  if (dx.grad().defined()) {
    EXPECT_TRUE(tessera::test::full_matches(dx.grad(), ref_x.grad(), tolerance(c.dtype)))
        << what << " (gradient)";
    EXPECT_EQ(placements(dx.grad()), c.logits) << what;
  }
  return counts;
}

// check_case, plus the documented counts where nothing but the loss communicates (the
// target plain or already laid out like the rows, the weight plain or replicated).
void check_with_counts(const DeviceMesh& mesh, const Case& c, const std::string& what) {
  const Counts n = check_case(mesh, c, what);
  EXPECT_EQ(n.forward_all_reduce, documented_all_reduces(c)) << what;
  EXPECT_EQ(n.forward_total, documented_all_reduces(c)) << what;
  EXPECT_EQ(n.backward_total, 0) << what;
}

// "vocabulary 4N + 1 over N ranks": N - 1 shards of 4 and a last one of 5.
ShardTable four_n_plus_one(int64_t n) {
  ShardTable t(n, 4);
  t.back() = 5;
  return t;
}
// A rank with no classes at all (for n > 1).
ShardTable with_empty_shard(int64_t n, int64_t classes) {
  ShardTable t(n, 0);
  if (n == 1) return {classes};
  t[0] = 3;
  t[n - 1] = classes - 3;
  return t;
}

std::vector<ShardTable> class_table(size_t ndim, ShardTable classes) {
  std::vector<ShardTable> tables(ndim);
  tables[ndim >= 2 ? 1 : 0] = std::move(classes);
  return tables;
}

const int64_t kReductions[] = {at::Reduction::None, at::Reduction::Sum, at::Reduction::Mean};

}  // namespace

// Every reduction, 1-D to 4-D inputs, even and uneven class tables (4N + 1 classes; a rank
// with none), 1 to 4 ranks; two all-reduces forward, nothing backward.
TEST(LossParallel, MatchesOneDeviceEveryShapeTableAndReduction) {
  for (int world : {1, 2, 3, 4}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const int64_t C = 4 * world + 1;
      for (const auto& shape :
           std::vector<std::vector<int64_t>>{{6, C}, {3, C, 4}, {2, C, 3, 2}, {C}}) {
        for (int table = 0; table < 3; ++table) {
          for (int64_t red : kReductions) {
            Case c;
            c.shape = shape;
            c.logits = {Shard(shape.size() >= 2 ? 1 : 0)};
            if (table == 1) c.tables = class_table(shape.size(), four_n_plus_one(world));
            if (table == 2) c.tables = class_table(shape.size(), with_empty_shard(world, C));
            c.reduction = red;
            c.ignore = shape.size() > 1;
            c.functional = table == 0;
            c.seed = 10 + table;
            check_with_counts(mesh, c, "world " + std::to_string(world) + " " + describe(c));
          }
        }
      }
    });
  }
}

// Class weights (plain and replicated), ignore_index (the default and a real class id),
// label smoothing with and without weights, float and double.
TEST(LossParallel, WeightsIgnoreIndexAndLabelSmoothing) {
  for (int world : {1, 2, 3, 4}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const int64_t C = 4 * world + 1;
      for (auto dtype : {at::kFloat, at::kDouble}) {
        for (double smoothing : {0.0, 0.1, 0.35}) {
          for (int w = 0; w < 3; ++w) {
            for (int64_t red : kReductions) {
              Case c;
              c.shape = red == at::Reduction::Sum ? std::vector<int64_t>{2, C, 3}
                                                  : std::vector<int64_t>{7, C};
              c.logits = {Shard(1)};
              c.tables = class_table(c.shape.size(), four_n_plus_one(world));
              c.dtype = dtype;
              c.reduction = red;
              c.weighted = w > 0;
              c.weight_distributed = w == 2;
              c.ignore_index = w == 1 ? 2 : -100;  // 2 is a class: its rows are ignored
              c.smoothing = smoothing;
              c.functional = w == 2;
              c.seed = 20 + w;
              check_with_counts(mesh, c, "world " + std::to_string(world) + " " + describe(c));
            }
          }
        }
      }
    });
  }
}

// PyTorch's count test: [8, 16] and [8, 16, 12] logits, every reduction: exactly two
// all-reduces forward (PyTorch issues three), no collective backward.
TEST(LossParallel, TwoAllReducesForwardNoCollectiveBackward) {
  for (int world : {2, 4}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      for (const auto& shape : std::vector<std::vector<int64_t>>{{8, 16}, {8, 16, 12}}) {
        for (int64_t red : kReductions) {
          for (bool weighted : {false, true}) {
            Case c;
            c.shape = shape;
            c.logits = {Shard(1)};
            c.reduction = red;
            c.weighted = weighted;
            c.weight_distributed = true;
            c.target = Placements{Replicate()};
            c.smoothing = weighted ? 0.2 : 0;
            const std::string what = "world " + std::to_string(world) + " " + describe(c);
            const Counts n = check_case(mesh, c, what);
            EXPECT_EQ(n.forward_all_reduce, 2) << what;
            EXPECT_EQ(n.forward_total, 2) << what;
            EXPECT_EQ(n.backward_total, 0) << what;
          }
        }
      }
    });
  }
}

// A 2-D mesh: classes on one mesh dim, rows on the other (either way round), the target
// distributed like the rows, plain, or laid out otherwise (then redistributed); uneven rows
// and classes. Mean adds one scalar all-reduce over the row mesh dim.
TEST(LossParallel, TwoDimMeshClassesAndBatch) {
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    for (int classes_on : {0, 1}) {
      const int rows_on = 1 - classes_on;
      for (const auto& shape : std::vector<std::vector<int64_t>>{{7, 9}, {3, 9, 5}}) {
        for (int target_kind = 0; target_kind < 3; ++target_kind) {
          for (int64_t red : kReductions) {
            Case c;
            c.shape = shape;
            c.logits = Placements(2, Replicate());
            c.logits[classes_on] = Shard(1);
            c.logits[rows_on] = Shard(0);
            c.tables = std::vector<ShardTable>(shape.size());
            c.tables[0] = {shape[0] - 2, 2};
            c.tables[1] = {9, 0};
            if (target_kind == 0) {
              c.target = Placements(2, Replicate());
              (*c.target)[rows_on] = Shard(0);
            } else if (target_kind == 2) {
              c.target = Placements(2, Replicate());  // not laid out like the rows
            }
            c.reduction = red;
            c.weighted = red != at::Reduction::Sum;
            c.weight_distributed = true;
            c.smoothing = red == at::Reduction::Mean ? 0.15 : 0;
            const std::string what = describe(c);
            const Counts n = check_case(mesh, c, what);
            EXPECT_EQ(n.forward_all_reduce, red == at::Reduction::Mean ? 3 : 2) << what;
            EXPECT_EQ(n.forward_all_reduce, documented_all_reduces(c)) << what;
            if (target_kind != 2) {
              EXPECT_EQ(n.forward_total, n.forward_all_reduce) << what;
            }
            EXPECT_EQ(n.backward_total, 0) << what;
          }
        }
      }
    }
    // Classes sharded over both mesh dims: one group, two all-reduces.
    for (int64_t red : kReductions) {
      Case c;
      c.shape = {5, 11, 2};
      c.logits = {Shard(1), Shard(1)};
      c.tables = class_table(3, {4, 0, 2, 5});
      c.reduction = red;
      c.weighted = true;
      c.smoothing = 0.1;
      check_with_counts(mesh, c, describe(c));
    }
    // Classes on one mesh dim, rows replicated over the other.
    for (int64_t red : kReductions) {
      Case c;
      c.shape = {6, 10};
      c.logits = {Replicate(), Shard(1)};
      c.reduction = red;
      check_with_counts(mesh, c, describe(c));
    }
  });
}

// Partial logits (a row-parallel projection's output) are reduced first, then sharded work
// goes on as usual.
TEST(LossParallel, PartialLogitsAreReducedFirst) {
  const auto logits = tessera::test::randn({6, 8}, 61);
  const auto target = at::randint(0, 8, {6}, tessera::test::generator(62), at::kLong);
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    auto ref_x = logits.clone().requires_grad_();
    auto ref = at::cross_entropy_loss(ref_x, target);
    auto dx = tessera::test::make_dtensor_from_full(logits, mesh, {Partial(), Shard(1)})
                  .detach()
                  .requires_grad_();
    at::Tensor got;
    {
      LossParallel scope;
      got = at::cross_entropy_loss(dx, target);
    }
    ASSERT_TRUE(tessera::test::full_matches(got, ref));
    ref.backward();
    got.backward();
    ASSERT_TRUE(tessera::test::full_matches(dx.grad(), ref_x.grad()));
  });
}

// The scope is per thread, nests, and the backward need not run inside it.
TEST(LossParallel, ScopeNestsAndBackwardMayRunAfterIt) {
  EXPECT_FALSE(LossParallel::enabled());
  {
    auto outer = loss_parallel();
    EXPECT_TRUE(LossParallel::enabled());
    {
      LossParallel inner;
      EXPECT_TRUE(LossParallel::enabled());
    }
    EXPECT_TRUE(LossParallel::enabled());
    std::atomic<bool> other{true};
    std::thread([&] { other = LossParallel::enabled(); }).join();
    EXPECT_FALSE(other.load()) << "the scope leaked into another thread";
  }
  EXPECT_FALSE(LossParallel::enabled());

  const auto logits = tessera::test::randn({5, 7}, 71);
  const auto target = at::randint(0, 7, {5}, tessera::test::generator(72), at::kLong);
  tessera::testing::run_ranks(3, [&](int) {
    auto mesh = init_device_mesh("cpu", {3});
    auto ref_x = logits.clone().requires_grad_();
    auto ref = at::cross_entropy_loss(ref_x, target, {}, at::Reduction::Sum);
    auto dx = distribute_tensor(logits, mesh, {Shard(1)}, std::nullopt).detach().requires_grad_();
    at::Tensor got;
    {
      LossParallel scope;
      got = at::cross_entropy_loss(dx, target, {}, at::Reduction::Sum);
    }
    CommDebugMode comm;
    got.backward();
    EXPECT_EQ(comm.get_total_counts(), 0);
    ref.backward();
    EXPECT_TRUE(tessera::test::full_matches(dx.grad(), ref_x.grad()));
  });
}

// Outside a scope cross_entropy decomposes as usual (class-sharded logits are gathered by
// the log_softmax rule); plain logits inside a scope are untouched.
TEST(LossParallel, OutsideTheScopeTheUsualDecompositionRuns) {
  const auto logits = tessera::test::randn({6, 9}, 81);
  const auto target = at::randint(0, 9, {6}, tessera::test::generator(82), at::kLong);
  const auto ref = at::cross_entropy_loss(logits, target, {}, at::Reduction::Mean, -100, 0.1);
  {
    LossParallel scope;
    auto x = logits.clone().requires_grad_();
    auto plain = at::cross_entropy_loss(x, target, {}, at::Reduction::Mean, -100, 0.1);
    EXPECT_FALSE(is_dtensor(plain));
    EXPECT_TRUE(at::allclose(plain, ref));
    plain.backward();
    EXPECT_TRUE(x.grad().defined());
  }
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto dx = distribute_tensor(logits, mesh, {Shard(1)}, std::nullopt).detach().requires_grad_();
    CommDebugMode comm;
    auto got = at::cross_entropy_loss(dx, target, {}, at::Reduction::Mean, -100, 0.1);
    EXPECT_GT(comm.get_comm_counts()["all_gather"], 0) << "expected the gathering decomposition";
    EXPECT_TRUE(tessera::test::full_matches(got, ref));
  });
}

// Logits not sharded on the class dim raise on every rank (decided from the spec, so no rank
// waits in a collective), naming loss_parallel, the placements and the shape.
TEST(LossParallel, WrongShardDimRaisesOnEveryRank) {
  struct Bad {
    std::vector<int64_t> shape;
    Placements p;
    std::string placements, shape_text;
  };
  const std::vector<Bad> bad = {
      {{8, 6}, {Shard(0)}, "(S(0))", "[8, 6]"},
      {{8, 6}, {Replicate()}, "(R)", "[8, 6]"},
      {{4, 6, 5}, {Shard(2)}, "(S(2))", "[4, 6, 5]"},
      {{4, 6, 5}, {Shard(0)}, "(S(0))", "[4, 6, 5]"},
  };
  for (const auto& b : bad) {
    expect_error_everywhere(3,
                            [&](int) {
                              auto mesh = init_device_mesh("cpu", {3});
                              auto x =
                                  distribute_tensor(at::zeros(b.shape), mesh, b.p, std::nullopt);
                              std::vector<int64_t> rows = b.shape;
                              rows.erase(rows.begin() + 1);
                              LossParallel scope;
                              at::cross_entropy_loss(x, at::zeros(rows, at::kLong));
                            },
                            {"loss_parallel", b.placements, b.shape_text, "class dim"});
  }
  // Class probabilities, and out-of-range class indices.
  expect_error_everywhere(
      2,
      [&](int) {
        auto mesh = init_device_mesh("cpu", {2});
        auto x = distribute_tensor(at::zeros({4, 6}), mesh, {Shard(1)}, std::nullopt);
        LossParallel scope;
        at::cross_entropy_loss(x, at::full({4, 6}, 1.0 / 6));
      },
      {"loss_parallel", "probability"});
  expect_error_everywhere(
      2,
      [&](int) {
        auto mesh = init_device_mesh("cpu", {2});
        auto x = distribute_tensor(at::zeros({4, 6}), mesh, {Shard(1)}, std::nullopt);
        LossParallel scope;
        at::cross_entropy_loss(x, at::tensor({0, 1, 6, 2}, at::kLong));
      },
      {"loss_parallel", "target 6 is out of bounds"});
  // Batch-sharded rows and mean: the rank holding the bad row tells the others.
  expect_error_everywhere(
      4,
      [&](int) {
        auto mesh = init_device_mesh("cpu", {2, 2});
        auto x = distribute_tensor(at::zeros({4, 6}), mesh, {Shard(0), Shard(1)}, std::nullopt);
        auto t = distribute_tensor(at::tensor({0, 1, 2, -3}, at::kLong), mesh,
                                   {Shard(0), Replicate()}, std::nullopt);
        LossParallel scope;
        at::cross_entropy_loss(x, t);
      },
      {"loss_parallel", "out of bounds"});
}

// Half-precision logits: computed in float, rounded once.
TEST(LossParallel, BFloat16LogitsComputeInFloat) {
  const auto logits = tessera::test::randn({6, 10}, 91).to(at::kBFloat16);
  const auto target = at::randint(0, 10, {6}, tessera::test::generator(92), at::kLong);
  auto ref_x = logits.to(at::kFloat).requires_grad_();
  auto ref = at::cross_entropy_loss(ref_x, target, {}, at::Reduction::Mean, -100, 0.1);
  ref.backward();
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto dx = distribute_tensor(logits, mesh, {Shard(1)}, std::nullopt).detach().requires_grad_();
    at::Tensor got;
    {
      LossParallel scope;
      got = at::cross_entropy_loss(dx, target, {}, at::Reduction::Mean, -100, 0.1);
    }
    EXPECT_EQ(got.scalar_type(), at::kBFloat16);
    got.backward();
    EXPECT_TRUE(tessera::test::full_matches(got.to(at::kFloat), ref.detach(), {1e-2, 1e-3}));
    EXPECT_TRUE(tessera::test::full_matches(dx.grad().to(at::kFloat), ref_x.grad(), {2e-2, 2e-3}));
  });
}

// Randomized: shapes of 1 to 4 dims, class counts, random class tables (empty shards
// likely), reductions, weights, ignore_index, smoothing, dtypes, targets plain or
// distributed, on 1-D and 2-D meshes.
class LossParallelSweep : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(LossParallelSweep, RandomCasesMatchOneDevice) {
  tessera::test::Sweep sweep;
  const auto cases = sweep.cases(40);
  if (!cases.any()) return;
  const auto shape = GetParam();
  tessera::test::on_mesh(shape, [&](const DeviceMesh& mesh) {
    cases.run([&](Rng& rng, int64_t k) {
      Case c;
      const int64_t nd = rng.uniform(1, 4);
      c.shape.clear();
      for (int64_t t = 0; t < nd; ++t) c.shape.push_back(rng.uniform(1, 4));
      const int64_t cdim = nd >= 2 ? 1 : 0;
      c.shape[cdim] = rng.uniform(1, 13);
      // Classes on one mesh dim (or on all of them); rows on another where there is one.
      c.logits = Placements(mesh.ndim(), Replicate());
      const int64_t class_mesh_dim = rng.uniform(0, mesh.ndim() - 1);
      const bool classes_everywhere = mesh.ndim() > 1 && rng.coin(0.2);
      for (int64_t m = 0; m < mesh.ndim(); ++m) {
        if (m == class_mesh_dim || classes_everywhere)
          c.logits[m] = Shard(cdim);
        else if (nd >= 2 && rng.coin(0.7)) {
          int64_t row_dim = rng.uniform(0, nd - 2);
          if (row_dim >= cdim) ++row_dim;
          c.logits[m] = Shard(row_dim);
        }
      }
      c.tables = tessera::test::random_tables(rng, mesh, c.logits, c.shape);
      const int target_kind = static_cast<int>(rng.uniform(0, 2));
      if (target_kind > 0) {
        Placements tp(mesh.ndim(), Replicate());
        if (target_kind == 1)  // laid out like the rows
          for (int64_t m = 0; m < mesh.ndim(); ++m)
            if (c.logits[m].is_shard() && !c.logits[m].is_shard(cdim)) {
              const int64_t t = c.logits[m].dim();
              tp[m] = Shard(t < cdim ? t : t - 1);
            }
        c.target = tp;
      }
      c.dtype = rng.coin(0.3) ? at::kDouble : at::kFloat;
      c.reduction = kReductions[rng.uniform(0, 2)];
      c.weighted = rng.coin();
      c.weight_distributed = rng.coin();
      c.ignore = nd >= 2 && rng.coin(0.6);
      c.ignore_index = rng.coin() ? -100 : rng.uniform(0, c.shape[cdim] - 1);
      c.smoothing = rng.coin() ? 0.0 : rng.pick(std::vector<double>{0.05, 0.3, 1.0});
      c.functional = rng.coin();
      c.seed = 1000 + static_cast<uint64_t>(k);
      const std::string what = sweep.label(k) + ": " + describe(c);
      const Counts n = check_case(mesh, c, what);
      EXPECT_EQ(n.forward_all_reduce, documented_all_reduces(c)) << what;
      if (target_kind != 2) {
        EXPECT_EQ(n.forward_total, n.forward_all_reduce) << what;
      }
      EXPECT_EQ(n.backward_total, 0) << what;
    });
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, LossParallelSweep,
                         ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                           std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                           std::vector<int64_t>{2, 2}),
                         [](const auto& info) { return tessera::test::mesh_name(info.param); });
