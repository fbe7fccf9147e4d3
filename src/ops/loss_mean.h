#pragma once
// reduction=mean over a sharded batch: each rank sums its own terms and divides by the global
// count, so the Partial(sum) of the results is the global mean.
#include <ATen/core/Reduction.h>
#include <ATen/core/Tensor.h>

#include "tessera/tensor/rule.h"
#include "dim_layout.h"

namespace tessera::ops {

inline LocalKernel sum_then_divide_by(double count) {
  return [count](KernelCall& k) {
    k.set("reduction", int64_t{at::Reduction::Sum});
    k.call_op();
    const at::Tensor sum = only_result(k).toTensor();
    k.finish({sum.div(count)});
  };
}

}  // namespace tessera::ops
