#pragma once
// Halo exchange along one sharded tensor dim: the building block of domain-parallel window
// ops (convolution, pooling, interpolation, padding).
//
// Each member of the group asks for a *window*: a range of global rows [lo, hi) that may
// extend past its own shard (halo), stop short of it (stride > 1 leaves rows unread), or
// reach past the global domain (padding). Every member knows every shard's size (the spec's
// table) and every member's window (they follow from replicated arguments), so each works
// out without talking which of its rows every other member needs. Rows come from whichever
// ranks own them, also beyond the direct neighbours when shards are thinner than the halo:
// a member never fails because a neighbour is thin. Rows outside the domain follow the
// boundary rule.
//
// Transport: point-to-point send/recv to exactly the members that share rows (default on
// Gloo), or one all-to-all-v with zero splits elsewhere (NCCL, or TESSERA_HALO=alltoall).
// Either way each rank sends and receives exactly its halo rows, never its interior.
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/comm/collectives.h"

namespace tessera::comm {

enum class HaloBoundary : uint8_t {
  Zeros,      // rows outside the domain take the fill value (0 unless given)
  Periodic,   // the domain wraps around (circular padding)
  Reflect,    // mirrored without repeating the edge row (reflection padding)
  Replicate,  // the edge row repeats (replication padding)
};

struct Window {
  int64_t lo = 0, hi = 0;  // global rows [lo, hi); may reach outside [0, total)
  int64_t size() const { return hi > lo ? hi - lo : 0; }
};

// Member `me`'s window as a tensor (rows lo..hi along `dim`). sizes[i] = member i's extent
// along dim; windows[i] = member i's window (all members pass the same vectors). A null
// group stands for a group of one (no communication: padding only).
at::Tensor fetch_window(const Group& pg, const at::Tensor& x, int64_t dim,
                        const std::vector<int64_t>& sizes, const std::vector<Window>& windows,
                        HaloBoundary boundary, double fill = 0.0);

// The same exchange, left in flight: start it, compute what needs no halo, then wait() for
// the window. Exchanges in flight at the same time on one group need distinct tags.
using PendingWindow = Pending<at::Tensor>;
PendingWindow fetch_window_async(const Group& pg, const at::Tensor& x, int64_t dim,
                                 const std::vector<int64_t>& sizes,
                                 const std::vector<Window>& windows, HaloBoundary boundary,
                                 double fill = 0.0, int tag = 0);

// The adjoint: given the gradient of this member's window, returns the gradient of its
// shard. Every window row's gradient goes back to the row's owner and is added there (a row
// read twice, as reflection can, gets both); rows outside the domain under Zeros drop out.
at::Tensor fetch_window_backward(const Group& pg, const at::Tensor& grad_window, int64_t dim,
                                 const std::vector<int64_t>& sizes,
                                 const std::vector<Window>& windows, HaloBoundary boundary);
// The same, left in flight (distinct tags for exchanges in flight together, as above).
PendingWindow fetch_window_backward_async(const Group& pg, const at::Tensor& grad_window,
                                          int64_t dim, const std::vector<int64_t>& sizes,
                                          const std::vector<Window>& windows, HaloBoundary boundary,
                                          int tag = 0);

// The common case: every member extends its own shard by `before` rows in front and
// `after` rows behind.
at::Tensor halo_exchange(const Group& pg, const at::Tensor& x, int64_t dim,
                         const std::vector<int64_t>& sizes, int64_t before, int64_t after,
                         HaloBoundary boundary);
at::Tensor halo_exchange_backward(const Group& pg, const at::Tensor& grad_extended, int64_t dim,
                                  const std::vector<int64_t>& sizes, int64_t before, int64_t after,
                                  HaloBoundary boundary);

// Exactly the bytes the exchange above moves to (or from) this member: the rows of its
// window owned by other members, times the bytes of one row.
int64_t halo_rows_received(int64_t me, const std::vector<int64_t>& sizes,
                           const std::vector<Window>& windows, HaloBoundary boundary);

}  // namespace tessera::comm
