// Seeded randomized differential tests of the window ops on spatially sharded inputs
// (convolution, transposed convolution, pooling, interpolation, padding, normalisation):
// random sizes, kernels, strides, dilations, paddings, groups and uneven shard tables (empty
// shards and shards thinner than the halo included) on 1-D and 2-D meshes; forward and
// backward against the same code on full tensors in one process.
// A failure prints the command that replays its case (support/property.h).
#include <functional>

#include "helpers.h"

using namespace tessera;

namespace {

using Shape = std::vector<int64_t>;
using test::Rng;

// One random case: the input's shape, the parameters' shapes (replicated), the op.
struct Case {
  std::string desc;
  Shape input;
  std::vector<Shape> params;
  std::function<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)> fn;
  std::vector<int64_t> window_dims;  // dims that may be sharded
  bool exact_grad = true;            // false: only the forward is compared
};

const test::Tolerance kTol{1e-9, 1e-10, /*equal_nan=*/true};

// Runs c.fn sharded (input shards from `placements`/`tables`, parameters replicated) and on
// the full tensors; compares outputs and every gradient.
void check(const DeviceMesh& mesh, const Case& c, const Placements& placements,
           const std::vector<ShardTable>& tables, uint64_t seed, const std::string& desc) {
  at::Tensor x = test::randn(c.input, seed, at::kDouble).requires_grad_();
  std::vector<at::Tensor> ps, dps;
  for (size_t i = 0; i < c.params.size(); ++i) {
    ps.push_back(test::randn(c.params[i], seed + 1 + i, at::kDouble).requires_grad_());
    dps.push_back(distribute_tensor(ps.back().detach(), mesh, Placements(mesh.ndim(), Replicate()),
                                    std::nullopt)
                      .requires_grad_());
  }
  at::Tensor dx =
      test::make_dtensor_from_full(x.detach(), mesh, placements, tables).requires_grad_();
  at::Tensor expected = c.fn(x, ps);
  at::Tensor got = c.fn(dx, dps);
  ASSERT_TRUE(is_dtensor(got)) << desc;
  ASSERT_TRUE(test::full_matches(got, expected, kTol)) << desc;
  if (!c.exact_grad || !expected.requires_grad()) return;
  at::Tensor g = test::randn(expected.sizes(), seed + 99, at::kDouble);
  expected.backward(g);
  got.backward(distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(),
                                 std::nullopt, ShardSizes::Given(spec(got).shard_tables())));
  ASSERT_TRUE(dx.grad().defined()) << desc << ": no input gradient";
  ASSERT_TRUE(test::full_matches(dx.grad(), x.grad(), kTol)) << desc << ": input gradient";
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(dps[i].grad().defined()) << desc << ": no gradient for parameter " << i;
    ASSERT_TRUE(test::full_matches(dps[i].grad(), ps[i].grad(), kTol))
        << desc << ": gradient of parameter " << i;
  }
}

// ---- case generators --------------------------------------------------------------------

Case conv_case(Rng& rng) {
  Case c;
  const int64_t nsp = rng.uniform(1, 3);
  const bool transposed = rng.coin(0.25);
  const int64_t groups = rng.coin(0.3) ? 2 : 1;
  const int64_t cin = groups * rng.uniform(1, 2), cout = groups * rng.uniform(1, 2);
  const int64_t batch = rng.uniform(1, 3);
  std::vector<int64_t> k, s, p, d, op, sizes;
  for (int64_t i = 0; i < nsp; ++i) {
    k.push_back(rng.uniform(1, nsp == 3 ? 3 : 7));
    s.push_back(rng.uniform(1, 3));
    d.push_back(rng.uniform(1, nsp == 3 ? 2 : 3));
    const int64_t reach = d.back() * (k.back() - 1);
    if (transposed) {
      p.push_back(rng.uniform(0, reach / 2));
      op.push_back(rng.uniform(0, std::max(s.back(), d.back()) - 1));
      sizes.push_back(rng.uniform(1, nsp == 3 ? 5 : 12));
    } else {
      p.push_back(rng.uniform(0, std::max<int64_t>(0, (reach + 1) / 2)));
      op.push_back(0);
      const int64_t min_in = std::max<int64_t>(1, reach + 1 - 2 * p.back());
      sizes.push_back(rng.uniform(min_in, min_in + (nsp == 3 ? 5 : 12)));
    }
  }
  c.input = {batch, cin};
  c.input.insert(c.input.end(), sizes.begin(), sizes.end());
  Shape w = transposed ? Shape{cin, cout / groups} : Shape{cout, cin / groups};
  w.insert(w.end(), k.begin(), k.end());
  c.params = {w};
  const bool bias = rng.coin();
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
    const int64_t out = transposed
                            ? (sizes[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1
                            : (sizes[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) / s[i] + 1;
    if (out <= 0) return conv_case(rng);
  }
  return c;
}

// A batched input [N, C, spatial...] with nsp spatial dims of the given sizes.
Shape batched(Rng& rng, const std::vector<int64_t>& spatial) {
  Shape s = {rng.uniform(1, 2), rng.uniform(1, 3)};
  s.insert(s.end(), spatial.begin(), spatial.end());
  return s;
}
std::vector<int64_t> trailing_dims(const Shape& s, int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = static_cast<int64_t>(s.size()) - n; i < static_cast<int64_t>(s.size()); ++i)
    d.push_back(i);
  return d;
}

Case pool_case(Rng& rng) {
  Case c;
  const int64_t nsp = rng.uniform(1, 3);
  const bool max = rng.coin();
  const bool ceil = rng.coin(0.3), include_pad = rng.coin();
  std::vector<int64_t> k, s, p, d, sizes;
  for (int64_t i = 0; i < nsp; ++i) {
    k.push_back(rng.uniform(1, nsp == 3 ? 3 : 4));
    s.push_back(rng.uniform(1, 3));
    p.push_back(rng.uniform(0, k.back() / 2));
    d.push_back(max ? rng.uniform(1, 2) : 1);
    // (3-D pooling also wants the unpadded input to cover the kernel; max pooling too, or
    // a window may hold padding only, for which ATen returns an index outside the input.)
    const int64_t span = d.back() * (k.back() - 1) + 1;
    const int64_t min_in = std::max<int64_t>(1, nsp == 3 || max ? span : span - 2 * p.back());
    sizes.push_back(rng.uniform(min_in, min_in + (nsp == 3 ? 5 : 11)));
  }
  const int64_t divisor = (!max && nsp > 1 && rng.coin(0.2)) ? rng.uniform(1, 5) : 0;
  const bool indices = max && nsp > 1 && rng.coin(0.2);
  c.input = batched(rng, sizes);
  c.window_dims = trailing_dims(c.input, nsp);
  c.desc = std::string(indices ? "max_pool_indices"
                       : max   ? "max_pool"
                               : "avg_pool") +
           std::to_string(nsp) + "d in " + shape_str(c.input) + " kernel " + shape_str(k) +
           " stride " + shape_str(s) + " pad " + shape_str(p) + " dil " + shape_str(d) +
           (ceil ? " ceil" : "") +
           (max           ? ""
            : include_pad ? " count_pad"
                          : " exclude_pad") +
           (divisor ? " divisor " + std::to_string(divisor) : "");
  c.exact_grad = !indices;
  c.fn = [=](const at::Tensor& x, const std::vector<at::Tensor>&) -> at::Tensor {
    c10::optional<int64_t> div = divisor ? c10::optional<int64_t>(divisor) : c10::nullopt;
    if (indices) {
      auto r = nsp == 2 ? at::max_pool2d_with_indices(x, k, s, p, d, ceil)
                        : at::max_pool3d_with_indices(x, k, s, p, d, ceil);
      return std::get<1>(r).to(at::kDouble);
    }
    switch (nsp) {
      case 1:
        return max ? at::max_pool1d(x, k, s, p, d, ceil)
                   : at::avg_pool1d(x, k, s, p, ceil, include_pad);
      case 2:
        return max ? at::max_pool2d(x, k, s, p, d, ceil)
                   : at::avg_pool2d(x, k, s, p, ceil, include_pad, div);
      default:
        return max ? at::max_pool3d(x, k, s, p, d, ceil)
                   : at::avg_pool3d(x, k, s, p, ceil, include_pad, div);
    }
  };
  // ATen rejects a last window that starts in the right padding; resample such shapes.
  for (int64_t i = 0; i < nsp; ++i) {
    const int64_t num = sizes[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1 + (ceil ? s[i] - 1 : 0);
    if (num < 0) return pool_case(rng);
  }
  return c;
}

Case adaptive_case(Rng& rng) {
  Case c;
  const int64_t nsp = rng.uniform(2, 3);
  std::vector<int64_t> out, sizes;
  for (int64_t i = 0; i < nsp; ++i) {
    out.push_back(rng.uniform(1, 3));
    // Mostly divisible sizes (the window path), sometimes not (spatial dims replicated).
    sizes.push_back(rng.coin(0.8) ? out.back() * rng.uniform(1, 4) : rng.uniform(1, 9));
  }
  c.input = batched(rng, sizes);
  c.window_dims = trailing_dims(c.input, nsp);
  c.desc = "adaptive_avg_pool" + std::to_string(nsp) + "d in " + shape_str(c.input) + " out " +
           shape_str(out);
  c.fn = [=](const at::Tensor& x, const std::vector<at::Tensor>&) {
    return nsp == 2 ? at::adaptive_avg_pool2d(x, out) : at::adaptive_avg_pool3d(x, out);
  };
  return c;
}

Case upsample_case(Rng& rng) {
  Case c;
  const int64_t nsp = rng.uniform(1, 3);
  const bool linear = rng.coin(), align = rng.coin();
  const bool by_scale = rng.coin(), vec = rng.coin();
  static const double kScales[] = {0.5, 1.0, 1.5, 2.0, 2.5, 3.0};
  std::vector<int64_t> sizes, out;
  std::vector<double> scales;
  for (int64_t i = 0; i < nsp; ++i) {
    sizes.push_back(rng.uniform(1, nsp == 3 ? 5 : 9));
    const double sc = kScales[rng.uniform(0, 5)];
    scales.push_back(sc);
    out.push_back(by_scale
                      ? std::max<int64_t>(1, static_cast<int64_t>(std::floor(sizes.back() * sc)))
                      : rng.uniform(1, 2 * sizes.back() + 2));
  }
  if (by_scale)
    for (int64_t i = 0; i < nsp; ++i)
      if (static_cast<int64_t>(std::floor(sizes[i] * scales[i])) < 1) return upsample_case(rng);
  c.input = batched(rng, sizes);
  c.window_dims = trailing_dims(c.input, nsp);
  c.desc = std::string(linear ? (align ? "linear_align" : "linear") : "nearest") +
           std::to_string(nsp) + "d in " + shape_str(c.input) + " out " + shape_str(out) +
           (by_scale ? " by scale" : "") + (vec ? " (vec)" : "");
  c.fn = [=](const at::Tensor& x, const std::vector<at::Tensor>&) -> at::Tensor {
    auto sc = [&](int64_t i) { return by_scale ? c10::optional<double>(scales[i]) : c10::nullopt; };
    if (vec) {
      c10::optional<at::ArrayRef<double>> sf;
      c10::optional<at::IntArrayRef> os;
      if (by_scale)
        sf = at::ArrayRef<double>(scales);
      else
        os = at::IntArrayRef(out);
      switch (nsp) {
        case 1:
          return linear ? at::upsample_linear1d(x, os, align, sf)
                        : at::upsample_nearest1d(x, os, sf);
        case 2:
          return linear ? at::upsample_bilinear2d(x, os, align, sf)
                        : at::upsample_nearest2d(x, os, sf);
        default:
          return linear ? at::upsample_trilinear3d(x, os, align, sf)
                        : at::upsample_nearest3d(x, os, sf);
      }
    }
    switch (nsp) {
      case 1:
        return linear ? at::upsample_linear1d(x, out, align, sc(0))
                      : at::upsample_nearest1d(x, out, sc(0));
      case 2:
        return linear ? at::upsample_bilinear2d(x, out, align, sc(0), sc(1))
                      : at::upsample_nearest2d(x, out, sc(0), sc(1));
      default:
        return linear ? at::upsample_trilinear3d(x, out, align, sc(0), sc(1), sc(2))
                      : at::upsample_nearest3d(x, out, sc(0), sc(1), sc(2));
    }
  };
  return c;
}

Case pad_case(Rng& rng) {
  Case c;
  const int64_t nsp = rng.uniform(1, 3);
  const int mode = static_cast<int>(rng.uniform(0, 3));  // constant, reflect, replicate, circular
  static const char* kModes[] = {"constant", "reflect", "replicate", "circular"};
  std::vector<int64_t> sizes, pad;
  for (int64_t i = 0; i < nsp; ++i) sizes.push_back(rng.uniform(1, nsp == 3 ? 5 : 9));
  for (int64_t i = nsp; i-- > 0;) {  // pairs from the last dim backwards
    for (int side = 0; side < 2; ++side) {
      const int64_t n = sizes[i];
      switch (mode) {
        case 0:
          pad.push_back(rng.uniform(-std::min<int64_t>((n - 1) / 2, 2), 3));
          break;  // keeps >= 1 row
        case 1: pad.push_back(rng.uniform(0, std::min<int64_t>(n - 1, 3))); break;
        case 2: pad.push_back(rng.uniform(0, 3)); break;
        default: pad.push_back(rng.uniform(0, std::min<int64_t>(n, 3))); break;
      }
    }
  }
  const double value = static_cast<double>(rng.uniform(-2, 2));
  c.input = batched(rng, sizes);
  c.window_dims = trailing_dims(c.input, nsp);
  c.desc =
      std::string("pad_") + kModes[mode] + " in " + shape_str(c.input) + " pad " + shape_str(pad);
  c.fn = [=](const at::Tensor& x, const std::vector<at::Tensor>&) -> at::Tensor {
    switch (mode) {
      case 0: return at::constant_pad_nd(x, pad, value);
      case 1:
        return nsp == 1   ? at::reflection_pad1d(x, pad)
               : nsp == 2 ? at::reflection_pad2d(x, pad)
                          : at::reflection_pad3d(x, pad);
      case 2:
        return nsp == 1   ? at::replication_pad1d(x, pad)
               : nsp == 2 ? at::replication_pad2d(x, pad)
                          : at::replication_pad3d(x, pad);
      default: return at::_pad_circular(x, pad);
    }
  };
  return c;
}

// ---- driver -----------------------------------------------------------------------------

using Generator = Case (*)(Rng&);

// One random case of `gen` on `mesh`. Each mesh dim shards a random window dim (or the
// batch, or nothing); two mesh dims may cut two different spatial dims (H x W).
void run_case(const DeviceMesh& mesh, Generator gen, Rng& rng, const std::string& label) {
  Case c = gen(rng);
  Placements p;
  std::vector<bool> used(c.input.size(), false);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const int64_t choice = rng.uniform(0, 9);
    int64_t dim = -1;
    if (choice < 7)
      dim = rng.pick(c.window_dims);
    else if (choice < 8)
      dim = 0;
    if (dim >= 0 && !used[dim]) {
      used[dim] = true;
      p.push_back(Shard(dim));
    } else {
      p.push_back(Replicate());
    }
  }
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

// The next `count` cases of this test, drawn by `gen`, on a mesh of this shape.
void run_cases(const std::vector<int64_t>& mesh_shape, test::Sweep& sweep, Generator gen,
               int64_t count) {
  const auto cases = sweep.cases(count);
  if (!cases.any()) return;
  test::on_mesh(mesh_shape, [&](const DeviceMesh& mesh) {
    cases.run([&](Rng& rng, int64_t c) { run_case(mesh, gen, rng, sweep.label(c)); });
  });
}

const auto kMeshes = ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                       std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                       std::vector<int64_t>{2, 2}, std::vector<int64_t>{1, 3});

std::string mesh_param(const ::testing::TestParamInfo<std::vector<int64_t>>& info) {
  return test::mesh_name(info.param);
}

}  // namespace

class DomainConv : public ::testing::TestWithParam<std::vector<int64_t>> {};
TEST_P(DomainConv, RandomConvolutionsMatchOneDevice) {
  test::Sweep sweep;
  run_cases(GetParam(), sweep, conv_case, 300);
}
INSTANTIATE_TEST_SUITE_P(Meshes, DomainConv, kMeshes, mesh_param);

class DomainPool : public ::testing::TestWithParam<std::vector<int64_t>> {};
TEST_P(DomainPool, RandomPoolingMatchesOneDevice) {
  test::Sweep sweep;
  run_cases(GetParam(), sweep, pool_case, 150);     // cases 0-149
  run_cases(GetParam(), sweep, adaptive_case, 30);  // cases 150-179
}
INSTANTIATE_TEST_SUITE_P(Meshes, DomainPool, kMeshes, mesh_param);

class DomainUpsample : public ::testing::TestWithParam<std::vector<int64_t>> {};
TEST_P(DomainUpsample, RandomInterpolationMatchesOneDevice) {
  test::Sweep sweep;
  run_cases(GetParam(), sweep, upsample_case, 100);
}
INSTANTIATE_TEST_SUITE_P(Meshes, DomainUpsample, kMeshes, mesh_param);

class DomainPad : public ::testing::TestWithParam<std::vector<int64_t>> {};
TEST_P(DomainPad, RandomPaddingMatchesOneDevice) {
  test::Sweep sweep;
  run_cases(GetParam(), sweep, pad_case, 100);
}
INSTANTIATE_TEST_SUITE_P(Meshes, DomainPad, kMeshes, mesh_param);
