// bucketize / searchsorted: the bucket of each value among sorted boundaries. Elementwise in
// the values (self keeps its layout, Partial replicated); the boundaries whole, or, for an
// N-D sorted sequence, sharing self's leading shards with its last dim whole. Every overload
// the running LibTorch lists is registered (Tensor, Scalar, out=).
#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// bucketize(self, boundaries): elementwise in self; the boundaries whole.
OpPlan bucketize_rule(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  if (!self) return replicate_everything(call);  // a Scalar self
  auto in = std::make_shared<DTensorSpec>(self->partial_as_replicate());
  OpPlan plan(call);
  plan.input("self", in).output(in);
  if (const auto* b = call.spec("boundaries")) plan.input("boundaries", replicated(*b));
  return plan;
}

// searchsorted(sorted_sequence, self, ..., sorter): elementwise in self. A 1-D sequence is
// whole; an N-D one shares self's leading shards and has its last dim whole.
OpPlan searchsorted_rule(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  if (!self) return replicate_everything(call);  // a Scalar self
  auto in = std::make_shared<DTensorSpec>(self->partial_as_replicate());
  OpPlan plan(call);
  plan.input("self", in).output(in);
  for (const char* name : {"sorted_sequence", "sorter"}) {
    const DTensorSpec* s = call.has(name) ? call.spec(name) : nullptr;
    if (!s) continue;
    if (s->ndim() <= 1 || s->ndim() != in->ndim()) {
      plan.input(name, replicated(*s));
      continue;
    }
    Placements p(in->mesh().ndim(), Replicate());
    std::vector<ShardTable> tables(s->ndim());
    for (int64_t m = 0; m < in->mesh().ndim(); ++m) {
      const auto& x = in->placement(m);
      if (!x.is_shard() || x.dim() == in->ndim() - 1) continue;
      p[m] = x;
      tables[x.dim()] = in->shard_table(x.dim());
    }
    plan.input(name, std::make_shared<DTensorSpec>(in->mesh(), p, s->sizes(), s->dtype(), tables));
  }
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule_for_overloads("aten::bucketize", bucketize_rule);
  register_rule_for_overloads("aten::searchsorted", searchsorted_rule);
}};

}  // namespace

}  // namespace tessera::ops
