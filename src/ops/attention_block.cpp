// One block's attention by matrix products, on any device and in any dtype, with the fused CPU
// kernel's results and conventions (NOTE: [Block kernels] in attention_ring.h), in tiles of
// rows and keys so that its scores take bounded memory whatever the block's size.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>

#include "attention_ring.h"

namespace tessera::ops::attention {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::atomic<int64_t>& tile_budget() {
  static std::atomic<int64_t> n{int64_t{1} << 24};  // 64 MiB of float32 scores
  return n;
}

double scale_of(const at::Tensor& q, c10::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// A tile: rows [r0, r0 + rows) against keys [k0, k0 + keys) of the block.
struct Tile {
  int64_t r0, rows, k0, keys;
};

// The block's tiles, row tiles outer: each holds at most tile_budget() scores over the batch
// and heads (at least one row by one key). Under the causal cut (key j hidden from row i when
// j > i), tiles wholly after their last row are left out.
std::vector<Tile> tiles(const at::Tensor& q, const at::Tensor& k, bool causal) {
  const int64_t R = q.size(-2), K = k.size(-2);
  const int64_t bh = std::max<int64_t>(q.numel() / std::max<int64_t>(R * q.size(-1), 1), 1);
  const int64_t cells = std::max<int64_t>(tile_budget().load(std::memory_order_relaxed) / bh, 1);
  int64_t rt = R, kt = K;
  if (R * K > cells) {  // near-square tiles, each side at most its dim
    const auto side = std::max<int64_t>(static_cast<int64_t>(std::sqrt(double(cells))), 1);
    rt = std::min(R, std::max(side, cells / std::max<int64_t>(K, 1)));
    kt = std::min(K, std::max<int64_t>(cells / rt, 1));
  }
  std::vector<Tile> out;
  for (int64_t r0 = 0; r0 < R; r0 += rt)
    for (int64_t k0 = 0; k0 < K; k0 += kt) {
      const int64_t rows = std::min(rt, R - r0);
      if (causal && k0 > r0 + rows - 1) break;
      out.push_back({r0, rows, k0, std::min(kt, K - k0)});
    }
  return out;
}

// A mask's part for tile `t`: its keys, and its rows where it has the block's rows.
at::Tensor mask_of(const at::Tensor& mask, int64_t R, const Tile& t) {
  if (!mask.defined()) return mask;
  at::Tensor m = mask.size(-1) == 1 ? mask : mask.narrow(-1, t.k0, t.keys);  // (or broadcast)
  return m.size(-2) == R && R > 1 ? m.narrow(-2, t.r0, t.rows) : m;
}

// Grouped-query heads: query head h is served by K/V head h / g. The query's [B, H, ...] is
// viewed as [B, H_kv, g, ...], and a tile's rows of a K/V head's g query heads are stacked
// into one matrix of g x rows rows, so one product serves the group and K and V are never
// repeated (plain heads are g = 1).
at::Tensor grouped(const at::Tensor& x, int64_t kv_heads) {
  return x.unflatten(1, {kv_heads, kv_heads == 0 ? 1 : x.size(1) / kv_heads});
}
// Rows [r0, r0 + rows) of a grouped [B, H_kv, g, R, X], stacked: [B, H_kv, g * rows, X].
at::Tensor stacked_rows(const at::Tensor& xg, const Tile& t) {
  return xg.narrow(-2, t.r0, t.rows).flatten(2, 3);
}
// A mask broadcastable to [B, H, rows, keys], made broadcastable to the grouped scores.
at::Tensor grouped_mask(at::Tensor m, int64_t kv_heads) {
  while (m.dim() < 4) m = m.unsqueeze(0);
  return m.size(1) == 1 ? m.unsqueeze(1) : grouped(m, kv_heads);
}

// scale * q k^T plus the mask for tile `t`, in the accumulation dtype, with the causal cut:
// [B, H_kv, g, rows, keys] from the grouped query qg.
at::Tensor scores(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& mask, bool causal,
                  double scale, const Tile& t) {
  const auto acc = accumulate_type(qg.scalar_type());
  const at::Tensor qt = stacked_rows(qg, t).to(acc);
  const at::Tensor kt = k.narrow(-2, t.k0, t.keys).to(acc);
  at::Tensor x = at::matmul(qt, kt.transpose(-2, -1))
                     .mul_(scale)
                     .view({qg.size(0), qg.size(1), qg.size(2), t.rows, t.keys});
  if (mask.defined()) x.add_(grouped_mask(mask_of(mask, qg.size(-2), t), k.size(1)).to(acc));
  if (causal && t.k0 + t.keys - 1 > t.r0) {  // some key of the tile after some row
    const auto opts = qg.options().dtype(at::kLong);
    const auto rows = at::arange(t.r0, t.r0 + t.rows, opts).unsqueeze(1);
    const auto keys = at::arange(t.k0, t.k0 + t.keys, opts).unsqueeze(0);
    x.masked_fill_(keys.gt(rows), -kInf);
  }
  return x;
}

}  // namespace

void merge_lse(at::Tensor out, at::Tensor lse, at::Tensor o, at::Tensor l) {
  l = l.to(lse.scalar_type());
  o = o.to(out.scalar_type()).masked_fill_(l.isneginf().unsqueeze(-1), 0.0);
  const at::Tensor merged = at::logaddexp(lse, l);
  // -inf - -inf is NaN where neither side has seen a key yet: both weights are 0 there.
  const at::Tensor wa = (lse - merged).exp_().nan_to_num_(0.0).unsqueeze(-1);
  const at::Tensor wb = (l - merged).exp_().nan_to_num_(0.0).unsqueeze(-1);
  out.mul_(wa).add_(o.mul_(wb));
  lse.copy_(merged);
}

std::tuple<at::Tensor, at::Tensor> products_forward(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& mask,
                                                    bool causal, c10::optional<double> scale) {
  TORCH_INTERNAL_ASSERT(q.dim() == 4 && k.dim() == 4 && v.dim() == 4);
  const auto acc = accumulate_type(q.scalar_type());
  const int64_t kv = k.size(1);
  auto out_sizes = q.sizes().vec();
  out_sizes.back() = v.size(-1);
  at::Tensor out = at::zeros(out_sizes, q.options().dtype(acc));
  at::Tensor lse = at::full(q.sizes().slice(0, q.dim() - 1), -kInf, q.options().dtype(acc));
  const at::Tensor qg = grouped(q, kv), og = grouped(out, kv), lg = grouped(lse, kv);
  const double s = scale_of(q, scale);
  for (const Tile& t : tiles(q, k, causal)) {
    at::Tensor p = scores(qg, k, mask, causal, s, t);
    const at::Tensor l = at::logsumexp(p, -1);
    // In place: the scores become their weights. Rows the tile hides wholly get weights 0
    // (exp(-inf - 0)) and merge as seeing nothing.
    p.sub_(l.masked_fill(l.isneginf(), 0.0).unsqueeze(-1)).exp_();
    const at::Tensor o = at::matmul(p.flatten(2, 3), v.narrow(-2, t.k0, t.keys).to(acc))
                             .view({p.size(0), p.size(1), p.size(2), t.rows, v.size(-1)});
    merge_lse(og.narrow(-2, t.r0, t.rows), lg.narrow(-1, t.r0, t.rows), o, l);
  }
  // A row hidden from every key: out 0 and log-sum-exp 0, as the fused kernel answers it.
  lse.masked_fill_(lse.isneginf(), 0.0);
  return {out.to(q.scalar_type()), lse};
}

// The fused backward's formula per tile: with P = exp(S - lse) (lse the whole row's, so a tile
// of the keys gives its share), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = scale dS K,
// dK = scale dS^T Q. With grouped heads the stacked rows make dK and dV sum over the group.
std::tuple<at::Tensor, at::Tensor, at::Tensor> products_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask, bool causal,
    c10::optional<double> scale) {
  TORCH_INTERNAL_ASSERT(q.dim() == 4 && k.dim() == 4 && v.dim() == 4);
  const auto acc = accumulate_type(q.scalar_type());
  const int64_t kv = k.size(1);
  const at::Tensor go = grouped(grad_out.to(acc), kv);
  const at::Tensor d = (go * grouped(out.to(acc), kv)).sum(-1, /*keepdim=*/true);
  const at::Tensor l = grouped(lse.to(acc), kv).unsqueeze(-1);
  const at::Tensor qg = grouped(q, kv);
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(acc));
  at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(acc));
  at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(acc));
  const at::Tensor dqg = grouped(dq, kv);
  const double s = scale_of(q, scale);
  for (const Tile& t : tiles(q, k, causal)) {
    const auto rows = [&](const at::Tensor& x) { return x.narrow(-2, t.r0, t.rows); };
    const auto keys = [&](const at::Tensor& x) { return x.narrow(-2, t.k0, t.keys); };
    const at::Tensor p = scores(qg, k, mask, causal, s, t).sub_(rows(l)).exp_();
    const at::Tensor ps = p.flatten(2, 3), gos = stacked_rows(go, t);
    keys(dv).add_(at::matmul(ps.transpose(-2, -1), gos));
    const at::Tensor ds = at::matmul(gos, keys(v).to(acc).transpose(-2, -1))
                              .view_as(p)
                              .sub_(rows(d))
                              .mul_(p)
                              .flatten(2, 3);
    rows(dqg).add_(at::matmul(ds, keys(k).to(acc)).view_as(rows(dqg)), s);
    keys(dk).add_(at::matmul(ds.transpose(-2, -1), stacked_rows(qg, t).to(acc)), s);
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

int64_t set_products_tile(int64_t scores) {
  return tile_budget().exchange(std::max<int64_t>(scores, 1));
}

}  // namespace tessera::ops::attention
