// Neighbourhood attention on one process, blocked: queries in tiles, each tile against the
// box of K/V rows its windows cover, as matrix products. See NOTE: [Blocked neighbourhood
// attention] in na_local.h.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "na_local.h"
#include "ops/accumulate_type.h"

namespace tessera::nn::detail {

namespace {

// TESSERA_NA_KERNEL=auto|taps|blocked, read at the first call.
LocalKernel kernel_from_env() {
  const char* v = std::getenv("TESSERA_NA_KERNEL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return LocalKernel::kAuto;
  if (std::strcmp(v, "taps") == 0) return LocalKernel::kTaps;
  if (std::strcmp(v, "blocked") == 0) return LocalKernel::kBlocked;
  TORCH_CHECK(false, "tessera: neighbourhood attention: TESSERA_NA_KERNEL=", v,
              " is not one of auto, taps, blocked; unset it or give one of those");
}

std::atomic<int>& kernel_choice() {
  static std::atomic<int> choice{static_cast<int>(kernel_from_env())};
  return choice;
}

// Tile edge per axis: about 64 queries per tile for 1, 2 or 3 axes (8 x 8 in 2-D). A box is
// tile + (k - 1) * d rows per axis, so smaller tiles waste less and larger ones make larger
// products. In 2-D at k = 7 on CPU, edges 6 to 10 timed alike and 4, 12, 16 slower (one
// profile under load); 1-D and 3-D take the same ~64 queries, unmeasured.
int64_t tile_edge(size_t nd) { return nd == 1 ? 16 : nd == 2 ? 8 : 4; }

// Above this many box keys per needed key the tap loop is chosen (dilation or a wide stride
// spread a tile's windows apart).
constexpr double kMaxWaste = 8.0;

// Logit elements per chunk of tiles: bounds the working set (logits, probabilities and their
// gradient) to a few of these, whatever the field's size.
int64_t chunk_elements(const at::Device& d) { return d.is_cuda() ? int64_t{1} << 25 : 1 << 21; }

// One axis of the blocked layout: `tiles` tiles of `tile` queries (the last one padded), each
// against `box` consecutive window rows from start[t].
struct AxisBlocks {
  int64_t nq = 0, tile = 1, tiles = 0, box = 0, kernel = 1;
  at::Tensor start;  // [tiles] int64
  at::Tensor read;   // [tiles, tile, box] bool: query j of tile t reads box row b
  at::Tensor rel;    // [tiles, tile, box] int64: that pair's bias entry (0 where not read)
};

int64_t tile_size(int64_t edge, int64_t nq) { return std::max<int64_t>(1, std::min(edge, nq)); }

// Per tile of `tile` queries: the lowest window row its queries read; and the box size, the
// widest tile's span.
struct Spans {
  std::vector<int64_t> lo;
  int64_t box = 0;
};

Spans spans(const TapTable& tb, int64_t tile) {
  const int64_t nq = tb.idx.size(0), k = tb.idx.size(1), tiles = (nq + tile - 1) / tile;
  const auto idx = tb.idx.accessor<int64_t, 2>();
  const auto valid = tb.valid.accessor<bool, 2>();
  Spans s;
  s.lo.assign(static_cast<size_t>(tiles), std::numeric_limits<int64_t>::max());
  std::vector<int64_t> hi(static_cast<size_t>(tiles), -1);
  for (int64_t r = 0; r < nq; ++r) {
    const auto t = static_cast<size_t>(r / tile);
    for (int64_t j = 0; j < k; ++j) {
      if (!valid[r][j]) continue;
      s.lo[t] = std::min(s.lo[t], idx[r][j]);
      hi[t] = std::max(hi[t], idx[r][j]);
    }
  }
  for (size_t t = 0; t < s.lo.size(); ++t) s.box = std::max(s.box, hi[t] - s.lo[t] + 1);
  return s;
}

AxisBlocks axis_blocks(const TapTable& tb, int64_t kv_len, int64_t edge) {
  AxisBlocks ab;
  ab.nq = tb.idx.size(0);
  ab.kernel = tb.idx.size(1);
  ab.tile = tile_size(edge, ab.nq);
  ab.tiles = (ab.nq + ab.tile - 1) / ab.tile;
  const Spans sp = spans(tb, ab.tile);
  ab.box = sp.box;
  TORCH_INTERNAL_ASSERT(ab.box <= kv_len);
  const auto idx = tb.idx.accessor<int64_t, 2>();
  const auto valid = tb.valid.accessor<bool, 2>();
  const auto rel = tb.rel.accessor<int64_t, 2>();
  ab.start = at::empty({ab.tiles}, at::kLong);
  ab.read = at::zeros({ab.tiles, ab.tile, ab.box}, at::kBool);
  ab.rel = at::zeros({ab.tiles, ab.tile, ab.box}, at::kLong);
  auto start = ab.start.accessor<int64_t, 1>();
  auto read = ab.read.accessor<bool, 3>();
  auto rl = ab.rel.accessor<int64_t, 3>();
  for (int64_t t = 0; t < ab.tiles; ++t) {
    start[t] = std::min(sp.lo[static_cast<size_t>(t)],
                        kv_len - ab.box);  // every box the same size, inside the window
    for (int64_t j = 0; j < ab.tile; ++j) {
      // A padding query copies the tile's last real one: its row is finite, its result unused.
      const int64_t r = std::min(t * ab.tile + j, ab.nq - 1);
      for (int64_t x = 0; x < ab.kernel; ++x) {
        if (!valid[r][x]) continue;
        const int64_t b = idx[r][x] - start[t];
        read[t][j][b] = true;
        rl[t][j][b] = rel[r][x];
      }
    }
  }
  return ab;
}

std::vector<AxisBlocks> all_axes(const std::vector<TapTable>& tables, at::IntArrayRef kv_spatial) {
  std::vector<AxisBlocks> axes;
  for (size_t a = 0; a < tables.size(); ++a)
    axes.push_back(axis_blocks(tables[a], kv_spatial[a], tile_edge(tables.size())));
  return axes;
}

// `x` [n] laid along dim `dim` of `nd` dims (size 1 elsewhere), for broadcasting.
at::Tensor along(const at::Tensor& x, int64_t dim, int64_t nd) {
  std::vector<int64_t> shape(static_cast<size_t>(nd), 1);
  shape[static_cast<size_t>(dim)] = x.size(0);
  return x.reshape(shape);
}

// Everything both passes need: the axes' blocks, the flat indices of every tile's queries and
// box rows, the operands heads-first in the compute dtype. Queries hold one extra zero row
// (index Nq) that padding positions read; their results land there and are dropped.
struct Blocked {
  int64_t nd, B, H, Hkv, G, D, Dv, Nq = 1, Nkv = 1, Ne = 0, n_tiles = 1, tile_q = 1, box_k = 1;
  int64_t tiles_rest = 1;  // tiles of axes 1.. per tile of axis 0
  std::vector<int64_t> sq;
  at::ScalarType ct;
  double scale;
  std::vector<AxisBlocks> axes;
  at::Tensor q_index, kv_index;         // [n_tiles * tile_q], [n_tiles * box_k] on the device
  std::vector<at::Tensor> masks, rels;  // per axis [tiles, tile, box]: 0 / -inf, bias index
  at::Tensor qh, kh, vh, rpbf, ekh, evh;

  Blocked(const at::Tensor& q, const at::Tensor& k_win, const at::Tensor& v_win,
          const std::vector<TapTable>& tables, double scale_, const at::Tensor& rpb,
          const at::Tensor& extra_k, const at::Tensor& extra_v)
      : nd(static_cast<int64_t>(tables.size())),
        scale(scale_),
        axes(all_axes(tables, k_win.sizes().slice(1, tables.size()))) {
    B = q.size(0);
    H = q.size(nd + 1);
    D = q.size(nd + 2);
    Hkv = k_win.size(nd + 1);
    Dv = v_win.size(nd + 2);
    G = H / Hkv;
    ct = ops::accumulate_type(q.scalar_type());
    const auto dev = q.device();
    std::vector<at::Tensor> q_pos, q_ok, kv_pos;
    int64_t q_stride = 1, kv_stride = 1, rel_stride = 1;
    for (int64_t a = nd - 1; a >= 0; --a) {
      const AxisBlocks& x = axes[a];
      sq.insert(sq.begin(), x.nq);
      // Query position of (tile, j) and box row of (tile, b), along dims a and nd + a.
      const at::Tensor pos = along(at::arange(x.tiles, at::kLong) * x.tile, a, 2 * nd) +
                             along(at::arange(x.tile, at::kLong), nd + a, 2 * nd);
      q_ok.push_back(pos < x.nq);
      q_pos.push_back(pos * q_stride);
      kv_pos.push_back(
          (along(x.start, a, 2 * nd) + along(at::arange(x.box, at::kLong), nd + a, 2 * nd)) *
          kv_stride);
      masks.insert(masks.begin(),
                   at::zeros(x.read.sizes(), at::TensorOptions(ct))
                       .masked_fill_(x.read.logical_not(), -std::numeric_limits<double>::infinity())
                       .to(dev));
      rels.insert(rels.begin(), (x.rel * rel_stride).to(dev));
      q_stride *= x.nq;
      kv_stride *= k_win.size(1 + a);
      rel_stride *= 2 * x.kernel - 1;
      n_tiles *= x.tiles;
      tile_q *= x.tile;
      box_k *= x.box;
      if (a > 0) tiles_rest *= x.tiles;
    }
    Nq = q_stride;
    Nkv = kv_stride;
    at::Tensor qi = q_pos[0], ok = q_ok[0], ki = kv_pos[0];
    for (size_t i = 1; i < q_pos.size(); ++i) {
      qi = qi + q_pos[i];
      ok = ok.logical_and(q_ok[i]);
      ki = ki + kv_pos[i];
    }
    q_index = at::where(ok, qi, at::full({}, Nq, at::kLong)).reshape(-1).to(dev);
    kv_index = ki.reshape(-1).to(dev);
    // Heads first, flattened positions: [B, H_kv, N (+1), G, X].
    qh = at::zeros({B, Hkv, Nq + 1, G, D}, q.options().dtype(ct));
    qh.narrow(2, 0, Nq).copy_(q.reshape({B, Nq, Hkv, G, D}).permute({0, 2, 1, 3, 4}));
    kh = k_win.to(ct).reshape({B, Nkv, Hkv, D}).permute({0, 2, 1, 3}).contiguous();
    vh = v_win.to(ct).reshape({B, Nkv, Hkv, Dv}).permute({0, 2, 1, 3}).contiguous();
    if (rpb.defined()) rpbf = rpb.to(ct).reshape({H, -1});
    if (extra_k.defined()) {
      Ne = extra_k.size(1);
      ekh = extra_k.to(ct).permute({0, 2, 1, 3}).unsqueeze(2);  // [B, H_kv, 1, N, D]
      evh = extra_v.to(ct).permute({0, 2, 1, 3}).unsqueeze(2);  // [B, H_kv, 1, N, Dv]
    }
  }

  // Rows of queries [B, H_kv, N + 1, G, X] (or [B, H_kv, N + 1, G]) heads-first, in the
  // compute dtype, with a trailing row `fill` for padding positions.
  at::Tensor heads_first(const at::Tensor& x, int64_t width, double fill) const {
    std::vector<int64_t> shape = {B, Hkv, Nq + 1, G};
    if (width >= 0) shape.push_back(width);
    at::Tensor r = at::empty(shape, x.options().dtype(ct));
    r.narrow(2, Nq, 1).fill_(fill);
    std::vector<int64_t> flat = {B, Nq, Hkv, G};
    if (width >= 0) flat.push_back(width);
    std::vector<int64_t> perm = {0, 2, 1, 3};
    if (width >= 0) perm.push_back(4);
    r.narrow(2, 0, Nq).copy_(x.reshape(flat).permute(perm));
    return r;
  }
  // The inverse, dropping the padding row: [B, *Sq, H(, X)] from [B, H_kv, N + 1, G(, X)].
  at::Tensor heads_last(const at::Tensor& x) const {
    const bool wide = x.dim() == 5;
    std::vector<int64_t> perm = {0, 2, 1, 3};
    if (wide) perm.push_back(4);
    std::vector<int64_t> shape = {B};
    shape.insert(shape.end(), sq.begin(), sq.end());
    shape.push_back(H);
    if (wide) shape.push_back(x.size(4));
    return x.narrow(2, 0, Nq).permute(perm).reshape(shape);
  }

  // The tiles of axis 0 in [t0, t0 + n): a chunk.
  struct Chunk {
    int64_t n_tiles;
    at::Tensor qi, ki;  // flat query rows / box rows of its tiles
    at::Tensor q;       // its queries [B, H_kv, tiles, tile_q * G, D]
    at::Tensor k, v;    // its boxes [B, H_kv, tiles, box_k, D / Dv]
    at::Tensor bias;    // [H_kv or 1, tiles, tile_q, G or 1, box_k]: mask (+ rpb)
    at::Tensor rel;     // with rpb: the bias entry of each (tile, query, box key), flat
  };

  int64_t chunk_tiles() const {
    const int64_t per_tile0 = B * H * tiles_rest * tile_q * (box_k + Ne);
    return std::max<int64_t>(1, chunk_elements(qh.device()) / std::max<int64_t>(1, per_tile0));
  }

  Chunk chunk(int64_t t0, int64_t n) const {
    Chunk c;
    c.n_tiles = n * tiles_rest;
    const int64_t first = t0 * tiles_rest;
    c.qi = q_index.narrow(0, first * tile_q, c.n_tiles * tile_q);
    c.ki = kv_index.narrow(0, first * box_k, c.n_tiles * box_k);
    c.q = qh.index_select(2, c.qi).view({B, Hkv, c.n_tiles, tile_q * G, D});
    c.k = kh.index_select(2, c.ki).view({B, Hkv, c.n_tiles, box_k, D});
    c.v = vh.index_select(2, c.ki).view({B, Hkv, c.n_tiles, box_k, Dv});
    // Per-axis masks (and bias indices) broadcast over [tiles.., tile.., box..].
    at::Tensor mask, rel;
    for (int64_t a = 0; a < nd; ++a) {
      at::Tensor m = masks[a], r = rels[a];
      if (a == 0) m = m.narrow(0, t0, n), r = r.narrow(0, t0, n);
      std::vector<int64_t> shape(static_cast<size_t>(3 * nd), 1);
      shape[a] = m.size(0);
      shape[nd + a] = m.size(1);
      shape[2 * nd + a] = m.size(2);
      mask = mask.defined() ? mask + m.view(shape) : m.view(shape);
      if (rpbf.defined()) rel = rel.defined() ? rel + r.view(shape) : r.view(shape);
    }
    c.bias = mask.reshape({1, c.n_tiles, tile_q, 1, box_k});
    if (rpbf.defined()) {
      c.rel = rel.reshape(-1);
      const at::Tensor b = rpbf.index_select(1, c.rel)
                               .view({Hkv, G, c.n_tiles, tile_q, box_k})
                               .permute({0, 2, 3, 1, 4});
      c.bias = b + c.bias;
    }
    return c;
  }

  // Scaled logits of a chunk with its bias, [B, H_kv, tiles, tile_q * G, box_k + Ne].
  at::Tensor logits(const Chunk& c) const {
    at::Tensor s = at::matmul(c.q, c.k.transpose(-1, -2)).mul_(scale);
    s.view({B, Hkv, c.n_tiles, tile_q, G, box_k}).add_(c.bias);
    if (Ne == 0) return s;
    const at::Tensor se = at::matmul(c.q, ekh.transpose(-1, -2)).mul_(scale);
    return at::cat({s, se}, -1);
  }

  // [B, H_kv, tiles, tile_q * G, X] -> [B, H_kv, tiles * tile_q, G, X] (queries' rows).
  at::Tensor rows(const at::Tensor& x, const Chunk& c) const {
    return x.reshape({B, Hkv, c.n_tiles * tile_q, G, x.size(-1)});
  }
};

}  // namespace

LocalKernel set_local_kernel(LocalKernel k) {
  return static_cast<LocalKernel>(kernel_choice().exchange(static_cast<int>(k)));
}

bool use_blocked(const std::vector<TapTable>& tables, at::IntArrayRef kv_spatial) {
  const auto choice = static_cast<LocalKernel>(kernel_choice().load(std::memory_order_relaxed));
  if (choice == LocalKernel::kTaps) return false;
  for (size_t a = 0; a < tables.size(); ++a)
    if (tables[a].idx.size(0) == 0 || kv_spatial[a] == 0) return false;  // nothing to tile
  if (choice == LocalKernel::kBlocked) return true;
  // Box keys per needed key.
  double waste = 1;
  for (const auto& tb : tables) {
    const int64_t k = tb.idx.size(1);
    waste *=
        static_cast<double>(spans(tb, tile_size(tile_edge(tables.size()), tb.idx.size(0))).box) /
        static_cast<double>(k);
  }
  return waste <= kMaxWaste;
}

std::tuple<at::Tensor, at::Tensor> blocked_forward(const at::Tensor& q, const at::Tensor& k_win,
                                                   const at::Tensor& v_win,
                                                   const std::vector<TapTable>& tables,
                                                   double scale, const at::Tensor& rpb,
                                                   const at::Tensor& extra_k,
                                                   const at::Tensor& extra_v) {
  const Blocked p(q, k_win, v_win, tables, scale, rpb, extra_k, extra_v);
  at::Tensor out = at::empty({p.B, p.Hkv, p.Nq + 1, p.G, p.Dv}, p.qh.options());
  at::Tensor lse = at::empty({p.B, p.Hkv, p.Nq + 1, p.G}, p.qh.options());
  const int64_t step = p.chunk_tiles(), tiles0 = p.axes[0].tiles;
  for (int64_t t0 = 0; t0 < tiles0; t0 += step) {
    const auto c = p.chunk(t0, std::min(step, tiles0 - t0));
    at::Tensor prob = p.logits(c);
    const at::Tensor m = at::amax(prob, {-1}, /*keepdim=*/true);
    prob.sub_(m).exp_();
    const at::Tensor l = prob.sum(-1, /*keepdim=*/true);
    prob.div_(l);
    at::Tensor o = at::matmul(prob.narrow(-1, 0, p.box_k), c.v);
    if (p.Ne > 0) o.add_(at::matmul(prob.narrow(-1, p.box_k, p.Ne), p.evh));
    out.index_copy_(2, c.qi, p.rows(o, c));
    lse.index_copy_(2, c.qi, p.rows(m + l.log(), c).squeeze(-1));
  }
  return {p.heads_last(out).to(q.scalar_type()), p.heads_last(lse)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> blocked_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k_win,
    const at::Tensor& v_win, const at::Tensor& out, const at::Tensor& lse,
    const std::vector<TapTable>& tables, double scale, const at::Tensor& rpb,
    const at::Tensor& extra_k, const at::Tensor& extra_v) {
  const Blocked p(q, k_win, v_win, tables, scale, rpb, extra_k, extra_v);
  // Padding rows: zero gradient and an infinite lse, so their probabilities are 0 and they add
  // nothing to dK, dV or the bias.
  const at::Tensor doh = p.heads_first(grad_out, p.Dv, 0);
  const at::Tensor lseh = p.heads_first(lse, -1, std::numeric_limits<double>::infinity());
  const at::Tensor delta =
      p.heads_first((grad_out.to(p.ct) * out.to(p.ct)).sum(-1), -1, 0);  // [B, H_kv, N+1, G]
  at::Tensor dq = at::empty(p.qh.sizes(), p.qh.options());
  at::Tensor dk = at::zeros(p.kh.sizes(), p.kh.options());
  at::Tensor dv = at::zeros(p.vh.sizes(), p.vh.options());
  at::Tensor drpb = p.rpbf.defined() ? at::zeros(p.rpbf.sizes(), p.rpbf.options()) : at::Tensor();
  at::Tensor dek, dev;
  if (p.Ne > 0) {
    dek = at::zeros({p.B, p.Hkv, p.Ne, p.D}, p.qh.options());
    dev = at::zeros({p.B, p.Hkv, p.Ne, p.Dv}, p.qh.options());
  }
  const int64_t step = p.chunk_tiles(), tiles0 = p.axes[0].tiles;
  for (int64_t t0 = 0; t0 < tiles0; t0 += step) {
    const auto c = p.chunk(t0, std::min(step, tiles0 - t0));
    const std::vector<int64_t> by_tile = {p.B, p.Hkv, c.n_tiles, p.tile_q * p.G, 1};
    at::Tensor prob = p.logits(c).sub_(lseh.index_select(2, c.qi).view(by_tile)).exp_();
    const at::Tensor dot = doh.index_select(2, c.qi).view({p.B, p.Hkv, c.n_tiles, -1, p.Dv});
    const at::Tensor pb = prob.narrow(-1, 0, p.box_k);
    // ds = p * (<dout, v> - delta), box keys then extra keys.
    at::Tensor ds = at::matmul(dot, c.v.transpose(-1, -2));
    if (p.Ne > 0) ds = at::cat({ds, at::matmul(dot, p.evh.transpose(-1, -2))}, -1);
    ds.sub_(delta.index_select(2, c.qi).view(by_tile)).mul_(prob);
    const at::Tensor dsb = ds.narrow(-1, 0, p.box_k);
    at::Tensor dqc = at::matmul(dsb, c.k);
    const int64_t rows = c.n_tiles * p.box_k;
    dk.index_add_(2, c.ki, at::matmul(dsb.transpose(-1, -2), c.q).view({p.B, p.Hkv, rows, p.D}));
    dv.index_add_(2, c.ki, at::matmul(pb.transpose(-1, -2), dot).view({p.B, p.Hkv, rows, p.Dv}));
    if (p.Ne > 0) {
      const at::Tensor dse = ds.narrow(-1, p.box_k, p.Ne);
      dqc.add_(at::matmul(dse, p.ekh));
      const int64_t m = c.n_tiles * p.tile_q * p.G;
      dek.add_(at::matmul(dse.reshape({p.B, p.Hkv, m, p.Ne}).transpose(-1, -2),
                          c.q.reshape({p.B, p.Hkv, m, p.D})));
      dev.add_(at::matmul(
          prob.narrow(-1, p.box_k, p.Ne).reshape({p.B, p.Hkv, m, p.Ne}).transpose(-1, -2),
          dot.reshape({p.B, p.Hkv, m, p.Dv})));
    }
    dq.index_copy_(2, c.qi, p.rows(dqc, c));
    if (drpb.defined()) {
      // Bias entries per (head, tile, query, box key), summed over the batch.
      const at::Tensor g = dsb.sum(0)
                               .view({p.Hkv, c.n_tiles, p.tile_q, p.G, p.box_k})
                               .permute({0, 3, 1, 2, 4})
                               .reshape({p.H, -1});
      drpb.index_add_(1, c.rel, g);
    }
  }
  dq.mul_(scale);
  dk.mul_(scale);
  const auto kv_last = [&](const at::Tensor& x, const at::Tensor& like) {
    return x.permute({0, 2, 1, 3}).reshape(like.sizes()).to(like.scalar_type());
  };
  if (p.Ne > 0) {
    dek = dek.mul_(scale).permute({0, 2, 1, 3}).to(extra_k.scalar_type()).contiguous();
    dev = dev.permute({0, 2, 1, 3}).to(extra_v.scalar_type()).contiguous();
  }
  if (drpb.defined()) drpb = drpb.view(rpb.sizes()).to(rpb.scalar_type());
  return {
      p.heads_last(dq).to(q.scalar_type()), kv_last(dk, k_win), kv_last(dv, v_win), drpb, dek, dev};
}

}  // namespace tessera::nn::detail
