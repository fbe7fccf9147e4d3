#pragma once
// The dtype attention and norm kernels (the context-parallel blocks, neighbourhood attention's
// local kernels, the norms' distributed kernels) accumulate in: float64 for double, else
// float32, as LibTorch's fused kernels keep their softmax statistics and log-sum-exp.
#include <c10/core/ScalarType.h>

namespace tessera::ops {

inline c10::ScalarType accumulate_type(c10::ScalarType t) {
  return t == c10::kDouble ? c10::kDouble : c10::kFloat;
}

}  // namespace tessera::ops
