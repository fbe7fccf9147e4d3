// Convolution and pooling over a batch-sharded input: every sample is independent, so the
// local op on the local samples is exact. Output keeps the batch sharding; weight and bias
// gradients are Partial(sum) over the batch-sharded mesh dims (summed over samples).
// Any other sharding of the activations (channels, spatial dims) is replicated first; the
// spatial (halo) strategies live with the domain-parallel rules.
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

// The activation layout: keep Shard(0) (batch) mesh dims, replicate everything else.
SpecPtr batch_only(const DTensorSpec& s) {
  Placements p = s.placements();
  std::vector<ShardTable> tables(s.ndim());
  for (auto& x : p) {
    if (x.is_shard(0)) continue;
    x = Replicate();
  }
  if (!s.mesh_dims_sharding(0).empty()) tables[0] = s.shard_table(0);
  return std::make_shared<DTensorSpec>(s.mesh(), p, s.sizes(), s.dtype(), tables);
}

// Another batch-major tensor of the same batch (grad_output, indices): same batch cut.
SpecPtr like_batch(const DTensorSpec& act, const DTensorSpec& other) {
  Placements p = act.placements();
  std::vector<ShardTable> tables(other.ndim());
  if (!act.mesh_dims_sharding(0).empty()) tables[0] = act.shard_table(0);
  return std::make_shared<DTensorSpec>(act.mesh(), p, other.sizes(), other.dtype(), tables);
}

SpecPtr with_shape(const DTensorSpec& act, std::vector<int64_t> sizes) {
  std::vector<ShardTable> tables(sizes.size());
  if (!act.mesh_dims_sharding(0).empty()) tables[0] = act.shard_table(0);
  return std::make_shared<DTensorSpec>(act.mesh(), act.placements(), std::move(sizes), act.dtype(),
                                       tables);
}

std::vector<int64_t> conv_out_sizes(const std::vector<int64_t>& in, const std::vector<int64_t>& w,
                                    const std::vector<int64_t>& stride, const std::vector<int64_t>& pad,
                                    const std::vector<int64_t>& dil, bool transposed,
                                    const std::vector<int64_t>& out_pad, int64_t groups) {
  std::vector<int64_t> out = {in[0], transposed ? w[1] * groups : w[0]};
  const size_t nsp = in.size() - 2;
  auto at = [](const std::vector<int64_t>& v, size_t i) { return v.size() == 1 ? v[0] : v[i]; };
  for (size_t i = 0; i < nsp; ++i) {
    const int64_t k = w[2 + i];
    if (transposed) {
      out.push_back((in[2 + i] - 1) * at(stride, i) - 2 * at(pad, i) + at(dil, i) * (k - 1) +
                    at(out_pad, i) + 1);
    } else {
      out.push_back((in[2 + i] + 2 * at(pad, i) - at(dil, i) * (k - 1) - 1) / at(stride, i) + 1);
    }
  }
  return out;
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
OpPlan convolution_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  auto act = batch_only(in);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = act;
  if (call.specs[1]) plan.inputs[1] = replicated(*call.specs[1]);
  if (call.specs[2]) plan.inputs[2] = replicated(*call.specs[2]);
  const auto& w = call.specs[1] ? call.specs[1]->sizes() : call.args[1].toTensor().sizes().vec();
  plan.outputs.push_back(with_shape(
      *act, conv_out_sizes(in.sizes(), w, call.args[3].toIntVector(), call.args[4].toIntVector(),
                           call.args[5].toIntVector(), call.args[6].toBool(),
                           call.args[7].toIntVector(), call.args[8].toInt())));
  return plan;
}

// convolution_backward(grad_out, input, weight, bias_sizes?, stride, padding, dilation,
//                      transposed, output_padding, groups, output_mask)
OpPlan convolution_backward_rule(const OpCall& call) {
  const auto& in = *call.specs[1];
  auto act = batch_only(in);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[1] = act;
  plan.inputs[0] = like_batch(*act, *call.specs[0]);
  if (call.specs[2]) plan.inputs[2] = replicated(*call.specs[2]);
  const auto w = call.specs[2] ? call.specs[2]->sizes() : call.args[2].toTensor().sizes().vec();
  plan.outputs.push_back(act);
  plan.outputs.push_back(summed_over_shards(*act, w));
  // grad_bias (undefined unless output_mask asks for it) has bias_sizes.
  plan.outputs.push_back(summed_over_shards(
      *act, call.args[3].isIntList() ? call.args[3].toIntVector() : std::vector<int64_t>{w[0]}));
  return plan;
}

// Pooling / adaptive pooling: output sizes come from the local op (batch only differs), so
// the rule states the layout and the fallback checks the shapes.
OpPlan pool_rule(const OpCall& call, size_t act_arg, const std::vector<size_t>& batch_args,
                 size_t outputs, std::vector<int64_t> (*out_sizes)(const OpCall&)) {
  const auto& in = *call.specs[act_arg];
  auto act = batch_only(in);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[act_arg] = act;
  for (auto i : batch_args)
    if (call.specs[i]) plan.inputs[i] = like_batch(*act, *call.specs[i]);
  auto sizes = out_sizes(call);
  for (size_t o = 0; o < outputs; ++o) plan.outputs.push_back(with_shape(*act, sizes));
  return plan;
}

std::vector<int64_t> pooled(const OpCall& call) {
  // max_pool2d_with_indices / avg_pool2d (self, kernel, stride, padding, [dilation,] ceil, ...)
  const auto& s = call.specs[0]->sizes();
  auto k = call.args[1].toIntVector();
  auto st = call.args[2].toIntVector();
  if (st.empty()) st = k;
  auto pad = call.args[3].toIntVector();
  const bool max_pool = call.op.schema().name().find("max_pool") != std::string::npos;
  std::vector<int64_t> dil = max_pool ? call.args[4].toIntVector() : std::vector<int64_t>{1};
  const bool ceil = call.args[max_pool ? 5 : 4].toBool();
  std::vector<int64_t> out(s.begin(), s.end() - static_cast<int64_t>(k.size()));
  auto at = [](const std::vector<int64_t>& v, size_t i) { return v.size() == 1 ? v[0] : v[i]; };
  for (size_t i = 0; i < k.size(); ++i) {
    const int64_t in = s[s.size() - k.size() + i];
    const int64_t num = in + 2 * at(pad, i) - at(dil, i) * (at(k, i) - 1) - 1 + (ceil ? at(st, i) - 1 : 0);
    int64_t o = num / at(st, i) + 1;
    if (ceil && (o - 1) * at(st, i) >= in + at(pad, i)) --o;
    out.push_back(o);
  }
  return out;
}
std::vector<int64_t> adaptive(const OpCall& call) {
  const auto& s = call.specs[0]->sizes();
  auto o = call.args[1].toIntVector();
  std::vector<int64_t> out(s.begin(), s.end() - static_cast<int64_t>(o.size()));
  out.insert(out.end(), o.begin(), o.end());
  return out;
}
std::vector<int64_t> input_shape(const OpCall& call) {
  // *_backward(grad_output, self, ...): the gradient has self's shape.
  return call.specs[1]->sizes();
}

OpPlan max_pool_rule(const OpCall& c) { return pool_rule(c, 0, {}, 2, pooled); }
OpPlan avg_pool_rule(const OpCall& c) { return pool_rule(c, 0, {}, 1, pooled); }
OpPlan adaptive_rule(const OpCall& c) { return pool_rule(c, 0, {}, 1, adaptive); }
// max_pool2d_with_indices_backward(grad_output, self, ..., indices)
OpPlan max_pool_backward_rule(const OpCall& c) {
  return pool_rule(c, 1, {0, c.args.size() - 1}, 1, input_shape);
}
// avg_pool2d_backward(grad_output, self, ...), _adaptive_avg_pool2d_backward(grad_output, self)
OpPlan pool_backward_rule(const OpCall& c) { return pool_rule(c, 1, {0}, 1, input_shape); }

const RuleRegistrar registrar{[] {
  register_rule("aten::convolution", convolution_rule);
  register_rule("aten::convolution_backward", convolution_backward_rule);
  for (const char* op : {"aten::max_pool2d_with_indices", "aten::max_pool3d_with_indices"})
    register_rule(op, max_pool_rule);
  for (const char* op : {"aten::max_pool2d_with_indices_backward",
                         "aten::max_pool3d_with_indices_backward"})
    register_rule(op, max_pool_backward_rule);
  for (const char* op : {"aten::avg_pool2d", "aten::avg_pool3d"}) register_rule(op, avg_pool_rule);
  for (const char* op : {"aten::avg_pool2d_backward", "aten::avg_pool3d_backward"})
    register_rule(op, pool_backward_rule);
  for (const char* op : {"aten::_adaptive_avg_pool2d", "aten::_adaptive_avg_pool3d"})
    register_rule(op, adaptive_rule);
  for (const char* op : {"aten::_adaptive_avg_pool2d_backward", "aten::_adaptive_avg_pool3d_backward"})
    register_rule(op, pool_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
