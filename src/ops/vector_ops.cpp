// Ops that combine the entries along one dim as a vector: glu (one half gates the other),
// _safe_softmax (normalised exponentials; what LibTorch 2.5+'s attention math path calls
// instead of softmax) and linalg_cross (3-vectors). The dim is whole, the other dims keep their
// shards (NOTE: [Dim-wise ops]).
#include <c10/util/Exception.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// glu(self, dim): `dim` whole, halved.
OpPlan glu_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const int64_t d = wrap_dim(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  auto sizes = in->sizes();
  sizes[d] /= 2;
  return along(call, {d}, resized(*in, sizes));
}

// glu_backward(grad_output, self, dim): self's layout with `dim` whole; the gradient follows.
OpPlan glu_backward_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const int64_t d = wrap_dim(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  auto half = in->sizes();
  half[d] /= 2;
  OpPlan plan(call);
  plan.input("self", in);
  if (const auto* g = call.spec("grad_output"))
    plan.input("grad_output", std::make_shared<DTensorSpec>(in->mesh(), in->placements(), half,
                                                            g->dtype(), in->shard_tables()));
  plan.output(in);
  return plan;
}

// linalg_cross(self, other, dim): `dim` whole on both.
OpPlan cross_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const DTensorSpec* other = call.spec("other");
  if (other && other->sizes() != self.sizes()) return computed_replicated(call);  // broadcasting
  const int64_t d = wrap_dim(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  OpPlan plan(call);
  plan.input("self", in).output(in);
  if (other) plan.input("other", align_to(*in, *other, false));
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::_safe_softmax", along_dim);
  register_rule("aten::glu", glu_rule);
  register_rule("aten::glu_backward", glu_backward_rule);
  register_rule("aten::linalg_cross", cross_rule);
}};

}  // namespace

}  // namespace tessera::ops
