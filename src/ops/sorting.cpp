// Sorting and order statistics along a dim: sort / argsort, topk, kthvalue, median / nanmedian /
// mode (along a dim, and median / nanmedian of the whole tensor). The dim is whole, the other
// dims keep their shards (NOTE: [Dim-wise ops]); indices are local to the whole dim, so they are
// global.
#include <c10/util/Exception.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// topk(self, k, dim, largest, sorted): `dim` whole, k entries along it.
OpPlan topk_rule(const OpCall& call) {
  const auto& self = self_of(call);
  if (self.ndim() == 0) return along(call, {});
  const int64_t d = wrap_dim(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  auto sizes = in->sizes();
  sizes[d] = call.arg<int64_t>("k");
  return along(call, {d}, resized(*in, sizes));
}

// kthvalue, median.dim, nanmedian.dim, mode: `dim` whole, reduced to one value and index.
OpPlan select_along_dim(const OpCall& call) {
  const auto& self = self_of(call);
  if (self.ndim() == 0) return along(call, {});
  const int64_t d = wrap_dim(call.arg<int64_t>("dim"), self.ndim());
  return along(call, {d}, reduced(*whole_along(self, {d}), d, call.arg<bool>("keepdim")));
}

// median() / nanmedian() of the whole tensor: gathered, one replicated value.
OpPlan whole_tensor_rule(const OpCall& call) {
  const auto& self = self_of(call);
  OpPlan plan = replicate_inputs(call);
  plan.output(std::make_shared<DTensorSpec>(self.mesh(),
                                            Placements(self.mesh().ndim(), Replicate()),
                                            std::vector<int64_t>{}, self.dtype()));
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::sort", "aten::sort.stable", "aten::argsort.stable"})
    register_rule(op, along_dim);
  register_rule("aten::topk", topk_rule);
  for (const char* op : {"aten::kthvalue", "aten::median.dim", "aten::nanmedian.dim", "aten::mode"})
    register_rule(op, select_along_dim);
  for (const char* op : {"aten::median", "aten::nanmedian"}) register_rule(op, whole_tensor_rule);
}};

}  // namespace

}  // namespace tessera::ops
