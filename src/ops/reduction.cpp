// Reductions. A sharded reduced dim becomes Partial(sum); exact on uneven shards because
// mean is computed as local sum / global count (never a mean of means).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

// Reduced dims from an optional int list argument (absent or empty = all dims).
std::vector<bool> reduced_dims(const c10::IValue& dims, int64_t ndim) {
  std::vector<bool> out(ndim, false);
  if (dims.isNone() || (dims.isIntList() && dims.toIntList().empty())) {
    std::fill(out.begin(), out.end(), true);
    return out;
  }
  for (int64_t d : dims.toIntList()) out.at(d < 0 ? d + ndim : d) = true;
  return out;
}

struct Reduction {
  SpecPtr input;   // input target
  SpecPtr output;  // output layout
};

// Partial(sum) passes through a sum (it is linear); other Partials are reduced first.
Reduction sum_layout(const DTensorSpec& in, const std::vector<bool>& reduced, bool keepdim) {
  Placements in_p = in.placements();
  for (auto& x : in_p)
    if (x.is_partial() && x.reduce_op() != PartialOp::Sum) x = Replicate();
  auto input = std::make_shared<DTensorSpec>(in.with_placements(in_p, in.shard_tables()));
  std::vector<int64_t> new_index(in.ndim(), -1), out_sizes;
  for (int64_t t = 0; t < in.ndim(); ++t) {
    if (reduced[t] && !keepdim) continue;
    new_index[t] = static_cast<int64_t>(out_sizes.size());
    out_sizes.push_back(reduced[t] ? 1 : in.sizes()[t]);
  }
  Placements out_p = in_p;
  std::vector<ShardTable> tables(out_sizes.size());
  for (auto& x : out_p) {
    if (!x.is_shard()) continue;
    const int64_t t = x.dim();
    if (reduced[t]) {
      x = Partial(PartialOp::Sum);
    } else {
      tables[new_index[t]] = in.shard_table(t);
      x = Shard(new_index[t]);
    }
  }
  auto output = std::make_shared<DTensorSpec>(in.mesh(), out_p, out_sizes, in.dtype(), tables);
  return {input, output};
}

OpPlan sum_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  const auto& schema = call.op.schema();
  const bool has_dim = schema.arguments().size() > 1 && schema.arguments()[1].name() == "dim";
  auto reduced = has_dim ? reduced_dims(call.args[1], in.ndim())
                         : std::vector<bool>(in.ndim(), true);
  const bool keepdim = has_dim && call.args[2].toBool();
  auto r = sum_layout(in, reduced, keepdim);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = r.input;
  plan.outputs.push_back(r.output);
  return plan;
}

OpPlan mean_rule(const OpCall& call) {
  OpPlan plan = sum_rule(call);
  const auto& in = *call.specs[0];
  const auto& schema = call.op.schema();
  const bool has_dim = schema.arguments().size() > 1 && schema.arguments()[1].name() == "dim";
  auto reduced = has_dim ? reduced_dims(call.args[1], in.ndim())
                         : std::vector<bool>(in.ndim(), true);
  int64_t count = 1;
  for (int64_t t = 0; t < in.ndim(); ++t)
    if (reduced[t]) count *= in.sizes()[t];
  std::vector<int64_t> dims;
  for (int64_t t = 0; t < in.ndim(); ++t)
    if (reduced[t]) dims.push_back(t);
  const bool keepdim = has_dim && call.args[2].toBool();
  const c10::IValue dtype = schema.arguments().size() > 3 ? call.args[3]
                            : (has_dim ? c10::IValue() : call.args[1]);
  // Local sum over the reduced dims divided by the *global* count: exact on uneven shards.
  plan.local_kernel = [count, dims, keepdim, dtype](torch::jit::Stack& stack) {
    c10::optional<at::ScalarType> dt;
    if (!dtype.isNone()) dt = dtype.toScalarType();
    at::Tensor s = at::sum(stack.front().toTensor(), dims, keepdim, dt);
    stack.clear();
    stack.emplace_back(s.div(static_cast<double>(count)));
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::sum", sum_rule);
  register_rule("aten::sum.dim_IntList", sum_rule);
  register_rule("aten::mean", mean_rule);
  register_rule("aten::mean.dim", mean_rule);
}};

}  // namespace

}  // namespace tessera::ops
