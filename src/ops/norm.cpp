// layer_norm: statistics over the trailing normalized dims. Leading (batch/sequence) dims may
// stay sharded; a sharded normalized dim is replicated first. weight/bias are replicated;
// their gradients sum over the leading dims, so they are Partial(sum) where those are
// sharded.
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

// Input layout with the last `k` dims whole (and no Partial: normalisation is not linear).
SpecPtr leading_only(const DTensorSpec& s, int64_t k) {
  Placements p = s.placements();
  auto tables = s.shard_tables();
  for (auto& x : p)
    if (x.is_partial() || (x.is_shard() && x.dim() >= s.ndim() - k)) x = Replicate();
  for (int64_t t = s.ndim() - k; t < s.ndim(); ++t) tables[t].clear();
  for (int64_t t = 0; t < s.ndim(); ++t) {
    bool still = false;
    for (auto& x : p) still = still || x.is_shard(t);
    if (!still) tables[t].clear();
  }
  return std::make_shared<DTensorSpec>(s.mesh(), p, s.sizes(), s.dtype(), tables);
}

// mean/rstd: the input's leading dims, then size-1 normalized dims.
SpecPtr stats_spec(const DTensorSpec& in, int64_t k) {
  auto sizes = in.sizes();
  for (int64_t t = in.ndim() - k; t < in.ndim(); ++t) sizes[t] = 1;
  return std::make_shared<DTensorSpec>(in.mesh(), in.placements(), sizes, in.dtype(),
                                       in.shard_tables());
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
OpPlan layer_norm_rule(const OpCall& call) {
  const int64_t k = static_cast<int64_t>(call.args[1].toIntList().size());
  auto in = leading_only(*call.specs[0], k);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = in;
  for (size_t i : {2, 3})
    if (call.specs[i]) plan.inputs[i] = replicated(*call.specs[i]);
  plan.outputs = {in, stats_spec(*in, k), stats_spec(*in, k)};
  return plan;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?,
//                            output_mask) -> (grad_input, grad_weight, grad_bias)
OpPlan layer_norm_backward_rule(const OpCall& call) {
  const auto shape = call.args[2].toIntVector();
  const int64_t k = static_cast<int64_t>(shape.size());
  auto in = leading_only(*call.specs[1], k);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[1] = in;
  plan.inputs[0] = std::make_shared<DTensorSpec>(in->mesh(), in->placements(), in->sizes(),
                                                 call.specs[0]->dtype(), in->shard_tables());
  for (size_t i : {3, 4})
    if (call.specs[i]) plan.inputs[i] = stats_spec(*in, k);
  for (size_t i : {5, 6})
    if (call.specs[i]) plan.inputs[i] = replicated(*call.specs[i]);
  plan.outputs = {in, summed_over_shards(*in, shape), summed_over_shards(*in, shape)};
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::native_layer_norm", layer_norm_rule);
  register_rule("aten::native_layer_norm_backward", layer_norm_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
