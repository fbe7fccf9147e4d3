// Sequence-sharded fused attention: the ring kernels. See NOTE: [Ring attention] in
// attention_ring.h.
#include "attention_ring.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "tessera/comm/halo.h"
#include "tessera/compat.h"
#include "tessera/placement/spec.h"

namespace tessera::ops::attention {

namespace {

constexpr int64_t kSeq = 2;
constexpr int64_t kRingFromBytes = int64_t{16} << 20;
// Rows per member from which `kAuto` deals a causal ring out head-tail: below it the two
// extra exchanges cost more than the even work saves (BENCHMARKS.md, "The load-balanced
// causal ring": on 2 ranks 0.52x at 512 rows each, 0.87x at 1,024, even to 1.07x at 2,048,
// 1.30x at 4,096).
constexpr int64_t kBalanceFromRows = 2048;
constexpr int kTagK = 0x3c0, kTagV = 0x3c1, kTagDK = 0x3c2, kTagDV = 0x3c3;

// The position of environment variable `name`'s value `v` among `words`; `fallback` when
// unset or empty. Anything else raises, naming the variable, its value and the choices.
int env_choice(const char* name, const char* v, const std::vector<const char*>& words,
               int fallback) {
  if (v == nullptr || *v == '\0') return fallback;
  std::string choices;
  for (size_t i = 0; i < words.size(); ++i) {
    if (std::strcmp(v, words[i]) == 0) return static_cast<int>(i);
    choices += (i ? ", " : "") + std::string(words[i]);
  }
  TORCH_CHECK(false, "tessera: attention: ", name, "=", v, " is not one of ", choices,
              "; unset it or give one of those");
}

KVMethod method_from_env() { return method_from(std::getenv("TESSERA_CP_METHOD")); }

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

// Grouped-query heads: the exchanges carry the K/V heads only. The products take them as
// they are; so does the fused CPU pair where LibTorch's takes them (compat.h), else each call
// repeats them for its block and its dK / dV are summed back per group.
int64_t fused_repeats(const at::Tensor& q, const at::Tensor& k) {
  return compat::kFusedCpuAttentionTakesGroups ? 1 : groups_of(q, k);
}

std::atomic<int>& block_kernel() {
  static std::atomic<int> k{
      static_cast<int>(block_kernel_from(std::getenv("TESSERA_ATTENTION_BLOCKS")))};
  return k;
}

// Which kernel computes a block with these arguments (NOTE: [Block kernels]).
enum class Route { kCpuPair, kEfficient, kProducts };
Route route(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const auto chosen = static_cast<BlockKernel>(block_kernel().load(std::memory_order_relaxed));
  switch (chosen) {
    case BlockKernel::kProducts: return Route::kProducts;
    case BlockKernel::kFusedOnCpu: return q.device().is_cpu() ? Route::kCpuPair : Route::kProducts;
    case BlockKernel::kFused:
      if (q.device().is_cpu()) return Route::kCpuPair;
      break;
    case BlockKernel::kEfficient: break;
  }
  return efficient_takes(q, k, v, mask) ? Route::kEfficient : Route::kProducts;
}

std::tuple<at::Tensor, at::Tensor> fused(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& mask, bool causal,
                                         c10::optional<double> scale) {
  const Route way = route(q, k, v, mask);
  if (way == Route::kProducts) return products_forward(q, k, v, mask, causal, scale);
  if (way == Route::kEfficient) return efficient_forward(q, k, v, causal, scale);
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("aten::_scaled_dot_product_flash_attention_for_cpu", "")
          .typed<ForwardFn>();
  const int64_t g = fused_repeats(q, k);
  return op.call(q, repeat_heads(k, g), repeat_heads(v, g), 0.0, causal,
                 mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask, bool causal,
    c10::optional<double> scale) {
  const Route way = route(q, k, v, mask);
  if (way == Route::kProducts)
    return products_backward(grad_out, q, k, v, out, lse, mask, causal, scale);
  if (way == Route::kEfficient)
    return efficient_backward(grad_out, q, k, v, out, lse, causal, scale);
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "")
          .typed<BackwardFn>();
  const int64_t g = fused_repeats(q, k);
  auto r = op.call(grad_out, q, repeat_heads(k, g), repeat_heads(v, g), out, lse, 0.0, causal,
                   mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt, scale);
  return {std::get<0>(r), sum_groups(std::get<1>(r), g), sum_groups(std::get<2>(r), g)};
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
// rows) that see at least one of them (all of them unless causal), whether the causal mask
// cuts inside the block, and whether that cut is the block's own top-left diagonal (its first
// row and first key at the same position: the kernel's is_causal, no mask needed).
struct Block {
  int64_t key_lo = 0, keys = 0, row0 = 0, rows = 0;
  bool cut = false, diagonal = false;
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
  b.diagonal = b.cut && q_lo + b.row0 == b.key_lo;
  return b;
}

// Whether the kernel's own is_causal makes block `b`'s cut: a diagonal cut and no given mask
// to add it to. The explicit mask it saves is rows x keys, per block.
bool kernel_causal(const Args& a, const Block& b) { return b.diagonal && !a.mask.defined(); }

// The mask of block `b` for the rows starting at global row `q_lo`: the causal cut (unless
// the kernel makes it) and the given mask's columns (and rows, where it has them), added.
at::Tensor block_mask(const Args& a, int64_t q_lo, const Block& b) {
  at::Tensor m;
  if (a.mask.defined()) {
    m = a.mask.size(-1) == 1 ? a.mask : a.mask.narrow(-1, b.key_lo, b.keys);  // (or broadcast)
    if (m.size(-2) == a.q.size(kSeq) && (b.row0 > 0 || b.rows < m.size(-2)))
      m = m.narrow(-2, b.row0, b.rows);
  }
  if (b.cut && !kernel_causal(a, b)) {
    const at::Tensor c = causal_mask(q_lo + b.row0, b.rows, b.key_lo, b.keys, a.q.options());
    m = m.defined() ? m + c : c;
  }
  return m;
}

// Every member's K/V window at ring step `step`: the block it attends to then, or nothing.
// block_of(m, j) is what member m's queries do with member j's keys.
template <class BlockOf>
std::vector<comm::Window> windows_at(int64_t P, int64_t step, const BlockOf& block_of) {
  std::vector<comm::Window> w;
  for (int64_t m = 0; m < P; ++m) {
    const Block b = block_of(m, (m - step + P) % P);
    w.push_back(b.rows > 0 ? comm::Window{b.key_lo, b.key_lo + b.keys}
                           : comm::Window{b.key_lo, b.key_lo});
  }
  return w;
}

// K and V blocks arriving for one ring step.
struct Incoming {
  comm::PendingWindow k, v;
};

// A ring over members whose K/V rows are kv_sizes (in member order along the sequence dim).
template <class BlockOf>
struct Ring {
  const comm::Group& pg;
  const std::vector<int64_t>& kv_sizes;
  int64_t me;
  BlockOf block_of;

  int64_t members() const { return static_cast<int64_t>(kv_sizes.size()); }
  std::vector<comm::Window> windows(int64_t step) const {
    return windows_at(members(), step, block_of);
  }

  Incoming fetch(const Args& a, int64_t step) const {
    const auto w = windows(step);
    const auto z = comm::HaloBoundary::Zeros;
    return {comm::fetch_window_async(pg, a.k, kSeq, kv_sizes, w, z, 0.0, kTagK),
            comm::fetch_window_async(pg, a.v, kSeq, kv_sizes, w, z, 0.0, kTagV)};
  }

  // Calls visit(step, block, k, v) for each step with that step's block and its K and V;
  // the next step's blocks arrive meanwhile.
  template <class Visit>
  void walk(const Args& a, Visit visit) const {
    const int64_t P = members();
    Incoming next;
    if (P > 1) next = fetch(a, 1);
    for (int64_t step = 0; step < P; ++step) {
      at::Tensor k = a.k, v = a.v;
      if (step > 0) {
        k = next.k.wait();
        v = next.v.wait();
        if (step + 1 < P) next = fetch(a, step + 1);
      }
      visit(step, block_of(me, (me - step + P) % P), k, v);
    }
  }
};

template <class BlockOf>
Ring<BlockOf> make_ring(const comm::Group& pg, const std::vector<int64_t>& kv_sizes, int64_t me,
                        BlockOf block_of) {
  return Ring<BlockOf>{pg, kv_sizes, me, std::move(block_of)};
}

std::vector<int64_t> with_rows(const at::Tensor& like, int64_t rows, int64_t last) {
  auto sizes = like.sizes().vec();
  sizes[kSeq] = rows;
  if (last >= 0) sizes.back() = last;
  return sizes;
}

// Query-key pairs this thread's forward block calls scored (NOTE: [Load-balanced causal
// ring]'s test reads it).
int64_t& scored() {
  thread_local int64_t n = 0;
  return n;
}

// Pairs of `rows` rows x `keys` keys that a call scores: all, or under the kernel's
// top-left is_causal, key j <= row i.
int64_t pairs(int64_t rows, int64_t keys, bool causal) {
  if (!causal) return rows * keys;
  const int64_t tri = std::min(rows, keys);
  return tri * (tri + 1) / 2 + (rows - tri) * keys;
}

// ---- ring --------------------------------------------------------------------------------

// The out / lse of this member's queries, accumulated block by block.
class Accumulator {
 public:
  explicit Accumulator(const Args& a) : a_(a) {}

  // Rows of block `b` (queries from global row q_lo) attend to its keys k / v.
  void attend(int64_t q_lo, const Block& b, const at::Tensor& k, const at::Tensor& v) {
    if (b.rows == 0 || a_.q.numel() == 0) return;  // (the fused kernel divides by batch, heads)
    const at::Tensor mask = block_mask(a_, q_lo, b);
    scored() += pairs(b.rows, k.size(kSeq), kernel_causal(a_, b));
    auto r = fused(a_.q.narrow(kSeq, b.row0, b.rows), k, v, mask, kernel_causal(a_, b), a_.scale);
    // The kernel answers a row its mask hides from every key of the block with out = 0 and
    // lse = 0; for the merge that row saw nothing (lse = -inf).
    at::Tensor l = std::get<1>(r);
    if (mask.defined())
      l = l.masked_fill(mask.isneginf().all(-1), -std::numeric_limits<double>::infinity());
    if (!out_.defined() && b.rows == a_.q.size(kSeq)) {  // a first block with every row
      out_ = std::get<0>(r).to(acc());
      lse_ = l.to(acc());
      if (mask.defined()) out_.masked_fill_(lse_.isneginf().unsqueeze(-1), 0.0);  // (as merge)
      return;
    }
    if (!out_.defined()) start();
    merge_lse(out_.narrow(kSeq, b.row0, b.rows), lse_.narrow(kSeq, b.row0, b.rows), std::get<0>(r),
              l);
  }

  // A row hidden from every key gets out = 0 and lse = 0, as from the kernel on one device
  // (backward then gives it no gradient).
  std::tuple<at::Tensor, at::Tensor> finish() {
    if (!out_.defined()) start();
    lse_.masked_fill_(lse_.isneginf(), 0.0);
    return {out_.to(a_.q.scalar_type()), lse_};
  }

 private:
  at::ScalarType acc() const { return accumulate_type(a_.q.scalar_type()); }
  void start() {
    const auto opts = a_.q.options().dtype(acc());
    out_ = at::zeros(with_rows(a_.q, a_.q.size(kSeq), a_.v.size(-1)), opts);
    lse_ = at::full(a_.q.sizes().slice(0, 3), -std::numeric_limits<double>::infinity(), opts);
  }

  const Args& a_;
  at::Tensor out_, lse_;
};

// Block `b`'s share of the gradients: (dq of its rows, dk, dv of its keys); undefined when
// its queries skip it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attend_backward(
    const Args& a, int64_t q_lo, const Block& b, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse) {
  if (b.rows == 0 || a.q.numel() == 0) return {};
  const auto rows = [&](const at::Tensor& t) { return t.narrow(kSeq, b.row0, b.rows); };
  return fused_backward(rows(grad_out), rows(a.q), k, v, rows(out), rows(lse),
                        block_mask(a, q_lo, b), kernel_causal(a, b), a.scale);
}

// This member's out / lse on ring `ring` (its queries' rows start at global row q_lo).
template <class R>
std::tuple<at::Tensor, at::Tensor> forward_on(const R& ring, const Args& a, int64_t q_lo) {
  Accumulator acc(a);
  ring.walk(a, [&](int64_t, const Block& b, const at::Tensor& k, const at::Tensor& v) {
    acc.attend(q_lo, b, k, v);
  });
  return acc.finish();
}

// (dq, dk, dv) on ring `ring`: each step's dK / dV go home while the next step computes.
template <class R>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_on(const R& ring, const Args& a,
                                                           int64_t q_lo, const at::Tensor& grad_out,
                                                           const at::Tensor& out,
                                                           const at::Tensor& lse) {
  const auto acc = accumulate_type(a.q.scalar_type());
  // Accumulators, taken over from the first gradient that covers them whole (no zeros + add).
  at::Tensor dq, dk, dv;
  const auto add = [acc](at::Tensor& sum, const at::Tensor& t) {
    if (sum.defined())
      sum.add_(t);
    else
      sum = t.to(acc);
  };
  const auto z = comm::HaloBoundary::Zeros;
  // The previous step's dK / dV on their way home while this step computes.
  std::optional<std::pair<comm::PendingWindow, comm::PendingWindow>> homebound;
  const auto arrive = [&] {
    if (!homebound) return;
    add(dk, homebound->first.wait());
    add(dv, homebound->second.wait());
    homebound.reset();
  };
  ring.walk(a, [&](int64_t step, const Block& b, const at::Tensor& k, const at::Tensor& v) {
    // This step's dK / dV of the block it holds (zeros when its queries skip the block).
    auto [dqb, dkb, dvb] = attend_backward(a, q_lo, b, k, v, grad_out, out, lse);
    if (dqb.defined()) {
      if (!dq.defined() && b.rows < a.q.size(kSeq))
        dq = at::zeros(a.q.sizes(), a.q.options().dtype(acc));
      if (dq.defined())
        dq.narrow(kSeq, b.row0, b.rows).add_(dqb);
      else
        dq = dqb.to(acc);
    } else {
      dkb = at::zeros(with_rows(a.k, k.size(kSeq), -1), a.k.options());
      dvb = at::zeros(with_rows(a.v, v.size(kSeq), -1), a.v.options());
    }
    arrive();
    if (step == 0) {  // our own block
      add(dk, dkb);
      add(dv, dvb);
      return;
    }
    const auto w = ring.windows(step);
    homebound.emplace(
        comm::fetch_window_backward_async(ring.pg, dkb, kSeq, ring.kv_sizes, w, z, kTagDK),
        comm::fetch_window_backward_async(ring.pg, dvb, kSeq, ring.kv_sizes, w, z, kTagDV));
  });
  arrive();
  if (!dq.defined()) dq = at::zeros(a.q.sizes(), a.q.options().dtype(acc));
  if (!dk.defined()) dk = at::zeros(a.k.sizes(), a.k.options().dtype(acc));
  if (!dv.defined()) dv = at::zeros(a.v.sizes(), a.v.options().dtype(acc));
  return {dq.to(a.q.scalar_type()), dk.to(a.k.scalar_type()), dv.to(a.v.scalar_type())};
}

// ---- load-balanced causal ring ---------------------------------------------------------

// NOTE: [Load-balanced causal ring]
// Under is_causal, a member's work grows with its rows' positions: on P members the last
// scores about 2P - 1 times the keys the first does, and the ring (each step waiting for the
// block its owner sends after finishing the previous step) runs at the pace of the last.
// Cut the sequence into 2P chunks, sizes within one of each other, and pair chunk a with
// chunk 2P - 1 - a (a < P): each pair holds the same causal work. Member m takes one pair,
// a_m chosen so that on an even split it already holds one of the two chunks (members m and
// P - 1 - m swap one chunk each: half of each tensor moves). The two chunks of a member are
// in position order, and for members m, j with a_j < a_m, j's low chunk precedes both of m's
// and j's high chunk follows both; with a_j > a_m, j's two chunks lie between m's. So every
// ring step is one unmasked call of equal work on every member (a_j < a_m: all rows against
// j's low chunk; a_j > a_m: m's high chunk against j's whole block; its own pair: the
// kernel's is_causal). No mask is built.
// The layout the caller sees stays the natural one: the kernel deals q, k and v out at entry
// and sends the results home at exit (halo windows: each chunk from / to its owners), so
// every other op keeps reading positions in order. The price: about half of q, k, v (and of
// out in backward) more moved per call, and their dealt copies held for the call.
struct HeadTail {
  std::vector<int64_t> pair;             // a_m: member m's low chunk
  std::vector<comm::Window> head, tail;  // member m's low / high chunk, global rows
  std::vector<int64_t> sizes;            // member m's rows in the dealt layout: head + tail

  HeadTail(int64_t length, int64_t P) {
    // The chunks of HeadTailShard (NOTE: [Head-tail order] in spec.h).
    const auto w = tessera::detail::head_tail_windows(length, P);
    pair = w.low;
    for (int64_t m = 0; m < P; ++m) {
      head.push_back(comm::Window{w.head[m].first, w.head[m].second});
      tail.push_back(comm::Window{w.tail[m].first, w.tail[m].second});
      sizes.push_back(head.back().size() + tail.back().size());
    }
  }

  // What member m's queries (its two chunks) do with member j's keys (its two chunks): rows
  // and keys in the dealt layout (member j's keys start at the sum of the sizes before it).
  Block block(int64_t m, int64_t j, const std::vector<int64_t>& offsets) const {
    Block b;
    b.key_lo = offsets[j];
    if (m == j) {  // the own pair: causal in local order
      b.keys = sizes[j];
      b.rows = sizes[m];
      b.cut = b.diagonal = b.rows > 1;
    } else if (pair[j] < pair[m]) {  // j's low chunk precedes both of m's; its high follows
      b.keys = head[j].size();
      b.rows = sizes[m];
    } else {  // j's two chunks lie between m's
      b.keys = sizes[j];
      b.row0 = head[m].size();
      b.rows = tail[m].size();
    }
    if (b.keys == 0) b.rows = 0;
    return b;
  }
};

std::atomic<bool>& load_balance() {
  static std::atomic<bool> on{load_balance_from(std::getenv("TESSERA_CP_LOAD_BALANCE"))};
  return on;
}

// Self-attention (queries and keys split alike) under is_causal, no mask, and balances().
bool balanced(const SeqSplit& s, const Args& a) {
  return a.causal && !a.mask.defined() && s.q_sizes == s.kv_sizes &&
         balances(s.kv_total(), static_cast<int64_t>(s.q_sizes.size()));
}

// Tags kTagDeal + 2i, + 2i + 1: tensor i's two chunks (at most six tensors in flight).
constexpr int kTagDeal = 0x3d0;

// Each member's two chunks (low, then high) of each of `xs` (split along the sequence by
// `natural`), every exchange in flight at once.
std::vector<at::Tensor> deal(const comm::Group& pg, const std::vector<at::Tensor>& xs,
                             const std::vector<int64_t>& natural, const HeadTail& ht) {
  const auto z = comm::HaloBoundary::Zeros;
  std::vector<comm::PendingWindow> pending;
  for (size_t i = 0; i < xs.size(); ++i) {
    const int tag = kTagDeal + 2 * static_cast<int>(i);
    pending.push_back(comm::fetch_window_async(pg, xs[i], kSeq, natural, ht.head, z, 0.0, tag));
    pending.push_back(comm::fetch_window_async(pg, xs[i], kSeq, natural, ht.tail, z, 0.0, tag + 1));
  }
  std::vector<at::Tensor> dealt;
  for (size_t i = 0; i < xs.size(); ++i)
    dealt.push_back(at::cat({pending[2 * i].wait(), pending[2 * i + 1].wait()}, kSeq));
  return dealt;
}

// The inverse: each chunk of each of `ys` (the dealt layout) back to its natural owner.
std::vector<at::Tensor> collect(const comm::Group& pg, const std::vector<at::Tensor>& ys,
                                const std::vector<int64_t>& natural, const HeadTail& ht,
                                int64_t me) {
  const auto z = comm::HaloBoundary::Zeros;
  const int64_t h = ht.head[me].size();
  std::vector<comm::PendingWindow> pending;
  for (size_t i = 0; i < ys.size(); ++i) {
    const int tag = kTagDeal + 2 * static_cast<int>(i);
    const at::Tensor& y = ys[i];
    pending.push_back(comm::fetch_window_backward_async(pg, y.narrow(kSeq, 0, h), kSeq, natural,
                                                        ht.head, z, tag));
    pending.push_back(comm::fetch_window_backward_async(pg, y.narrow(kSeq, h, y.size(kSeq) - h),
                                                        kSeq, natural, ht.tail, z, tag + 1));
  }
  std::vector<at::Tensor> home;
  for (size_t i = 0; i < ys.size(); ++i)
    home.push_back(pending[2 * i].wait() + pending[2 * i + 1].wait());
  return home;
}

// The dealt layout's ring, with the offsets its blocks need.
struct BalancedRing {
  HeadTail ht;
  std::vector<int64_t> offsets;

  explicit BalancedRing(const SeqSplit& s)
      : ht(s.kv_total(), static_cast<int64_t>(s.q_sizes.size())) {
    offsets.assign(ht.sizes.size() + 1, 0);
    for (size_t m = 0; m < ht.sizes.size(); ++m) offsets[m + 1] = offsets[m] + ht.sizes[m];
  }
  auto on(const comm::Group& pg, int64_t me) const {
    return make_ring(pg, ht.sizes, me,
                     [this](int64_t m, int64_t j) { return ht.block(m, j, offsets); });
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> ring_forward(const comm::Group& pg, const SeqSplit& s,
                                                const Args& a) {
  if (s.stored && a.causal) {
    const BalancedRing br(s);
    return forward_on(br.on(pg, s.me), a, 0);
  }
  if (s.stored) {  // without the causal cut no block reads a position: any order serves
    const auto whole = [&](int64_t m, int64_t j) { return block(s, m, j, false); };
    return forward_on(make_ring(pg, s.kv_sizes, s.me, whole), a, 0);
  }
  if (balanced(s, a)) {
    const BalancedRing br(s);
    Args d = a;
    {
      auto in = deal(pg, {a.q, a.k, a.v}, s.q_sizes, br.ht);
      d.q = std::move(in[0]), d.k = std::move(in[1]), d.v = std::move(in[2]);
    }
    auto [out, lse] = forward_on(br.on(pg, s.me), d, 0);
    d = Args{};  // (the dealt copies go before the results are sent home)
    const auto home = collect(pg, {out, lse}, s.q_sizes, br.ht, s.me);
    return {home[0], home[1]};
  }
  const auto block_of = [&](int64_t m, int64_t j) { return block(s, m, j, a.causal); };
  return forward_on(make_ring(pg, s.kv_sizes, s.me, block_of), a, s.q_offset(s.me));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(const comm::Group& pg,
                                                             const SeqSplit& s, const Args& a,
                                                             const at::Tensor& grad_out,
                                                             const at::Tensor& out,
                                                             const at::Tensor& lse) {
  if (s.stored && a.causal) {
    const BalancedRing br(s);
    return backward_on(br.on(pg, s.me), a, 0, grad_out, out, lse);
  }
  if (s.stored) {
    const auto whole = [&](int64_t m, int64_t j) { return block(s, m, j, false); };
    return backward_on(make_ring(pg, s.kv_sizes, s.me, whole), a, 0, grad_out, out, lse);
  }
  if (balanced(s, a)) {
    const BalancedRing br(s);
    auto in = deal(pg, {a.q, a.k, a.v, grad_out, out, lse}, s.q_sizes, br.ht);
    Args d = a;
    d.q = std::move(in[0]), d.k = std::move(in[1]), d.v = std::move(in[2]);
    auto [dq, dk, dv] = backward_on(br.on(pg, s.me), d, 0, in[3], in[4], in[5]);
    d = Args{}, in.clear();  // (the dealt copies go before the gradients are sent home)
    const auto home = collect(pg, {dq, dk, dv}, s.q_sizes, br.ht, s.me);
    return {home[0], home[1], home[2]};
  }
  const auto block_of = [&](int64_t m, int64_t j) { return block(s, m, j, a.causal); };
  return backward_on(make_ring(pg, s.kv_sizes, s.me, block_of), a, s.q_offset(s.me), grad_out, out,
                     lse);
}

namespace {

// This member's rows [q_lo, q_lo + n) against whole K/V (S keys) as two blocks: the keys
// before q_lo, which every row sees, and the keys from q_lo on, the diagonal.
std::vector<Block> causal_blocks(const Args& a, int64_t q_lo) {
  const int64_t n = a.q.size(kSeq), S = a.k.size(kSeq);
  Block before, diagonal;
  before.keys = std::min(q_lo, S);
  before.rows = before.keys > 0 ? n : 0;
  diagonal.key_lo = before.keys;
  diagonal.keys = std::max<int64_t>(std::min(n, S - q_lo), 0);
  diagonal.rows = diagonal.keys > 0 ? n : 0;
  diagonal.cut = diagonal.rows > 0 && diagonal.keys > 1;
  diagonal.diagonal = diagonal.cut;
  return {before, diagonal};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_forward(const Args& a, int64_t q_lo) {
  Accumulator acc(a);
  for (const Block& b : causal_blocks(a, q_lo))
    acc.attend(q_lo, b, a.k.narrow(kSeq, b.key_lo, b.keys), a.v.narrow(kSeq, b.key_lo, b.keys));
  return acc.finish();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_backward(const Args& a, int64_t q_lo,
                                                               const at::Tensor& grad_out,
                                                               const at::Tensor& out,
                                                               const at::Tensor& lse) {
  const auto blocks = causal_blocks(a, q_lo);
  // One call (the rows start at key 0): its gradients are the answer, nothing to add up.
  if (blocks[0].rows == 0 && blocks[1].rows > 0 && blocks[1].keys == a.k.size(kSeq))
    return attend_backward(a, q_lo, blocks[1], a.k, a.v, grad_out, out, lse);
  const auto acc = accumulate_type(a.q.scalar_type());
  at::Tensor dq = at::zeros(a.q.sizes(), a.q.options().dtype(acc));
  at::Tensor dk = at::zeros(a.k.sizes(), a.k.options().dtype(acc));
  at::Tensor dv = at::zeros(a.v.sizes(), a.v.options().dtype(acc));
  for (const Block& b : blocks) {
    auto [dqb, dkb, dvb] = attend_backward(a, q_lo, b, a.k.narrow(kSeq, b.key_lo, b.keys),
                                           a.v.narrow(kSeq, b.key_lo, b.keys), grad_out, out, lse);
    if (!dqb.defined()) continue;
    dq.add_(dqb);
    dk.narrow(kSeq, b.key_lo, b.keys).add_(dkb);
    dv.narrow(kSeq, b.key_lo, b.keys).add_(dvb);
  }
  return {dq.to(a.q.scalar_type()), dk.to(a.k.scalar_type()), dv.to(a.v.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> forward(const Args& a) {
  return fused(a.q, a.k, a.v, a.mask, a.causal, a.scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const Args& a, const at::Tensor& grad_out,
                                                        const at::Tensor& out,
                                                        const at::Tensor& lse) {
  return fused_backward(grad_out, a.q, a.k, a.v, out, lse, a.mask, a.causal, a.scale);
}

KVMethod kv_method_for(int64_t gathered_kv_bytes, int64_t members) {
  const auto m = static_cast<KVMethod>(method().load(std::memory_order_relaxed));
  if (m != KVMethod::kAuto) return m;
  return members > 1 && gathered_kv_bytes > kRingFromBytes ? KVMethod::kRing : KVMethod::kAllGather;
}

bool balances(int64_t length, int64_t members) {
  if (members < 2 || !load_balance().load(std::memory_order_relaxed)) return false;
  const auto m = static_cast<KVMethod>(method().load(std::memory_order_relaxed));
  return m != KVMethod::kAuto || length >= kBalanceFromRows * members;
}

int64_t groups_of(const at::Tensor& q, const at::Tensor& k) {
  return k.size(1) == q.size(1) || k.size(1) == 0 ? 1 : q.size(1) / k.size(1);
}

at::Tensor sum_groups(const at::Tensor& t, int64_t groups) {
  if (groups == 1) return t;
  const auto s = t.sizes();
  return t.reshape({s[0], s[1] / groups, groups, s[2], s[3]}).sum(2);
}

at::Tensor repeat_heads(const at::Tensor& t, int64_t groups) {
  if (groups == 1) return t;
  const auto s = t.sizes();
  return t.unsqueeze(2)
      .expand({s[0], s[1], groups, s[2], s[3]})
      .reshape({s[0], s[1] * groups, s[2], s[3]});
}

KVMethod method_from(const char* value) {
  static const std::vector<KVMethod> methods = {KVMethod::kAuto, KVMethod::kRing,
                                                KVMethod::kAllGather};
  return methods[env_choice("TESSERA_CP_METHOD", value, {"auto", "ring", "allgather"}, 0)];
}

bool load_balance_from(const char* value) {
  const int i =
      env_choice("TESSERA_CP_LOAD_BALANCE", value, {"0", "1", "off", "on", "false", "true"}, 1);
  return i % 2 == 1;
}

int64_t scores_this_thread() { return scored(); }

bool composite_by_math(const at::Tensor& q) {
  return !q.device().is_cpu() ||
         block_kernel().load(std::memory_order_relaxed) == static_cast<int>(BlockKernel::kProducts);
}

BlockKernel block_kernel_from(const char* value) {
  static const std::vector<BlockKernel> kernels = {BlockKernel::kFusedOnCpu, BlockKernel::kProducts,
                                                   BlockKernel::kFused, BlockKernel::kEfficient};
  return kernels[env_choice("TESSERA_ATTENTION_BLOCKS", value,
                            {"auto", "products", "fused", "efficient"}, 0)];
}

BlockKernel set_block_kernel(BlockKernel kernel) {
  return static_cast<BlockKernel>(block_kernel().exchange(static_cast<int>(kernel)));
}

int64_t SeqSplit::q_offset(int64_t m) const {
  return std::accumulate(q_sizes.begin(), q_sizes.begin() + m, int64_t{0});
}

int64_t SeqSplit::kv_offset(int64_t m) const {
  return std::accumulate(kv_sizes.begin(), kv_sizes.begin() + m, int64_t{0});
}

int64_t SeqSplit::kv_total() const { return kv_offset(static_cast<int64_t>(kv_sizes.size())); }

}  // namespace tessera::ops::attention

namespace tessera {

ContextParallelMethod set_context_parallel_method(ContextParallelMethod method) {
  return static_cast<ContextParallelMethod>(
      ops::attention::method().exchange(static_cast<int>(method)));
}

bool set_context_parallel_load_balance(bool on) {
  return ops::attention::load_balance().exchange(on);
}

bool context_parallel_load_balance() {
  return ops::attention::load_balance().load(std::memory_order_relaxed);
}

ContextParallelMethod context_parallel_method() {
  return static_cast<ContextParallelMethod>(
      ops::attention::method().load(std::memory_order_relaxed));
}

}  // namespace tessera
