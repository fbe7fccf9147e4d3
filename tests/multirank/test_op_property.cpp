// Seeded randomized differential test over the op families: a random op, random operand
// shapes, meshes, placements (Partial included) and uneven shard tables; forward and
// backward against the same code on full tensors in one process.
// A failure prints the command that replays its case (support/property.h).
#include <functional>

#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::Operand;
using tessera::test::Rng;

namespace {

using Shape = std::vector<int64_t>;
using Fn = tessera::test::Fn;

struct OpCase {
  const char* name;
  // Operand shapes from a random base shape (2-3 dims, sizes 1..6).
  std::function<std::vector<Shape>(const Shape&)> shapes;
  Fn fn;
};

Shape last_dim(const Shape& s) { return {s.back()}; }
Shape mat(const Shape& s) { return {s[0], s[1]}; }

const std::vector<OpCase>& op_table() {
  static const std::vector<OpCase> table = {
      {"exp_tanh", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].tanh() + v[0].exp() * 0.1; }},
      {"sigmoid_relu", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].sigmoid() * v[0].relu(); }},
      {"scalar_affine", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0] * 3 - 1; }},
      {"add_mul",
       [](const Shape& s) {
         return std::vector<Shape>{s, s};
       },
       [](auto& v) { return v[0] + v[1] * v[0]; }},
      {"div_safe",
       [](const Shape& s) {
         return std::vector<Shape>{s, s};
       },
       [](auto& v) { return v[0] / (v[1].abs() + 1); }},
      {"where_max",
       [](const Shape& s) {
         return std::vector<Shape>{s, s};
       },
       [](auto& v) { return at::where(v[0] > v[1], v[0], at::maximum(v[0], v[1]) * 2); }},
      {"broadcast_bias",
       [](const Shape& s) {
         return std::vector<Shape>{s, last_dim(s)};
       },
       [](auto& v) { return v[0] - v[1]; }},
      {"sum_all", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return (v[0] * v[0]).sum(); }},
      {"mean_all", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].mean() * 5; }},
      {"sum_dim0", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].sum(0); }},
      {"mean_last_keep", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].mean(-1, true); }},
      {"mm",
       [](const Shape& s) {
         return std::vector<Shape>{mat(s), {s[1], s[0]}};
       },
       [](auto& v) { return at::mm(v[0], v[1]); }},
      {"addmm",
       [](const Shape& s) {
         return std::vector<Shape>{{s[0]}, mat(s), {s[1], s[0]}};
       },
       [](auto& v) { return at::addmm(v[0], v[1], v[2]); }},
      {"linear",
       [](const Shape& s) {
         return std::vector<Shape>{s, {3, s.back()}, {3}};
       },
       [](auto& v) { return at::linear(v[0], v[1], v[2]); }},
      {"bmm",
       [](const Shape& s) {
         return std::vector<Shape>{{2, s[0], s[1]}, {2, s[1], 3}};
       },
       [](auto& v) { return at::bmm(v[0], v[1]); }},
      {"transpose", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].transpose(0, 1) * 2; }},
      {"flatten", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].flatten() + 1; }},
      {"unsqueeze_expand", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) {
         auto sz = v[0].sizes().vec();
         sz.insert(sz.begin(), 2);
         return v[0].unsqueeze(0).expand(sz) * 1.5;
       }},
      {"softmax_last", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return at::softmax(v[0], -1); }},
      {"log_softmax_0", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return at::log_softmax(v[0], 0); }},
      {"layer_norm", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return at::layer_norm(v[0], {v[0].size(-1)}); }},
      {"mse_mean",
       [](const Shape& s) {
         return std::vector<Shape>{s, s};
       },
       [](auto& v) { return at::mse_loss(v[0], v[1]); }},
      {"smooth_l1_sum",
       [](const Shape& s) {
         return std::vector<Shape>{s, s};
       },
       [](auto& v) { return at::smooth_l1_loss(v[0], v[1], 2, 0.3); }},
      {"to_double", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].to(at::kDouble).square(); }},
  };
  return table;
}

Placement random_placement(Rng& rng, int64_t ndim) {
  switch (rng.uniform(0, 4)) {
    case 0:
    case 1: return Shard(rng.uniform(0, ndim - 1));
    case 2:
    case 3: return Replicate();
    default: return Partial();
  }
}

// One random case: an op from the table, a base shape, each operand's layout and tables.
void run_case(const DeviceMesh& mesh, Rng& rng, const std::string& label) {
  const auto& table = op_table();
  const auto& op = rng.pick(table);
  Shape base;
  const int64_t nd = rng.uniform(2, 3);
  for (int64_t d = 0; d < nd; ++d) base.push_back(rng.uniform(1, 6));
  std::vector<Operand> operands;
  std::string desc = label + " op " + op.name + " mesh " + shape_str(mesh.shape());
  for (const auto& shape : op.shapes(base)) {
    Placements p;
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      p.push_back(random_placement(rng, static_cast<int64_t>(shape.size())));
    auto tables = rng.uniform(0, 2) == 0 ? std::vector<ShardTable>{}
                                         : tessera::test::random_tables(rng, mesh, p, shape);
    desc += " | " + shape_str(shape) + " " + to_string(p);
    for (size_t t = 0; t < tables.size(); ++t)
      if (!tables[t].empty()) desc += " t" + std::to_string(t) + "=" + shape_str(tables[t]);
    operands.push_back({shape, p, tables});
  }
  try {
    differential(mesh, operands, op.fn, desc, rng.bits());
  } catch (const std::exception& e) {
    throw std::runtime_error(desc + ": " + e.what());  // name the case
  }
}

}  // namespace

// 7 meshes x 300 cases = 2,100 random cases per run.
class OpProperty : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(OpProperty, RandomOpsMatchOneDevice) {
  tessera::test::Sweep sweep;
  const auto cases = sweep.cases(300);
  if (!cases.any()) return;
  tessera::test::on_mesh(GetParam(), [&](const DeviceMesh& mesh) {
    cases.run([&](Rng& rng, int64_t c) { run_case(mesh, rng, sweep.label(c)); });
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, OpProperty,
                         ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                           std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                           std::vector<int64_t>{2, 2}, std::vector<int64_t>{2, 3},
                                           std::vector<int64_t>{1, 2}),
                         [](const auto& info) { return tessera::test::mesh_name(info.param); });
