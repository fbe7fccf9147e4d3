// Binary cross entropy, on probabilities and on logits, with their backward ops.
//
// As for loss.cpp's elementwise losses: target, weight and pos_weight follow the input's
// layout (broadcast dims replicated); reduction=none is elementwise; sum is a local sum,
// Partial(sum) over the sharded mesh dims; mean runs with reduction=sum and divides by the
// *global* element count (exact on uneven shards, empty ones included). The backward of a
// reduced loss gets a whole scalar gradient and divides the same way. Partial inputs are
// reduced first (the losses are not linear).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"
#include "dim_layout.h"

namespace tessera::ops {

namespace {

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;  // at::Reduction

OpPlan binary_loss_rule(const OpCall& call) {
  const bool backward = call.has("grad_output");
  const DTensorSpec* self = call.spec("self");
  TORCH_CHECK(self, "tessera: ", call.describe(), ": the input must be distributed");
  auto in = std::make_shared<DTensorSpec>(self->partial_as_replicate());
  const int64_t reduction = call.arg<int64_t>("reduction");
  OpPlan plan(call);
  plan.input("self", in);
  for (const char* name : {"target", "weight", "pos_weight"})
    if (call.has(name))
      if (const auto* s = call.spec(name)) plan.input(name, align_to(*in, *s, false));
  if (backward) {
    const auto& g = *call.spec("grad_output");
    plan.input("grad_output", reduction == kNone ? align_to(*in, g, false) : replicated(g));
    plan.output(in);
  } else {
    plan.output(reduction == kNone ? in : summed_over_shards(*in, {}));
  }
  if (reduction == kMean) {
    const double count = static_cast<double>(self->numel());
    plan.local_kernel = [count](KernelCall& k) {
      k.set("reduction", c10::IValue(kSum));
      k.call_op();
      only_result(k) = only_result(k).toTensor().div(count);
    };
  }
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::binary_cross_entropy", "aten::binary_cross_entropy_backward",
                         "aten::binary_cross_entropy_with_logits",
                         "aten::binary_cross_entropy_with_logits_backward"})
    register_rule(op, binary_loss_rule);
}};

}  // namespace

}  // namespace tessera::ops
