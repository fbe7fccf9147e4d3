// Seeded randomized differential test over the op families: a random op, random operand
// shapes, meshes, placements (Partial included) and uneven shard tables; forward and
// backward against the same code on full tensors in one process.
// Reproduce a failure with TESSERA_OP_SEED=<seed> and the printed case index.
#include <cstdlib>
#include <functional>

#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::Operand;

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
      {"add_mul", [](const Shape& s) { return std::vector<Shape>{s, s}; },
       [](auto& v) { return v[0] + v[1] * v[0]; }},
      {"div_safe", [](const Shape& s) { return std::vector<Shape>{s, s}; },
       [](auto& v) { return v[0] / (v[1].abs() + 1); }},
      {"where_max", [](const Shape& s) { return std::vector<Shape>{s, s}; },
       [](auto& v) { return at::where(v[0] > v[1], v[0], at::maximum(v[0], v[1]) * 2); }},
      {"broadcast_bias", [](const Shape& s) { return std::vector<Shape>{s, last_dim(s)}; },
       [](auto& v) { return v[0] - v[1]; }},
      {"sum_all", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return (v[0] * v[0]).sum(); }},
      {"mean_all", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].mean() * 5; }},
      {"sum_dim0", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].sum(0); }},
      {"mean_last_keep", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].mean(-1, true); }},
      {"mm", [](const Shape& s) { return std::vector<Shape>{mat(s), {s[1], s[0]}}; },
       [](auto& v) { return at::mm(v[0], v[1]); }},
      {"addmm", [](const Shape& s) { return std::vector<Shape>{{s[0]}, mat(s), {s[1], s[0]}}; },
       [](auto& v) { return at::addmm(v[0], v[1], v[2]); }},
      {"linear", [](const Shape& s) { return std::vector<Shape>{s, {3, s.back()}, {3}}; },
       [](auto& v) { return at::linear(v[0], v[1], v[2]); }},
      {"bmm", [](const Shape& s) { return std::vector<Shape>{{2, s[0], s[1]}, {2, s[1], 3}}; },
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
      {"mse_mean", [](const Shape& s) { return std::vector<Shape>{s, s}; },
       [](auto& v) { return at::mse_loss(v[0], v[1]); }},
      {"smooth_l1_sum", [](const Shape& s) { return std::vector<Shape>{s, s}; },
       [](auto& v) { return at::smooth_l1_loss(v[0], v[1], 2, 0.3); }},
      {"to_double", [](const Shape& s) { return std::vector<Shape>{s}; },
       [](auto& v) { return v[0].to(at::kDouble).square(); }},
  };
  return table;
}

Placement random_placement(std::mt19937& rng, int64_t ndim) {
  switch (std::uniform_int_distribution<int>(0, 4)(rng)) {
    case 0:
    case 1: return Shard(std::uniform_int_distribution<int64_t>(0, ndim - 1)(rng));
    case 2:
    case 3: return Replicate();
    default: return Partial();
  }
}

uint64_t base_seed() {
  const char* s = std::getenv("TESSERA_OP_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 777;
}

void run_cases(const std::vector<int64_t>& mesh_shape, int cases, uint64_t seed) {
  int world = 1;
  for (auto s : mesh_shape) world *= static_cast<int>(s);
  tessera::testing::run_ranks(world, [&](int) {
    auto mesh = init_device_mesh("cpu", mesh_shape);
    std::mt19937 rng(static_cast<unsigned>(seed));
    const auto& table = op_table();
    for (int c = 0; c < cases && !::testing::Test::HasFatalFailure(); ++c) {
      const auto& op = table[std::uniform_int_distribution<size_t>(0, table.size() - 1)(rng)];
      Shape base;
      const int64_t nd = std::uniform_int_distribution<int64_t>(2, 3)(rng);
      for (int64_t d = 0; d < nd; ++d) base.push_back(std::uniform_int_distribution<int64_t>(1, 6)(rng));
      std::vector<Operand> operands;
      std::string desc = "seed " + std::to_string(seed) + " case " + std::to_string(c) + " op " +
                         op.name + " mesh " + shape_str(mesh_shape);
      for (const auto& shape : op.shapes(base)) {
        Placements p;
        for (int64_t m = 0; m < mesh.ndim(); ++m)
          p.push_back(random_placement(rng, static_cast<int64_t>(shape.size())));
        auto tables = std::uniform_int_distribution<int>(0, 2)(rng) == 0
                          ? std::vector<ShardTable>{}
                          : tessera::test::random_tables(rng, mesh, p, shape);
        desc += " | " + shape_str(shape) + " " + to_string(p);
        for (size_t t = 0; t < tables.size(); ++t)
          if (!tables[t].empty()) desc += " t" + std::to_string(t) + "=" + shape_str(tables[t]);
        operands.push_back({shape, p, tables});
      }
      try {
        differential(mesh, operands, op.fn, desc, seed + static_cast<uint64_t>(c));
      } catch (const std::exception& e) {
        throw std::runtime_error(desc + ": " + e.what());  // name the case
      }
    }
  });
}

}  // namespace

// 7 meshes x 300 cases = 2,100 random cases per run.
class OpProperty : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(OpProperty, RandomOpsMatchOneDevice) {
  uint64_t seed = base_seed();
  for (auto s : GetParam()) seed = seed * 10 + static_cast<uint64_t>(s);
  run_cases(GetParam(), 300, seed);
}

INSTANTIATE_TEST_SUITE_P(Meshes, OpProperty,
                         ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                           std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                           std::vector<int64_t>{2, 2},
                                           std::vector<int64_t>{2, 3},
                                           std::vector<int64_t>{1, 2}),
                         [](const auto& info) {
                           std::string s = "mesh";
                           for (auto d : info.param) s += std::to_string(d) + "x";
                           s.pop_back();
                           return s;
                         });
