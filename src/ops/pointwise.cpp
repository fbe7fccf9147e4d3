// Pointwise ops: operands are aligned to one reference layout (the first distributed
// operand with the output's shape); broadcast dims are replicated.
//
// Partial rules, [out | operands] (one mesh dim shown):
//   additive (add, sub):       P(sum) | P(sum), P(sum)   R operands become P (no comm)
//   scaling  (mul, neg, div):  P(sum) | P(sum), R        one partial operand (for div the
//                                                       dividend); P(avg) alike, P(max/min) never
//   anything else:             R      | R, R             P(x) + 1 would add 1 n times
//
// Every operand with the output's shape is a candidate reference; the one whose layout costs
// the fewest bytes to reach wins (R + S(0) slices the R operand instead of gathering S(0)).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

enum class PartialPolicy { Replicate, Additive, Scaling, Dividend };

// Sums and averages of terms are linear; max/min of terms are not (scaling by a negative
// number swaps them, adding to them is not adding to the result).
bool linear_partials(const DTensorSpec& s) {
  for (const auto& p : s.placements())
    if (p.is_partial() && p.reduce_op() != PartialOp::Sum && p.reduce_op() != PartialOp::Avg)
      return false;
  return true;
}

std::vector<int64_t> broadcast_shape(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  const size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n, 1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TORCH_CHECK(x == y || x == 1 || y == 1, "tessera: shapes ", shape_str(a), " and ",
                shape_str(b), " do not broadcast");
    out[i] = x == 1 ? y : x;
  }
  return out;
}

int out_argument(const c10::FunctionSchema& schema) {
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& a = schema.arguments()[i];
    if (a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite()) return static_cast<int>(i);
  }
  return -1;
}

OpPlan pointwise(const OpCall& call, PartialPolicy policy) {
  const auto& schema = call.op.schema();
  const int out_idx = out_argument(schema);
  const size_t n = call.args.size();
  std::vector<int64_t> out_shape;
  bool plain_operand = false;
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<int>(i) == out_idx || !call.args[i].isTensor()) {
      // A number operand ("other"), not a coefficient such as add's alpha.
      plain_operand = plain_operand ||
                      (call.args[i].isScalar() && schema.arguments()[i].name() == "other");
      continue;
    }
    const auto& t = call.args[i].toTensor();
    if (!t.defined()) continue;
    if (!call.specs[i]) plain_operand = true;
    out_shape = broadcast_shape(out_shape, call.specs[i] ? call.specs[i]->sizes() : t.sizes().vec());
  }
  int partial_operands = 0;
  std::vector<const DTensorSpec*> refs;  // operands that could set the layout
  for (size_t i = 0; i < n; ++i) {
    if (!call.specs[i] || static_cast<int>(i) == out_idx) continue;
    if (call.specs[i]->has_partial()) ++partial_operands;
    if (call.specs[i]->sizes() == out_shape) refs.push_back(call.specs[i]);
  }
  const bool inplace = schema.arguments().size() > 0 && schema.arguments()[0].alias_info() &&
                       schema.arguments()[0].alias_info()->isWrite();
  if (inplace) {
    // self keeps its place: it is the output.
    TORCH_CHECK(call.specs[0] && call.specs[0]->sizes() == out_shape, "tessera: ",
                call.describe(), ": an in-place op needs `self` distributed with the broadcast ",
                "result's shape ", shape_str(out_shape));
    refs = {call.specs[0]};
  }

  if (refs.empty()) {
    // Every operand broadcasts: compute replicated.
    OpPlan plan;
    plan.inputs.resize(n);
    for (size_t i = 0; i < n; ++i)
      if (call.specs[i] && static_cast<int>(i) != out_idx) plan.inputs[i] = replicated(*call.specs[i]);
    auto out = std::make_shared<DTensorSpec>(call.first().mesh(),
                                             Placements(call.first().mesh().ndim(), Replicate()),
                                             out_shape, call.first().dtype());
    plan.outputs.push_back(out);
    return plan;
  }
  // One candidate per operand that could set the layout; the cheapest moves the least.
  std::vector<Strategy> candidates;
  for (const DTensorSpec* ref : refs) {
    bool keep_partial = false;
    if (ref->has_partial() && linear_partials(*ref)) {
      if (policy == PartialPolicy::Additive) keep_partial = !plain_operand;
      if (policy == PartialPolicy::Scaling) keep_partial = partial_operands == 1;
      // x / P is not a sum of terms: only the dividend may carry them.
      if (policy == PartialPolicy::Dividend)
        keep_partial = partial_operands == 1 && call.specs[0] == ref;
    }
    SpecPtr ref_target = keep_partial ? std::make_shared<DTensorSpec>(*ref)
                                      : std::make_shared<DTensorSpec>(ref->partial_as_replicate());
    Strategy st;
    st.inputs.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (!call.specs[i] || static_cast<int>(i) == out_idx) continue;
      if (call.specs[i] == ref) {
        st.inputs[i] = ref_target;
        continue;
      }
      const bool operand_partial = keep_partial && policy == PartialPolicy::Additive;
      st.inputs[i] = align_to(*ref_target, *call.specs[i], operand_partial);
    }
    st.outputs.push_back(ref_target);
    candidates.push_back(std::move(st));
  }
  return cheapest(call, candidates);
}

OpPlan replicate_partials(const OpCall& call) { return pointwise(call, PartialPolicy::Replicate); }
OpPlan additive(const OpCall& call) { return pointwise(call, PartialPolicy::Additive); }
OpPlan scaling(const OpCall& call) { return pointwise(call, PartialPolicy::Scaling); }
OpPlan dividend(const OpCall& call) { return pointwise(call, PartialPolicy::Dividend); }

// Every overload family gets the functional, in-place and out= forms.
void family(const std::string& base, const std::vector<std::string>& overloads, Rule rule) {
  for (const auto& o : overloads) {
    const std::string suffix = o.empty() ? "" : "." + o;
    register_rule("aten::" + base + suffix, rule);
    register_rule("aten::" + base + "_" + suffix, rule);
  }
  register_rule("aten::" + base + ".out", rule);
}

const RuleRegistrar registrar{[] {
  family("add", {"Tensor", "Scalar"}, additive);
  family("sub", {"Tensor", "Scalar"}, additive);
  family("mul", {"Tensor", "Scalar"}, scaling);
  family("div", {"Tensor", "Scalar"}, dividend);
  for (const char* op : {"aten::div.Tensor_mode", "aten::div_.Tensor_mode", "aten::div.Scalar_mode",
                         "aten::div_.Scalar_mode", "aten::div.out_mode"})
    register_rule(op, replicate_partials);  // rounding is not linear
  family("neg", {""}, scaling);
  for (const char* unary :
       {"abs", "exp", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos", "tan",
        "tanh", "sigmoid", "relu", "reciprocal", "sign", "floor", "ceil", "round", "trunc",
        "erf", "silu", "square", "logical_not", "bitwise_not", "exp2", "sgn", "isnan",
        "isinf", "isfinite", "signbit", "isposinf", "isneginf", "nan_to_num", "frac"})
    family(unary, {""}, replicate_partials);
  for (const char* binary : {"pow", "maximum", "minimum", "fmod", "remainder", "atan2",
                             "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
                             "bitwise_and", "bitwise_or", "bitwise_xor", "hypot", "copysign",
                             "fmax", "fmin", "xlogy"})
    family(binary, {"", "Tensor", "Scalar", "Tensor_Scalar", "Tensor_Tensor"}, replicate_partials);
  family("clamp", {"", "Tensor"}, replicate_partials);
  family("clamp_min", {"", "Tensor"}, replicate_partials);
  family("clamp_max", {"", "Tensor"}, replicate_partials);
  family("lerp", {"Scalar", "Tensor"}, replicate_partials);
  family("addcmul", {""}, replicate_partials);
  family("addcdiv", {""}, replicate_partials);
  family("where", {"self"}, replicate_partials);
  family("gelu", {""}, replicate_partials);
  family("leaky_relu", {""}, replicate_partials);
  family("hardtanh", {""}, replicate_partials);
  for (const char* bw : {"threshold_backward", "sigmoid_backward", "tanh_backward",
                         "gelu_backward", "silu_backward", "leaky_relu_backward",
                         "hardtanh_backward"})
    register_rule(std::string("aten::") + bw, replicate_partials),
        register_rule(std::string("aten::") + bw + ".grad_input", replicate_partials);
  register_rule("aten::masked_fill.Scalar", replicate_partials);
  register_rule("aten::masked_fill_.Scalar", replicate_partials);
  register_rule("aten::masked_fill.Tensor", replicate_partials);
  register_rule("aten::masked_fill_.Tensor", replicate_partials);
}};

}  // namespace

}  // namespace tessera::ops
