// Seeded randomized differential tests of the window ops on spatially sharded inputs
// (convolution, transposed convolution, pooling, interpolation, padding, normalisation):
// random sizes, kernels, strides, dilations, paddings, groups and uneven shard tables (empty
// shards and shards thinner than the halo included) on 1-D and 2-D meshes; forward and
// backward against the same code on full tensors in one process.
// Reproduce a failure with TESSERA_DOMAIN_SEED=<seed> and the printed case.
#include <cstdlib>
#include <functional>
#include <random>

#include "helpers.h"

using namespace tessera;

namespace {

using Shape = std::vector<int64_t>;
using Rng = std::mt19937;

int64_t pick(Rng& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
bool coin(Rng& rng, double p = 0.5) { return std::bernoulli_distribution(p)(rng); }

// One random case: the input's shape, the parameters' shapes (replicated), the op.
struct Case {
  std::string desc;
  Shape input;
  std::vector<Shape> params;
  std::function<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)> fn;
  std::vector<int64_t> window_dims;  // dims that may be sharded
  bool exact_grad = true;            // false: only the forward is compared
};

uint64_t base_seed() {
  const char* s = std::getenv("TESSERA_DOMAIN_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 4242;
}

bool close(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::allclose(a, b, 1e-9, 1e-10, /*equal_nan=*/true);
}

// Runs c.fn sharded (input shards from `placements`/`tables`, parameters replicated) and on
// the full tensors; compares outputs and every gradient.
void check(const DeviceMesh& mesh, const Case& c, const Placements& placements,
           const std::vector<ShardTable>& tables, uint64_t seed, const std::string& desc) {
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = test::randn(c.input, seed, at::kDouble).requires_grad_();
  std::vector<at::Tensor> ps, dps;
  for (size_t i = 0; i < c.params.size(); ++i) {
    ps.push_back(test::randn(c.params[i], seed + 1 + i, at::kDouble).requires_grad_());
    dps.push_back(distribute_tensor(ps.back().detach(), mesh,
                                    Placements(mesh.ndim(), Replicate()), std::nullopt)
                      .requires_grad_());
  }
  at::Tensor dx = test::make_dtensor_from_full(x.detach(), mesh, placements, tables).requires_grad_();
  at::Tensor expected = c.fn(x, ps);
  at::Tensor got = c.fn(dx, dps);
  ASSERT_TRUE(is_dtensor(got)) << desc;
  at::Tensor got_full = full_tensor(got);
  ASSERT_TRUE(close(got_full, expected.detach()))
      << desc << "\n  result " << spec(got).str() << "\n  max |diff| "
      << (got_full.sizes() == expected.sizes() ? (got_full - expected).abs().max().item<double>() : -1.0);
  if (!c.exact_grad || !expected.requires_grad()) return;
  at::Tensor g = test::randn(expected.sizes(), seed + 99, at::kDouble);
  expected.backward(g);
  got.backward(distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(),
                                 std::nullopt, ShardSizes::Given(spec(got).shard_tables())));
  ASSERT_TRUE(dx.grad().defined()) << desc << ": no input gradient";
  ASSERT_TRUE(close(full_tensor(dx.grad()), x.grad()))
      << desc << ": input gradient, max |diff| "
      << (full_tensor(dx.grad()) - x.grad()).abs().max().item<double>();
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(dps[i].grad().defined()) << desc << ": no gradient for parameter " << i;
    ASSERT_TRUE(close(full_tensor(dps[i].grad()), ps[i].grad()))
        << desc << ": gradient of parameter " << i << ", max |diff| "
        << (full_tensor(dps[i].grad()) - ps[i].grad()).abs().max().item<double>();
  }
  (void)opts;
}

// ---- case generators --------------------------------------------------------------------

Case conv_case(Rng& rng) {
  Case c;
  const int64_t nsp = pick(rng, 1, 3);
  const bool transposed = coin(rng, 0.25);
  const int64_t groups = coin(rng, 0.3) ? 2 : 1;
  const int64_t cin = groups * pick(rng, 1, 2), cout = groups * pick(rng, 1, 2);
  const int64_t batch = pick(rng, 1, 3);
  std::vector<int64_t> k, s, p, d, op, sizes;
  for (int64_t i = 0; i < nsp; ++i) {
    k.push_back(pick(rng, 1, nsp == 3 ? 3 : 7));
    s.push_back(pick(rng, 1, 3));
    d.push_back(pick(rng, 1, nsp == 3 ? 2 : 3));
    const int64_t reach = d.back() * (k.back() - 1);
    if (transposed) {
      p.push_back(pick(rng, 0, reach / 2));
      op.push_back(pick(rng, 0, std::max(s.back(), d.back()) - 1));
      sizes.push_back(pick(rng, 1, nsp == 3 ? 5 : 12));
    } else {
      p.push_back(pick(rng, 0, std::max<int64_t>(0, (reach + 1) / 2)));
      op.push_back(0);
      const int64_t min_in = std::max<int64_t>(1, reach + 1 - 2 * p.back());
      sizes.push_back(pick(rng, min_in, min_in + (nsp == 3 ? 5 : 12)));
    }
  }
  c.input = {batch, cin};
  c.input.insert(c.input.end(), sizes.begin(), sizes.end());
  Shape w = transposed ? Shape{cin, cout / groups} : Shape{cout, cin / groups};
  w.insert(w.end(), k.begin(), k.end());
  c.params = {w};
  const bool bias = coin(rng);
  if (bias) c.params.push_back({cout});
  for (int64_t i = 0; i < nsp; ++i) c.window_dims.push_back(2 + i);
  c.desc = std::string(transposed ? "conv_transpose" : "conv") + std::to_string(nsp) + "d in " +
           shape_str(c.input) + " w " + shape_str(w) + " stride " + shape_str(s) + " pad " +
           shape_str(p) + " dil " + shape_str(d) + " outpad " + shape_str(op) + " groups " +
           std::to_string(groups) + (bias ? " bias" : "");
  c.fn = [=](const at::Tensor& x, const std::vector<at::Tensor>& ps) {
    at::Tensor b = ps.size() > 1 ? ps[1] : at::Tensor();
    return at::convolution(x, ps[0], b, s, p, d, transposed, op, groups);
  };
  // Outputs must exist.
  for (int64_t i = 0; i < nsp; ++i) {
    const int64_t out = transposed ? (sizes[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1
                                   : (sizes[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) / s[i] + 1;
    if (out <= 0) return conv_case(rng);
  }
  return c;
}

// ---- driver -----------------------------------------------------------------------------

using Generator = Case (*)(Rng&);

void run_cases(const std::vector<int64_t>& mesh_shape, Generator gen, int cases, uint64_t seed) {
  int world = 1;
  for (auto s : mesh_shape) world *= static_cast<int>(s);
  tessera::testing::run_ranks(world, [&](int) {
    auto mesh = init_device_mesh("cpu", mesh_shape);
    Rng rng(static_cast<unsigned>(seed));
    for (int i = 0; i < cases && !::testing::Test::HasFatalFailure(); ++i) {
      Case c = gen(rng);
      // Each mesh dim shards a random window dim (or the batch, or nothing); two mesh dims
      // may cut two different spatial dims (H x W decompositions).
      Placements p;
      std::vector<bool> used(c.input.size(), false);
      for (int64_t m = 0; m < mesh.ndim(); ++m) {
        const int64_t choice = pick(rng, 0, 9);
        int64_t dim = -1;
        if (choice < 7) dim = c.window_dims[pick(rng, 0, c.window_dims.size() - 1)];
        else if (choice < 8) dim = 0;
        if (dim >= 0 && !used[dim]) {
          used[dim] = true;
          p.push_back(Shard(dim));
        } else {
          p.push_back(Replicate());
        }
      }
      auto tables = coin(rng, 0.8) ? test::random_tables(rng, mesh, p, c.input)
                                   : std::vector<ShardTable>{};
      std::string desc = "seed " + std::to_string(seed) + " case " + std::to_string(i) + " mesh " +
                         shape_str(mesh_shape) + ": " + c.desc + " placements " + to_string(p);
      for (size_t t = 0; t < tables.size(); ++t)
        if (!tables[t].empty()) desc += " t" + std::to_string(t) + "=" + shape_str(tables[t]);
      try {
        check(mesh, c, p, tables, seed + static_cast<uint64_t>(i) * 13, desc);
      } catch (const std::exception& e) {
        throw std::runtime_error(desc + ": " + e.what());
      }
    }
  });
}

std::string mesh_name(const std::vector<int64_t>& shape) {
  std::string s = "mesh";
  for (auto d : shape) s += std::to_string(d) + "x";
  s.pop_back();
  return s;
}

const auto kMeshes = ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                       std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                       std::vector<int64_t>{2, 2}, std::vector<int64_t>{1, 3});

uint64_t seed_for(const std::vector<int64_t>& mesh, uint64_t salt) {
  uint64_t seed = base_seed() * 31 + salt;
  for (auto s : mesh) seed = seed * 10 + static_cast<uint64_t>(s);
  return seed;
}

}  // namespace

class DomainConv : public ::testing::TestWithParam<std::vector<int64_t>> {};
TEST_P(DomainConv, RandomConvolutionsMatchOneDevice) {
  run_cases(GetParam(), conv_case, 150, seed_for(GetParam(), 1));
}
INSTANTIATE_TEST_SUITE_P(Meshes, DomainConv, kMeshes,
                         [](const auto& info) { return mesh_name(info.param); });
