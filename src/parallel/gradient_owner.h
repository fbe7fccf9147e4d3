#pragma once
// Parameters whose gradients a data-parallel reducer owns (internal to parallel/).
//
// replace_parameter gives every distributed parameter a hook that moves its gradient to the
// parameter's layout as it arrives (one all-reduce per parameter for a replicated weight).
// A reducer that batches those reductions into buckets marks its parameters here, and the
// hook then leaves their gradients as they arrive (Partial sums), for the reducer to reduce.
#include <c10/core/TensorImpl.h>

namespace tessera::detail {

void set_gradient_owned(const c10::TensorImpl* param, bool owned);
bool gradient_owned(const c10::TensorImpl* param);

}  // namespace tessera::detail
