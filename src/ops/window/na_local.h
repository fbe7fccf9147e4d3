#pragma once
// Neighbourhood attention on one process: the window rule per axis, the tap tables built from
// it, and the forward / backward kernels on K/V windows. Shared by the public op
// (src/nn/neighborhood_attention.cpp) and its domain-parallel rule
// (src/ops/window/neighborhood_attention.cpp), which both call the same kernels: the sharded
// rule only changes which queries a rank computes and which K/V rows it holds.
//
// Positions are global. A rank computes the queries [q_begin, q_begin + nq) of each axis and
// holds the K/V rows [kv_begin, kv_begin + kv_len) (its window: the union of its queries'
// key windows, fetched from their owners). On one process q_begin = 0 and the window is the
// whole axis (plus the wrap-around margins of a circular axis).
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "tessera/comm/halo.h"

namespace tessera::nn::detail {

// One spatial axis of the op (NATTEN's per-axis arguments).
struct NAAxis {
  int64_t length = 0;    // global extent L
  int64_t kernel = 1;    // k (> 1)
  int64_t dilation = 1;  // d
  int64_t stride = 1;    // s (1 <= s <= k)
  bool causal = false;
  // The axis wraps around (a periodic domain): the window is centred on the stride leader and
  // its rows are taken modulo L; never shifted inward. Not with causal.
  bool circular = false;
};

// The global key rows query i reads along one axis, in tap order (k rows; a causal window
// near its start holds fewer, the list is then shorter). Circular rows are unwrapped (may lie
// outside [0, L)); take them modulo L for the key itself.
//
// With g = i mod d (dilation group), x = i div d, n_g = ceil((L - g) / d), left = k / 2:
//   non-causal: leader l = min(floor(x/s)*s + floor(s/2), n_g - 1),
//               rows g + d*(a + t), t < k, a = clamp(l - left, 0, n_g - k)  (NATTEN's rule);
//   causal:     l = min(floor(x/s)*s + s - 1, n_g - 1), rows g + d*y, max(l - k + 1, 0) <= y <= x;
//   circular:   the non-causal leader l, never shifted: rows g + d*(l - left + t), t < k,
//               unwrapped. The key of row r is r mod L: the physical position in the periodic
//               domain (when L mod d != 0 a wrapped row may land in another dilation group;
//               the k rows stay distinct since k*d <= L).
// The relative offset of key row y (unwrapped) from query i is (y - i) / d, in group units;
// it lies in [-(k-1), k-1] for every rule, so rel = (y - i) / d + k - 1 is in [0, 2k-2].
// (For a circular axis with s = 1 this is t - left + k - 1.)
std::vector<int64_t> window_rows(const NAAxis& a, int64_t i);

// The K/V rows [lo, hi) queries [q_lo, q_hi) read (the union of their windows); empty when
// q_hi <= q_lo. Circular windows may reach outside [0, L) (fetch them periodically).
comm::Window reads(const NAAxis& a, int64_t q_lo, int64_t q_hi);

// Per axis, for nq queries from q_begin and a K/V window of kv_len rows from kv_begin:
// idx[i][t] = local row (in the window) of query i's tap t; valid[i][t] = false only for
// causal taps past the window's end (idx then repeats a valid row); rel[i][t] = the rpb
// entry of the pair, (y - x) + k - 1 in dilation-group units. Shapes [nq, k], int64 / bool.
struct TapTable {
  at::Tensor idx, valid, rel;
};
TapTable tap_table(const NAAxis& a, int64_t q_begin, int64_t nq, int64_t kv_begin, int64_t kv_len);

// Argument checks on global sizes (so every rank raises the same error): kernel > 1,
// 1 <= stride <= kernel, dilation >= 1, kernel * dilation <= L, no rpb with a causal axis, no
// causal circular axis, layouts [B, *S, H, D] with H % H_kv == 0, extra keys/values
// [B, N, H_kv, D / Dv]. `op` names the caller in the message ("tessera::na2d").
void check_arguments(const char* op, at::IntArrayRef q, at::IntArrayRef k, at::IntArrayRef v,
                     const std::vector<NAAxis>& axes, const c10::optional<at::Tensor>& rpb,
                     const c10::optional<at::Tensor>& additional_keys,
                     const c10::optional<at::Tensor>& additional_values);

// The axes of a call from the op's per-axis lists (one entry per spatial axis of q, which is
// [B, *S, H, D]); checks only the list lengths (check_arguments does the rest).
std::vector<NAAxis> make_axes(const char* op, at::IntArrayRef q, at::IntArrayRef kernel_size,
                              at::IntArrayRef stride, at::IntArrayRef dilation,
                              const std::vector<bool>& is_causal,
                              const std::vector<bool>& circular);

// Dtype and device checks on the (local) tensors: float32, float64, float16 or bfloat16, the
// same everywhere, one device. Undefined rpb / extra keys / values are skipped. (Half
// precision is computed in float32; lse is float32 then.)
void check_tensors(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& rpb, const at::Tensor& extra_k, const at::Tensor& extra_v);

// Forward on windows (the blocked kernel or the tap loop: NOTE: [Blocked neighbourhood
// attention]). q [B, *Sq, H, D] (the rank's queries), k_win [B, *Skv, H_kv, D],
// v_win [B, *Skv, H_kv, Dv] (its K/V windows), tables per axis (tap_table with Sq / Skv),
// rpb [H, 2k1-1, ...] or undefined, extra keys/values [B, N, H_kv, D / Dv] or undefined.
// Returns out [B, *Sq, H, Dv] in q's dtype and lse [B, *Sq, H] (float32, float64 for
// double inputs). Memory O(B * Sq * H * prod(k)): never the full attention matrix.
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k_win,
                                           const at::Tensor& v_win,
                                           const std::vector<TapTable>& tables, double scale,
                                           const at::Tensor& rpb, const at::Tensor& extra_k,
                                           const at::Tensor& extra_v);

// Backward on the same windows: (dq, dk_win, dv_win, drpb, dextra_k, dextra_v); the last
// three undefined when their inputs are. dk_win / dv_win have the windows' shapes (the
// caller sends their rows home).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k_win,
    const at::Tensor& v_win, const at::Tensor& out, const at::Tensor& lse,
    const std::vector<TapTable>& tables, double scale, const at::Tensor& rpb,
    const at::Tensor& extra_k, const at::Tensor& extra_v);

// NOTE: [Blocked neighbourhood attention]
// The tap loop (forward / backward above) makes prod(k) passes of gathers and element-wise
// products over all queries: memory-bound on a CPU, and on a GPU a few kernel launches per tap
// (launch-bound below about 256^2). The blocked kernels cut the queries into tiles of about 64
// (8 x 8 in 2-D) and compute each tile against its box, the K/V rows its windows span
// (tile + (k - 1) * d rows per axis), as matrix products: logits = Q_tile K_box^T plus a 0 /
// -inf mask (and the bias) per (query, box row), softmax, P V_box; backward the same products
// transposed, dK / dV boxes added back into the window. A box holds more keys than the k per
// axis a query needs (4x at k = 7 in 2-D), but matrix products run far faster than gathers,
// and the launches no longer scale with prod(k). Tiles go in chunks of a bounded number of
// logits, so memory stays O(chunk) beyond the outputs. Both kernels give the same result (the
// unit tests run each against the dense oracle); `kAuto` takes the blocked one unless dilation
// or stride spread a tile's windows so far apart that its box holds over 8x the needed keys.
enum class LocalKernel { kAuto, kTaps, kBlocked };
// Process-wide, from TESSERA_NA_KERNEL=auto|taps|blocked (default auto); tests pin one here.
// Returns the previous choice.
LocalKernel set_local_kernel(LocalKernel kernel);
// Whether forward / backward take the blocked kernels for these tables and window extents.
bool use_blocked(const std::vector<TapTable>& tables, at::IntArrayRef kv_spatial);
// The blocked kernels; arguments and results as forward / backward.
std::tuple<at::Tensor, at::Tensor> blocked_forward(const at::Tensor& q, const at::Tensor& k_win,
                                                   const at::Tensor& v_win,
                                                   const std::vector<TapTable>& tables,
                                                   double scale, const at::Tensor& rpb,
                                                   const at::Tensor& extra_k,
                                                   const at::Tensor& extra_v);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> blocked_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k_win,
    const at::Tensor& v_win, const at::Tensor& out, const at::Tensor& lse,
    const std::vector<TapTable>& tables, double scale, const at::Tensor& rpb,
    const at::Tensor& extra_k, const at::Tensor& extra_v);

// NOTE: [K/V windows kept for backward]
// The sharded forward fetches this rank's K/V windows (its rows plus the halo); backward reads
// the same windows. Fetching them again would move twice the forward's halo, so the autograd
// kernel, when a gradient will be taken, opens a KeepWindows scope around the forward call:
// the sharded kernel leaves its windows there and the autograd node saves them (memory: one
// more K/V window per op until backward). Around the backward call an OfferWindows scope hands
// them back, and the sharded backward kernel uses them instead of fetching. Both scopes are
// thread-local and span one synchronous dispatcher call, so no other op sees them; outside
// them (no gradient, the backward op called directly) the kernels fetch as before.
struct KVWindows {
  at::Tensor k, v;
};
class KeepWindows {
 public:
  explicit KeepWindows(KVWindows* into);
  ~KeepWindows();
  KeepWindows(const KeepWindows&) = delete;
  KeepWindows& operator=(const KeepWindows&) = delete;

 private:
  KVWindows* previous_;
};
class OfferWindows {
 public:
  explicit OfferWindows(const KVWindows* windows);
  ~OfferWindows();
  OfferWindows(const OfferWindows&) = delete;
  OfferWindows& operator=(const OfferWindows&) = delete;

 private:
  const KVWindows* previous_;
};
// Inside a KeepWindows scope: where the sharded forward leaves its windows (else nullptr).
KVWindows* windows_to_keep();
// Inside an OfferWindows scope with windows: the forward's windows (else nullptr). Taken once:
// a second sharded backward in the same scope fetches.
const KVWindows* take_offered_windows();

}  // namespace tessera::nn::detail
