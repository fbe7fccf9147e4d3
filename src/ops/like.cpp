// Ops whose result has the input's layout: identity/alias ops, *_like factories, casts,
// fills; and item(), which needs the whole (replicated) value.
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

OpPlan keep_layout(const OpCall& call) {
  OpPlan plan(call);
  plan.output(std::make_shared<DTensorSpec>(call.first()));
  return plan;
}

// A cast keeps the layout, except that Partial terms cast to a non-floating dtype are reduced
// first: the truncated sum of terms is not the sum of truncated terms.
OpPlan cast_rule(const OpCall& call) {
  const DTensorSpec& self = call.first();
  const auto dtype = call.arg<c10::optional<at::ScalarType>>("dtype");
  if (!self.has_partial() || !dtype || c10::isFloatingType(*dtype) || c10::isComplexType(*dtype))
    return keep_layout(call);
  auto whole = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  OpPlan plan(call);
  plan.input("self", whole).output(whole);
  return plan;
}

// as_strided addresses storage, which a distributed tensor's wrapper does not have (its
// strides are the global contiguous ones). Autograd calls it for an in-place op on a view of
// a tensor that requires grad (CopySlices); run locally it would pick the wrong elements.
OpPlan as_strided_rule(const OpCall& call) {
  TORCH_CHECK(false, "tessera: ", call.describe(), ": as_strided addresses storage, and a ",
              "distributed tensor has none of its own; autograd calls it for an in-place op on ",
              "a view of a tensor that requires grad: do that op out of place, or on the base");
  return OpPlan(call);
}

// New values (ones, fill, random) are not partial terms: Partial dims become Replicate.
OpPlan fresh_values(const OpCall& call) {
  OpPlan plan(call);
  plan.output(std::make_shared<DTensorSpec>(call.first().partial_as_replicate()));
  return plan;
}

OpPlan needs_replicate(const OpCall& call) {
  OpPlan plan = replicate_inputs(call);
  plan.output(replicated(call.first()));
  return plan;
}

// copy_(self, src): src moves to self's layout. A partial self is made whole first (its
// terms are about to be overwritten, but its shard shape must be a real layout).
OpPlan copy_rule(const OpCall& call) {
  auto self = std::make_shared<DTensorSpec>(call.spec("self")->partial_as_replicate());
  const auto& src = *call.spec("src");
  OpPlan plan(call);
  plan.input("self", self);
  plan.input("src", std::make_shared<DTensorSpec>(self->mesh(), self->placements(), src.sizes(),
                                                  src.dtype(), self->shard_tables()));
  plan.output(self);
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::detach", "aten::alias", "aten::clone", "aten::zeros_like",
                         "aten::zero_", "aten::lift_fresh", "aten::detach_", "aten::_conj",
                         "aten::conj_physical", "aten::resolve_conj", "aten::resolve_neg"})
    register_rule(op, keep_layout);
  for (const char* op : {"aten::ones_like", "aten::empty_like", "aten::full_like",
                         "aten::fill_.Scalar", "aten::fill.Scalar"})
    register_rule(op, fresh_values);
  register_rule("aten::_local_scalar_dense", needs_replicate);
  register_rule("aten::is_nonzero", needs_replicate);
  register_rule("aten::copy_", copy_rule);
  register_rule("aten::_to_copy", cast_rule);
  register_rule("aten::as_strided", as_strided_rule);
}};

}  // namespace

}  // namespace tessera::ops
