#pragma once
// Private to the tensor layer: the boxed fallback as the typed fast path calls it.
// See NOTE: [Fast path] in fast_path.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "tessera/placement/spec.h"

namespace tessera::detail {

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
