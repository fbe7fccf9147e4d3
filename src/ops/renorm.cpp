// renorm: each slice along `dim` rescaled to norm at most `maxnorm`. The worked example of
// NOTE: [How to add an op]: this file is the whole change.
#include <c10/core/WrapDimMinimal.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// A slice's norm runs over every dim but `dim`: those must be whole on each rank, so their
// shards are gathered (Partial values are summed first: a norm is not linear). Shards of
// `dim` itself stay: each rank rescales the slices it holds. The result keeps that layout.
OpPlan renorm_rule(const OpCall& call) {
  const DTensorSpec& self = *call.spec("self");
  const int64_t dim = c10::maybe_wrap_dim(call.arg<int64_t>("dim"), self.ndim());
  auto layout =
      std::make_shared<DTensorSpec>(self.replicate_where([&](int64_t, const Placement& p) {
        return p.is_partial() || (p.is_shard() && p.dim() != dim);
      }));
  OpPlan plan(call);
  plan.input("self", layout);
  plan.output(layout);
  return plan;
}

const RuleRegistrar registrar{[] {
  // renorm.out borrows this rule (NOTE: [out= forms]); the in-place form has its own name.
  register_rule("aten::renorm", renorm_rule);
  register_rule("aten::renorm_", renorm_rule);
}};

}  // namespace

}  // namespace tessera::ops
