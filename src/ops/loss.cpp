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

#include "tessera/comm/collectives.h"
#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;  // at::Reduction

// forward(self, target, reduction, ...extra) / backward(grad, self, target, reduction, ...).
OpPlan loss_rule(const OpCall& call, size_t self_arg, bool backward) {
  const auto& self = *call.specs[self_arg];
  auto self_t = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  const int64_t reduction = call.args[self_arg + 2].toInt();
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[self_arg] = self_t;
  if (call.specs[self_arg + 1]) plan.inputs[self_arg + 1] = align_to(*self_t, *call.specs[self_arg + 1], false);
  if (backward) {
    const auto& grad = *call.specs[0];
    plan.inputs[0] = reduction == kNone ? align_to(*self_t, grad, false)
                                        : replicated(grad);  // a scalar gradient, whole
    plan.outputs.push_back(self_t);
  } else {
    plan.outputs.push_back(reduction == kNone ? self_t : summed_over_shards(*self_t, {}));
  }
  if (reduction == kMean) {
    // Run with reduction=sum and divide by the global count.
    const double count = static_cast<double>(self.numel());
    c10::OperatorHandle op = call.op;
    const size_t red = self_arg + 2;
    plan.stack_kernel = [op, count, red](torch::jit::Stack& stack) {
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
    if (call.specs[i]) plan.inputs[i] = align_to(*target, *call.specs[i], false);
  plan.outputs.push_back(target);
  return plan;
}

// _softmax(self, dim, half_to_float) / _log_softmax(...)
OpPlan softmax_rule(const OpCall& call) { return softmax_layout(call, 0, 1, {0}); }
// _softmax_backward_data(grad_output, output, dim, input_dtype)
OpPlan softmax_backward_rule(const OpCall& call) { return softmax_layout(call, 1, 2, {0, 1}); }

SpecPtr replicated_scalar(const DTensorSpec& like) {
  return std::make_shared<DTensorSpec>(like.mesh(), Placements(like.mesh().ndim(), Replicate()),
                                       std::vector<int64_t>{}, like.dtype());
}

// NOTE: [nll_loss on shards]
// The class dim must be whole; batch and spatial dims may stay sharded (target follows).
// mean = sum(w_t * -x_t) / sum(w_t) over the *whole* batch: the local kernel runs with
// reduction=sum and divides by the global total weight (one scalar all-reduce per sharded
// mesh dim: ignore_index makes the count data-dependent). The backward gets that global
// total weight from autograd and is local.
struct NllLayout {
  SpecPtr self, target;
  std::vector<int64_t> sharded_mesh_dims;
};

NllLayout nll_layout(const OpCall& call, size_t self_arg) {
  const auto& self = *call.specs[self_arg];
  const int64_t cdim = self.ndim() >= 2 ? 1 : 0;
  Placements p = self.placements();
  auto tables = self.shard_tables();
  for (auto& x : p)
    if (x.is_partial() || x.is_shard(cdim)) x = Replicate();
  tables[cdim].clear();
  auto self_t = std::make_shared<DTensorSpec>(self.mesh(), p, self.sizes(), self.dtype(), tables);
  const auto* target = call.specs[self_arg + 1];
  TORCH_CHECK(target, "tessera: ", call.describe(), ": the target must be a tensor");
  Placements tp = p;
  std::vector<ShardTable> ttables(target->ndim());
  std::vector<int64_t> sharded;
  for (size_t m = 0; m < tp.size(); ++m) {
    if (!tp[m].is_shard()) continue;
    sharded.push_back(static_cast<int64_t>(m));
    const int64_t t = tp[m].dim();
    const int64_t tt = t < cdim ? t : t - 1;
    ttables[tt] = self_t->shard_table(t);
    tp[m] = Shard(tt);
  }
  auto target_t = std::make_shared<DTensorSpec>(self.mesh(), tp, target->sizes(), target->dtype(), ttables);
  return {self_t, target_t, sharded};
}

// nll_loss_forward / nll_loss2d_forward(self, target, weight?, reduction, ignore_index)
OpPlan nll_rule(const OpCall& call) {
  auto l = nll_layout(call, 0);
  const int64_t reduction = call.args[3].toInt();
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = l.self;
  plan.inputs[1] = l.target;
  if (call.specs[2]) plan.inputs[2] = replicated(*call.specs[2]);
  if (reduction == kNone) {
    plan.outputs = {std::make_shared<DTensorSpec>(l.target->mesh(), l.target->placements(),
                                                  l.target->sizes(), l.self->dtype(),
                                                  l.target->shard_tables()),
                    replicated_scalar(*l.self)};
    return plan;
  }
  plan.outputs = {summed_over_shards(*l.self, {}), reduction == kSum ? summed_over_shards(*l.self, {}) : replicated_scalar(*l.self)};
  if (reduction == kMean) {
    c10::OperatorHandle op = call.op;
    DeviceMesh mesh = l.self->mesh();
    auto dims = l.sharded_mesh_dims;
    plan.stack_kernel = [op, mesh, dims](torch::jit::Stack& stack) {
      stack[3] = c10::IValue(kSum);
      op.callBoxed(&stack);
      at::Tensor total = stack[1].toTensor();
      for (auto d : dims) total = comm::all_reduce(mesh.group(d), total, PartialOp::Sum);
      stack[0] = stack[0].toTensor().div(total);
      stack[1] = total;
    };
  }
  return plan;
}

// nll_loss_backward / nll_loss2d_backward(grad_output, self, target, weight?, reduction,
//                                         ignore_index, total_weight)
OpPlan nll_backward_rule(const OpCall& call) {
  auto l = nll_layout(call, 1);
  const int64_t reduction = call.args[4].toInt();
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[1] = l.self;
  plan.inputs[2] = l.target;
  if (call.specs[3]) plan.inputs[3] = replicated(*call.specs[3]);
  plan.inputs[0] = reduction == kNone
                       ? std::make_shared<DTensorSpec>(l.target->mesh(), l.target->placements(),
                                                       l.target->sizes(), call.specs[0]->dtype(),
                                                       l.target->shard_tables())
                       : replicated(*call.specs[0]);
  // total_weight: used only by mean, where the forward made it global already.
  plan.outputs.push_back(l.self);
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::nll_loss_forward", nll_rule);
  register_rule("aten::nll_loss2d_forward", nll_rule);
  register_rule("aten::nll_loss_backward", nll_backward_rule);
  register_rule("aten::nll_loss2d_backward", nll_backward_rule);
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
