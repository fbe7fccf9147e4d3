// Elementwise losses (mse, smooth_l1, huber) and softmax / log_softmax.
//
// Losses: target follows the input's layout. reduction=none is pointwise; sum gives a local
// sum that is Partial(sum) over the sharded mesh dims; mean divides that local sum by the
// *global* element count (exact on uneven shards). The backward of mean scales by the global
// count the same way. Partial inputs are made whole first (losses are not linear).
//
// Softmax over an unsharded dim is local; over a sharded dim that mesh dim is replicated
// first (one all-gather; the result is re-sharded by whoever needs it sharded).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;  // at::Reduction

// `other`'s layout lined up with `ref` (same shard dims; Partial never kept).
SpecPtr aligned(const DTensorSpec& ref, const DTensorSpec& other) {
  const int64_t shift = ref.ndim() - other.ndim();
  Placements p = ref.placements();
  std::vector<ShardTable> tables(other.ndim());
  for (auto& x : p) {
    if (x.is_partial()) x = Replicate();
    if (!x.is_shard()) continue;
    const int64_t t = x.dim() - shift;
    if (t < 0 || other.sizes()[t] != ref.sizes()[x.dim()]) {
      x = Replicate();
      continue;
    }
    tables[t] = ref.shard_table(x.dim());
    x = Shard(t);
  }
  return std::make_shared<DTensorSpec>(ref.mesh(), p, other.sizes(), other.dtype(), tables);
}

// 0-dim result of reducing everything of `in`: Partial(sum) where `in` is sharded.
SpecPtr reduced_scalar(const DTensorSpec& in) {
  Placements p = in.placements();
  for (auto& x : p) x = x.is_shard() ? Partial() : Replicate();
  return std::make_shared<DTensorSpec>(in.mesh(), p, std::vector<int64_t>{}, in.dtype());
}

// forward(self, target, reduction, ...extra) / backward(grad, self, target, reduction, ...).
OpPlan loss_rule(const OpCall& call, size_t self_arg, bool backward) {
  const auto& self = *call.specs[self_arg];
  auto self_t = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  const int64_t reduction = call.args[self_arg + 2].toInt();
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[self_arg] = self_t;
  if (call.specs[self_arg + 1]) plan.inputs[self_arg + 1] = aligned(*self_t, *call.specs[self_arg + 1]);
  if (backward) {
    const auto& grad = *call.specs[0];
    plan.inputs[0] = reduction == kNone ? aligned(*self_t, grad)
                                        : replicated(grad);  // a scalar gradient, whole
    plan.outputs.push_back(self_t);
  } else {
    plan.outputs.push_back(reduction == kNone ? self_t : reduced_scalar(*self_t));
  }
  if (reduction == kMean) {
    // Run with reduction=sum and divide by the global count.
    const double count = static_cast<double>(self.numel());
    c10::OperatorHandle op = call.op;
    const size_t red = self_arg + 2;
    plan.local_kernel = [op, count, red](torch::jit::Stack& stack) {
      stack[red] = c10::IValue(kSum);
      op.callBoxed(&stack);
      stack.back() = stack.back().toTensor().div(count);
    };
  }
  return plan;
}

OpPlan loss_forward(const OpCall& call) { return loss_rule(call, 0, false); }
OpPlan loss_backward(const OpCall& call) { return loss_rule(call, 1, true); }

OpPlan softmax_layout(const OpCall& call, size_t tensor_arg, size_t dim_arg,
                      const std::vector<size_t>& inputs) {
  const auto& in = *call.specs[tensor_arg];
  int64_t dim = call.args[dim_arg].toInt();
  if (dim < 0) dim += in.ndim();
  Placements p = in.placements();
  auto tables = in.shard_tables();
  for (auto& x : p) {
    if (x.is_partial() || x.is_shard(dim)) x = Replicate();
  }
  tables[dim].clear();
  auto target = std::make_shared<DTensorSpec>(in.mesh(), p, in.sizes(), in.dtype(), tables);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  for (auto i : inputs)
    if (call.specs[i]) plan.inputs[i] = aligned(*target, *call.specs[i]);
  plan.outputs.push_back(target);
  return plan;
}

// _softmax(self, dim, half_to_float) / _log_softmax(...)
OpPlan softmax_rule(const OpCall& call) { return softmax_layout(call, 0, 1, {0}); }
// _softmax_backward_data(grad_output, output, dim, input_dtype)
OpPlan softmax_backward_rule(const OpCall& call) { return softmax_layout(call, 1, 2, {0, 1}); }

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::mse_loss", "aten::smooth_l1_loss", "aten::huber_loss",
                         "aten::soft_margin_loss"})
    register_rule(op, loss_forward);
  for (const char* op : {"aten::mse_loss_backward", "aten::smooth_l1_loss_backward",
                         "aten::huber_loss_backward", "aten::soft_margin_loss_backward"})
    register_rule(op, loss_backward);
  register_rule("aten::_softmax", softmax_rule);
  register_rule("aten::_log_softmax", softmax_rule);
  register_rule("aten::_softmax_backward_data", softmax_backward_rule);
  register_rule("aten::_log_softmax_backward_data", softmax_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
