// Pointwise ops: operands are aligned to one reference layout (an operand with the output's
// shape); broadcast dims are replicated. Every operand with the output's shape is a candidate
// reference; the one whose layout costs the fewest bytes to reach wins (R + S(0) slices the R
// operand instead of gathering S(0)). In-place ops keep self's layout; out= arguments (one or
// several) take the result's; every result gets the output's layout. Every overload the
// running LibTorch lists is registered (functional, in-place, out=, Scalar-first). prelu,
// whose weight runs along the channel dim, has its own rule at the end.
//
// NOTE: [Pointwise partial tables]
// Partial placements follow data, not code: each category below is a table of rows plus the
// base names of its ops, and every overload of those names (read from the dispatcher) gets
// the category's rule. A row reads `out | self, other, third`: on a mesh dim where the
// reference operand is Partial(x), the first row holding x at the reference's schema position
// applies; each operand then gets the row's placement on that mesh dim (R: reduced first) and
// the result gets `out`. Without a row the partial is reduced first, which is always right.
// A row that wants Partial(sum) of a number or a plain tensor does not apply (a value cannot
// be split into terms); Partial(avg/max/min) of equal values is that value, so those rows take
// plain operands as they are. Partials of one reference must commute (sum with avg, max with
// max): a mix of sum and max is reduced first.
#include <array>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// A placement on one mesh dim, as rows spell it: Replicate or Partial(op).
enum Pl : uint8_t { R, Sum, Avg, Max, Min };

struct Row {
  Pl out;
  std::array<Pl, 3> in;  // by schema position (self, other, third); absent operands ignored
  // Integer wraparound breaks the order (-INT_MIN, unsigned negation, a + b overflowing), so
  // the row needs a floating reference.
  bool floating_only = false;
};
using Table = std::vector<Row>;

// Everything else: partials are reduced first (P(x) + 1 would add 1 once per term).
const Table kNone = {};
// Linear in every operand: a sum of sums is a sum of terms; R operands become terms (one
// rank holds the value). Adding a value keeps the order of self (alpha scales only other).
const Table kLinear = {
    {Sum, {Sum, Sum}}, {Avg, {Avg, Avg}}, {Max, {Max, R}, true}, {Min, {Min, R}, true}};
// Linear in any one operand: (sum a_i) * b = sum (a_i * b).
const Table kScaling = {{Sum, {Sum, R}}, {Sum, {R, Sum}}, {Avg, {Avg, R}}, {Avg, {R, Avg}}};
// Linear in the dividend only: x / P is not a sum of terms.
const Table kDividend = {{Sum, {Sum, R}}, {Avg, {Avg, R}}};
// Multiplying by a positive constant: linear and increasing.
const Table kPositiveScale = {{Sum, {Sum}}, {Avg, {Avg}}, {Max, {Max}}, {Min, {Min}}};
// Linear, and decreasing: -max(a_i) = min(-a_i), exact in floating point.
const Table kNegation = {{Sum, {Sum}}, {Avg, {Avg}}, {Min, {Max}, true}, {Max, {Min}, true}};
// Decreasing on every dtype the op takes (~x = -x - 1, or 255 - x, or not).
const Table kDecreasing = {{Min, {Max}}, {Max, {Min}}};
// Nondecreasing in self over the whole real line: f(max a_i) = max f(a_i). Ops increasing on
// part of the line only (log, sqrt, asin, ...) are not here: a term below the max may fall
// outside their domain, and its NaN would win the max.
const Table kIncreasing = {{Max, {Max, R, R}}, {Min, {Min, R, R}}};
// Nondecreasing in every operand (bounds included): each may carry the partial.
const Table kIncreasingInAll = {{Max, {Max, R, R}}, {Max, {R, Max, R}}, {Max, {R, R, Max}},
                                {Min, {Min, R, R}}, {Min, {R, Min, R}}, {Min, {R, R, Min}}};
// self + w * (end - self), self + v * t1 * t2, self + v * t1 / t2: linear in the first two
// together (the weight is a coefficient, and max/min would depend on its sign).
const Table kLinearPair = {{Sum, {Sum, Sum, R}}, {Avg, {Avg, Avg, R}}};
// Selecting elements keeps any partial: where(c, a, b) picks term by term.
const Table kWhere = {
    {Sum, {R, Sum, Sum}}, {Avg, {R, Avg, Avg}}, {Max, {R, Max, Max}}, {Min, {R, Min, Min}}};
const Table kMaskedFill = {
    {Sum, {Sum, R, Sum}}, {Avg, {Avg, R, Avg}}, {Max, {Max, R, Max}}, {Min, {Min, R, Min}}};

struct Category {
  const Table& table;
  std::vector<const char*> ops;  // base names; the in-place forms (add_) come with them
  // Ops only some LibTorch versions have: no warning where they are absent.
  bool some_versions_only = false;
};

// clang-format off
const std::vector<Category>& categories() {
  static const std::vector<Category> all = {
      {kLinear, {"add", "sub"}},
      {kScaling, {"mul"}},
      {kDividend, {"div"}},  // with a rounding_mode: no rows, see rounded()
      {kPositiveScale, {"deg2rad", "rad2deg"}},
      {kNegation, {"neg"}},
      {kDecreasing, {"bitwise_not"}},
      {kIncreasing, {"exp", "exp2", "expm1", "sigmoid", "tanh", "relu", "hardsigmoid", "hardtanh",
                     "atan", "asinh", "sinh", "erf", "floor", "ceil", "trunc", "round", "sign"}},
      {kIncreasingInAll, {"maximum", "minimum", "fmax", "fmin", "clamp", "clamp_min", "clamp_max"}},
      {kLinearPair, {"lerp", "addcmul", "addcdiv"}},
      {kWhere, {"where"}},
      {kMaskedFill, {"masked_fill"}},
      // Not monotone (abs, cos, silu and gelu dip below zero, reciprocal flips at 0), monotone
      // on part of the line only (log, sqrt, asin, ...), depending on a Scalar the rule must
      // not read (leaky_relu's slope), or about NaN itself (nan_to_num).
      {kNone,
       {"abs", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "sin", "cos", "tan", "cosh",
        "asin", "acos", "acosh", "atanh", "erfc", "erfinv", "reciprocal", "silu", "gelu",
        "leaky_relu", "square", "sgn", "frac", "nan_to_num", "logical_not", "isnan", "isinf",
        "isfinite", "isposinf", "isneginf", "signbit", "pow", "fmod", "remainder", "atan2",
        "hypot", "copysign", "xlogy", "logaddexp", "logaddexp2", "eq", "ne", "lt", "le", "gt",
        "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
        "bitwise_xor", "threshold_backward", "sigmoid_backward", "tanh_backward",
        "gelu_backward", "silu_backward", "leaky_relu_backward", "hardtanh_backward",
        "hardsigmoid_backward"}},
      // More activations and their backward ops, and special functions: not monotone (mish,
      // hardswish, hardshrink, lgamma, i0, ...), monotone on part of the line only (logit),
      // or depending on a Scalar the rule must not read (elu's alpha, softplus' beta,
      // threshold's value). log_sigmoid_forward returns a buffer of the output's layout too.
      {kNone,
       {"elu", "elu_backward", "celu", "softplus", "softplus_backward", "mish", "mish_backward",
        "hardswish", "hardswish_backward", "log_sigmoid_forward", "log_sigmoid_backward",
        "hardshrink", "hardshrink_backward", "softshrink", "softshrink_backward", "threshold",
        "logit", "logit_backward", "lgamma", "digamma", "polygamma", "mvlgamma", "i0", "sinc",
        "heaviside", "nextafter", "special_xlog1py", "float_power"}},
      // LibTorch 2.x's prelu kernels take a weight already shaped to broadcast (see prelu_rule
      // for 1.13's prelu).
      {kNone, {"_prelu_kernel", "_prelu_kernel_backward"}, /*some_versions_only=*/true},
  };
  return all;
}
// clang-format on

// Overloads that share a base name but are not pointwise.
const std::vector<std::string>& skipped(const std::string& base) {
  static const std::vector<std::string> none;
  // where(condition) -> Tensor[] is nonzero's other name (CompositeImplicit in 1.13 and 2.6).
  static const std::vector<std::string> where = {""};
  return base == "where" ? where : none;
}

Pl kind_of(const Placement& p) {
  if (!p.is_partial()) return R;
  switch (p.reduce_op()) {
    case PartialOp::Sum: return Sum;
    case PartialOp::Avg: return Avg;
    case PartialOp::Max: return Max;
    case PartialOp::Min: return Min;
  }
  return R;
}

Placement placement_of(Pl k) {
  switch (k) {
    case Sum: return Partial(PartialOp::Sum);
    case Avg: return Partial(PartialOp::Avg);
    case Max: return Partial(PartialOp::Max);
    case Min: return Partial(PartialOp::Min);
    case R: break;
  }
  return Replicate();
}

// Sum and avg commute with each other; max and min do not, with anything else.
bool partials_commute(const DTensorSpec& s) {
  int family = -1;
  for (const auto& p : s.placements()) {
    if (!p.is_partial()) continue;
    const Pl k = kind_of(p);
    const int f = k == Sum || k == Avg ? 0 : static_cast<int>(k);
    if (family >= 0 && f != family) return false;
    family = f;
  }
  return true;
}

// floor(a / b) and trunc(a / b) are neither linear nor monotone in a for every b.
bool rounded(const OpCall& call) {
  return call.has("rounding_mode") && !call.arg("rounding_mode").isNone();
}

// The out= arguments: keyword-only arguments the op writes (log_sigmoid_forward.output has
// two).
std::vector<bool> out_arguments(const c10::FunctionSchema& schema) {
  std::vector<bool> out(schema.arguments().size(), false);
  for (size_t i = 0; i < out.size(); ++i) {
    const auto& a = schema.arguments()[i];
    out[i] = a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite();
  }
  return out;
}

// The first row that keeps the reference's Partial(kind), or nullptr.
const Row* find_row(const OpCall& call, const Table& table, size_t ref, Pl kind, bool inplace,
                    const std::vector<bool>& is_out) {
  if (ref >= 3) return nullptr;
  for (const auto& row : table) {
    if (row.in[ref] != kind) continue;
    if (row.floating_only && !c10::isFloatingType(call.specs[ref]->dtype())) continue;
    // self is the result, and views of self keep their layout: it must not change.
    if (inplace && row.out != kind) continue;
    bool applies = true;
    for (size_t i = 0; i < 3 && i < call.args.size() && applies; ++i) {
      if (i == ref || is_out[i] || row.in[i] != Sum) continue;
      const auto& a = call.args[i];
      const bool absent = a.isNone() || (a.isTensor() && !a.toTensor().defined());
      applies = absent || call.specs[i] != nullptr;  // a plain value has no terms
    }
    if (applies) return &row;
  }
  return nullptr;
}

OpPlan pointwise(const OpCall& call, const Table& all_rows) {
  const Table& table = rounded(call) ? kNone : all_rows;
  const auto& schema = call.op.schema();
  const std::vector<bool> is_out = out_arguments(schema);
  const size_t n = call.args.size();
  const size_t nret = schema.returns().size();
  std::vector<int64_t> out_shape;
  for (size_t i = 0; i < n; ++i) {
    if (is_out[i] || !call.args[i].isTensor()) continue;
    const auto& t = call.args[i].toTensor();
    if (!t.defined()) continue;
    out_shape = broadcast_shapes(
        out_shape, call.specs[i] ? call.specs[i]->sizes() : t.sizes().vec(), call.describe());
  }
  // An out= result has the dtype of `out` (eq.Tensor_out writes bools), which the fallback
  // does not read off written arguments.
  c10::optional<c10::ScalarType> out_dtype;
  for (size_t i = 0; i < n && !out_dtype; ++i)
    if (is_out[i] && call.args[i].isTensor() && call.args[i].toTensor().defined())
      out_dtype = call.args[i].toTensor().scalar_type();
  std::vector<size_t> refs;  // operands that could set the layout
  for (size_t i = 0; i < n; ++i) {
    if (!call.specs[i] || is_out[i]) continue;
    if (call.specs[i]->sizes() == out_shape) refs.push_back(i);
  }
  const bool inplace = schema.arguments().size() > 0 && schema.arguments()[0].alias_info() &&
                       schema.arguments()[0].alias_info()->isWrite();
  if (inplace) {
    // self keeps its place: it is the output.
    TORCH_CHECK(call.specs[0] && call.specs[0]->sizes() == out_shape, "tessera: ", call.describe(),
                ": an in-place op needs `self` distributed with the broadcast ", "result's shape ",
                shape_str(out_shape));
    refs = {0};
  }

  if (refs.empty()) {
    // Every operand broadcasts: compute replicated.
    OpPlan plan(call);
    for (size_t i = 0; i < n; ++i)
      if (call.specs[i] && !is_out[i]) plan.inputs[i] = replicated(*call.specs[i]);
    plan.outputs.assign(
        nret, std::make_shared<DTensorSpec>(call.first().mesh(),
                                            Placements(call.first().mesh().ndim(), Replicate()),
                                            out_shape, out_dtype.value_or(call.first().dtype())));
    return plan;
  }
  // One candidate per operand that could set the layout; the cheapest moves the least.
  std::vector<Strategy> candidates;
  for (size_t r : refs) {
    const DTensorSpec& ref = *call.specs[r];
    const int64_t mesh_ndim = ref.mesh().ndim();
    std::vector<const Row*> rows(mesh_ndim, nullptr);  // per mesh dim: the row keeping it
    if (ref.has_partial() && partials_commute(ref))
      for (int64_t m = 0; m < mesh_ndim; ++m)
        if (ref.placement(m).is_partial())
          rows[m] = find_row(call, table, r, kind_of(ref.placement(m)), inplace, is_out);
    auto ref_in = std::make_shared<DTensorSpec>(ref.replicate_where(
        [&](int64_t m, const Placement& p) { return p.is_partial() && !rows[m]; }));
    Placements out_p = ref_in->placements();
    for (int64_t m = 0; m < mesh_ndim; ++m)
      if (rows[m]) out_p[m] = placement_of(rows[m]->out);

    Strategy st;
    st.inputs.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (!call.specs[i] || is_out[i]) continue;
      if (i == r) {
        st.inputs[i] = ref_in;
        continue;
      }
      // The reference's shard dims where the extents match; on kept partial dims, the row's.
      auto aligned = align_to(*ref_in, *call.specs[i], /*keep_partial=*/true);
      Placements p = aligned->placements();
      for (int64_t m = 0; m < mesh_ndim; ++m)
        if (rows[m]) p[m] = placement_of(i < 3 ? rows[m]->in[i] : R);
      st.inputs[i] =
          p == aligned->placements()
              ? aligned
              : std::make_shared<DTensorSpec>(aligned->with_placements(p, aligned->shard_tables()));
    }
    // Every result (log_sigmoid_forward's buffer too) has the output's shape and layout.
    st.outputs.assign(nret, std::make_shared<DTensorSpec>(ref.mesh(), out_p, ref.sizes(),
                                                          out_dtype.value_or(ref.dtype()),
                                                          ref_in->shard_tables()));
    candidates.push_back(std::move(st));
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

const RuleRegistrar registrar{[] {
  for (const auto& category : categories()) {
    const Table* table = &category.table;
    const Rule rule = [table](const OpCall& call) { return pointwise(call, *table); };
    for (const char* op : category.ops) {
      const std::string base = std::string("aten::") + op;
      const int n = register_rule_for_overloads(base, rule, skipped(op)) +
                    register_rule_for_overloads(base + "_", rule, skipped(op));
      // A misspelt or removed name would otherwise leave its ops without a rule, silently.
      if (n == 0 && !category.some_versions_only)
        TORCH_WARN("tessera: this LibTorch has no op ", base, "; its pointwise rule is idle");
    }
  }
  register_rule("aten::prelu", prelu_rule);
  register_rule("aten::prelu_backward", prelu_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
