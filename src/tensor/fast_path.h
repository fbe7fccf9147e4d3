#pragma once
// Private to the tensor layer: the boxed fallback as the typed fast path calls it.
// See NOTE: [Fast path] in fast_path.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "tessera/placement/spec.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::detail {

// The wrapper of a distributed tensor, or nullptr: one bit test for the key, then an exact
// type check (DTensorImpl is final; cheaper than dynamic_cast on the hot path).
inline DTensorImpl* as_dtensor(const at::Tensor& t) {
  if (!t.defined() || !t.key_set().has(c10::DispatchKey::PrivateUse1)) return nullptr;
  auto* impl = t.unsafeGetTensorImpl();
  return typeid(*impl) == typeid(DTensorImpl) ? static_cast<DTensorImpl*>(impl) : nullptr;
}

// Whether an in-place write into `t` reaches what it views: false for a view whose shard is
// a copy (NOTE: [Head-tail arguments]; NOTE: [view of a strided shard]). Views only.
inline bool writes_reach_base(const at::Tensor& t) {
  if (!t.is_view()) return true;
  const auto* self = as_dtensor(t);
  const c10::TensorImpl* b = t._base().unsafeGetTensorImpl();  // (a TensorBase on 2.x)
  const auto* base =
      typeid(*b) == typeid(DTensorImpl) ? static_cast<const DTensorImpl*>(b) : nullptr;
  return !self || !base || self->local().is_alias_of(base->local());
}

// What a fallback call tells the fast path: whether replaying it needs nothing but the op on
// the local shards (no redistribution, no kernel, no implicit conversion, one result), and
// the result's spec (null when the result is the first argument, updated in place with its
// spec unchanged).
struct FallbackReport {
  bool replayable = false;
  SpecPtr output;
  std::vector<std::pair<int, c10::IValue>> local_args;  // the plan's argument replacements
};

void dtensor_fallback_reporting(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                                FallbackReport* report);

}  // namespace tessera::detail
