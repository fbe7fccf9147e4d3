// Sequence-sharded fused attention: the ring kernels. See NOTE: [Ring attention] in
// attention_ring.h.
#include "attention_ring.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "tessera/comm/halo.h"

namespace tessera::ops::attention {

namespace {

constexpr int64_t kSeq = 2;
constexpr int64_t kRingFromBytes = int64_t{16} << 20;
constexpr int kTagK = 0x3c0, kTagV = 0x3c1;

KVMethod method_from_env() {
  const char* v = std::getenv("TESSERA_CP_METHOD");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return KVMethod::kAuto;
  if (std::strcmp(v, "ring") == 0) return KVMethod::kRing;
  if (std::strcmp(v, "allgather") == 0) return KVMethod::kAllGather;
  TORCH_CHECK(false, "tessera: attention: TESSERA_CP_METHOD=", v,
              " is not one of auto, ring, allgather; unset it or give one of those");
}

std::atomic<int>& method() {
  static std::atomic<int> m{static_cast<int>(method_from_env())};
  return m;
}

using ForwardFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, double, bool,
                                                     const c10::optional<at::Tensor>&,
                                                     c10::optional<double>);
using BackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, bool, const c10::optional<at::Tensor>&, c10::optional<double>);

std::tuple<at::Tensor, at::Tensor> fused(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& mask,
                                         c10::optional<double> scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("aten::_scaled_dot_product_flash_attention_for_cpu", "")
          .typed<ForwardFn>();
  return op.call(q, k, v, 0.0, false,
                 mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask,
    c10::optional<double> scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "")
          .typed<BackwardFn>();
  return op.call(grad_out, q, k, v, out, lse, 0.0, false,
                 mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt, scale);
}

at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The causal mask of query rows [row_lo, row_lo + rows) against keys [key_lo, key_lo +
// keys), global positions, top-left aligned as is_causal on one device: key j is visible
// from row i when j <= i. Additive, in `opts`' dtype (the fused kernel takes no boolean).
at::Tensor causal_mask(int64_t row_lo, int64_t rows, int64_t key_lo, int64_t keys,
                       const at::TensorOptions& opts) {
  const auto r = at::arange(row_lo, row_lo + rows, opts.dtype(at::kLong)).unsqueeze(1);
  const auto c = at::arange(key_lo, key_lo + keys, opts.dtype(at::kLong)).unsqueeze(0);
  return at::zeros({rows, keys}, opts)
      .masked_fill(c.gt(r), -std::numeric_limits<double>::infinity());
}

// What member `m`'s queries do with member j's keys: the local query rows [row0, row0 +
// rows) that see at least one of them (all of them unless causal), and whether the causal
// mask cuts inside the block.
struct Block {
  int64_t key_lo = 0, keys = 0, row0 = 0, rows = 0;
  bool cut = false;
};

Block block(const SeqSplit& s, int64_t m, int64_t j, bool causal) {
  Block b;
  b.key_lo = s.kv_offset(j);
  b.keys = s.kv_sizes[j];
  const int64_t nq = s.q_sizes[m], q_lo = s.q_offset(m);
  if (b.keys == 0 || nq == 0) return b;
  if (!causal) {
    b.rows = nq;
    return b;
  }
  b.row0 = std::min(std::max(b.key_lo - q_lo, int64_t{0}), nq);
  b.rows = nq - b.row0;
  b.cut = b.rows > 0 && q_lo + b.row0 < b.key_lo + b.keys - 1;
  return b;
}

// The mask of block `b` for this member's rows: the causal cut and the given mask's columns
// (and rows, where it has them), added.
at::Tensor block_mask(const Args& a, const SeqSplit& s, const Block& b) {
  at::Tensor m;
  if (a.mask.defined()) {
    m = a.mask.narrow(-1, b.key_lo, b.keys);
    if (m.size(-2) == a.q.size(kSeq) && (b.row0 > 0 || b.rows < m.size(-2)))
      m = m.narrow(-2, b.row0, b.rows);
  }
  if (b.cut) {
    const at::Tensor c =
        causal_mask(s.q_offset(s.me) + b.row0, b.rows, b.key_lo, b.keys, a.q.options());
    m = m.defined() ? m + c : c;
  }
  return m;
}

// Every member's K/V window at ring step `step`: the block it attends to then, or nothing.
std::vector<comm::Window> windows_at(const SeqSplit& s, int64_t step, bool causal) {
  const int64_t P = static_cast<int64_t>(s.q_sizes.size());
  std::vector<comm::Window> w;
  for (int64_t m = 0; m < P; ++m) {
    const int64_t j = (m - step + P) % P;
    const Block b = block(s, m, j, causal);
    w.push_back(b.rows > 0 ? comm::Window{b.key_lo, b.key_lo + b.keys}
                           : comm::Window{b.key_lo, b.key_lo});
  }
  return w;
}

// K and V blocks arriving for one ring step.
struct Incoming {
  comm::PendingWindow k, v;
};

Incoming fetch(const comm::Group& pg, const SeqSplit& s, const Args& a, int64_t step) {
  const auto w = windows_at(s, step, a.causal);
  const auto z = comm::HaloBoundary::Zeros;
  return {comm::fetch_window_async(pg, a.k, kSeq, s.kv_sizes, w, z, 0.0, kTagK),
          comm::fetch_window_async(pg, a.v, kSeq, s.kv_sizes, w, z, 0.0, kTagV)};
}

// Walks the ring: calls visit(step, block, k, v) for each step whose block this member's
// queries see, with that block's K and V; the next step's blocks arrive meanwhile.
template <class Visit>
void walk_ring(const comm::Group& pg, const SeqSplit& s, const Args& a, Visit visit) {
  const int64_t P = static_cast<int64_t>(s.q_sizes.size());
  Incoming next;
  if (P > 1) next = fetch(pg, s, a, 1);
  for (int64_t step = 0; step < P; ++step) {
    at::Tensor k = a.k, v = a.v;
    if (step > 0) {
      k = next.k.wait();
      v = next.v.wait();
      if (step + 1 < P) next = fetch(pg, s, a, step + 1);
    }
    const Block b = block(s, s.me, (s.me - step + P) % P, a.causal);
    visit(step, b, k, v);
  }
}

std::vector<int64_t> with_rows(const at::Tensor& like, int64_t rows, int64_t last) {
  auto sizes = like.sizes().vec();
  sizes[kSeq] = rows;
  if (last >= 0) sizes.back() = last;
  return sizes;
}

// ---- ring --------------------------------------------------------------------------------

// out / lse rows [row0, row0 + n) merged with one block's (o, l): by log-sum-exp, in the
// accumulators' dtype. A row that none of the block's keys reach (masked) has l = -inf.
void merge(at::Tensor& out, at::Tensor& lse, const Block& b, at::Tensor o, at::Tensor l) {
  at::Tensor oa = out.narrow(kSeq, b.row0, b.rows), la = lse.narrow(kSeq, b.row0, b.rows);
  l = l.to(lse.scalar_type());
  o = o.to(out.scalar_type()).masked_fill_(l.isneginf().unsqueeze(-1), 0.0);
  const at::Tensor merged = at::logaddexp(la, l);
  // -inf - -inf is NaN where neither side has seen a key yet: both weights are 0 there.
  const at::Tensor wa = (la - merged).exp_().nan_to_num_(0.0).unsqueeze(-1);
  const at::Tensor wb = (l - merged).exp_().nan_to_num_(0.0).unsqueeze(-1);
  oa.mul_(wa).add_(o.mul_(wb));
  la.copy_(merged);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ring_forward(const comm::Group& pg, const SeqSplit& s,
                                                const Args& a) {
  const auto acc = a.q.options().dtype(accumulate_type(a.q.scalar_type()));
  at::Tensor out = at::zeros(with_rows(a.q, a.q.size(kSeq), a.v.size(-1)), acc);
  at::Tensor lse = at::full(a.q.sizes().slice(0, 3), -std::numeric_limits<double>::infinity(), acc);
  walk_ring(pg, s, a, [&](int64_t, const Block& b, const at::Tensor& k, const at::Tensor& v) {
    if (b.rows == 0 || a.q.numel() == 0) return;  // (the fused kernel divides by batch, heads)
    const at::Tensor mask = block_mask(a, s, b);
    auto r = fused(a.q.narrow(kSeq, b.row0, b.rows), k, v, mask, a.scale);
    // The kernel answers a row its mask hides from every key of the block with out = 0 and
    // lse = 0; for the merge that row saw nothing (lse = -inf).
    at::Tensor l = std::get<1>(r);
    if (mask.defined())
      l = l.masked_fill(mask.isneginf().all(-1), -std::numeric_limits<double>::infinity());
    merge(out, lse, b, std::get<0>(r), l);
  });
  // A row hidden from every key gets out = 0 and lse = 0, as from the kernel on one device
  // (backward then gives it no gradient).
  lse.masked_fill_(lse.isneginf(), 0.0);
  return {out.to(a.q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(const comm::Group& pg,
                                                             const SeqSplit& s, const Args& a,
                                                             const at::Tensor& grad_out,
                                                             const at::Tensor& out,
                                                             const at::Tensor& lse) {
  const auto acc = accumulate_type(a.q.scalar_type());
  at::Tensor dq = at::zeros(a.q.sizes(), a.q.options().dtype(acc));
  at::Tensor dk = at::zeros(a.k.sizes(), a.k.options().dtype(acc));
  at::Tensor dv = at::zeros(a.v.sizes(), a.v.options().dtype(acc));
  const auto z = comm::HaloBoundary::Zeros;
  walk_ring(pg, s, a, [&](int64_t step, const Block& b, const at::Tensor& k, const at::Tensor& v) {
    // This step's dK / dV of the block it holds (zeros when its queries skip the block).
    at::Tensor dkb, dvb;
    if (b.rows == 0 || a.q.numel() == 0) {
      dkb = at::zeros(with_rows(a.k, k.size(kSeq), -1), a.k.options());
      dvb = at::zeros(with_rows(a.v, v.size(kSeq), -1), a.v.options());
    } else {
      const auto rows = [&](const at::Tensor& t) { return t.narrow(kSeq, b.row0, b.rows); };
      auto r = fused_backward(rows(grad_out), rows(a.q), k, v, rows(out), rows(lse),
                              block_mask(a, s, b), a.scale);
      rows(dq).add_(std::get<0>(r));
      dkb = std::get<1>(r);
      dvb = std::get<2>(r);
    }
    if (step == 0) {  // our own block
      dk.add_(dkb);
      dv.add_(dvb);
      return;
    }
    const auto w = windows_at(s, step, a.causal);
    dk.add_(comm::fetch_window_backward(pg, dkb, kSeq, s.kv_sizes, w, z));
    dv.add_(comm::fetch_window_backward(pg, dvb, kSeq, s.kv_sizes, w, z));
  });
  return {dq.to(a.q.scalar_type()), dk.to(a.k.scalar_type()), dv.to(a.v.scalar_type())};
}

KVMethod set_kv_method(KVMethod m) {
  return static_cast<KVMethod>(method().exchange(static_cast<int>(m)));
}

KVMethod kv_method_for(int64_t gathered_kv_bytes, int64_t members) {
  const auto m = static_cast<KVMethod>(method().load(std::memory_order_relaxed));
  if (m != KVMethod::kAuto) return m;
  return members > 1 && gathered_kv_bytes > kRingFromBytes ? KVMethod::kRing : KVMethod::kAllGather;
}

int64_t SeqSplit::q_offset(int64_t m) const {
  return std::accumulate(q_sizes.begin(), q_sizes.begin() + m, int64_t{0});
}

int64_t SeqSplit::kv_offset(int64_t m) const {
  return std::accumulate(kv_sizes.begin(), kv_sizes.begin() + m, int64_t{0});
}

int64_t SeqSplit::kv_total() const { return kv_offset(static_cast<int64_t>(kv_sizes.size())); }

}  // namespace tessera::ops::attention
