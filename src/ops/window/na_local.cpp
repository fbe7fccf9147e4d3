// Neighbourhood attention on one process: the window rule, the tap tables and the tap-loop
// kernels (see na_local.h). The kernels loop over the prod(k) taps of the neighbourhood; tap
// t of every query is one gathered K row, so each step is a K-sized gather, a dot product
// per (query, head) and an accumulation. The probabilities [B, N, H, T] are the only
// tap-sized buffer; nothing [B, N, H, T, D]-sized and no N x N matrix is ever formed.
// forward / backward hand the call to the blocked kernels (na_blocked.cpp) when use_blocked
// says so.
#include "na_local.h"

#include <algorithm>
#include <array>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "ops/accumulate_type.h"

namespace tessera::nn::detail {

namespace {

int64_t group_length(const NAAxis& a, int64_t g) {
  return (a.length - g + a.dilation - 1) / a.dilation;
}

std::string shape(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

bool present(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

}  // namespace

std::vector<int64_t> window_rows(const NAAxis& a, int64_t i) {
  const int64_t L = a.length, k = a.kernel, d = a.dilation, s = a.stride;
  TORCH_CHECK(i >= 0 && i < L, "tessera: neighbourhood attention: query ", i,
              " outside an axis of length ", L);
  TORCH_CHECK(k >= 1 && d >= 1 && s >= 1 && k * d <= L,
              "tessera: neighbourhood attention: ", "kernel ", k, ", dilation ", d, ", stride ", s,
              " do not fit an axis of length ", L);
  const int64_t g = i % d, x = i / d, n = group_length(a, g), left = k / 2;
  std::vector<int64_t> rows;
  if (a.causal) {
    const int64_t lead = std::min((x / s) * s + s - 1, n - 1);
    for (int64_t y = std::max(lead - (k - 1), int64_t{0}); y <= x; ++y) rows.push_back(g + d * y);
    return rows;
  }
  const int64_t lead = std::min((x / s) * s + s / 2, n - 1);
  // Circular: centred on the leader, unwrapped (the caller takes rows modulo L). Otherwise
  // shifted inward at the borders of the dilation group.
  const int64_t start =
      a.circular ? lead - left : std::min(std::max(lead - left, int64_t{0}), n - k);
  rows.reserve(static_cast<size_t>(k));
  for (int64_t t = 0; t < k; ++t) rows.push_back(g + d * (start + t));
  return rows;
}

comm::Window reads(const NAAxis& a, int64_t q_lo, int64_t q_hi) {
  if (q_hi <= q_lo) return {q_lo, q_lo};
  // Within a dilation group windows move monotonically with the query, so the first key is
  // met among the first d queries and the last among the last d.
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  for (int64_t i = q_lo; i < std::min(q_hi, q_lo + a.dilation); ++i)
    lo = std::min(lo, window_rows(a, i).front());
  for (int64_t i = std::max(q_lo, q_hi - a.dilation); i < q_hi; ++i)
    hi = std::max(hi, window_rows(a, i).back() + 1);
  return {lo, hi};
}

TapTable tap_table(const NAAxis& a, int64_t q_begin, int64_t nq, int64_t kv_begin, int64_t kv_len) {
  const int64_t k = a.kernel;
  TapTable tb;
  tb.idx = at::empty({nq, k}, at::kLong);
  tb.valid = at::empty({nq, k}, at::kBool);
  tb.rel = at::empty({nq, k}, at::kLong);
  auto idx = tb.idx.accessor<int64_t, 2>();
  auto valid = tb.valid.accessor<bool, 2>();
  auto rel = tb.rel.accessor<int64_t, 2>();
  const bool whole_axis = kv_begin == 0 && kv_len == a.length;
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = q_begin + r;
    const auto rows = window_rows(a, i);
    for (int64_t t = 0; t < k; ++t) {
      const bool ok = t < static_cast<int64_t>(rows.size());
      const int64_t y = rows[static_cast<size_t>(ok ? t : static_cast<int64_t>(rows.size()) - 1)];
      int64_t local = y - kv_begin;
      if (local < 0 || local >= kv_len) {
        // A circular row outside [0, L) read straight from the unpadded axis.
        TORCH_INTERNAL_ASSERT(a.circular && whole_axis, "neighbourhood attention: query ", i,
                              " reads row ", y, " outside the K/V window [", kv_begin, ", ",
                              kv_begin + kv_len, ")");
        local = ((y % a.length) + a.length) % a.length;
      }
      idx[r][t] = local;
      valid[r][t] = ok;
      // y and i are in the same dilation group: (y - i) / d is exact, in group units.
      rel[r][t] = (y - i) / a.dilation + k - 1;
      TORCH_INTERNAL_ASSERT(rel[r][t] >= 0 && rel[r][t] <= 2 * k - 2);
    }
  }
  return tb;
}

std::vector<NAAxis> make_axes(const char* op, at::IntArrayRef q, at::IntArrayRef kernel_size,
                              at::IntArrayRef stride, at::IntArrayRef dilation,
                              const std::vector<bool>& is_causal,
                              const std::vector<bool>& circular) {
  TORCH_CHECK(q.size() >= 4 && q.size() <= 6, op, ": query must be [B, *S, H, D] with 1 to 3 ",
              "spatial dims (4 to 6 dims), got shape ", shape(q));
  const size_t nd = q.size() - 3;
  auto check_len = [&](const char* name, size_t n) {
    TORCH_CHECK(n == nd, op, ": ", name, " has ", n, " entries but query ", shape(q), " has ", nd,
                " spatial axes; give one entry per axis");
  };
  check_len("kernel_size", kernel_size.size());
  check_len("stride", stride.size());
  check_len("dilation", dilation.size());
  check_len("is_causal", is_causal.size());
  check_len("circular", circular.size());
  std::vector<NAAxis> axes(nd);
  for (size_t a = 0; a < nd; ++a) {
    axes[a].length = q[1 + a];
    axes[a].kernel = kernel_size[a];
    axes[a].stride = stride[a];
    axes[a].dilation = dilation[a];
    axes[a].causal = is_causal[a];
    axes[a].circular = circular[a];
  }
  return axes;
}

void check_arguments(const char* op, at::IntArrayRef q, at::IntArrayRef k, at::IntArrayRef v,
                     const std::vector<NAAxis>& axes, const c10::optional<at::Tensor>& rpb,
                     const c10::optional<at::Tensor>& additional_keys,
                     const c10::optional<at::Tensor>& additional_values) {
  const int64_t nd = static_cast<int64_t>(axes.size());
  TORCH_CHECK(nd >= 1 && nd <= 3, op, ": 1 to 3 spatial axes are supported, got ", nd);
  const size_t rank = static_cast<size_t>(nd + 3);
  TORCH_CHECK(q.size() == rank, op, ": query must be [B, *S, H, D] with ", nd, " spatial dims (",
              rank, " dims; the layout is heads-last), got shape ", shape(q));
  TORCH_CHECK(k.size() == rank, op, ": key must be [B, *S, H_kv, D] (", rank, " dims, like query ",
              shape(q), "), got shape ", shape(k));
  TORCH_CHECK(v.size() == rank, op, ": value must be [B, *S, H_kv, Dv] (", rank,
              " dims, like query ", shape(q), "), got shape ", shape(v));
  for (int64_t d = 0; d <= nd; ++d) {
    TORCH_CHECK(k[d] == q[d] && v[d] == q[d], op, ": key ", shape(k), " and value ", shape(v),
                " must have the batch and spatial sizes of query ", shape(q), " (dim ", d, ")");
  }
  const int64_t H = q[nd + 1], D = q[nd + 2], Hkv = k[nd + 1], Dv = v[nd + 2];
  TORCH_CHECK(v[nd + 1] == Hkv, op, ": key ", shape(k), " and value ", shape(v),
              " must have the same number of heads");
  // An empty heads shard (0 of 0) is a valid local view of sharded heads.
  TORCH_CHECK(Hkv >= 1 ? H % Hkv == 0 : H == 0, op, ": the query heads (", H, " in ", shape(q),
              ") must be a multiple of the key/value heads (", Hkv, " in ", shape(k),
              "); for grouped-query attention give H_kv dividing H");
  TORCH_CHECK(k[nd + 2] == D, op, ": query ", shape(q), " and key ", shape(k),
              " must have the same head dim");
  for (int64_t a = 0; a < nd; ++a) {
    const NAAxis& x = axes[a];
    TORCH_CHECK(x.length == q[1 + a], op, ": axis ", a, " has length ", x.length, " but query ",
                shape(q), " has ", q[1 + a]);
    TORCH_CHECK(x.kernel > 1, op, ": kernel_size must be > 1 on every axis, got ", x.kernel,
                " on spatial axis ", a);
    TORCH_CHECK(x.stride >= 1 && x.stride <= x.kernel, op, ": stride must lie in [1, kernel_size]",
                " on every axis, got stride ", x.stride, " with kernel_size ", x.kernel,
                " on spatial axis ", a);
    TORCH_CHECK(x.dilation >= 1, op, ": dilation must be >= 1, got ", x.dilation,
                " on spatial axis ", a);
    TORCH_CHECK(x.kernel * x.dilation <= x.length, op, ": kernel_size * dilation (", x.kernel,
                " * ", x.dilation, " = ", x.kernel * x.dilation, ") exceeds the extent ", x.length,
                " of spatial axis ", a, " of query ", shape(q),
                "; lower kernel_size or dilation, or pad the input");
    TORCH_CHECK(!(x.causal && x.circular), op, ": spatial axis ", a,
                " is both causal and circular; a circular axis cannot be causal");
  }
  if (present(rpb)) {
    for (int64_t a = 0; a < nd; ++a)
      TORCH_CHECK(!axes[a].causal, op, ": rpb (relative positional bias) cannot be used with a ",
                  "causal axis (spatial axis ", a, " is causal); drop rpb or is_causal");
    std::vector<int64_t> want = {H};
    for (const auto& x : axes) want.push_back(2 * x.kernel - 1);
    TORCH_CHECK(rpb->sizes().vec() == want, op, ": rpb must be [H, 2*k1-1, ...] = ", shape(want),
                " for query ", shape(q), " and kernel_size, got ", shape(rpb->sizes()));
  }
  const bool has_k = present(additional_keys), has_v = present(additional_values);
  TORCH_CHECK(has_k == has_v, op, ": additional_keys and additional_values must be given ",
              "together (got only additional_", has_k ? "keys" : "values", ")");
  if (has_k) {
    const auto ek = additional_keys->sizes(), ev = additional_values->sizes();
    TORCH_CHECK(ek.size() == 4 && ek[0] == q[0] && ek[2] == Hkv && ek[3] == D, op,
                ": additional_keys must be [B, N, H_kv, D] = [", q[0], ", N, ", Hkv, ", ", D,
                "], got ", shape(ek));
    TORCH_CHECK(ev.size() == 4 && ev[0] == q[0] && ev[1] == ek[1] && ev[2] == Hkv && ev[3] == Dv,
                op, ": additional_values must be [B, N, H_kv, Dv] = [", q[0], ", ", ek[1], ", ",
                Hkv, ", ", Dv, "], got ", shape(ev));
  }
}

void check_tensors(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& rpb, const at::Tensor& extra_k, const at::Tensor& extra_v) {
  const auto t = q.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16, op,
              ": query must be float32, float64, float16 or bfloat16, got ", t);
  auto same = [&](const at::Tensor& x, const char* name) {
    if (!x.defined()) return;
    TORCH_CHECK(x.scalar_type() == t, op, ": ", name, " has dtype ", x.scalar_type(),
                " but query has ", t, "; convert them to one dtype");
    TORCH_CHECK(x.device() == q.device(), op, ": ", name, " is on ", x.device(),
                " but query is on ", q.device());
  };
  same(k, "key");
  same(v, "value");
  same(rpb, "rpb");
  same(extra_k, "additional_keys");
  same(extra_v, "additional_values");
}

namespace {

// Dims of the [B, Nq, H_kv, G, X] products that the tap loops sum over.
const std::array<int64_t, 1> kLastDim{-1}, kGroupDim{3}, kBatchDim{0};

// The T = prod(k) taps of the neighbourhood (row-major over the axes), as flattened indices:
// tap tau of every query reads window position key[q] with bias rpb[:, rel[q]].
class Taps {
 public:
  // `with_rel`: the bias indices too (only where there is a bias).
  Taps(const std::vector<TapTable>& tables, at::IntArrayRef kv_spatial, const at::Device& device,
       bool with_rel)
      : nd_(static_cast<int64_t>(tables.size())) {
    int64_t kv_stride = 1, rel_stride = 1;
    kv_stride_.assign(nd_, 0);
    rel_stride_.assign(nd_, 0);
    for (int64_t a = nd_ - 1; a >= 0; --a) {
      kv_stride_[a] = kv_stride;
      rel_stride_[a] = rel_stride;
      kv_stride *= kv_spatial[a];
      rel_stride *= 2 * tables[a].idx.size(1) - 1;
    }
    for (int64_t a = 0; a < nd_; ++a) {
      const auto& tb = tables[a];
      kernel_.push_back(tb.idx.size(1));
      std::vector<int64_t> view(nd_, 1);
      view[a] = tb.idx.size(0);
      views_.push_back(view);
      idx_.push_back(tb.idx.to(device));
      rel_.push_back(tb.rel.to(device));
      const bool all_valid = tb.valid.all().item<bool>();
      valid_.push_back(all_valid ? at::Tensor() : tb.valid.to(device));
      count_ *= kernel_.back();
    }
    // Every tap's indices once, [T, Nq]: the loops over taps then only take views (a tap's
    // [Nq] index tensors are large enough at 256^2 queries that building them per tap and
    // pass showed in the profile).
    std::vector<at::Tensor> keys, rels, valids;
    for (int64_t tau = 0; tau < count_; ++tau) {
      Tap t = build(tau);
      keys.push_back(t.key);
      if (with_rel) rels.push_back(t.rel);
      valids.push_back(t.valid);
      any_invalid_ = any_invalid_ || t.valid.defined();
    }
    keys_ = at::stack(keys);
    if (with_rel) rels_ = at::stack(rels);
    if (any_invalid_) {
      for (auto& v : valids)  // taps every query has: an all-true row
        if (!v.defined()) v = at::ones_like(keys[0], at::kBool);
      valid_rows_ = at::stack(valids);
    }
  }

  int64_t count() const { return count_; }

  struct Tap {
    at::Tensor key, rel, valid;  // [Nq] each; valid undefined when every query has the tap
  };

  // Tap tau: views of the precomputed rows (rel only when asked for).
  Tap tap(int64_t tau, bool with_rel) const {
    Tap r;
    r.key = keys_[tau];
    if (with_rel) {
      TORCH_INTERNAL_ASSERT(rels_.defined(), "Taps built without bias indices");
      r.rel = rels_[tau];
    }
    if (any_invalid_) r.valid = valid_rows_[tau];
    return r;
  }

 private:
  Tap build(int64_t tau) const {
    std::vector<int64_t> t(nd_);
    for (int64_t a = nd_ - 1; a >= 0; --a) {
      t[a] = tau % kernel_[a];
      tau /= kernel_[a];
    }
    Tap r;
    for (int64_t a = 0; a < nd_; ++a) {
      at::Tensor key = idx_[a].select(1, t[a]).mul(kv_stride_[a]).view(views_[a]);
      r.key = r.key.defined() ? r.key + key : key;
      at::Tensor rel = rel_[a].select(1, t[a]).mul(rel_stride_[a]).view(views_[a]);
      r.rel = r.rel.defined() ? r.rel + rel : rel;
      if (valid_[a].defined()) {
        at::Tensor ok = valid_[a].select(1, t[a]).view(views_[a]);
        r.valid = r.valid.defined() ? r.valid.logical_and(ok) : ok;
      }
    }
    std::vector<int64_t> sq;
    for (int64_t a = 0; a < nd_; ++a) sq.push_back(views_[a][a]);
    r.key = r.key.expand(sq).reshape(-1);
    r.rel = r.rel.expand(sq).reshape(-1);
    if (r.valid.defined()) r.valid = r.valid.expand(sq).reshape(-1);
    return r;
  }

  int64_t nd_, count_ = 1;
  at::Tensor keys_, rels_, valid_rows_;  // [T, Nq]
  bool any_invalid_ = false;
  std::vector<int64_t> kernel_, kv_stride_, rel_stride_;
  std::vector<std::vector<int64_t>> views_;
  std::vector<at::Tensor> idx_, rel_, valid_;
};

// Everything both passes need, in the compute dtype and flattened: queries [B, Nq, H_kv, G, D]
// (query head h = h_kv * G + g reads kv head h_kv), windows [B, Nkv, H_kv, D / Dv], extra
// keys/values as [B, H_kv, N, D / Dv] for matmuls.
struct Problem {
  int64_t nd, B, H, Hkv, G, D, Dv, Nq, Nkv, Ne = 0;
  std::vector<int64_t> sq;
  at::ScalarType ct;
  double scale;
  at::Tensor qf, kf, vf, rpbf, ekh, evh;
  Taps taps;

  Problem(const at::Tensor& q, const at::Tensor& k_win, const at::Tensor& v_win,
          const std::vector<TapTable>& tables, double scale_, const at::Tensor& rpb,
          const at::Tensor& extra_k, const at::Tensor& extra_v)
      : nd(static_cast<int64_t>(tables.size())),
        scale(scale_),
        taps(tables, k_win.sizes().slice(1, tables.size()), q.device(), rpb.defined()) {
    TORCH_INTERNAL_ASSERT(q.dim() == nd + 3 && k_win.dim() == nd + 3 && v_win.dim() == nd + 3);
    B = q.size(0);
    H = q.size(nd + 1);
    D = q.size(nd + 2);
    Hkv = k_win.size(nd + 1);
    Dv = v_win.size(nd + 2);
    G = H / Hkv;
    Nq = 1;
    Nkv = 1;
    for (int64_t a = 0; a < nd; ++a) {
      TORCH_INTERNAL_ASSERT(tables[a].idx.size(0) == q.size(1 + a));
      sq.push_back(q.size(1 + a));
      Nq *= q.size(1 + a);
      Nkv *= k_win.size(1 + a);
    }
    ct = ops::accumulate_type(q.scalar_type());
    qf = q.to(ct).reshape({B, Nq, Hkv, G, D});
    kf = k_win.to(ct).reshape({B, Nkv, Hkv, D});
    vf = v_win.to(ct).reshape({B, Nkv, Hkv, Dv});
    if (rpb.defined()) rpbf = rpb.to(ct).reshape({H, -1});
    if (extra_k.defined()) {
      Ne = extra_k.size(1);
      ekh = extra_k.to(ct).permute({0, 2, 1, 3});  // [B, H_kv, N, D]
      evh = extra_v.to(ct).permute({0, 2, 1, 3});  // [B, H_kv, N, Dv]
    }
  }

  // [B, Nq, H_kv, G, X] -> [B, H_kv, Nq * G, X] and back.
  at::Tensor heads_first(const at::Tensor& x) const {
    return x.permute({0, 2, 1, 3, 4}).reshape({B, Hkv, Nq * G, x.size(-1)});
  }
  at::Tensor heads_last(const at::Tensor& x) const {
    return x.view({B, Hkv, Nq, G, x.size(-1)}).permute({0, 2, 1, 3, 4});
  }

  // Logits [B, Nq, H_kv, G, T + Ne]: scale * <q, k> (+ rpb) per tap, -inf for missing taps,
  // then scale * <q, extra k> for the extra keys.
  at::Tensor logits() const {
    const int64_t T = taps.count();
    at::Tensor s = at::empty({B, Nq, Hkv, G, T + Ne}, qf.options());
    // One tap's keys, products and dot products, reused by every tap: no allocation per tap.
    at::Tensor kt = at::empty({B, Nq, Hkv, D}, kf.options());
    at::Tensor prod = at::empty({B, Nq, Hkv, G, D}, qf.options());
    at::Tensor dot = at::empty({B, Nq, Hkv, G}, qf.options());
    for (int64_t tau = 0; tau < T; ++tau) {
      const auto tap = taps.tap(tau, rpbf.defined());
      at::Tensor st = s.select(-1, tau);
      at::index_select_out(kt, kf, 1, tap.key);
      at::mul_out(prod, qf, kt.unsqueeze(3));
      at::sum_out(dot, prod, kLastDim);
      st.copy_(dot.mul_(scale));
      if (rpbf.defined()) st.add_(rpbf.index_select(1, tap.rel).t().reshape({1, Nq, Hkv, G}));
      if (tap.valid.defined())
        st.masked_fill_(tap.valid.logical_not().view({1, Nq, 1, 1}),
                        -std::numeric_limits<double>::infinity());
    }
    if (Ne > 0) {
      at::Tensor se = at::matmul(heads_first(qf), ekh.transpose(-1, -2)).mul_(scale);
      s.narrow(-1, T, Ne).copy_(heads_last(se));
    }
    return s;
  }

  std::vector<int64_t> shape_with(std::initializer_list<int64_t> tail) const {
    std::vector<int64_t> r = {B};
    r.insert(r.end(), sq.begin(), sq.end());
    r.insert(r.end(), tail.begin(), tail.end());
    return r;
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k_win,
                                           const at::Tensor& v_win,
                                           const std::vector<TapTable>& tables, double scale,
                                           const at::Tensor& rpb, const at::Tensor& extra_k,
                                           const at::Tensor& extra_v) {
  if (q.numel() > 0 && k_win.numel() > 0 &&
      use_blocked(tables, k_win.sizes().slice(1, tables.size())))
    return blocked_forward(q, k_win, v_win, tables, scale, rpb, extra_k, extra_v);
  const Problem p(q, k_win, v_win, tables, scale, rpb, extra_k, extra_v);
  const int64_t T = p.taps.count();
  at::Tensor prob = p.logits();
  at::Tensor m = std::get<0>(prob.max(-1, /*keepdim=*/true));
  prob.sub_(m).exp_();
  at::Tensor l = prob.sum(-1, /*keepdim=*/true);
  prob.div_(l);
  at::Tensor lse = (m + l.log()).squeeze(-1);  // [B, Nq, H_kv, G]

  at::Tensor o = at::zeros({p.B, p.Nq, p.Hkv, p.G, p.Dv}, p.qf.options());
  at::Tensor vt = at::empty({p.B, p.Nq, p.Hkv, p.Dv}, p.vf.options());  // reused per tap
  for (int64_t tau = 0; tau < T; ++tau) {
    const auto tap = p.taps.tap(tau, false);
    at::index_select_out(vt, p.vf, 1, tap.key);
    o.addcmul_(prob.select(-1, tau).unsqueeze(-1), vt.unsqueeze(3));
  }
  if (p.Ne > 0) {
    at::Tensor pe = p.heads_first(prob.narrow(-1, T, p.Ne));
    o.add_(p.heads_last(at::matmul(pe, p.evh)));
  }
  return {o.reshape(p.shape_with({p.H, p.Dv})).to(q.scalar_type()),
          lse.reshape(p.shape_with({p.H}))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k_win,
    const at::Tensor& v_win, const at::Tensor& out, const at::Tensor& lse,
    const std::vector<TapTable>& tables, double scale, const at::Tensor& rpb,
    const at::Tensor& extra_k, const at::Tensor& extra_v) {
  if (q.numel() > 0 && k_win.numel() > 0 &&
      use_blocked(tables, k_win.sizes().slice(1, tables.size())))
    return blocked_backward(grad_out, q, k_win, v_win, out, lse, tables, scale, rpb, extra_k,
                            extra_v);
  const Problem p(q, k_win, v_win, tables, scale, rpb, extra_k, extra_v);
  const int64_t T = p.taps.count();
  const at::Tensor dof = grad_out.to(p.ct).reshape({p.B, p.Nq, p.Hkv, p.G, p.Dv});
  const at::Tensor of = out.to(p.ct).reshape({p.B, p.Nq, p.Hkv, p.G, p.Dv});
  const at::Tensor lsef = lse.to(p.ct).reshape({p.B, p.Nq, p.Hkv, p.G, 1});
  at::Tensor prob = p.logits().sub_(lsef).exp_();
  const at::Tensor delta = (dof * of).sum(-1);  // [B, Nq, H_kv, G]

  at::Tensor dq = at::zeros(p.qf.sizes(), p.qf.options());
  at::Tensor dk = at::zeros(p.kf.sizes(), p.kf.options());
  at::Tensor dv = at::zeros(p.vf.sizes(), p.vf.options());
  at::Tensor drpb = p.rpbf.defined() ? at::zeros(p.rpbf.sizes(), p.rpbf.options()) : at::Tensor();
  // Per-tap buffers, reused: a tap's keys and values, the [B, Nq, H_kv, G, D or Dv] products
  // and their sums over G or D.
  at::Tensor kt = at::empty({p.B, p.Nq, p.Hkv, p.D}, p.kf.options());
  at::Tensor vt = at::empty({p.B, p.Nq, p.Hkv, p.Dv}, p.vf.options());
  at::Tensor prod_v = at::empty({p.B, p.Nq, p.Hkv, p.G, p.Dv}, p.qf.options());
  at::Tensor prod_q = at::empty({p.B, p.Nq, p.Hkv, p.G, p.D}, p.qf.options());
  at::Tensor sum_v = at::empty({p.B, p.Nq, p.Hkv, p.Dv}, p.qf.options());
  at::Tensor sum_k = at::empty({p.B, p.Nq, p.Hkv, p.D}, p.qf.options());
  at::Tensor ds = at::empty({p.B, p.Nq, p.Hkv, p.G}, p.qf.options());
  at::Tensor ds_b = drpb.defined() ? at::empty({p.Nq, p.Hkv, p.G}, p.qf.options()) : at::Tensor();
  for (int64_t tau = 0; tau < T; ++tau) {
    const auto tap = p.taps.tap(tau, drpb.defined());
    const at::Tensor pt = prob.select(-1, tau);  // [B, Nq, H_kv, G]
    at::index_select_out(vt, p.vf, 1, tap.key);
    at::mul_out(prod_v, dof, pt.unsqueeze(-1));
    at::sum_out(sum_v, prod_v, kGroupDim);
    dv.index_add_(1, tap.key, sum_v);
    // ds = pt * (<dout, v> - delta)
    at::mul_out(prod_v, dof, vt.unsqueeze(3));
    at::sum_out(ds, prod_v, kLastDim);
    ds.sub_(delta).mul_(pt);
    at::index_select_out(kt, p.kf, 1, tap.key);
    dq.addcmul_(ds.unsqueeze(-1), kt.unsqueeze(3));
    at::mul_out(prod_q, p.qf, ds.unsqueeze(-1));
    at::sum_out(sum_k, prod_q, kGroupDim);
    dk.index_add_(1, tap.key, sum_k.mul_(scale));
    if (drpb.defined()) {
      at::sum_out(ds_b, ds, kBatchDim);
      drpb.index_add_(1, tap.rel, ds_b.view({p.Nq, p.H}).t());
    }
  }
  at::Tensor dek, dev;
  if (p.Ne > 0) {
    const at::Tensor pe = p.heads_first(prob.narrow(-1, T, p.Ne));  // [B, H_kv, Nq G, Ne]
    const at::Tensor doh = p.heads_first(dof);                      // [B, H_kv, Nq G, Dv]
    const at::Tensor dh = delta.permute({0, 2, 1, 3}).reshape({p.B, p.Hkv, p.Nq * p.G, 1});
    const at::Tensor dse = pe * (at::matmul(doh, p.evh.transpose(-1, -2)) - dh);
    dq.add_(p.heads_last(at::matmul(dse, p.ekh)));
    dek = at::matmul(dse.transpose(-1, -2), p.heads_first(p.qf)).mul_(scale).permute({0, 2, 1, 3});
    dev = at::matmul(pe.transpose(-1, -2), doh).permute({0, 2, 1, 3});
    dek = dek.to(extra_k.scalar_type()).contiguous();
    dev = dev.to(extra_v.scalar_type()).contiguous();
  }
  dq.mul_(scale);
  if (drpb.defined()) drpb = drpb.view(rpb.sizes()).to(rpb.scalar_type());
  return {dq.reshape(q.sizes()).to(q.scalar_type()),
          dk.view(k_win.sizes()).to(k_win.scalar_type()),
          dv.view(v_win.sizes()).to(v_win.scalar_type()),
          drpb,
          dek,
          dev};
}

// NOTE: [K/V windows kept for backward] (na_local.h).
namespace {
thread_local KVWindows* t_keep = nullptr;
thread_local const KVWindows* t_offer = nullptr;
}  // namespace

KeepWindows::KeepWindows(KVWindows* into) : previous_(t_keep) { t_keep = into; }
KeepWindows::~KeepWindows() { t_keep = previous_; }
OfferWindows::OfferWindows(const KVWindows* windows) : previous_(t_offer) { t_offer = windows; }
OfferWindows::~OfferWindows() { t_offer = previous_; }

KVWindows* windows_to_keep() { return t_keep; }

const KVWindows* take_offered_windows() {
  const KVWindows* w = t_offer;
  t_offer = nullptr;
  return w != nullptr && w->k.defined() && w->v.defined() ? w : nullptr;
}

}  // namespace tessera::nn::detail
