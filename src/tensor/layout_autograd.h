#pragma once
// The differentiable layout changes the public entry points are made of (layout_autograd.cpp).
#include <ATen/core/Tensor.h>

#include "tessera/placement/spec.h"

namespace tessera::detail {

// x (distributed) moved to `target`; its backward moves the gradient back.
at::Tensor redistribute_to(const at::Tensor& x, const SpecPtr& target);
// `local` wrapped as a distributed tensor with `spec` (from_local); differentiable.
at::Tensor wrap_local(const at::Tensor& local, const SpecPtr& spec);
// scatter's backward on `out`: the source rank gets the full gradient, the others zeros.
void connect_scatter_backward(at::Tensor& out, const at::Tensor& full, const SpecPtr& spec,
                              bool is_src);

}  // namespace tessera::detail
