#pragma once
// Halo exchange along one sharded tensor dim (the building block of domain-parallel window
// ops). Every member of the group knows every shard's size (the spec's table), so each can
// work out, without talking, which rows every other member needs from it: rows are fetched
// from whichever ranks own them (also beyond the direct neighbours when shards are thinner
// than the halo), in one all-to-all-v that moves exactly the halo rows.
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/comm/collectives.h"

namespace tessera::comm {

enum class HaloBoundary : uint8_t {
  Zeros,     // rows outside the global domain are zeros
  Periodic,  // the domain wraps around (circular padding)
};

// The local shard extended by `before` rows that precede it and `after` rows that follow it
// along `dim` in global order. sizes[i] = member i's extent along dim.
at::Tensor halo_exchange(const Group& pg, const at::Tensor& x, int64_t dim,
                         const std::vector<int64_t>& sizes, int64_t before, int64_t after,
                         HaloBoundary boundary);

// The adjoint: given the gradient of an extended shard (before + local + after rows), returns
// the gradient of the local shard, with every halo row's gradient sent back to its owner and
// added into the owner's rows.
at::Tensor halo_exchange_backward(const Group& pg, const at::Tensor& grad_extended, int64_t dim,
                                  const std::vector<int64_t>& sizes, int64_t before,
                                  int64_t after, HaloBoundary boundary);

}  // namespace tessera::comm
