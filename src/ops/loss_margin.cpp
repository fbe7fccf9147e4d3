// multi_margin_loss (nn::MultiMarginLoss) and its backward.
//
// multi_margin_loss(self [N, C] or [C], target [N] or [], p, margin, weight [C]?, reduction):
// each sample's loss reads its whole row of class scores, so the class dim is whole; the
// batch dim may stay sharded, the target following it and the class weights whole. As for
// the elementwise losses (loss.cpp): reduction=none keeps the batch sharding, sum is a local
// sum that is Partial(sum) over the sharded mesh dims, and mean is that local sum divided by
// the *global* batch size; the backward of mean scales by the global batch size the same
// way. Partial scores are made whole first (the loss is not linear).
#include <ATen/core/Reduction.h>
#include <c10/util/Exception.h>

#include "loss_mean.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// self with its class (last) dim whole and no Partial; the batch dim keeps its shards.
SpecPtr scores_layout(const DTensorSpec& self) {
  const int64_t classes = self.ndim() - 1;
  return std::make_shared<DTensorSpec>(self.replicate_where([classes](int64_t, const Placement& x) {
    return x.is_partial() || (x.is_shard() && x.dim() >= classes);
  }));
}

// target (or the unreduced loss) laid out as self's batch dim.
SpecPtr per_sample(const DTensorSpec& scores, std::vector<int64_t> sizes, c10::ScalarType dtype) {
  Placements p = scores.placements();
  std::vector<ShardTable> tables(sizes.size());
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    if (sizes.empty()) {
      x = Replicate();  // (a 1-D self has no batch dim to shard)
      continue;
    }
    tables[0] = scores.shard_table(0);
  }
  return std::make_shared<DTensorSpec>(scores.mesh(), p, std::move(sizes), dtype,
                                       std::move(tables));
}

// multi_margin_loss(self, target, p, margin, weight?, reduction) and
// multi_margin_loss_backward(grad_output, self, target, p, margin, weight?, reduction).
OpPlan multi_margin_rule(const OpCall& call) {
  const bool backward = call.has("grad_output");
  TORCH_CHECK(call.spec("self"), "tessera: ", call.describe(), ": the scores must be distributed");
  auto self_t = scores_layout(*call.spec("self"));
  const int64_t reduction = call.arg<int64_t>("reduction");
  OpPlan plan(call);
  plan.input("self", self_t);
  const auto* target = call.spec("target");
  const auto target_sizes = target ? target->sizes() : call.arg("target").toTensor().sizes().vec();
  SpecPtr target_t = per_sample(*self_t, target_sizes, target ? target->dtype() : c10::kLong);
  if (target) plan.input("target", target_t);
  if (const auto* weight = call.spec("weight")) plan.input("weight", replicated(*weight));
  auto losses = per_sample(*self_t, target_sizes, self_t->dtype());
  if (backward) {
    const auto& grad = *call.spec("grad_output");
    plan.input("grad_output", reduction == at::Reduction::None ? losses : replicated(grad));
    plan.output(self_t);
  } else {
    plan.output(reduction == at::Reduction::None ? losses : summed_over_shards(*self_t, {}));
  }
  if (reduction == at::Reduction::Mean && self_t->is_sharded()) {
    // Run with reduction=sum and divide by the global batch size.
    const double count = self_t->ndim() >= 2 ? static_cast<double>(self_t->sizes()[0]) : 1.0;
    plan.local_kernel = sum_then_divide_by(count);
  }
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::multi_margin_loss", multi_margin_rule);
  register_rule("aten::multi_margin_loss_backward", multi_margin_rule);
}};

}  // namespace

}  // namespace tessera::ops
