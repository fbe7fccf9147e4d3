// Normalisation on activations sharded along spatial dims (domain parallelism) and the batch
// dim: seeded randomized differential tests of group_norm, batch_norm (training, with the
// running statistics, and evaluation) and instance_norm on 1-D and 2-D meshes, with uneven
// shard tables (empty shards included), nested shardings of one dim, and occasional channel
// sharding or Partial inputs; forward, running statistics and every gradient against the same
// code on full tensors in one process (double precision). Also: torch::nn GroupNorm and
// BatchNorm2d modules (distribute_module) for SGD steps on an H x W decomposition, the
// communication a spatially sharded norm costs, and the error for sharded running stats.
// A failure of the randomized test prints the command that replays its case.

#include <array>
#include <cstdio>
#include <string>
#include <tuple>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include "helpers.h"

using namespace tessera;
namespace nn = torch::nn;

namespace {

using Shape = std::vector<int64_t>;
using test::Rng;

const test::Tolerance kTol{1e-9, 1e-9, /*equal_nan=*/true};
double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() ? (a - b).abs().max().item<double>() : -1.0;
}
at::Tensor whole(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t) : t; }

enum class Kind { GroupNorm, BatchTrain, BatchEval, Instance };
enum class Stats { None, Plain, Replicated };  // how the distributed run gets running stats
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::GroupNorm: return "group_norm";
    case Kind::BatchTrain: return "batch_norm(train)";
    case Kind::BatchEval: return "batch_norm(eval)";
    case Kind::Instance: return "instance_norm";
  }
  return "?";
}
const char* stats_name(Stats s) {
  return s == Stats::None ? "none" : s == Stats::Plain ? "plain" : "replicated";
}

struct Case {
  Kind kind;
  Shape input;
  int64_t groups = 1;
  bool affine = true;
  double eps = 1e-5, momentum = 0.1;
  Stats stats = Stats::None;
  bool use_input_stats = true;  // instance_norm
  std::string desc;
};

at::Tensor run(const Case& c, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
               const at::Tensor& rm, const at::Tensor& rv) {
  switch (c.kind) {
    case Kind::GroupNorm: return at::group_norm(x, c.groups, w, b, c.eps);
    case Kind::BatchTrain: return at::batch_norm(x, w, b, rm, rv, true, c.momentum, c.eps, false);
    case Kind::BatchEval: return at::batch_norm(x, w, b, rm, rv, false, c.momentum, c.eps, false);
    case Kind::Instance:
      return at::instance_norm(x, w, b, rm, rv, c.use_input_stats, c.momentum, c.eps, false);
  }
  return {};
}

// Elements each statistic averages over (kept >= 2 so variances are meaningful).
int64_t stat_count(const Case& c) {
  int64_t spatial = 1;
  for (size_t t = 2; t < c.input.size(); ++t) spatial *= c.input[t];
  switch (c.kind) {
    case Kind::GroupNorm: return c.input[1] / c.groups * spatial;
    case Kind::Instance: return spatial;
    default: return c.input[0] * spatial;
  }
}

Case make_case(Rng& rng, Kind kind) {
  Case c;
  c.kind = kind;
  const int64_t nsp =
      kind == Kind::Instance ? rng.uniform(1, 3) : (rng.coin(0.1) ? 0 : rng.uniform(1, 3));
  const int64_t batch = rng.uniform(1, 4);
  int64_t channels = rng.uniform(1, 4);
  if (kind == Kind::GroupNorm) {
    c.groups = rng.uniform(1, 3);
    channels = c.groups * rng.uniform(1, 3);
  }
  c.input = {batch, channels};
  for (int64_t i = 0; i < nsp; ++i)
    c.input.push_back(rng.uniform(1, nsp == 1 ? 12 : nsp == 2 ? 8 : 5));
  c.affine = rng.coin(0.75);
  c.eps = rng.coin() ? 1e-5 : 1e-3;
  c.momentum = rng.coin() ? 0.1 : 0.37;
  if (kind == Kind::BatchTrain || kind == Kind::Instance) {
    const int64_t r = rng.uniform(0, 2);
    c.stats = r == 0 ? Stats::None : r == 1 ? Stats::Plain : Stats::Replicated;
  }
  if (kind == Kind::BatchEval) c.stats = rng.coin() ? Stats::Plain : Stats::Replicated;
  if (kind == Kind::Instance && c.stats != Stats::None) c.use_input_stats = rng.coin(0.7);
  if (stat_count(c) < 2) return make_case(rng, kind);
  c.desc =
      std::string(kind_name(kind)) + " input " + shape_str(c.input) +
      (kind == Kind::GroupNorm ? " groups " + std::to_string(c.groups) : "") +
      (c.affine ? " affine" : " no-affine") + " eps " + std::to_string(c.eps) + " momentum " +
      std::to_string(c.momentum) + " running stats " + stats_name(c.stats) +
      (kind == Kind::Instance ? (c.use_input_stats ? " use_input_stats" : " running-only") : "");
  return c;
}

// Each mesh dim shards a random spatial dim (two mesh dims may nest on one), the batch, or
// now and then the channel dim or nothing, or holds Partial terms.
Placements random_placements(Rng& rng, const DeviceMesh& mesh, const Shape& input) {
  const int64_t nsp = static_cast<int64_t>(input.size()) - 2;
  Placements p;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const int64_t r = rng.uniform(0, 19);
    if (r < 12 && nsp > 0)
      p.push_back(Shard(2 + rng.uniform(0, nsp - 1)));
    else if (r < 16)
      p.push_back(Shard(0));
    else if (r < 17)
      p.push_back(Shard(1));
    else if (r < 18)
      p.push_back(Partial());
    else
      p.push_back(Replicate());
  }
  return p;
}

void check(const DeviceMesh& mesh, const Case& c, const Placements& placements,
           const std::vector<ShardTable>& tables, uint64_t seed, const std::string& desc) {
  const auto dbl = at::TensorOptions().dtype(at::kDouble);
  const Placements rep(mesh.ndim(), Replicate());
  const int64_t channels = c.input[1];
  at::Tensor x = test::randn(c.input, seed, at::kDouble).mul_(1.5).add_(0.3).requires_grad_();
  at::Tensor w, b, dw, db;
  if (c.affine) {
    w = (test::randn({channels}, seed + 1, at::kDouble) * 0.5 + 1).requires_grad_();
    b = test::randn({channels}, seed + 2, at::kDouble).requires_grad_();
    dw = distribute_tensor(w.detach(), mesh, rep, std::nullopt).requires_grad_();
    db = distribute_tensor(b.detach(), mesh, rep, std::nullopt).requires_grad_();
  }
  at::Tensor rm, rv, drm, drv;
  if (c.stats != Stats::None) {
    rm = test::randn({channels}, seed + 3, at::kDouble) * 0.2;
    rv = at::rand({channels}, test::generator(seed + 4), dbl) + 0.5;
    drm = c.stats == Stats::Plain ? rm.clone() : distribute_tensor(rm, mesh, rep, std::nullopt);
    drv = c.stats == Stats::Plain ? rv.clone() : distribute_tensor(rv, mesh, rep, std::nullopt);
  }
  at::Tensor dx =
      test::make_dtensor_from_full(x.detach(), mesh, placements, tables).requires_grad_();

  at::Tensor expected = run(c, x, w, b, rm, rv);
  at::Tensor got = run(c, dx, dw, db, drm, drv);
  ASSERT_TRUE(is_dtensor(got)) << desc;
  ASSERT_TRUE(test::full_matches(got, expected, kTol)) << desc;
  if (c.stats != Stats::None) {
    ASSERT_EQ(is_dtensor(drm), c.stats == Stats::Replicated) << desc;
    if (is_dtensor(drm)) {
      ASSERT_TRUE(spec(drm).is_replicated()) << desc << ": " << spec(drm).str();
    }
    ASSERT_TRUE(test::matches(whole(drm), rm, kTol)) << desc << ": running_mean";
    ASSERT_TRUE(test::matches(whole(drv), rv, kTol)) << desc << ": running_var";
  }

  at::Tensor g = test::randn(expected.sizes(), seed + 99, at::kDouble);
  expected.backward(g);
  got.backward(distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(),
                                 std::nullopt, ShardSizes::Given(spec(got).shard_tables())));
  ASSERT_TRUE(dx.grad().defined()) << desc << ": no input gradient";
  ASSERT_TRUE(test::full_matches(dx.grad(), x.grad(), kTol)) << desc << ": input gradient";
  if (c.affine) {
    ASSERT_TRUE(dw.grad().defined() && db.grad().defined()) << desc << ": no weight/bias gradient";
    ASSERT_TRUE(test::full_matches(dw.grad(), w.grad(), kTol)) << desc << ": weight gradient";
    ASSERT_TRUE(test::full_matches(db.grad(), b.grad(), kTol)) << desc << ": bias gradient";
  }
}

// Case i draws a norm of kind i % 4, so every kind gets a quarter of the cases.
void run_case(const DeviceMesh& mesh, int64_t i, Rng& rng, const std::string& label) {
  const Kind kinds[] = {Kind::GroupNorm, Kind::BatchTrain, Kind::BatchEval, Kind::Instance};
  Case c = make_case(rng, kinds[i % 4]);
  Placements p = random_placements(rng, mesh, c.input);
  auto tables =
      rng.coin(0.8) ? test::random_tables(rng, mesh, p, c.input) : std::vector<ShardTable>{};
  std::string desc =
      label + " mesh " + shape_str(mesh.shape()) + ": " + c.desc + " placements " + to_string(p);
  for (size_t t = 0; t < tables.size(); ++t)
    if (!tables[t].empty()) desc += " t" + std::to_string(t) + "=" + shape_str(tables[t]);
  try {
    check(mesh, c, p, tables, rng.bits(), desc);
  } catch (const std::exception& e) {
    throw std::runtime_error(desc + ": " + e.what());
  }
}

}  // namespace

// 4 meshes x 4 kinds x 14 cases = 224 random cases.
class DomainNorm : public ::testing::TestWithParam<Shape> {};
TEST_P(DomainNorm, RandomNormalisationsMatchOneDevice) {
  test::Sweep sweep;
  const auto cases = sweep.cases(4 * 14);
  if (!cases.any()) return;
  test::on_mesh(GetParam(), [&](const DeviceMesh& mesh) {
    cases.run([&](Rng& rng, int64_t i) { run_case(mesh, i, rng, sweep.label(i)); });
  });
}
INSTANTIATE_TEST_SUITE_P(Meshes, DomainNorm,
                         ::testing::Values(Shape{2}, Shape{3}, Shape{4}, Shape{2, 2}),
                         [](const auto& info) { return test::mesh_name(info.param); });

// A spatially sharded norm moves only its statistics, per sharding mesh dim: forward one
// all-gather of every shard's (count, mean, variance), per [N, groups] (group norm) or per
// [C] (batch norm); backward one all-reduce (both gradient sums stacked).
TEST(DomainNorm, SpatialShardingCommunicatesOnlyStatistics) {
  const auto x = test::randn({2, 6, 9, 7}, 7, at::kDouble);
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    for (bool batch_norm : {false, true}) {
      auto dx = distribute_tensor(x, mesh, {Shard(2), Shard(3)}, std::nullopt,
                                  ShardSizes::Given({{}, {}, {9, 0}, {3, 4}}))
                    .requires_grad_();
      at::Tensor out;
      {
        CommDebugMode comm;
        out = batch_norm ? at::batch_norm(dx, {}, {}, {}, {}, true, 0.1, 1e-5, false)
                         : at::group_norm(dx, 3);
        EXPECT_EQ(comm.get_total_counts(), 2) << comm.table();
        EXPECT_EQ(comm.stats(comm::CollectiveKind::AllGather).calls, 2) << comm.table();
      }
      EXPECT_EQ(placements(out), (Placements{Shard(2), Shard(3)}));
      CommDebugMode comm;
      out.backward(at::ones_like(out));
      EXPECT_EQ(comm.get_total_counts(), 2) << comm.table();
      EXPECT_EQ(comm.stats(comm::CollectiveKind::AllReduce).calls, 2) << comm.table();
      EXPECT_EQ(placements(dx.grad()), (Placements{Shard(2), Shard(3)}));
    }
  });
}

// bfloat16 activations with float32 weights (norms kept in float32, as mixed-precision
// training does): the kernels return mean and rstd in float32 (as CUDA's do for any half
// input), and backward takes them so. layer_norm over a batch split, group_norm and
// batch_norm over a spatial split (uneven, one shard empty), on 1-3 ranks: forward and every
// gradient against one device's same call.
TEST(DomainNorm, FloatStatisticsOfBFloat16Activations) {
  const auto x = test::randn({4, 6, 5}, 1).to(at::kBFloat16);
  const auto w6 = test::randn({6}, 2), b6 = test::randn({6}, 3);
  const auto w5 = test::randn({5}, 4), b5 = test::randn({5}, 5);
  const auto g = test::randn({4, 6, 5}, 6).to(at::kBFloat16);
  const test::Tolerance tol{2e-2, 2e-2};
  enum class Op { LayerNorm, GroupNorm, BatchNorm };
  std::string skipped;
  for (const Op op : {Op::LayerNorm, Op::GroupNorm, Op::BatchNorm}) {
    const char* name = op == Op::LayerNorm   ? "layer_norm"
                       : op == Op::GroupNorm ? "group_norm"
                                             : "batch_norm";
    const auto call = [&](const at::Tensor& in, const at::Tensor& w, const at::Tensor& b) {
      switch (op) {
        case Op::LayerNorm: return at::layer_norm(in, {5}, w, b);
        case Op::GroupNorm: return at::group_norm(in, 3, w, b);
        case Op::BatchNorm: return at::batch_norm(in, w, b, {}, {}, true, 0.1, 1e-5, false);
      }
      return at::Tensor();
    };
    const bool ln = op == Op::LayerNorm;
    auto xl = x.detach().requires_grad_();
    auto wl = (ln ? w5 : w6).detach().requires_grad_(),
         bl = (ln ? b5 : b6).detach().requires_grad_();
    at::Tensor expected;
    try {
      expected = call(xl, wl, bl);
    } catch (const c10::Error&) {
      skipped += std::string(" ") + name;  // (no mixed-dtype kernel on CPU: nothing to compare)
      continue;
    }
    expected.backward(g);
    for (const ShardTable& table : std::vector<ShardTable>{{4}, {3, 1}, {1, 0, 3}}) {
      const int world = static_cast<int>(table.size());
      const int64_t dim = ln ? 0 : 2;
      const ShardTable split = ln ? table
                                  : (world == 1   ? ShardTable{5}
                                     : world == 2 ? ShardTable{2, 3}
                                                  : ShardTable{1, 0, 4});
      const std::string what = std::string(name) + " on " + std::to_string(world) + " ranks";
      tessera::testing::run_ranks(world, [&](int) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {world});
        std::vector<ShardTable> tables(static_cast<size_t>(dim) + 1);
        tables.back() = split;
        auto dx = test::make_dtensor_from_full(x, mesh, {Shard(dim)}, tables).requires_grad_();
        auto dw = distribute_tensor(ln ? w5 : w6, mesh, {Replicate()}).requires_grad_();
        auto db = distribute_tensor(ln ? b5 : b6, mesh, {Replicate()}).requires_grad_();
        auto got = call(dx, dw, db);
        EXPECT_EQ(got.scalar_type(), expected.scalar_type()) << what;
        EXPECT_TRUE(test::full_matches(got, expected, tol)) << what << ": output";
        got.backward(test::make_dtensor_from_full(g, mesh, {Shard(dim)}, tables));
        EXPECT_TRUE(test::full_matches(dx.grad(), xl.grad(), tol)) << what << ": input grad";
        EXPECT_TRUE(test::full_matches(dw.grad(), wl.grad(), tol)) << what << ": weight grad";
        EXPECT_TRUE(test::full_matches(db.grad(), bl.grad(), tol)) << what << ": bias grad";
      });
    }
  }
  if (skipped.size() == std::string(" layer_norm group_norm batch_norm").size())
    GTEST_SKIP() << "no mixed-dtype norm kernels on CPU in this LibTorch";
  if (!skipped.empty())
    std::printf("(not compared, no mixed-dtype CPU kernel:%s)\n", skipped.c_str());
}

// The norms' own ops called directly on bfloat16 input, with bfloat16 or float32 weights:
// every result (output, statistics, and the backward's three gradients) in one device's
// dtype, the output and gradients at one device's values; group_norm and batch_norm over a
// spatial split on 2 ranks (their distributed kernels), layer_norm over a batch split.
TEST(DomainNorm, NormOpsGiveOneDevicesDtypes) {
  const auto x = test::randn({4, 6, 5}, 11).to(at::kBFloat16);
  const auto g = test::randn({4, 6, 5}, 12).to(at::kBFloat16);
  const test::Tolerance tol{2e-2, 2e-2};
  using Three = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
  const std::array<bool, 3> all = {true, true, true};
  int compared = 0;
  for (const at::ScalarType param_dtype : {at::kBFloat16, at::kFloat}) {
    for (const char* name : {"layer_norm", "group_norm", "batch_norm"}) {
      const std::string op = name;
      const int64_t c = op == "layer_norm" ? 5 : 6;
      const auto w = test::randn({c}, 13).to(param_dtype), b = test::randn({c}, 14).to(param_dtype);
      const auto forward = [&](const at::Tensor& in, const at::Tensor& wt,
                               const at::Tensor& bs) -> Three {
        if (op == "layer_norm") return at::native_layer_norm(in, {5}, wt, bs, 1e-5);
        if (op == "group_norm") return at::native_group_norm(in, wt, bs, 4, 6, 5, 3, 1e-5);
        return at::native_batch_norm(in, wt, bs, {}, {}, true, 0.1, 1e-5);
      };
      const auto backward = [&](const at::Tensor& dy, const at::Tensor& in, const at::Tensor& wt,
                                const at::Tensor& bs, const Three& f) -> Three {
        if (op == "layer_norm")
          return at::native_layer_norm_backward(dy, in, {5}, std::get<1>(f), std::get<2>(f), wt, bs,
                                                all);
        if (op == "group_norm")
          return at::native_group_norm_backward(dy, in, std::get<1>(f), std::get<2>(f), wt, 4, 6, 5,
                                                3, all);
        return at::native_batch_norm_backward(dy, in, wt, {}, {}, std::get<1>(f), std::get<2>(f),
                                              true, 1e-5, all);
      };
      Three one_f, one_b;
      try {
        one_f = forward(x, w, b);
        one_b = backward(g, x, w, b, one_f);
      } catch (const c10::Error&) {
        continue;  // (no mixed-dtype kernel on CPU in this LibTorch)
      }
      ++compared;
      const std::string what = op + " with " + c10::toString(param_dtype) + " parameters";
      const int64_t dim = op == "layer_norm" ? 0 : 2;
      const ShardTable split = op == "layer_norm" ? ShardTable{3, 1} : ShardTable{2, 3};
      tessera::testing::run_ranks(2, [&](int) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2});
        std::vector<ShardTable> tables(static_cast<size_t>(dim) + 1);
        tables.back() = split;
        const auto dx = test::make_dtensor_from_full(x, mesh, {Shard(dim)}, tables);
        const auto dg = test::make_dtensor_from_full(g, mesh, {Shard(dim)}, tables);
        const auto dw = distribute_tensor(w, mesh, {Replicate()});
        const auto db = distribute_tensor(b, mesh, {Replicate()});
        const Three f = forward(dx, dw, db);
        const Three bw = backward(dg, dx, dw, db, f);
        const std::array<at::Tensor, 3> got_f = {std::get<0>(f), std::get<1>(f), std::get<2>(f)};
        const std::array<at::Tensor, 3> want_f = {std::get<0>(one_f), std::get<1>(one_f),
                                                  std::get<2>(one_f)};
        const std::array<at::Tensor, 3> got_b = {std::get<0>(bw), std::get<1>(bw), std::get<2>(bw)};
        const std::array<at::Tensor, 3> want_b = {std::get<0>(one_b), std::get<1>(one_b),
                                                  std::get<2>(one_b)};
        for (size_t r = 0; r < 3; ++r) {
          EXPECT_EQ(got_f[r].scalar_type(), want_f[r].scalar_type())
              << what << ": forward result " << r;
          EXPECT_EQ(got_b[r].scalar_type(), want_b[r].scalar_type()) << what << ": gradient " << r;
          EXPECT_TRUE(test::full_matches(got_b[r], want_b[r], tol)) << what << ": gradient " << r;
        }
        EXPECT_TRUE(test::full_matches(got_f[0], want_f[0], tol)) << what << ": output";
      });
    }
  }
  if (compared == 0) GTEST_SKIP() << "no bfloat16 norm kernels on CPU in this LibTorch";
}

TEST(DomainNorm, TrainingWithShardedRunningStatsIsRejected) {
  const auto x = test::randn({4, 4, 6}, 8, at::kDouble);
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto dx = distribute_tensor(x, mesh, {Shard(2)}, std::nullopt);
    auto rm = distribute_tensor(at::zeros({4}, at::kDouble), mesh, {Shard(0)}, std::nullopt);
    auto rv = distribute_tensor(at::ones({4}, at::kDouble), mesh, {Replicate()}, std::nullopt);
    try {
      at::batch_norm(dx, {}, {}, rm, rv, true, 0.1, 1e-5, false);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("native_batch_norm"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("replicated"), std::string::npos) << e.what();
    }
  });
}

// Unchanged torch::nn modules with every parameter and buffer replicated (distribute_module),
// input sharded H over one mesh dim and W over the other (one empty shard): losses,
// parameters and running buffers after SGD steps, then an evaluation forward, equal one
// device, in double and in float (the modules' default).
TEST(DomainNorm, GroupNormAndBatchNormModulesTrainOnHxWDecomposition) {
  for (auto dtype : {at::kDouble, at::kFloat}) {
    const double tol = dtype == at::kDouble ? 1e-9 : 1e-5;
    auto near = [tol](const at::Tensor& a, const at::Tensor& b) {
      return a.sizes() == b.sizes() && at::allclose(a.to(at::kDouble), b.to(at::kDouble), tol, tol);
    };
    torch::manual_seed(3);  // on the test thread, before any rank thread exists
    torch::nn::Sequential proto(
        torch::nn::GroupNorm(torch::nn::GroupNormOptions(2, 4)), torch::nn::ReLU(),
        torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(4).momentum(0.3)));
    proto->to(dtype);
    // Non-trivial affine parameters, so their gradients are tested through the whole net.
    {
      torch::NoGradGuard no_grad;
      for (auto& p : proto->parameters())
        p.add_(at::rand(p.sizes(), test::generator(p.numel()), p.options()));
    }
    const auto x = test::randn({3, 4, 7, 6}, 31, dtype);
    const auto y = test::randn({3, 4, 7, 6}, 32, dtype);
    tessera::testing::run_ranks(4, [&](int) {
      auto mesh = init_device_mesh("cpu", {2, 2});
      auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(proto->clone());
      auto dist = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(proto->clone());
      distribute_module(*dist, mesh);  // parameters and buffers replicated
      const auto sizes = ShardSizes::Given({{}, {}, {5, 2}, {0, 6}});
      auto dx = distribute_tensor(x, mesh, {Shard(2), Shard(3)}, std::nullopt, sizes);
      auto dy = distribute_tensor(y, mesh, {Shard(2), Shard(3)}, std::nullopt, sizes);
      torch::optim::SGD opt_ref(ref->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD opt_dist(dist->parameters(), torch::optim::SGDOptions(0.1));
      const std::string what = dtype == at::kDouble ? "double" : "float";
      for (int step = 0; step < 2; ++step) {
        opt_ref.zero_grad();
        opt_dist.zero_grad();
        auto loss_ref = at::mse_loss(ref->forward(x), y);
        auto loss_dist = at::mse_loss(dist->forward(dx), dy);
        loss_ref.backward();
        loss_dist.backward();
        opt_ref.step();
        opt_dist.step();
        ASSERT_NEAR(loss_ref.item<double>(), loss_dist.item<double>(), tol)
            << what << " step " << step;
      }
      auto pa = ref->named_parameters(), pb = dist->named_parameters();
      for (const auto& item : pa) {
        auto got = *pb.find(item.key());
        ASSERT_TRUE(is_dtensor(got)) << item.key();
        EXPECT_TRUE(near(full_tensor(got).detach(), item.value().detach()))
            << what << " parameter " << item.key();
      }
      auto ba = ref->named_buffers(), bb = dist->named_buffers();
      ASSERT_EQ(ba.size(), 3u);
      for (const auto& item : ba) {
        auto got = *bb.find(item.key());
        ASSERT_TRUE(is_dtensor(got)) << item.key();
        EXPECT_TRUE(spec(got).is_replicated()) << item.key() << " " << spec(got).str();
        EXPECT_TRUE(near(full_tensor(got), item.value()))
            << what << " buffer " << item.key() << " max |diff| "
            << max_diff(full_tensor(got).to(at::kDouble), item.value().to(at::kDouble));
      }
      ref->eval();
      dist->eval();
      EXPECT_TRUE(near(full_tensor(dist->forward(dx)).detach(), ref->forward(x).detach()))
          << what << " evaluation forward";
    });
  }
}
