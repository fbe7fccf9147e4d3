// Elementwise ops beyond pointwise.cpp's list: activations a network uses (elu / selu, celu,
// softplus, mish, hardswish, log_sigmoid, hard / soft shrink, threshold, prelu) with their
// backward ops, the special functions (lgamma / digamma / polygamma, i0, sinc, ...), and
// bucketize / searchsorted (elementwise in their values, the boundaries whole).
//
// One rule for all of them, the one pointwise.cpp uses for ops a Partial cannot pass through:
// the output takes the layout of one operand of the output's shape (the cheapest to reach when
// several could), Partial mesh dims replicated; every other operand is aligned to it
// (broadcast dims replicated). In-place ops keep self's layout; out= arguments take the result.
// Every overload the running LibTorch lists is registered (functional, in-place, out=).
#include <algorithm>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "dimwise.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

std::vector<int64_t> broadcast(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                               const OpCall& call) {
  const size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n, 1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TORCH_CHECK(x == y || x == 1 || y == 1, "tessera: ", call.describe(), ": shapes ", shape_str(a),
                " and ", shape_str(b), " do not broadcast");
    out[i] = x == 1 ? y : x;
  }
  return out;
}

bool writes(const c10::Argument& a) { return a.alias_info() && a.alias_info()->isWrite(); }

OpPlan elementwise(const OpCall& call) {
  const auto& args = call.schema().arguments();
  const size_t n = call.args.size();
  auto is_out = [&](size_t i) { return args[i].kwarg_only() && writes(args[i]); };
  std::vector<int64_t> shape;
  for (size_t i = 0; i < n; ++i) {
    if (is_out(i) || !call.args[i].isTensor() || !call.args[i].toTensor().defined()) continue;
    shape = broadcast(
        shape, call.specs[i] ? call.specs[i]->sizes() : call.args[i].toTensor().sizes().vec(),
        call);
  }
  std::vector<const DTensorSpec*> refs;
  if (n > 0 && writes(args[0]) && !is_out(0)) {  // in place: self is the output
    TORCH_CHECK(call.specs[0] && call.specs[0]->sizes() == shape, "tessera: ", call.describe(),
                ": an in-place op needs `self` distributed with the broadcast shape ",
                shape_str(shape));
    refs.push_back(call.specs[0]);
  } else {
    for (size_t i = 0; i < n; ++i)
      if (call.specs[i] && !is_out(i) && call.specs[i]->sizes() == shape)
        refs.push_back(call.specs[i]);
  }
  const size_t nret = call.schema().returns().size();
  std::vector<Strategy> candidates;
  for (const DTensorSpec* ref : refs) {
    auto target = std::make_shared<DTensorSpec>(ref->partial_as_replicate());
    Strategy s;
    s.inputs.resize(n);
    for (size_t i = 0; i < n; ++i)
      if (call.specs[i] && !is_out(i))
        s.inputs[i] = call.specs[i] == ref ? target : align_to(*target, *call.specs[i], false);
    s.outputs.assign(nret, target);
    candidates.push_back(std::move(s));
  }
  if (candidates.empty()) {  // every operand broadcasts: computed replicated
    const auto& like = call.first();
    Strategy s;
    s.inputs.resize(n);
    for (size_t i = 0; i < n; ++i)
      if (call.specs[i] && !is_out(i)) s.inputs[i] = replicated(*call.specs[i]);
    s.outputs.assign(
        nret, std::make_shared<DTensorSpec>(
                  like.mesh(), Placements(like.mesh().ndim(), Replicate()), shape, like.dtype()));
    candidates.push_back(std::move(s));
  }
  return cheapest(call, candidates);
}

// prelu(self, weight): the weight [C] applies along dim 1, so C is whole there (one weight
// for every channel: elementwise).
SpecPtr prelu_layout(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  TORCH_CHECK(self, "tessera: ", call.describe(), ": the input must be distributed");
  const DTensorSpec* w = call.spec("weight");
  const int64_t n = w ? w->numel() : call.arg("weight").toTensor().numel();
  if (n == 1 || self->ndim() < 2)
    return std::make_shared<DTensorSpec>(self->partial_as_replicate());
  return whole_along(*self, {1});
}

OpPlan prelu_rule(const OpCall& call) {
  auto in = prelu_layout(call);
  OpPlan plan(call);
  plan.input("self", in).output(in);
  if (const auto* w = call.spec("weight")) plan.input("weight", replicated(*w));
  return plan;
}

// prelu_backward(grad_output, self, weight) -> (grad_input, grad_weight): the weight's gradient
// sums over every dim but the channels, so it is Partial(sum) where the input is sharded.
OpPlan prelu_backward_rule(const OpCall& call) {
  auto in = prelu_layout(call);
  OpPlan plan(call);
  plan.input("self", in).output(in);
  if (const auto* g = call.spec("grad_output")) plan.input("grad_output", align_to(*in, *g, false));
  const DTensorSpec* w = call.spec("weight");
  if (w) plan.input("weight", replicated(*w));
  plan.output(
      summed_over_shards(*in, w ? w->sizes() : call.arg("weight").toTensor().sizes().vec()));
  return plan;
}

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
  register_rule("aten::prelu", prelu_rule);
  register_rule("aten::prelu_backward", prelu_backward_rule);
  for (const char* base : {"aten::bucketize"}) register_rule_for_overloads(base, bucketize_rule);
  for (const char* base : {"aten::searchsorted"})
    register_rule_for_overloads(base, searchsorted_rule);
  for (const char* base :
       {// activations and their backward ops (pointwise.cpp's tables hold the others)
        "elu", "elu_backward", "celu", "softplus", "softplus_backward", "mish", "mish_backward",
        "hardswish", "hardswish_backward", "log_sigmoid_forward", "log_sigmoid_backward",
        "hardshrink", "hardshrink_backward", "softshrink", "softshrink_backward", "threshold",
        "logit", "logit_backward",
        // math
        "lgamma", "digamma", "polygamma", "mvlgamma", "i0", "sinc", "heaviside", "nextafter",
        "special_xlog1py", "float_power",
        // LibTorch 2.x's prelu kernels take a weight already shaped to broadcast
        "_prelu_kernel", "_prelu_kernel_backward"}) {
    register_rule_for_overloads(std::string("aten::") + base, elementwise);
    register_rule_for_overloads(std::string("aten::") + base + "_", elementwise);
  }
}};

}  // namespace

}  // namespace tessera::ops
