// Neighbourhood attention on plain tensors: the window rule (the reference note's worked
// examples and a brute force), the K/V reads of query ranges (the note's halo tables), the
// tap tables, and the op (forward, lse and every gradient) against an independent dense
// masked-attention oracle, plus finite differences, errors and the module.
#include <cmath>
#include <limits>
#include <set>

#include <torch/csrc/autograd/autograd.h>

#include "ops/window/na_local.h"
#include "helpers.h"
#include "tessera/nn/neighborhood_attention.h"

using namespace tessera;
using tessera::comm::Window;
using tessera::nn::detail::NAAxis;
using tessera::test::Rng;
namespace F = tessera::nn::functional;

namespace {

NAAxis axis(int64_t L, int64_t k, int64_t s = 1, int64_t d = 1, bool causal = false,
            bool circular = false) {
  NAAxis a;
  a.length = L;
  a.kernel = k;
  a.stride = s;
  a.dilation = d;
  a.causal = causal;
  a.circular = circular;
  return a;
}

std::string str(const NAAxis& a) {
  return "L=" + std::to_string(a.length) + " k=" + std::to_string(a.kernel) +
         " s=" + std::to_string(a.stride) + " d=" + std::to_string(a.dilation) +
         (a.causal ? " causal" : "") + (a.circular ? " circular" : "");
}

std::vector<int64_t> range(int64_t lo, int64_t hi) {
  std::vector<int64_t> r;
  for (int64_t i = lo; i <= hi; ++i) r.push_back(i);
  return r;
}

// The window rule written out from the reference note (§1.2), independently of the library:
// per dilation group, leader, clamp; circular keeps the leader's centred window unwrapped.
std::vector<int64_t> ref_window(const NAAxis& a, int64_t i) {
  const int64_t L = a.length, k = a.kernel, s = a.stride, d = a.dilation;
  const int64_t g = i % d, x = i / d, n = (L - g + d - 1) / d;
  const int64_t left = k / 2;
  std::vector<int64_t> r;
  if (a.causal) {
    const int64_t lead = std::min((x / s) * s + s - 1, n - 1);
    for (int64_t t = std::max<int64_t>(lead - (k - 1), 0); t < x + 1; ++t) r.push_back(g + d * t);
    return r;
  }
  const int64_t lead = std::min((x / s) * s + s / 2, n - 1);
  int64_t lo = lead - left;
  if (!a.circular) lo = std::min(std::max<int64_t>(lo, 0), n - k);
  for (int64_t t = lo; t < lo + k; ++t) r.push_back(g + d * t);
  return r;
}

int64_t wrap(int64_t r, int64_t L) { return ((r % L) + L) % L; }

// ---- the window rule ------------------------------------------------------------------------

TEST(NeighborhoodAttentionWindow, WorkedExamples) {
  using nn::detail::window_rows;
  const auto a = axis(10, 4);
  for (int64_t i : {0, 1, 2}) EXPECT_EQ(window_rows(a, i), range(0, 3)) << i;
  EXPECT_EQ(window_rows(a, 5), range(3, 6));
  EXPECT_EQ(window_rows(a, 9), range(6, 9));

  const auto b = axis(13, 3, 1, 3);
  EXPECT_EQ(window_rows(b, 9), (std::vector<int64_t>{6, 9, 12}));
  EXPECT_EQ(window_rows(b, 10), (std::vector<int64_t>{4, 7, 10}));
  EXPECT_EQ(window_rows(b, 12), (std::vector<int64_t>{6, 9, 12}));

  const auto c = axis(10, 3, 1, 2, /*causal=*/true);
  EXPECT_EQ(window_rows(c, 0), (std::vector<int64_t>{0}));
  EXPECT_EQ(window_rows(c, 7), (std::vector<int64_t>{3, 5, 7}));

  const auto s = axis(10, 5, 2);
  for (int64_t i : {2, 3}) EXPECT_EQ(window_rows(s, i), range(1, 5)) << i;
  for (int64_t i : {4, 5}) EXPECT_EQ(window_rows(s, i), range(3, 7)) << i;
  for (int64_t i : {6, 7, 8, 9}) EXPECT_EQ(window_rows(s, i), range(5, 9)) << i;

  // Circular: centred on the query, unwrapped, never shifted.
  const auto w = axis(10, 4, 1, 1, false, true);
  EXPECT_EQ(window_rows(w, 0), range(-2, 1));
  EXPECT_EQ(window_rows(w, 9), range(7, 10));
  const auto wd = axis(9, 3, 1, 2, false, true);
  EXPECT_EQ(window_rows(wd, 8), (std::vector<int64_t>{6, 8, 10}));  // 10 is row 1
}

// The halo tables of the reference note (§3): (left, right) = (a - lo, hi - e) per shard.
TEST(NeighborhoodAttentionWindow, HaloTables) {
  struct Row {
    NAAxis a;
    std::vector<int64_t> shards;
    std::vector<std::pair<int64_t, int64_t>> halos;
  };
  const std::vector<Row> rows = {
      {axis(32, 5), {8, 8, 8, 8}, {{0, 2}, {2, 2}, {2, 2}, {2, 0}}},
      {axis(32, 5), {14, 14, 3, 1}, {{0, 2}, {2, 2}, {2, 1}, {4, 0}}},
      {axis(32, 5), {2, 14, 14, 2}, {{0, 3}, {2, 2}, {2, 2}, {3, 0}}},
      {axis(32, 5), {1, 1, 1, 1, 28}, {{0, 4}, {1, 3}, {2, 2}, {2, 2}, {2, 0}}},
      {axis(32, 4), {8, 8, 8, 8}, {{0, 1}, {2, 1}, {2, 1}, {2, 0}}},
      {axis(33, 5, 1, 3), {10, 1, 17, 5}, {{0, 6}, {6, 6}, {6, 5}, {10, 0}}},
      {axis(32, 5, 1, 2, true), {3, 20, 1, 8}, {{0, 0}, {3, 0}, {8, 0}, {8, 0}}},
      {axis(32, 5, 2), {7, 9, 11, 5}, {{0, 3}, {2, 2}, {1, 3}, {2, 0}}},
      {axis(32, 5, 5), {8, 8, 8, 8}, {{0, 2}, {3, 4}, {1, 1}, {4, 0}}},
      {axis(64, 7), {24, 40}, {{0, 3}, {3, 0}}},
  };
  for (const auto& r : rows) {
    int64_t a = 0;
    for (size_t m = 0; m < r.shards.size(); ++m) {
      const int64_t e = a + r.shards[m];
      const Window w = nn::detail::reads(r.a, a, e);
      EXPECT_EQ(std::make_pair(a - w.lo, w.hi - e), r.halos[m]) << str(r.a) << " shard " << m;
      a = e;
    }
  }
  EXPECT_EQ(nn::detail::reads(axis(32, 5), 7, 7).size(), 0);
}

// window_rows against the rule written out above, and reads (and tap tables built on a
// range's reads) against the union of the range's windows, for every L <= 20.
TEST(NeighborhoodAttentionWindow, BruteForce) {
  int64_t configs = 0;
  for (int64_t L = 2; L <= 20; ++L)
    for (int64_t k = 2; k <= L; ++k)
      for (int64_t d = 1; k * d <= L; ++d)
        for (int64_t s = 1; s <= k; ++s)
          for (int mode = 0; mode < 3; ++mode) {
            const auto a = axis(L, k, s, d, mode == 1, mode == 2);
            ++configs;
            std::vector<std::vector<int64_t>> win(L);
            for (int64_t i = 0; i < L; ++i) {
              win[i] = ref_window(a, i);
              ASSERT_EQ(nn::detail::window_rows(a, i), win[i]) << str(a) << " query " << i;
              std::set<int64_t> keys;
              for (auto r : win[i]) keys.insert(wrap(r, L));
              ASSERT_EQ(keys.size(), win[i].size()) << str(a) << " query " << i;
              ASSERT_TRUE(std::find(win[i].begin(), win[i].end(), i) != win[i].end() ||
                          a.stride > 1)
                  << str(a) << " query " << i;
            }
            for (int64_t lo = 0; lo < L; ++lo) {
              int64_t mn = std::numeric_limits<int64_t>::max(),
                      mx = std::numeric_limits<int64_t>::min();
              for (int64_t hi = lo + 1; hi <= L; ++hi) {
                mn = std::min(mn, *std::min_element(win[hi - 1].begin(), win[hi - 1].end()));
                mx = std::max(mx, *std::max_element(win[hi - 1].begin(), win[hi - 1].end()));
                const Window w = nn::detail::reads(a, lo, hi);
                ASSERT_EQ(w.lo, mn) << str(a) << " queries [" << lo << ", " << hi << ")";
                ASSERT_EQ(w.hi, mx + 1) << str(a) << " queries [" << lo << ", " << hi << ")";
              }
            }
            // Tap tables on a range's own window, and on the whole axis.
            const int64_t lo = L / 3, hi = std::max(lo + 1, 2 * L / 3);
            const Window w = nn::detail::reads(a, lo, hi);
            for (int whole = 0; whole < 2; ++whole) {
              const int64_t q0 = whole ? 0 : lo, nq = whole ? L : hi - lo;
              const int64_t kv0 = whole ? 0 : w.lo, kvn = whole ? L : w.size();
              const auto tb = nn::detail::tap_table(a, q0, nq, kv0, kvn);
              ASSERT_EQ(tb.idx.sizes(), (at::IntArrayRef{nq, k}));
              auto idx = tb.idx.accessor<int64_t, 2>();
              auto ok = tb.valid.accessor<bool, 2>();
              auto rel = tb.rel.accessor<int64_t, 2>();
              for (int64_t r = 0; r < nq; ++r) {
                const auto& wi = win[q0 + r];
                for (int64_t t = 0; t < k; ++t) {
                  const bool has = t < static_cast<int64_t>(wi.size());
                  const int64_t y = wi[has ? t : wi.size() - 1];
                  ASSERT_EQ(ok[r][t], has) << str(a);
                  const int64_t want = whole ? wrap(y, L) : y - kv0;
                  ASSERT_EQ(idx[r][t], want) << str(a) << " query " << q0 + r << " tap " << t;
                  ASSERT_EQ(rel[r][t], (y - (q0 + r)) / d + k - 1) << str(a);
                  ASSERT_GE(rel[r][t], 0);
                  ASSERT_LE(rel[r][t], 2 * k - 2);
                }
              }
            }
          }
  EXPECT_GT(configs, 3000);
}

// ---- the dense oracle -----------------------------------------------------------------------

struct Problem {
  std::vector<NAAxis> axes;
  int64_t B = 1, H = 2, Hkv = 2, D = 3, Dv = 3, Ne = 0;
  bool rpb = false;
  std::string describe() const {
    std::string s = "B=" + std::to_string(B) + " H=" + std::to_string(H) + "/" +
                    std::to_string(Hkv) + " D=" + std::to_string(D) + " Dv=" + std::to_string(Dv) +
                    " Ne=" + std::to_string(Ne) + (rpb ? " rpb" : "");
    for (const auto& a : axes) s += " | " + str(a);
    return s;
  }
  std::vector<int64_t> spatial() const {
    std::vector<int64_t> r;
    for (const auto& a : axes) r.push_back(a.length);
    return r;
  }
  std::vector<int64_t> shape(int64_t heads, int64_t dim) const {
    std::vector<int64_t> r = {B};
    for (const auto& a : axes) r.push_back(a.length);
    r.push_back(heads);
    r.push_back(dim);
    return r;
  }
  F::NeighborhoodAttentionFuncOptions options() const {
    F::NeighborhoodAttentionFuncOptions o;
    std::vector<int64_t> s, d;
    std::vector<bool> c, w;
    for (const auto& a : axes) {
      s.push_back(a.stride);
      d.push_back(a.dilation);
      c.push_back(a.causal);
      w.push_back(a.circular);
    }
    o.stride(s).dilation(d).is_causal(c).circular(w);
    return o;
  }
  std::vector<int64_t> kernel() const {
    std::vector<int64_t> k;
    for (const auto& a : axes) k.push_back(a.kernel);
    return k;
  }
};

struct Inputs {
  at::Tensor q, k, v, rpb, ek, ev;
  std::vector<at::Tensor> list() const {
    std::vector<at::Tensor> r = {q, k, v};
    for (const auto& t : {rpb, ek, ev})
      if (t.defined()) r.push_back(t);
    return r;
  }
};

Inputs make_inputs(const Problem& p, uint64_t seed, at::ScalarType dtype = at::kDouble) {
  Inputs in;
  in.q = test::randn(p.shape(p.H, p.D), seed, dtype);
  in.k = test::randn(p.shape(p.Hkv, p.D), seed + 1, dtype);
  in.v = test::randn(p.shape(p.Hkv, p.Dv), seed + 2, dtype);
  if (p.rpb) {
    std::vector<int64_t> s = {p.H};
    for (const auto& a : p.axes) s.push_back(2 * a.kernel - 1);
    in.rpb = test::randn(s, seed + 3, dtype);
  }
  if (p.Ne > 0) {
    in.ek = test::randn({p.B, p.Ne, p.Hkv, p.D}, seed + 4, dtype);
    in.ev = test::randn({p.B, p.Ne, p.Hkv, p.Dv}, seed + 5, dtype);
  }
  return in;
}

// Dense masked attention: the full N x N logits, a boolean neighbourhood mask (the Cartesian
// product of the per-axis windows), the bias gathered per pair, the extra keys as extra
// columns. Returns (out [B, *S, H, Dv], lse [B, *S, H]); differentiable with autograd.
std::pair<at::Tensor, at::Tensor> dense(const Problem& p, const Inputs& in, double scale) {
  const int64_t nd = static_cast<int64_t>(p.axes.size());
  int64_t N = 1, R = 1;
  for (const auto& a : p.axes) {
    N *= a.length;
    R *= 2 * a.kernel - 1;
  }
  at::Tensor mask = at::zeros({N, N}, at::kBool);
  at::Tensor rel = at::zeros({N, N}, at::kLong);
  auto m = mask.accessor<bool, 2>();
  auto r = rel.accessor<int64_t, 2>();
  std::vector<int64_t> pos(nd), key(nd);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t a = nd - 1, x = n; a >= 0; --a)
      pos[a] = x % p.axes[a].length, x /= p.axes[a].length;
    // per axis: key position -> unwrapped row in the window, or none
    std::vector<std::vector<int64_t>> row_of(nd);
    for (int64_t a = 0; a < nd; ++a) {
      const auto& ax = p.axes[a];
      row_of[a].assign(ax.length, std::numeric_limits<int64_t>::min());
      for (int64_t y : ref_window(ax, pos[a])) row_of[a][wrap(y, ax.length)] = y;
    }
    for (int64_t j = 0; j < N; ++j) {
      for (int64_t a = nd - 1, x = j; a >= 0; --a)
        key[a] = x % p.axes[a].length, x /= p.axes[a].length;
      bool ok = true;
      int64_t flat = 0;
      for (int64_t a = 0; a < nd; ++a) {
        const int64_t y = row_of[a][key[a]];
        if (y == std::numeric_limits<int64_t>::min()) {
          ok = false;
          break;
        }
        flat = flat * (2 * p.axes[a].kernel - 1) + (y - pos[a]) / p.axes[a].dilation +
               p.axes[a].kernel - 1;
      }
      m[n][j] = ok;
      r[n][j] = ok ? flat : 0;
    }
  }
  const int64_t G = p.H / p.Hkv;
  const at::Tensor heads = at::arange(p.H, at::kLong).div(G, "floor");
  auto to_bhnd = [&](const at::Tensor& x) {  // [B, *S, h, d] -> [B, H, N, d]
    return x.reshape({p.B, N, x.size(-2), x.size(-1)}).index_select(2, heads).permute({0, 2, 1, 3});
  };
  const at::Tensor qh = in.q.reshape({p.B, N, p.H, p.D}).permute({0, 2, 1, 3});
  const at::Tensor kh = to_bhnd(in.k), vh = to_bhnd(in.v);
  at::Tensor s = at::matmul(qh, kh.transpose(-1, -2)) * scale;  // [B, H, N, N]
  if (in.rpb.defined())
    s = s + in.rpb.reshape({p.H, R}).index_select(1, rel.reshape(-1)).view({1, p.H, N, N});
  s = s.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor values = vh;
  if (in.ek.defined()) {
    const at::Tensor ekh = in.ek.index_select(2, heads).permute({0, 2, 1, 3});
    const at::Tensor evh = in.ev.index_select(2, heads).permute({0, 2, 1, 3});
    s = at::cat({s, at::matmul(qh, ekh.transpose(-1, -2)) * scale}, -1);
    values = at::cat({vh, evh}, 2);
  }
  const at::Tensor out = at::matmul(at::softmax(s, -1), values).permute({0, 2, 1, 3});
  const at::Tensor lse = at::logsumexp(s, -1).permute({0, 2, 1});
  return {out.reshape(p.shape(p.H, p.Dv)), lse.reshape(p.shape(p.H, 1)).squeeze(-1)};
}

std::pair<at::Tensor, at::Tensor> run_op(const Problem& p, const Inputs& in, double scale) {
  auto o = p.options().scale(scale).rpb(in.rpb).additional_keys(in.ek).additional_values(in.ev);
  auto r = F::neighborhood_attention_with_lse(in.q, in.k, in.v, p.kernel(), o);
  return {std::get<0>(r), std::get<1>(r)};
}

Inputs with_grad(const Inputs& in, at::ScalarType dtype) {
  Inputs r;
  auto f = [&](const at::Tensor& t) {
    return t.defined() ? t.detach().to(dtype).requires_grad_() : at::Tensor();
  };
  r.q = f(in.q), r.k = f(in.k), r.v = f(in.v), r.rpb = f(in.rpb), r.ek = f(in.ek), r.ev = f(in.ev);
  return r;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

template <class Fn>
void expect_error(Fn&& fn, const std::string& substring) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning \"" << substring << "\"";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(substring), std::string::npos)
        << e.what_without_backtrace();
  }
}

// Forward, lse and every gradient of the op against the dense oracle (float64).
void check_against_dense(const Problem& p, uint64_t seed, at::ScalarType dtype = at::kDouble,
                         double tol = 1e-10) {
  SCOPED_TRACE(p.describe());
  const Inputs base = make_inputs(p, seed);
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.D)) * (1.0 + 0.25 * (seed % 3));
  const Inputs ref = with_grad(base, at::kDouble), got = with_grad(base, dtype);
  const auto want = dense(p, ref, scale);
  const auto have = run_op(p, got, scale);
  ASSERT_EQ(have.first.sizes(), want.first.sizes());
  ASSERT_EQ(have.first.scalar_type(), dtype);
  ASSERT_EQ(have.second.sizes(), want.second.sizes());
  ASSERT_EQ(have.second.scalar_type(), dtype == at::kDouble ? at::kDouble : at::kFloat);
  EXPECT_LT(max_diff(have.first, want.first), tol) << "out";
  EXPECT_LT(max_diff(have.second, want.second), tol) << "lse";
  const at::Tensor w = test::randn(want.first.sizes(), seed + 17, at::kDouble);
  const auto gw = torch::autograd::grad({(want.first * w).sum()}, ref.list());
  const auto gh = torch::autograd::grad({(have.first * w.to(dtype)).sum()}, got.list());
  const char* names[] = {"dq", "dk", "dv", "drpb", "dextra_k", "dextra_v"};
  std::vector<const char*> present = {names[0], names[1], names[2]};
  if (base.rpb.defined()) present.push_back(names[3]);
  if (base.ek.defined()) present.push_back(names[4]), present.push_back(names[5]);
  ASSERT_EQ(gh.size(), gw.size());
  for (size_t i = 0; i < gw.size(); ++i) {
    ASSERT_TRUE(gh[i].defined()) << present[i];
    ASSERT_EQ(gh[i].sizes(), gw[i].sizes()) << present[i];
    EXPECT_LT(max_diff(gh[i], gw[i]), tol) << present[i];
  }
}

NAAxis random_axis(Rng& rng, int64_t max_len, bool allow_causal = true) {
  const int64_t L = rng.uniform(2, max_len);
  const int64_t k = rng.uniform(2, L);
  const int64_t d = rng.uniform(1, L / k);
  const int64_t s = rng.coin(0.6) ? 1 : rng.uniform(1, k);
  const int mode = rng.uniform(0, 2);  // plain, causal, circular
  return axis(L, k, s, d, allow_causal && mode == 1, mode == 2);
}

Problem random_problem(Rng& rng, int64_t nd, int64_t max_len) {
  Problem p;
  for (int64_t a = 0; a < nd; ++a) p.axes.push_back(random_axis(rng, max_len));
  bool causal = false;
  for (const auto& a : p.axes) causal = causal || a.causal;
  static const std::vector<std::pair<int64_t, int64_t>> heads = {
      {2, 2}, {4, 2}, {2, 1}, {1, 1}, {3, 1}};
  std::tie(p.H, p.Hkv) = rng.pick(heads);
  p.B = rng.uniform(1, 2);
  p.D = rng.uniform(1, 4);
  p.Dv = rng.coin() ? p.D : rng.uniform(1, 5);
  p.rpb = !causal && rng.coin();
  p.Ne = rng.coin(0.3) ? rng.uniform(1, 3) : 0;
  return p;
}

// Runs `body` under each local kernel, the tap loop and the blocked one (NOTE: [Blocked
// neighbourhood attention]); both must equal the oracle on every case.
template <class Body>
void each_kernel(Body body) {
  using nn::detail::LocalKernel;
  for (const LocalKernel k : {LocalKernel::kTaps, LocalKernel::kBlocked}) {
    SCOPED_TRACE(k == LocalKernel::kTaps ? "tap-loop kernel" : "blocked kernel");
    struct Pin {
      LocalKernel before;
      ~Pin() { nn::detail::set_local_kernel(before); }
    } pin{nn::detail::set_local_kernel(k)};
    body();
  }
}

TEST(NeighborhoodAttention, Dense1d) {
  each_kernel([] {
    test::Sweep sweep;
    sweep.cases(120).run(
        [&](Rng& rng, int64_t c) { check_against_dense(random_problem(rng, 1, 14), 100 + c); });
  });
}

TEST(NeighborhoodAttention, Dense2d) {
  each_kernel([] {
    test::Sweep sweep;
    sweep.cases(40).run(
        [&](Rng& rng, int64_t c) { check_against_dense(random_problem(rng, 2, 7), 200 + c); });
  });
}

TEST(NeighborhoodAttention, Dense3d) {
  each_kernel([] {
    test::Sweep sweep;
    sweep.cases(12).run(
        [&](Rng& rng, int64_t c) { check_against_dense(random_problem(rng, 3, 5), 300 + c); });
  });
}

// Fields larger than a tile in every axis: several tiles, a padded last one, and (blocked)
// several chunks of tiles on the largest.
TEST(NeighborhoodAttention, ManyTiles) {
  each_kernel([] {
    Problem a;
    a.axes = {axis(37, 7), axis(21, 5, 1, 1, true)};
    a.H = 4, a.Hkv = 2, a.D = 3, a.Dv = 2, a.rpb = false, a.Ne = 1;
    check_against_dense(a, 11);
    Problem b;
    b.axes = {axis(19, 3, 2), axis(11, 3, 1, 2), axis(9, 4, 1, 1, false, true)};
    b.rpb = true;
    check_against_dense(b, 12);
    Problem c;
    c.axes = {axis(300, 9, 3)};
    c.B = 2, c.H = 2, c.Hkv = 1, c.rpb = true;
    check_against_dense(c, 13);
  });
}

// A field whose blocked logits span several chunks of tiles (too large for the dense oracle):
// the blocked kernel against the tap loop, forward, lse and every gradient.
TEST(NeighborhoodAttention, KernelsAgreeAcrossChunks) {
  using nn::detail::LocalKernel;
  Problem p;
  p.axes = {axis(100, 7), axis(90, 7)};
  p.H = 2, p.Hkv = 2, p.D = 4, p.Dv = 4, p.rpb = true;
  const Inputs base = make_inputs(p, 21);
  std::vector<std::vector<at::Tensor>> results;
  for (const LocalKernel k : {LocalKernel::kTaps, LocalKernel::kBlocked}) {
    const LocalKernel before = nn::detail::set_local_kernel(k);
    const Inputs in = with_grad(base, at::kDouble);
    const auto r = run_op(p, in, 0.4);
    const at::Tensor w = test::randn(r.first.sizes(), 22, at::kDouble);
    auto grads = torch::autograd::grad({(r.first * w).sum()}, in.list());
    grads.push_back(r.first);
    grads.push_back(r.second);
    results.push_back(grads);
    nn::detail::set_local_kernel(before);
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  for (size_t i = 0; i < results[0].size(); ++i)
    EXPECT_LT(max_diff(results[0][i], results[1][i]), 1e-10) << "result " << i;
}

// The automatic choice: blocked where a tile's box holds at most 8x the keys its queries
// need, the tap loop where dilation spreads them further.
TEST(NeighborhoodAttention, KernelChoice) {
  using nn::detail::LocalKernel;
  const auto tables = [](const NAAxis& a, int64_t n_axes) {
    std::vector<nn::detail::TapTable> t;
    for (int64_t i = 0; i < n_axes; ++i)
      t.push_back(nn::detail::tap_table(a, 0, a.length, 0, a.length));
    return t;
  };
  const auto choose = [&](const NAAxis& a, int64_t n_axes, LocalKernel pin) {
    const LocalKernel before = nn::detail::set_local_kernel(pin);
    const std::vector<int64_t> kv(static_cast<size_t>(n_axes), a.length);
    const bool blocked = nn::detail::use_blocked(tables(a, n_axes), kv);
    nn::detail::set_local_kernel(before);
    return blocked;
  };
  EXPECT_TRUE(choose(axis(64, 7), 2, LocalKernel::kAuto));
  EXPECT_TRUE(choose(axis(64, 7), 1, LocalKernel::kAuto));
  EXPECT_TRUE(choose(axis(16, 3), 3, LocalKernel::kAuto));
  EXPECT_FALSE(choose(axis(64, 5, 1, 3), 2, LocalKernel::kAuto));  // box 20 of 5 per axis
  EXPECT_FALSE(choose(axis(64, 7), 2, LocalKernel::kTaps));
  EXPECT_TRUE(choose(axis(64, 5, 1, 3), 2, LocalKernel::kBlocked));
}

TEST(NeighborhoodAttention, NamedCases) {
  each_kernel([] {
    Problem a;  // the note's 2-D case
    a.axes = {axis(7, 3, 1, 2, true), axis(9, 5)};
    a.H = 4, a.Hkv = 2, a.D = 4, a.Dv = 3, a.Ne = 2;
    check_against_dense(a, 1);
    Problem b;  // 3-D (5, 6, 7), k = 3, rpb
    b.axes = {axis(5, 3), axis(6, 3), axis(7, 3)};
    b.rpb = true;
    check_against_dense(b, 2);
    Problem c;  // L not a multiple of d, even kernel, stride, circular, GQA 2 over 1
    c.axes = {axis(13, 4, 2, 3, false, true), axis(11, 2, 2, 2)};
    c.H = 2, c.Hkv = 1, c.rpb = true, c.Ne = 1;
    check_against_dense(c, 3);
    Problem d;  // circular and causal on different axes, 2-D
    d.axes = {axis(8, 3, 1, 2, false, true), axis(6, 4, 1, 1, true)};
    check_against_dense(d, 4);
  });
}

TEST(NeighborhoodAttention, Float32) {
  each_kernel([] {
    Problem p;
    p.axes = {axis(7, 3, 1, 2, true), axis(9, 5)};
    p.H = 4, p.Hkv = 2, p.D = 8, p.Dv = 8, p.Ne = 2;
    check_against_dense(p, 5, at::kFloat, 1e-5);
    Problem q;
    q.axes = {axis(12, 5, 2, 1, false, true)};
    q.rpb = true;
    check_against_dense(q, 6, at::kFloat, 1e-5);
    // Half precision is computed in float32 (lse in float32).
    check_against_dense(p, 7, at::kHalf, 1e-2);
  });
}

TEST(NeighborhoodAttention, NoDoubleBackward) {
  Problem p;
  p.axes = {axis(6, 3)};
  const Inputs in = with_grad(make_inputs(p, 13), at::kDouble);
  const at::Tensor out = run_op(p, in, 0.5).first;
  expect_error([&] { torch::autograd::grad({out.sum()}, {in.q}, {}, true, true); },
               "double backward is not supported");
}

// A window covering the whole domain is plain attention (and, in 1-D, causal attention).
TEST(NeighborhoodAttention, FullWindowIsAttention) {
  for (bool causal : {false, true}) {
    Problem p;
    p.axes = causal ? std::vector<NAAxis>{axis(9, 9, 1, 1, true)}
                    : std::vector<NAAxis>{axis(5, 5), axis(6, 6)};
    const Inputs in = make_inputs(p, 7);
    const int64_t N = causal ? 9 : 30;
    const double scale = 0.6;
    auto bhnd = [&](const at::Tensor& x) {
      return x.reshape({1, N, 2, x.size(-1)}).permute({0, 2, 1, 3});
    };
    at::Tensor s = at::matmul(bhnd(in.q), bhnd(in.k).transpose(-1, -2)) * scale;
    if (causal)
      s = s.masked_fill(at::ones({N, N}, at::kBool).triu(1),
                        -std::numeric_limits<double>::infinity());
    const at::Tensor want = at::matmul(at::softmax(s, -1), bhnd(in.v)).permute({0, 2, 1, 3});
    const at::Tensor got = run_op(p, in, scale).first;
    EXPECT_LT(max_diff(got.reshape(want.sizes()), want), 1e-12) << (causal ? "causal" : "2-D");
  }
}

// Central differences along a random direction, for each input, against <grad, u>.
TEST(NeighborhoodAttention, FiniteDifferences) {
  std::vector<Problem> ps(3);
  ps[0].axes = {axis(6, 3, 1, 2), axis(5, 2, 2, 1, false, true)};
  ps[0].H = 4, ps[0].Hkv = 2, ps[0].rpb = true, ps[0].Ne = 2, ps[0].Dv = 2;
  ps[1].axes = {axis(9, 4, 3, 2, true)};
  ps[1].H = 2, ps[1].Hkv = 1;
  ps[2].axes = {axis(4, 2), axis(3, 3), axis(4, 3, 1, 1, false, true)};
  ps[2].rpb = true;
  uint64_t seed = 40;
  for (const auto& p : ps) {
    SCOPED_TRACE(p.describe());
    const Inputs base = make_inputs(p, seed);
    const at::Tensor w = test::randn(p.shape(p.H, p.Dv), seed + 9, at::kDouble);
    const double scale = 0.7;
    const Inputs g = with_grad(base, at::kDouble);
    const auto grads = torch::autograd::grad({(run_op(p, g, scale).first * w).sum()}, g.list());
    auto f = [&](const Inputs& in) {
      at::NoGradGuard no_grad;
      return (run_op(p, in, scale).first * w).sum().item<double>();
    };
    const auto inputs = base.list();
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor u = test::randn(inputs[i].sizes(), seed + 20 + i, at::kDouble);
      const double eps = 1e-6;
      auto shifted = [&](double e) {
        Inputs x = base;
        at::Tensor* slots[] = {&x.q, &x.k, &x.v, &x.rpb, &x.ek, &x.ev};
        size_t n = 0;
        for (at::Tensor* s : slots)
          if (s->defined() && n++ == i) *s = *s + e * u;
        return x;
      };
      const double fd = (f(shifted(eps)) - f(shifted(-eps))) / (2 * eps);
      const double an = (grads[i] * u).sum().item<double>();
      EXPECT_NEAR(fd, an, 1e-6 * (1 + std::abs(an))) << "input " << i;
    }
    seed += 100;
  }
}

// The backward op returns empty (defined) tensors for absent inputs.
TEST(NeighborhoodAttention, BackwardOpShapes) {
  Problem p;
  p.axes = {axis(6, 3)};
  const Inputs in = make_inputs(p, 11);
  const auto fwd = run_op(p, in, 0.5);
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "tessera::neighborhood_attention_backward", "");
  torch::jit::Stack stack;
  c10::List<bool> f;
  f.push_back(false);
  for (c10::IValue x : {c10::IValue(at::ones_like(fwd.first)), c10::IValue(in.q), c10::IValue(in.k),
                        c10::IValue(in.v), c10::IValue(fwd.first), c10::IValue(fwd.second),
                        c10::IValue(std::vector<int64_t>{3}), c10::IValue(std::vector<int64_t>{1}),
                        c10::IValue(std::vector<int64_t>{1}), c10::IValue(f), c10::IValue(f),
                        c10::IValue(0.5), c10::IValue(), c10::IValue(), c10::IValue()})
    stack.push_back(x);
  op.callBoxed(&stack);
  ASSERT_EQ(stack.size(), 6u);
  EXPECT_EQ(stack[0].toTensor().sizes(), in.q.sizes());
  EXPECT_EQ(stack[1].toTensor().sizes(), in.k.sizes());
  EXPECT_EQ(stack[2].toTensor().sizes(), in.v.sizes());
  for (int i = 3; i < 6; ++i) {
    ASSERT_TRUE(stack[i].toTensor().defined());
    EXPECT_EQ(stack[i].toTensor().numel(), 0);
  }
}

TEST(NeighborhoodAttention, Errors) {
  auto q = at::randn({1, 5, 2, 3}, at::kDouble), k = at::randn({1, 5, 2, 3}, at::kDouble);
  auto v = at::randn({1, 5, 2, 3}, at::kDouble);
  expect_error([&] { F::na1d(q, k, v, {3}, F::NeighborhoodAttentionFuncOptions().dilation({2})); },
               "exceeds the extent 5");
  expect_error([&] { F::na1d(q, k, v, {3}, F::NeighborhoodAttentionFuncOptions().stride({4})); },
               "stride must lie in [1, kernel_size]");
  expect_error([&] { F::na1d(q, k, v, {1}); }, "kernel_size must be > 1");
  expect_error([&] { F::na1d(q, k, v, {7}); }, "exceeds the extent");
  expect_error(
      [&] {
        F::na1d(q, k, v, {3},
                F::NeighborhoodAttentionFuncOptions().is_causal({true}).rpb(
                    at::zeros({2, 5}, at::kDouble)));
      },
      "cannot be used with a causal axis");
  expect_error(
      [&] {
        F::na1d(q, k, v, {3},
                F::NeighborhoodAttentionFuncOptions().rpb(at::zeros({2, 4}, at::kDouble)));
      },
      "rpb must be [H, 2*k1-1, ...] = [2, 5]");
  expect_error(
      [&] {
        F::na1d(q, k, v, {3},
                F::NeighborhoodAttentionFuncOptions().is_causal({true}).circular({true}));
      },
      "both causal and circular");
  auto q3 = at::randn({1, 5, 3, 3}, at::kDouble);
  expect_error([&] { F::na1d(q3, k, v, {3}); }, "must be a multiple of the key/value heads");
  expect_error([&] { F::na1d(q, k.narrow(-1, 0, 2), v, {3}); }, "same head dim");
  expect_error([&] { F::na1d(q, k, v.narrow(1, 0, 4), {3}); }, "batch and spatial sizes");
  expect_error([&] { F::na1d(q, k.to(at::kFloat), v, {3}); }, "has dtype");
  expect_error(
      [&] {
        F::na1d(q, k, v, {3},
                F::NeighborhoodAttentionFuncOptions().additional_keys(
                    at::zeros({1, 2, 2, 3}, at::kDouble)));
      },
      "given together");
  expect_error([&] { F::na1d(q, k, v, {3, 3}); }, "one per spatial axis");
  expect_error([&] { F::na2d(q, k, v, {3}); }, "tessera::na2d");
}

// The module is qkv -> NA -> proj; with rpb its bias gets a gradient.
TEST(NeighborhoodAttention, Module2d) {
  nn::NeighborhoodAttention2d m(
      nn::NeighborhoodAttentionOptions(8, 2, {3, 5}).dilation({1, 2}).rpb(true));
  m->to(at::kDouble);
  const at::Tensor x = test::randn({2, 5, 11, 8}, 12, at::kDouble);
  const at::Tensor y = m->forward(x);
  ASSERT_EQ(y.sizes(), x.sizes());
  ASSERT_EQ(m->rpb.sizes(), (at::IntArrayRef{2, 5, 9}));
  const at::Tensor qkv = at::linear(x, m->qkv->weight, m->qkv->bias).view({2, 5, 11, 3, 2, 4});
  const at::Tensor na = F::na2d(qkv.select(3, 0), qkv.select(3, 1), qkv.select(3, 2), {3, 5},
                                F::NeighborhoodAttentionFuncOptions().dilation({1, 2}).rpb(m->rpb));
  const at::Tensor want = at::linear(na.reshape({2, 5, 11, 8}), m->proj->weight, m->proj->bias);
  EXPECT_LT(max_diff(y, want), 1e-14);
  y.pow(2).sum().backward();
  for (const auto& p : m->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0) << p.key();
  }
  EXPECT_EQ(m->named_parameters().size(), 5u);  // qkv.{weight,bias}, proj.{weight,bias}, rpb
  nn::NeighborhoodAttention1d m1(nn::NeighborhoodAttentionOptions(6, 3, {3}).qkv_bias(false));
  EXPECT_EQ(m1->forward(at::randn({1, 7, 6})).sizes(), (at::IntArrayRef{1, 7, 6}));
}

}  // namespace
