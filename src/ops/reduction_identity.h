#pragma once
// Shared by the reduction families (reduction.cpp, reduction_collective.cpp).
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

namespace tessera::ops {

// A tensor of `shape` filled with the identity of max (is_max: the dtype's lowest value) or
// of min (its highest): what an empty shard contributes to a max / min reduction.
inline at::Tensor identity_fill(at::IntArrayRef shape, const at::TensorOptions& opts, bool is_max) {
  const auto dt = c10::typeMetaToScalarType(opts.dtype());
  if (at::isFloatingType(dt)) {
    const double inf = std::numeric_limits<double>::infinity();
    return at::full(shape, is_max ? -inf : inf, opts);
  }
  if (dt == at::kBool) return at::full(shape, !is_max, opts);
  int64_t v = 0;
  AT_DISPATCH_INTEGRAL_TYPES(dt, "tessera_identity_fill", [&] {
    v = is_max ? static_cast<int64_t>(std::numeric_limits<scalar_t>::lowest())
               : static_cast<int64_t>(std::numeric_limits<scalar_t>::max());
  });
  return at::full(shape, v, opts);
}

}  // namespace tessera::ops
