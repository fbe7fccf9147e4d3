// The window axis maps of the domain-parallel rules (src/ops/window/window_internal.h, a private
// header) against ATen on one device: which input rows an output range depends on (autograd of the
// real op), the interpolation source rows and weights (the op on an index ramp), and the
// per-member output/input tables against brute-force assignment.
#include "ops/window/window_internal.h"
#include "helpers.h"

using namespace tessera;
using tessera::comm::Window;
using tessera::ops::spatial::Axis;
using tessera::test::Rng;

namespace {

std::string str(const Window& w) {
  return "[" + std::to_string(w.lo) + ", " + std::to_string(w.hi) + ")";
}

// Input rows whose gradient exceeds `threshold` when outputs [lo, hi) of f(x) are summed:
// the rows that range depends on.
std::vector<int64_t> depends_on(const std::function<at::Tensor(const at::Tensor&)>& f, int64_t in,
                                int64_t lo, int64_t hi, double threshold = 0) {
  at::Tensor x = at::ones({1, 1, in}, at::kDouble).requires_grad_();
  f(x).narrow(-1, lo, hi - lo).sum().backward();
  at::Tensor rows = x.grad().reshape(-1).abs().gt(threshold).nonzero().reshape(-1);
  return {rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + rows.numel()};
}

bool inside(const std::vector<int64_t>& rows, const Window& w) {
  for (auto r : rows)
    if (r < w.lo || r >= w.hi) return false;
  return true;
}

// A random stencil axis (convolution / pooling rows) whose output is not empty.
Axis random_stencil(Rng& rng) {
  for (;;) {
    const int64_t k = rng.uniform(1, 5), s = rng.uniform(1, 3), d = rng.uniform(1, 3);
    const int64_t p = rng.uniform(0, 4), in = rng.uniform(1, 16);
    const int64_t out = (in + 2 * p - d * (k - 1) - 1) / s + 1;
    if (in + 2 * p - d * (k - 1) - 1 >= 0 && out >= 1) return Axis::stencil(in, out, k, s, p, d);
  }
}

Axis random_transposed(Rng& rng, int64_t* output_padding) {
  for (;;) {
    const int64_t k = rng.uniform(1, 5), s = rng.uniform(1, 3), d = rng.uniform(1, 3);
    const int64_t p = rng.uniform(0, d * (k - 1) / 2 + 1), in = rng.uniform(1, 12);
    const int64_t op = rng.uniform(0, std::max(s, d) - 1);
    const int64_t out = (in - 1) * s - 2 * p + d * (k - 1) + op + 1;
    if (p <= d * (k - 1) && out >= 1) {  // ATen: padding no larger than the kernel's reach
      *output_padding = op;
      return Axis::transposed(in, out, k, s, p, d);
    }
  }
}

std::function<at::Tensor(const at::Tensor&)> conv(const Axis& a) {
  return [a](const at::Tensor& x) {
    return at::conv1d(x, at::ones({1, 1, a.kernel}, at::kDouble), {}, a.stride, a.pad, a.dilation);
  };
}

// Interpolation axis and ATen's op for it (scale: ATen's scale factor, 0 when sizes given).
struct Interp {
  Axis axis;
  std::function<at::Tensor(const at::Tensor&)> op;
};

Interp random_interp(Rng& rng) {
  static const std::vector<double> kScales = {0.5, 1.0, 1.5, 2.0, 2.5, 3.0};
  for (;;) {
    const int64_t in = rng.uniform(1, 12);
    const bool linear = rng.coin(), align = rng.coin(), by_scale = rng.coin();
    const double scale = by_scale ? rng.pick(kScales) : 0.0;
    const int64_t out =
        by_scale ? static_cast<int64_t>(std::floor(in * scale)) : rng.uniform(1, 2 * in + 2);
    if (out < 1) continue;
    const c10::optional<double> sc = by_scale ? c10::optional<double>(scale) : c10::nullopt;
    Interp r;
    r.axis = linear ? Axis::linear(in, out, align, scale) : Axis::nearest(in, out, scale);
    const std::vector<int64_t> size = {out};
    r.op = [=](const at::Tensor& x) {
      return linear ? at::upsample_linear1d(x, size, align, sc)
                    : at::upsample_nearest1d(x, size, sc);
    };
    return r;
  }
}

std::pair<int64_t, int64_t> random_range(Rng& rng, int64_t out) {
  const int64_t lo = rng.uniform(0, out - 1);
  return {lo, rng.uniform(lo + 1, out)};
}

}  // namespace

// Output o of a stencil reads rows o*stride - pad + dilation*j (j < kernel): reads() is their
// hull (padding rows included), and the rows inside the input are exactly those conv1d's
// outputs depend on.
TEST(WindowAxes, StencilReadsAreTheWindowsHull) {
  tessera::test::Sweep sweep;
  sweep.cases(400).run([](Rng& rng, int64_t) {
    const Axis a = random_stencil(rng);
    auto [lo, hi] = random_range(rng, a.out);
    ASSERT_EQ(conv(a)(at::ones({1, 1, a.in}, at::kDouble)).size(-1), a.out) << a.str();
    int64_t first = INT64_MAX, last = INT64_MIN;
    std::vector<int64_t> rows;
    for (int64_t o = lo; o < hi; ++o)
      for (int64_t j = 0; j < a.kernel; ++j) {
        const int64_t r = o * a.stride - a.pad + a.dilation * j;
        first = std::min(first, r), last = std::max(last, r);
        if (r >= 0 && r < a.in) rows.push_back(r);
      }
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    const Window w = a.reads(lo, hi);
    EXPECT_EQ(w.lo, first) << a.str() << " outputs [" << lo << ", " << hi << ")";
    EXPECT_EQ(w.hi, last + 1) << a.str() << " outputs [" << lo << ", " << hi << ")";
    EXPECT_EQ(depends_on(conv(a), a.in, lo, hi), rows)
        << a.str() << " outputs [" << lo << ", " << hi << ")";
    // The owner of output o holds the centre of its window.
    for (int64_t o = lo; o < hi; ++o) {
      const Window one = a.reads(o, o + 1);
      EXPECT_TRUE(a.source_row(o) >= one.lo && a.source_row(o) < one.hi)
          << a.str() << " output " << o;
    }
  });
}

// Transposed convolution: reads() covers every input row the outputs depend on, stays in the
// input, and is exactly their hull when the kernel is not dilated.
TEST(WindowAxes, TransposedReadsCoverTheDependencies) {
  tessera::test::Sweep sweep;
  sweep.cases(400).run([](Rng& rng, int64_t) {
    int64_t op = 0;
    const Axis a = random_transposed(rng, &op);
    auto f = [a, op](const at::Tensor& x) {
      return at::conv_transpose1d(x, at::ones({1, 1, a.kernel}, at::kDouble), {}, a.stride, a.pad,
                                  op, 1, a.dilation);
    };
    ASSERT_EQ(f(at::ones({1, 1, a.in}, at::kDouble)).size(-1), a.out) << a.str();
    auto [lo, hi] = random_range(rng, a.out);
    const auto rows = depends_on(f, a.in, lo, hi);
    const Window w = a.reads(lo, hi);
    const std::string what = a.str() + " output_padding " + std::to_string(op) + " outputs [" +
                             std::to_string(lo) + ", " + std::to_string(hi) + ") reads " + str(w);
    EXPECT_TRUE(inside(rows, w)) << what;
    EXPECT_TRUE(w.size() == 0 || (w.lo >= 0 && w.hi <= a.in)) << what;
    if (a.dilation == 1) {
      const Window hull = rows.empty() ? Window{0, 0} : Window{rows.front(), rows.back() + 1};
      EXPECT_EQ(w.lo, hull.lo) << what;
      EXPECT_EQ(w.hi, hull.hi) << what;
    }
  });
}

// Interpolation: taps() are ATen's source rows and weights (the op applied to a ramp of row
// indices reproduces them), and reads() covers the taps of the range and what autograd sees.
TEST(WindowAxes, InterpolationTapsAreAtens) {
  tessera::test::Sweep sweep;
  sweep.cases(400).run([](Rng& rng, int64_t) {
    const Interp it = random_interp(rng);
    const Axis& a = it.axis;
    const at::Tensor ramp = at::arange(a.in, at::kDouble).reshape({1, 1, a.in});
    const at::Tensor y = it.op(ramp).reshape(-1);
    ASSERT_EQ(y.numel(), a.out) << a.str();
    for (int64_t o = 0; o < a.out; ++o) {
      const auto t = a.taps(o);
      EXPECT_NEAR(t.i0 * t.w0 + t.i1 * t.w1, y[o].item<double>(), 1e-9)
          << a.str() << " output " << o;
      EXPECT_NEAR(t.w0 + t.w1, 1.0, 1e-12) << a.str() << " output " << o;
    }
    auto [lo, hi] = random_range(rng, a.out);
    const Window w = a.reads(lo, hi);
    for (int64_t o = lo; o < hi; ++o) {
      const auto t = a.taps(o);
      EXPECT_TRUE(t.i0 >= w.lo && t.i0 < w.hi && t.i1 >= w.lo && t.i1 < w.hi)
          << a.str() << " output " << o << " reads " << str(w);
    }
    // ATen's kernel fuses scale * (o + 0.5) - 0.5 into one multiply-add, so where a source
    // coordinate is an exact row it may give the row before a weight of ~1e-16: ignore those.
    EXPECT_TRUE(inside(depends_on(it.op, a.in, lo, hi, 1e-12), w))
        << a.str() << " reads " << str(w);
  });
}

namespace {

// Per-member tables: output o belongs to the member holding its (clamped) source row; an
// output table maps back to an input table with exactly those outputs; each member's read
// window is reads() of its outputs. Kinds: 0 stencil, 1 transposed, 2 interpolation. The
// input table must be found for interpolation (the upsample backward relies on it), and for
// the other kinds when `stencils_invert`.
void check_member_tables(Rng& rng, int64_t first_kind, int64_t last_kind, bool stencils_invert) {
  int64_t op = 0;
  const int64_t kind = rng.uniform(first_kind, last_kind);
  const Axis a = kind == 0   ? random_stencil(rng)
                 : kind == 1 ? random_transposed(rng, &op)
                             : random_interp(rng).axis;
  const int64_t members = rng.uniform(1, 5);
  const auto in_sizes = tessera::test::random_table(rng, a.in, members);
  const std::string what = a.str() + " input table " + shape_str(in_sizes);

  std::vector<int64_t> expected(members, 0);
  for (int64_t o = 0; o < a.out; ++o) {
    const int64_t r = std::clamp<int64_t>(a.source_row(o), 0, a.in - 1);
    int64_t m = 0, end = in_sizes[0];
    while (r >= end) end += in_sizes[++m];
    ++expected[m];
  }
  const auto out_sizes = tessera::ops::spatial::output_sizes(a, in_sizes);
  ASSERT_EQ(out_sizes, expected) << what;

  const auto back = tessera::ops::spatial::input_sizes_for(a, out_sizes);
  if (kind == 2 || stencils_invert || !back.empty()) {
    ASSERT_EQ(back.size(), in_sizes.size())
        << what << ": no input table for " << shape_str(out_sizes);
    EXPECT_EQ(tessera::ops::spatial::output_sizes(a, back), out_sizes)
        << what << " back " << shape_str(back);
  }

  const auto windows = tessera::ops::spatial::read_windows(a, out_sizes);
  int64_t offset = 0;
  for (int64_t m = 0; m < members; ++m) {
    const Window w = a.reads(offset, offset + out_sizes[m]);
    EXPECT_TRUE(windows[m].lo == w.lo && windows[m].hi == w.hi) << what << " member " << m;
    offset += out_sizes[m];
  }
}

}  // namespace

TEST(WindowAxes, MemberTablesFollowSourceRows) {
  tessera::test::Sweep sweep;
  sweep.cases(600).run([](Rng& rng, int64_t) { check_member_tables(rng, 0, 2, false); });
}

// Every output table of a stencil or transposed axis has an input table giving it back,
// also where the last outputs' source rows lie past the input (stencil(in 9, out 5, kernel
// 1, stride 3, pad 3) with outputs [2, 2, 1] needs inputs [3, 4, 2]).
TEST(WindowAxes, StencilOutputTablesHaveInputTables) {
  tessera::test::Sweep sweep;
  sweep.cases(500).run([](Rng& rng, int64_t) { check_member_tables(rng, 0, 1, true); });
}
