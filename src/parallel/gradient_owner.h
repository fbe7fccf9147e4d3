#pragma once
// Parameters whose gradients a data-parallel reducer owns (internal to parallel/).
//
// replace_parameter gives every distributed parameter a hook that moves its gradient to the
// parameter's layout as it arrives (one all-reduce per parameter for a replicated weight).
// A reducer that batches those reductions into buckets marks its parameters here, and the
// hook then leaves their gradients as they arrive (Partial sums), for the reducer to reduce.
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

namespace tessera::detail {

void set_gradient_owned(const c10::TensorImpl* param, bool owned);
bool gradient_owned(const c10::TensorImpl* param);

// NOTE: [Keeping the user's parameter objects]
// An optimizer built before replicate / fully_shard / distribute_module holds the module's
// original (plain) parameter tensors, which a swap would orphan: training would silently do
// nothing. Instead the original becomes a view of the new parameter's local tensor
// (set_data), so a step on it updates the distributed parameter in place, and whoever writes
// the distributed parameter's gradient hands the gradient's local tensor to the original
// (hand_gradient_to_user). The original is held until nothing but this binding holds it.
// Per-element optimizers (SGD, Adam, AdamW, Adagrad, RMSprop) then equal one device.
void adopt_user_parameter(const at::Tensor& user, const at::Tensor& dist);
// user.grad = the local tensor of dist.grad (both undefined alike).
void hand_gradient_to_user(const c10::TensorImpl* dist);
// Before a gradient is accumulated into dist: a gradient the user dropped on the original
// (zero_grad with set_to_none) is dropped on dist too, so nothing stale is added to.
void drop_gradient_the_user_dropped(const c10::TensorImpl* dist);
// The original's version (bumped by an optimizer step on it), 0 when none is bound.
int64_t user_parameter_version(const c10::TensorImpl* dist);

}  // namespace tessera::detail
