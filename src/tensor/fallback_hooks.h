#pragma once
// Checks other layers install into the fallback (internal).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/ArrayRef.h>

namespace tessera {

// Called for an op that mixes plain tensors with distributed ones, before its rule runs, with
// the distributed arguments' impls and the plain tensors. Tensor parallelism installs one
// while parameters exist that must not meet plain activations (NOTE: [Plain operands at
// modules Tessera cannot intercept] in parallel/tp_boundary.cpp).
using PlainOperandCheck = void (*)(const c10::OperatorHandle& op,
                                   c10::ArrayRef<const c10::TensorImpl*> distributed,
                                   c10::ArrayRef<at::Tensor> plain);
void set_plain_operand_check(PlainOperandCheck check);

}  // namespace tessera
