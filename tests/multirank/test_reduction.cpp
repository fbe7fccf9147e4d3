// Reductions (sum/mean/nansum, amax/amin/max/min, prod, max.dim/min.dim/argmax/argmin,
// var/std(_mean), norms) on distributed tensors against the same code on one device, forward
// and backward, on even, uneven and zero-size shard tables; plus a seeded random sweep.
//
// Some backward formulas run ops owned by other rule families; Reduction.BackwardPrerequisites
// checks those directly, so a regression there fails it by name (and the backward checks that
// use them fail too).
#include <atomic>
#include <cmath>
#include <functional>
#include <sstream>

#include <ATen/core/dispatch/Dispatcher.h>

#include "helpers.h"
#include "tessera/tensor/rule.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::Fn;
using tessera::test::full_matches;
using tessera::test::make_dtensor_from_full;
using tessera::test::on_meshes;
using tessera::test::Operand;
using tessera::test::Rng;
using tessera::test::same_values;

namespace {

const double kInf = std::numeric_limits<double>::infinity();

bool has_rule(const char* name) {
  auto op = c10::Dispatcher::singleton().findOp({name, ""});
  return op && tessera::ops::find_rule(*op) != nullptr;
}

// One reduction call. `dims` empty means every dim; `none` passes dim=None where allowed.
struct Red {
  std::string op;
  std::vector<int64_t> dims = {};
  int64_t dim = 0;  // single-dim ops
  bool keepdim = false;
  double p = 2;
  int64_t correction = 1;
  bool none = false;
  std::string str() const {
    std::ostringstream s;
    s << op << " dims " << shape_str(dims) << (none ? " (None)" : "") << " dim " << dim
      << " keepdim " << keepdim << " p " << p << " correction " << correction;
    return s.str();
  }
};

Fn make_fn(const Red& r) {
  return [r](const std::vector<at::Tensor>& v) -> at::Tensor {
    const at::Tensor& x = v[0];
    const at::IntArrayRef d(r.dims);
    const at::OptionalIntArrayRef od = r.none ? at::OptionalIntArrayRef() : d;
    const auto& op = r.op;
    if (op == "sum") return x.sum(d, r.keepdim);
    if (op == "mean") return x.mean(d, r.keepdim);
    if (op == "nansum") return at::nansum(x, d, r.keepdim);
    if (op == "amax") return x.amax(d, r.keepdim);
    if (op == "amin") return x.amin(d, r.keepdim);
    if (op == "max()") return x.max();
    if (op == "min()") return x.min();
    if (op == "prod") return x.prod(r.dim, r.keepdim);
    if (op == "prod()") return x.prod();
    if (op == "max.dim" || op == "min.dim" || op == "max.indices" || op == "min.indices") {
      auto t = op[1] == 'a' ? x.max(r.dim, r.keepdim) : x.min(r.dim, r.keepdim);
      return op.find("indices") == std::string::npos ? std::get<0>(t) : std::get<1>(t);
    }
    if (op == "argmax") return r.none ? x.argmax() : x.argmax(r.dim, r.keepdim);
    if (op == "argmin") return r.none ? x.argmin() : x.argmin(r.dim, r.keepdim);
    if (op == "var") return at::var(x, od, r.correction, r.keepdim);
    if (op == "std") return at::std(x, od, r.correction, r.keepdim);
    if (op == "var_mean" || op == "std_mean") {
      auto t = op == "var_mean" ? at::var_mean(x, od, r.correction, r.keepdim)
                                : at::std_mean(x, od, r.correction, r.keepdim);
      return std::get<0>(t) - std::get<1>(t) * 0.5;
    }
    if (op == "norm") return at::norm(x, r.p, d, r.keepdim);
    if (op == "norm()") return x.norm(r.p);
    if (op == "norm(double)") return at::norm(x, r.p, at::kDouble);
    TORCH_CHECK(op == "linalg_vector_norm", "unknown op ", op);
    return at::linalg_vector_norm(x, r.p, od, r.keepdim);
  };
}

bool starts(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Whether the backward of `r` is checked: not for integer results (indices).
bool backward_checked(const Red& r) {
  return r.op.find("indices") == std::string::npos && !starts(r.op, "arg");
}

void check(const DeviceMesh& mesh, const Operand& o, const Red& r, const std::string& what,
           uint64_t seed = 7) {
  const Fn fn = make_fn(r);
  if (backward_checked(r)) return differential(mesh, {o}, fn, what, seed);
  auto full = tessera::test::randn(o.shape, seed);
  auto dist = make_dtensor_from_full(full, mesh, o.placements, o.tables);
  auto expected = fn({full});
  auto got = fn({dist});
  ASSERT_TRUE(is_dtensor(got)) << what;
  ASSERT_TRUE(full_matches(got, expected)) << what << " (forward)";
}

// Shard table of n elements in `parts` pieces: 0 torch.chunk, 1 uneven (ones, then the
// rest), 2 everything on the second piece and the others empty.
ShardTable table_of(int variant, int64_t n, int64_t parts) {
  if (variant == 0 || parts == 1) return chunk_sizes(n, parts);
  ShardTable t(parts, 0);
  for (int64_t i = 0; variant == 1 && i + 1 < parts && i < n; ++i) t[i] = 1;
  t[variant == 1 ? parts - 1 : 1] = variant == 1 ? n - std::min(n, parts - 1) : n;
  return t;
}

struct OperandLayout {
  std::string name;
  Placements p;
  std::vector<int> variant;  // table variant per tensor dim
};

std::vector<OperandLayout> layouts(const DeviceMesh& mesh) {
  const auto R = Replicate();
  const auto Max = Partial(PartialOp::Max), Min = Partial(PartialOp::Min);
  std::vector<OperandLayout> out;
  if (mesh.ndim() == 1) {
    out = {{"R", {R}, {}},
           {"S0 chunk", {Shard(0)}, {0, 0}},
           {"S0 uneven", {Shard(0)}, {1, 0}},
           {"S0 empty", {Shard(0)}, {2, 0}},
           {"S1 uneven", {Shard(1)}, {0, 1}},
           {"S1 empty", {Shard(1)}, {0, 2}},
           {"P(sum)", {Partial()}, {}},
           {"P(max)", {Max}, {}},
           {"P(min)", {Min}, {}}};
  } else {
    out = {{"S0,S1 uneven", {Shard(0), Shard(1)}, {1, 1}},
           {"S0,S0 empty", {Shard(0), Shard(0)}, {2, 0}},
           {"S1,S0 chunk", {Shard(1), Shard(0)}, {0, 0}},
           {"R,S1 empty", {R, Shard(1)}, {0, 2}},
           {"S1,P(sum)", {Shard(1), Partial()}, {0, 1}},
           {"P(max),S0", {Max, Shard(0)}, {1, 0}},
           {"P(min),R", {Min, R}, {}}};
  }
  for (auto& l : out) l.name = " on " + l.name + " mesh" + shape_str(mesh.shape());
  return out;
}

Operand operand(const DeviceMesh& mesh, const OperandLayout& l, std::vector<int64_t> shape) {
  std::vector<ShardTable> tables(shape.size());
  for (size_t t = 0; t < shape.size(); ++t) {
    int64_t parts = 1;
    bool sharded = false;
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      if (l.p[m].is_shard(static_cast<int64_t>(t))) parts *= mesh.size(m), sharded = true;
    if (sharded) tables[t] = table_of(t < l.variant.size() ? l.variant[t] : 0, shape[t], parts);
  }
  return {shape, l.p, tables};
}

}  // namespace

// What the backward formulas need from other rule families, on two ranks.
TEST(Reduction, BackwardPrerequisites) {
  EXPECT_TRUE(has_rule("aten::isnan")) << "the backward of max()/min(), nansum, inf-norms";
  EXPECT_TRUE(has_rule("aten::nonzero")) << "the backward of prod() over every dim";
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    // R / P(sum) is exact: amax over a sharded dim, prod of a Partial.
    auto a = distribute_tensor(at::full({}, 3.0), mesh, {Replicate()});
    auto b = make_dtensor_from_full(at::full({1, 1}, 2.0), mesh, {Partial()});
    EXPECT_TRUE(same_values(full_tensor(a / b), at::full({1, 1}, 1.5))) << "R / P(sum)";
    // P(max) * negative R is exact: var/std/norm/prod of P(max) and P(min).
    auto v = at::tensor({1.0f, -2.0f, 3.0f});
    auto m = make_dtensor_from_full(v, mesh, {Partial(PartialOp::Max)});
    auto r = distribute_tensor(at::full({3}, -2.0f), mesh, {Replicate()});
    EXPECT_TRUE(same_values(full_tensor(m * r), v * -2)) << "P(max) * negative R";
  });
}

// Every op on every layout of [5, 4]: even, uneven and empty shards, Partial inputs.
TEST(Reduction, EveryOpEveryLayout) {
  const std::vector<Red> reds = {{"sum", {0, 1}},
                                 {"nansum"},
                                 {"nansum", {-1}, 0, true},
                                 {"mean", {0}},
                                 {"prod()"},
                                 {"prod", {}, 0},
                                 {"prod", {}, -1, true},
                                 {"amax", {0}},
                                 {"amax", {1}, 0, true},
                                 {"amax", {}},
                                 {"amin", {0, -1}},
                                 {"amin", {-1}, 0, true},
                                 {"max()"},
                                 {"min()"},
                                 {"max.dim", {}, 0},
                                 {"min.dim", {}, -1, true},
                                 {"max.indices", {}, 1},
                                 {"min.indices", {}, 0, true},
                                 {"argmax", {}, 0},
                                 {"argmin", {}, -1, true},
                                 {"argmax", {}, 0, false, 2, 1, true},
                                 {"var", {}, 0, false, 2, 1, true},
                                 {"var", {0}},
                                 {"var", {0, 1}, 0, true, 2, 0},
                                 {"var", {-1}, 0, false, 2, 2},
                                 {"std", {1}, 0, true},
                                 {"std", {}, 0, false, 2, 1, true},
                                 {"var_mean", {0}},
                                 {"std_mean", {1}, 0, true},
                                 {"norm()"},
                                 {"norm()", {}, 0, false, 1},
                                 {"norm", {0}, 0, false, 3},
                                 {"norm", {1}, 0, true},
                                 {"norm", {0}, 0, false, kInf},
                                 {"norm(double)"},
                                 {"linalg_vector_norm", {}, 0, false, 2, 1, true},
                                 {"linalg_vector_norm", {-1}, 0, false, 1.5},
                                 {"linalg_vector_norm", {0, 1}, 0, false, kInf}};
  on_meshes([&](const DeviceMesh& mesh) {
    for (const auto& l : layouts(mesh))
      for (const auto& r : reds) check(mesh, operand(mesh, l, {5, 4}), r, r.str() + l.name);
  });
}

// Three dims, dim lists in any order, keepdim both ways.
TEST(Reduction, ThreeDimsAndDimLists) {
  const std::vector<Red> reds = {
      {"amax", {2, 0}},   {"amin", {1}, 0, true},   {"var", {0, 2}, 0, true},
      {"std", {-1, -2}},  {"norm", {0, 2}},         {"prod", {}, 1},
      {"max.dim", {}, 2}, {"argmin", {}, 1, true},  {"mean", {0, 2}, 0, true},
      {"nansum", {1, 2}}, {"sum", {2, 1}, 0, true}, {"linalg_vector_norm", {2, 0}, 0, true, 3}};
  on_meshes([&](const DeviceMesh& mesh) {
    std::vector<OperandLayout> ls = {{"S2 uneven", Placements(mesh.ndim(), Replicate()), {0, 0, 1}},
                                     {"S1 empty", Placements(mesh.ndim(), Replicate()), {0, 2, 0}}};
    ls[0].p[0] = Shard(2);
    ls[1].p[mesh.ndim() - 1] = Shard(1);
    if (mesh.ndim() == 2) ls.push_back({"S0,S2", {Shard(0), Shard(2)}, {1, 0, 2}});
    for (auto& l : ls) l.name = " on " + l.name + " mesh" + shape_str(mesh.shape());
    for (const auto& l : ls)
      for (const auto& r : reds) check(mesh, operand(mesh, l, {3, 4, 5}), r, r.str() + l.name);
  });
}

// Where the rule puts things: decomposable reductions leave Partial without communicating;
// whole-dim reductions move the shard to a kept dim (all-to-all), or replicate if none.
TEST(Reduction, LayoutsAndCommunication) {
  tessera::testing::run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto full = tessera::test::randn({6, 4}, 3);
    auto x = distribute_tensor(full, mesh, {Shard(0)});
    {
      CommDebugMode comm;
      auto m = x.amax(0);
      auto n = x.amin(0);
      EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
      EXPECT_EQ(placements(m), (Placements{Partial(PartialOp::Max)}));
      EXPECT_EQ(placements(n), (Placements{Partial(PartialOp::Min)}));
      EXPECT_EQ(placements(x.amax(1)), (Placements{Shard(0)}));
    }
    for (auto fn : std::vector<std::function<at::Tensor(const at::Tensor&)>>{
             [](const at::Tensor& t) { return t.var(0); },
             [](const at::Tensor& t) { return at::norm(t, 2, {0}); },
             [](const at::Tensor& t) { return t.prod(0); },
             [](const at::Tensor& t) { return std::get<0>(t.max(0)); },
             [](const at::Tensor& t) { return t.argmin(0); }}) {
      CommDebugMode comm;
      auto y = fn(x);
      EXPECT_EQ(comm.get_total_counts(), 1) << comm.table();
      EXPECT_EQ(comm.get_comm_counts()["all_to_all"], 1) << comm.table();
      EXPECT_EQ(placements(y), (Placements{Shard(0)}));
      EXPECT_TRUE(full_matches(y, fn(full)));
    }
    {
      CommDebugMode comm;
      auto y = x.var();  // every dim reduced: nowhere to move the shard
      EXPECT_EQ(comm.get_comm_counts()["all_gather"], 1) << comm.table();
      EXPECT_EQ(placements(y), (Placements{Replicate()}));
    }
    // Partial(sum) input to a whole-dim reduction: one reduce-scatter onto the kept dim.
    auto p = make_dtensor_from_full(full, mesh, {Partial()});
    auto v = p.var(1);
    EXPECT_EQ(placements(v), (Placements{Shard(0)}));
    EXPECT_TRUE(full_matches(v, full.var(1)));
  });
}

// value_selecting_reduction_backward also serves sort/topk/kthvalue (several or one index
// per slice); those ops have no sharding rule yet, so replicated inputs only.
TEST(Reduction, ValueSelectingBackwardOfSortTopk) {
  on_meshes([](const DeviceMesh& mesh) {
    const Operand x{{4, 6}, Placements(mesh.ndim(), Replicate())};
    differential(
        mesh, {x}, [](auto& v) { return std::get<0>(v[0].topk(2, 1)); }, "topk");
    differential(
        mesh, {x}, [](auto& v) { return std::get<0>(v[0].sort(0)); }, "sort");
    differential(
        mesh, {x}, [](auto& v) { return std::get<0>(v[0].kthvalue(2, 1)); }, "kthvalue");
  });
}

// out= variants of sum, mean and nansum write the result into a distributed `out`.
TEST(Reduction, OutVariants) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(1);
    auto full = tessera::test::randn({5, 7}, 11);
    auto x = make_dtensor_from_full(full, mesh, p, {{}, table_of(2, 7, mesh.size(0))});
    const Placements r(mesh.ndim(), Replicate());
    auto a = distribute_tensor(at::zeros({0}), mesh, r), b = a.clone(), c = a.clone();
    at::sum_out(a, x, {0});
    EXPECT_TRUE(full_matches(a, full.sum(0))) << spec(a).str();
    at::mean_out(b, x, {1}, true);
    EXPECT_TRUE(full_matches(b, full.mean(1, true))) << spec(b).str();
    at::nansum_out(c, x, {0});
    EXPECT_TRUE(full_matches(c, at::nansum(full, {0}))) << spec(c).str();
  });
}

// Integer dtypes (the identity of an empty shard is the dtype's extreme), 0-dim tensors and
// globally empty tensors.
TEST(Reduction, IntegersScalarsAndEmptyTensors) {
  const std::vector<Red> ints = {
      {"sum", {0}},      {"amax", {0}},   {"amin"},           {"max()"},
      {"min()"},         {"prod", {}, 1}, {"max.dim", {}, 0}, {"min.indices", {}, 0, true},
      {"argmax", {}, -1}};
  on_meshes([&](const DeviceMesh& mesh) {
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    const std::vector<ShardTable> empty_first = {table_of(2, 5, mesh.size(0))};
    for (auto dtype : {at::kLong, at::kInt}) {
      auto full = tessera::test::randn({5, 4}, 5, dtype);
      auto x = make_dtensor_from_full(full, mesh, p, empty_first);
      for (const auto& r : ints) {
        auto got = make_fn(r)({x});
        EXPECT_TRUE(full_matches(got, make_fn(r)({full}))) << r.str() << " " << dtype;
      }
    }
    // 0-dim: only Replicate or Partial.
    auto s = tessera::test::randn({}, 9);
    for (auto pl : {Partial(), Partial(PartialOp::Max), Replicate()}) {
      auto x = make_dtensor_from_full(s, mesh, Placements(mesh.ndim(), pl));
      for (const auto& r : std::vector<Red>{{"amax"}, {"amin"}, {"sum"}, {"prod()"}, {"norm()"}})
        EXPECT_TRUE(full_matches(make_fn(r)({x}), make_fn(r)({s}))) << r.str();
    }
    // Globally empty: reductions over the non-empty dim, and sums over the empty one.
    Placements q(mesh.ndim(), Replicate());
    q[mesh.ndim() - 1] = Shard(1);
    auto e = at::zeros({0, 4});
    auto x = make_dtensor_from_full(e, mesh, q);
    for (const auto& r : std::vector<Red>{{"sum", {0}},
                                          {"mean", {1}},
                                          {"amax", {1}},
                                          {"var", {1}},
                                          {"norm", {1}},
                                          {"prod", {}, 0},
                                          {"max.dim", {}, 1}})
      EXPECT_TRUE(full_matches(make_fn(r)({x}), make_fn(r)({e}))) << r.str();
  });
}

namespace {

// One random case: op, shape (1-3 dims of 1-6), placements, uneven tables, dims and keepdim.
void random_case(const DeviceMesh& mesh, Rng& rng, const std::string& label) {
  static const char* kOps[] = {"sum",      "mean",     "nansum",  "amax",
                               "amin",     "max()",    "min()",   "prod",
                               "prod()",   "max.dim",  "min.dim", "max.indices",
                               "argmax",   "argmin",   "var",     "std",
                               "var_mean", "std_mean", "norm",    "linalg_vector_norm"};
  auto pick = [&](int64_t n) { return rng.uniform(0, n - 1); };
  Red r{kOps[pick(sizeof(kOps) / sizeof(kOps[0]))]};
  const int64_t nd = 1 + pick(3);
  std::vector<int64_t> shape(nd);
  for (auto& s : shape) s = 1 + pick(6);
  // Partial(avg) test terms do not add up exactly on 3 ranks, and the backward of
  // amax/max/inf-norms compares values bitwise: avg only for the linear-ish families.
  const bool avg = r.op == "sum" || r.op == "mean" || starts(r.op, "var") || starts(r.op, "std");
  Placements p;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const int64_t k = pick(6);
    if (k < 3)
      p.push_back(Shard(pick(nd)));
    else if (k == 3)
      p.push_back(Replicate());
    else if (k == 4)
      p.push_back(Partial(avg && pick(2) ? PartialOp::Avg : PartialOp::Sum));
    else
      p.push_back(Partial(pick(2) ? PartialOp::Max : PartialOp::Min));
  }
  auto tables = tessera::test::random_tables(rng, mesh, p, shape);
  for (int64_t t = 0; t < nd; ++t)
    if (pick(2)) r.dims.push_back(pick(2) ? t : t - nd);
  rng.shuffle(r.dims);
  r.none = r.dims.empty() && pick(2) &&
           (starts(r.op, "var") || starts(r.op, "std") || starts(r.op, "linalg"));
  r.dim = pick(2) ? pick(nd) : pick(nd) - nd;
  r.keepdim = pick(2);
  const double ps[] = {1, 2, 3, kInf, 0.5};
  r.p = ps[pick(5)];
  int64_t count = 1;  // elements per reduced slice: no NaN variances
  for (int64_t t = 0; t < nd; ++t)
    if (r.dims.empty() || std::count(r.dims.begin(), r.dims.end(), t) ||
        std::count(r.dims.begin(), r.dims.end(), t - nd))
      count *= shape[t];
  r.correction = count > 1 ? 1 : 0;
  std::ostringstream what;
  what << label << " mesh" << shape_str(mesh.shape()) << ": " << r.str() << " shape "
       << shape_str(shape) << " " << to_string(p) << " tables {";
  for (auto& t : tables) what << shape_str(t);
  what << "}";
  try {
    check(mesh, {shape, p, tables}, r, what.str(), rng.bits());
  } catch (const std::exception& e) {
    throw std::runtime_error(what.str() + ": " + e.what());
  }
}

}  // namespace

// Seeded random sweep, 90 cases on each standard mesh (cases 0-89 on one rank, 90-179 on
// two, ...). A failure prints the command that replays its case.
TEST(Reduction, RandomizedAgainstOneDevice) {
  tessera::test::Sweep sweep;
  int64_t expected = 0;
  std::atomic<int64_t> ran{0};  // cases run by the first rank of each mesh
  for (const auto& shape : tessera::test::standard_meshes()) {
    const auto cases = sweep.cases(90);
    if (!cases.any()) continue;
    expected += cases.selected();
    tessera::test::on_mesh(shape, [&](const DeviceMesh& mesh) {
      cases.run([&](Rng& rng, int64_t c) {
        random_case(mesh, rng, sweep.label(c));
        if (mesh.coordinate() == std::vector<int64_t>(mesh.ndim(), 0)) ++ran;
      });
    });
  }
  EXPECT_EQ(ran.load(), expected);
}
