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
#include <ATen/core/Reduction.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>

#include "tessera/comm/collectives.h"
#include "loss_mean.h"
#include "tessera/tensor/rule.h"
#include "dim_layout.h"

namespace tessera::ops {

namespace {

// forward(self, target, reduction, ...) / backward(grad_output, self, target, reduction, ...).
OpPlan loss_rule(const OpCall& call) {
  const bool backward = call.has("grad_output");
  const auto& self = *call.spec("self");
  auto self_t = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  const int64_t reduction = call.arg<int64_t>("reduction");
  OpPlan plan(call);
  plan.input("self", self_t);
  if (const auto* target = call.spec("target"))
    plan.input("target", align_to(*self_t, *target, false));
  if (backward) {
    const auto& grad = *call.spec("grad_output");
    plan.input("grad_output", reduction == at::Reduction::None
                                  ? align_to(*self_t, grad, false)
                                  : replicated(grad));  // a scalar gradient, whole
    plan.output(self_t);
  } else {
    plan.output(reduction == at::Reduction::None ? self_t : summed_over_shards(*self_t, {}));
  }
  if (reduction == at::Reduction::Mean) {
    // Run with reduction=sum and divide by the global count.
    const double count = static_cast<double>(self.numel());
    plan.local_kernel = sum_then_divide_by(count);
  }
  return plan;
}

// _softmax(self, dim, half_to_float) / _log_softmax(...) and their backward
// (grad_output, output, dim, input_dtype): dim whole, no Partial.
OpPlan softmax_rule(const OpCall& call) {
  const bool backward = call.has("grad_output");
  const auto& in = *call.spec(backward ? "output" : "self");
  const int64_t dim = c10::maybe_wrap_dim(call.arg<int64_t>("dim"), in.ndim());
  auto target = std::make_shared<DTensorSpec>(in.replicate_where(
      [dim](int64_t, const Placement& x) { return x.is_partial() || x.is_shard(dim); }));
  OpPlan plan(call);
  for (const char* name : {"self", "grad_output", "output"})
    if (call.has(name) && call.spec(name))
      plan.input(name, align_to(*target, *call.spec(name), false));
  plan.output(target);
  return plan;
}

SpecPtr replicated_scalar(const DTensorSpec& like) {
  return std::make_shared<DTensorSpec>(like.mesh(), Placements(like.mesh().ndim(), Replicate()),
                                       std::vector<int64_t>{}, like.dtype());
}

// NOTE: [nll_loss on shards]
// The class dim must be whole; batch and spatial dims may stay sharded (target follows).
// mean = sum(w_t * -x_t) / sum(w_t) over the *whole* batch: the distributed kernel runs with
// reduction=sum and divides by the global total weight (one scalar all-reduce per sharded
// mesh dim: ignore_index makes the count data-dependent). The backward gets that global
// total weight from autograd and is local.
struct NllLayout {
  SpecPtr self, target;
  std::vector<int64_t> sharded_mesh_dims;
};

// The layouts of self and target, forward and backward alike.
NllLayout nll_layout(const OpCall& call) {
  const auto& self = *call.spec("self");
  const int64_t cdim = self.ndim() >= 2 ? 1 : 0;
  auto self_t = std::make_shared<DTensorSpec>(self.replicate_where(
      [cdim](int64_t, const Placement& x) { return x.is_partial() || x.is_shard(cdim); }));
  const auto* target = call.spec("target");
  TORCH_CHECK(target, "tessera: ", call.describe(), ": the target must be a tensor");
  Placements tp = self_t->placements();
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
  auto target_t =
      std::make_shared<DTensorSpec>(self.mesh(), tp, target->sizes(), target->dtype(), ttables);
  return {self_t, target_t, sharded};
}

// The inputs both nll rules share: self and target as laid out, the class weights whole.
OpPlan nll_inputs(const OpCall& call, const NllLayout& l) {
  OpPlan plan(call);
  plan.input("self", l.self).input("target", l.target);
  if (const auto* weight = call.spec("weight")) plan.input("weight", replicated(*weight));
  return plan;
}

// target's layout with another dtype (the unreduced loss and its gradient).
SpecPtr like_target(const NllLayout& l, c10::ScalarType dtype) {
  return std::make_shared<DTensorSpec>(l.target->mesh(), l.target->placements(), l.target->sizes(),
                                       dtype, l.target->shard_tables());
}

// nll_loss_forward / nll_loss2d_forward(self, target, weight?, reduction, ignore_index)
//   -> (output, total_weight)
OpPlan nll_rule(const OpCall& call) {
  const auto l = nll_layout(call);
  const int64_t reduction = call.arg<int64_t>("reduction");
  OpPlan plan = nll_inputs(call, l);
  if (reduction == at::Reduction::None) {
    plan.output(like_target(l, l.self->dtype())).output(replicated_scalar(*l.self));
    return plan;
  }
  plan.output(summed_over_shards(*l.self, {}));
  plan.output(reduction == at::Reduction::Sum ? summed_over_shards(*l.self, {})
                                              : replicated_scalar(*l.self));
  if (reduction == at::Reduction::Mean) {
    const auto dims = l.sharded_mesh_dims;
    plan.distributed_kernel = [dims](KernelCall& k, const DeviceMesh& mesh) {
      k.set("reduction", int64_t{at::Reduction::Sum});
      k.call_op();
      const at::Tensor output = result_named(k, "output").toTensor();
      at::Tensor total = result_named(k, "total_weight").toTensor();
      for (auto d : dims) total = comm::all_reduce(mesh.group(d), total, PartialOp::Sum);
      k.finish({output.div(total), total});
    };
  }
  return plan;
}

// nll_loss_backward / nll_loss2d_backward(grad_output, self, target, weight?, reduction,
//                                         ignore_index, total_weight)
OpPlan nll_backward_rule(const OpCall& call) {
  const auto l = nll_layout(call);
  const int64_t reduction = call.arg<int64_t>("reduction");
  OpPlan plan = nll_inputs(call, l);
  const auto& grad = *call.spec("grad_output");
  plan.input("grad_output",
             reduction == at::Reduction::None ? like_target(l, grad.dtype()) : replicated(grad));
  // total_weight: used only by mean, where the forward made it global already.
  plan.output(l.self);
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::nll_loss_forward", nll_rule);
  register_rule("aten::nll_loss2d_forward", nll_rule);
  register_rule("aten::nll_loss_backward", nll_backward_rule);
  register_rule("aten::nll_loss2d_backward", nll_backward_rule);
  for (const char* op :
       {"aten::mse_loss", "aten::smooth_l1_loss", "aten::huber_loss", "aten::soft_margin_loss",
        "aten::mse_loss_backward", "aten::smooth_l1_loss_backward", "aten::huber_loss_backward",
        "aten::soft_margin_loss_backward"})
    register_rule(op, loss_rule);
  for (const char* op : {"aten::_softmax", "aten::_log_softmax", "aten::_softmax_backward_data",
                         "aten::_log_softmax_backward_data"})
    register_rule(op, softmax_rule);
}};

}  // namespace

}  // namespace tessera::ops
