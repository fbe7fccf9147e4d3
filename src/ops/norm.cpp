// Normalisation: layer_norm, group_norm and batch_norm (instance_norm decomposes into
// batch_norm), forward and backward.
//
// layer_norm: statistics over the trailing normalized dims. Leading (batch/sequence) dims may
// stay sharded; a sharded normalized dim is replicated first. weight/bias are replicated;
// their gradients sum over the leading dims, so they are Partial(sum) where those are
// sharded.
//
// NOTE: [Normalising sharded activations]
// group_norm and batch_norm take [N, C, *spatial] activations that may stay sharded on the
// batch dim and on any spatial dim (domain parallelism: uneven and empty shards included).
// Their statistics span dims that are sharded, so the local kernels compute local moments
// and combine them over the mesh dims that shard those dims, dividing by *global* counts:
//   group_norm: per (n, group) over channels-in-group x spatial, over the mesh dims sharding
//     spatial dims (a sample's statistics never cross batch shards);
//   batch_norm: per channel over batch x spatial, over the mesh dims sharding the batch or a
//     spatial dim.
// Both send every shard's (count, mean, variance) in one all-gather per mesh dim (latency
// bound: one collective, not a sum of means followed by a sum of deviations) and combine them
// exactly: the global mean first, then every shard's squared deviations about it
// (combine_moments).
// The backward all-reduces the two per-statistic gradient sums in one message; weight/bias
// gradients come out of those sums already reduced (Replicate) where the input gradient
// needed them, and as local Partial(sum) terms otherwise. Partial inputs and a sharded
// channel dim are replicated first, except that batch_norm keeps a sharded channel dim
// (statistics are per channel) unless it must update running stats in place.
#include <array>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include "ops/accumulate_type.h"
#include "tessera/comm/collectives.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// Input layout with the last `k` dims whole (and no Partial: normalisation is not linear).
SpecPtr leading_only(const DTensorSpec& s, int64_t k) {
  return std::make_shared<DTensorSpec>(s.replicate_where([&](int64_t, const Placement& x) {
    return x.is_partial() || (x.is_shard() && x.dim() >= s.ndim() - k);
  }));
}

// mean/rstd: the input's leading dims, then size-1 normalized dims.
SpecPtr stats_spec(const DTensorSpec& in, int64_t k) {
  auto sizes = in.sizes();
  for (int64_t t = in.ndim() - k; t < in.ndim(); ++t) sizes[t] = 1;
  return std::make_shared<DTensorSpec>(in.mesh(), in.placements(), sizes, in.dtype(),
                                       in.shard_tables());
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
OpPlan layer_norm_rule(const OpCall& call) {
  const int64_t k = static_cast<int64_t>(call.arg("normalized_shape").toIntList().size());
  auto in = leading_only(*call.spec("input"), k);
  OpPlan plan(call);
  plan.input("input", in);
  for (const char* param : {"weight", "bias"})
    if (const auto* sp = call.spec(param)) plan.input(param, replicated(*sp));
  plan.outputs = {in, stats_spec(*in, k), stats_spec(*in, k)};
  return plan;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?,
//                            output_mask) -> (grad_input, grad_weight, grad_bias)
OpPlan layer_norm_backward_rule(const OpCall& call) {
  const auto shape = call.arg<std::vector<int64_t>>("normalized_shape");
  const int64_t k = static_cast<int64_t>(shape.size());
  auto in = leading_only(*call.spec("input"), k);
  OpPlan plan(call);
  plan.input("input", in);
  const auto grad_dtype = call.spec("grad_out")->dtype();
  plan.input("grad_out", std::make_shared<DTensorSpec>(in->mesh(), in->placements(), in->sizes(),
                                                       grad_dtype, in->shard_tables()));
  for (const char* stat : {"mean", "rstd"})
    if (call.spec(stat)) plan.input(stat, stats_spec(*in, k));
  for (const char* param : {"weight", "bias"})
    if (const auto* sp = call.spec(param)) plan.input(param, replicated(*sp));
  plan.outputs = {in, summed_over_shards(*in, shape), summed_over_shards(*in, shape)};
  return plan;
}

// ---- shared by group_norm and batch_norm --------------------------------------------------

bool is_half(const at::Tensor& x) {
  return x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
}

// The dtype the kernels compute in (float32 for half input): accumulate_type.
at::ScalarType compute_dtype(const at::Tensor& x) { return accumulate_type(x.scalar_type()); }

// The dtype of the statistics a kernel returns for input x: float32 for bfloat16 / float16
// input beside a float32 parameter (weight, bias, running statistics: mixed precision), or on
// CUDA where `on_cuda_always` (batch_norm), as LibTorch's kernels; else the input's. The
// output keeps the input's dtype either way.
at::ScalarType stats_dtype(const at::Tensor& x, std::initializer_list<at::Tensor> params,
                           bool on_cuda_always = false) {
  if (!is_half(x)) return x.scalar_type();
  bool mixed = on_cuda_always && x.is_cuda();
  for (const at::Tensor& p : params)
    mixed = mixed || (p.defined() && p.scalar_type() == at::kFloat);
  return mixed ? at::kFloat : x.scalar_type();
}

// A parameter gradient in its parameter's dtype (the input's where there is no parameter).
at::Tensor as_param(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& x) {
  return grad.defined() ? grad.to(param.defined() ? param.scalar_type() : x.scalar_type()) : grad;
}

// `s` without Partial and with only the tensor dims `keep` accepts still sharded.
template <class Keep>
SpecPtr keep_sharded(const DTensorSpec& s, Keep keep) {
  return std::make_shared<DTensorSpec>(s.replicate_where([&](int64_t, const Placement& x) {
    return x.is_partial() || (x.is_shard() && !keep(x.dim()));
  }));
}

// Mesh dims of `s` that shard a tensor dim `pick` accepts.
template <class Pick>
std::vector<int64_t> mesh_dims_where(const DTensorSpec& s, Pick pick) {
  std::vector<int64_t> dims;
  for (int64_t m = 0; m < s.mesh().ndim(); ++m)
    if (s.placement(m).is_shard() && pick(s.placement(m).dim())) dims.push_back(m);
  return dims;
}

// A [sizes[0], ...] tensor laid out like `x`'s dim `t` on its dim 0: Shard(0) with x's table
// where x shards t; elsewhere `other` (Replicate, or Partial for unreduced sums).
SpecPtr along_dim(const DTensorSpec& x, int64_t t, std::vector<int64_t> sizes,
                  c10::ScalarType dtype, Placement other = Replicate()) {
  Placements p(x.mesh().ndim(), Replicate());
  std::vector<ShardTable> tables(sizes.size());
  for (int64_t m = 0; m < x.mesh().ndim(); ++m) {
    if (x.placement(m).is_shard(t)) {
      p[m] = Shard(0);
      tables[0] = x.shard_table(t);
    } else if (x.placement(m).is_shard()) {
      p[m] = other;
    }
  }
  return std::make_shared<DTensorSpec>(x.mesh(), p, std::move(sizes), dtype, tables);
}

at::Tensor sum_over(const DeviceMesh& mesh, const std::vector<int64_t>& dims, at::Tensor t) {
  for (auto d : dims) t = comm::all_reduce(mesh.group(d), t, PartialOp::Sum);
  return t;
}

// The global mean and sum of squared deviations (M2) of statistics of which this shard holds
// `local` elements with mean `lmean` and population variance `lvar` (any shape, the same on
// every shard), over the shards of the mesh dims `dims`, `count` elements in all. Float at
// least (a half count would overflow past 65504 elements).
std::pair<at::Tensor, at::Tensor> combine_moments(const DeviceMesh& mesh,
                                                  const std::vector<int64_t>& dims, int64_t local,
                                                  const at::Tensor& lmean, const at::Tensor& lvar,
                                                  double count) {
  const auto acc = compute_dtype(lmean);  // (the count too: bfloat16 rounds it past 256)
  at::Tensor moments =
      at::stack({at::full(lmean.sizes(), static_cast<double>(local), lmean.options().dtype(acc)),
                 lmean.to(acc), lvar.to(acc)});
  int64_t shards = 1;
  for (auto d : dims) {
    const std::vector<int64_t> one_each(mesh.size(d), 1);
    moments = comm::all_gather(mesh.group(d), moments.unsqueeze(0), 0, one_each);
    shards *= mesh.size(d);
  }
  auto shape = lmean.sizes().vec();
  shape.insert(shape.begin(), {shards, 3});
  moments = moments.reshape(shape);
  const at::Tensor elements = moments.select(1, 0), means = moments.select(1, 1);
  const at::Tensor mean = (elements * means).sum(0).div(count);
  const at::Tensor m2 = (elements * (moments.select(1, 2) + (means - mean).pow(2))).sum(0);
  return {mean, m2};
}

at::Tensor tensor_or_undefined(const c10::IValue& v) {
  return v.isTensor() ? v.toTensor() : at::Tensor();
}

// [C] -> [1, C, 1, ...] to broadcast over an ndim-dim activation.
at::Tensor per_channel_view(const at::Tensor& v, int64_t ndim) {
  std::vector<int64_t> shape(ndim, 1);
  shape[1] = v.numel();
  return v.reshape(shape);
}

// Elements per (sample, channel): the product of the spatial sizes.
int64_t spatial_numel(at::IntArrayRef s) { return c10::multiply_integers(s.begin() + 2, s.end()); }

// ---- group_norm ---------------------------------------------------------------------------

struct GroupNormLayout {
  SpecPtr input;                           // batch and spatial shards kept
  SpecPtr stats;                           // [N, group]: the input's batch sharding
  std::vector<int64_t> spatial_mesh_dims;  // all-reduce over these
  double count;                            // elements per (n, group), global
};

GroupNormLayout group_norm_layout(const OpCall& call, const DTensorSpec& in, int64_t group) {
  TORCH_CHECK(in.ndim() >= 2, "tessera: ", call.describe(), ": group_norm needs [N, C, ...]");
  TORCH_CHECK(group > 0 && in.sizes()[1] % group == 0, "tessera: ", call.describe(),
              ": the channels must divide into ", group, " groups");
  GroupNormLayout l;
  l.input = keep_sharded(in, [](int64_t t) { return t != 1; });
  l.stats = along_dim(*l.input, 0, {in.sizes()[0], group}, in.dtype());
  l.spatial_mesh_dims = mesh_dims_where(*l.input, [](int64_t t) { return t >= 2; });
  l.count =
      static_cast<double>(in.sizes()[1] / group) * static_cast<double>(spatial_numel(in.sizes()));
  return l;
}

// native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd)
// N and HxW are global; the kernel works from the local shard's sizes.
OpPlan group_norm_rule(const OpCall& call) {
  const int64_t group = call.arg<int64_t>("group");
  auto l = group_norm_layout(call, *call.spec("input"), group);
  OpPlan plan(call);
  plan.input("input", l.input);
  for (const char* param : {"weight", "bias"})
    if (const auto* sp = call.spec(param)) plan.input(param, replicated(*sp));
  plan.outputs = {l.input, l.stats, l.stats};
  plan.distributed_kernel = [dims = l.spatial_mesh_dims, count = l.count, group](
                                KernelCall& kc, const DeviceMesh& mesh) {
    const at::Tensor x = kc.tensor("input");
    const at::Tensor w = tensor_or_undefined(kc.arg("weight")),
                     b = tensor_or_undefined(kc.arg("bias"));
    const double eps = kc.arg<double>("eps");
    const int64_t n = x.size(0), c = x.size(1), d = c / group;
    const int64_t local = d * spatial_numel(x.sizes());  // elements per (sample, group) here
    // One pass for the local moments, then one all-gather per spatial mesh dim.
    at::Tensor lmean, lvar;
    if (local > 0 && n > 0) {
      // ATen's own group-norm kernel gives the local moments several times faster than
      // var_mean; with eps 0 its rstd is exactly 1/sqrt(variance) (inf for a constant group,
      // which gives variance 0 back).
      at::Tensor lrstd;
      std::tie(std::ignore, lmean, lrstd) = at::native_group_norm(
          x.to(compute_dtype(x)), {}, {}, n, c, spatial_numel(x.sizes()), group, /*eps=*/0.0);
      lvar = lrstd.pow(-2);
    } else {
      lmean = at::zeros({n, group}, x.options().dtype(compute_dtype(x)));
      lvar = at::zeros_like(lmean);
    }
    const auto [global_mean, m2] = combine_moments(mesh, dims, local, lmean, lvar, count);
    const at::Tensor mean = global_mean.to(stats_dtype(x, {w, b}));
    const at::Tensor rstd = (m2.div(count).clamp_min(0) + eps).rsqrt().to(stats_dtype(x, {w, b}));
    // out = x * scale + shift with one scale and shift per (sample, channel): one pass.
    at::Tensor scale = rstd.unsqueeze(-1).expand({n, group, d}).reshape({n, c});
    if (w.defined()) scale = scale * w.view({1, c});
    at::Tensor shift = -mean.unsqueeze(-1).expand({n, group, d}).reshape({n, c}) * scale;
    if (b.defined()) shift = shift + b.view({1, c});
    std::vector<int64_t> per_channel(x.dim(), 1);
    per_channel[0] = n;
    per_channel[1] = c;
    kc.finish({at::addcmul(shift.view(per_channel), x, scale.view(per_channel)).to(x.scalar_type()),
               mean, rstd});
  };
  return plan;
}

// native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group,
//                            output_mask) -> (grad_input, grad_weight, grad_bias)
OpPlan group_norm_backward_rule(const OpCall& call) {
  const int64_t group = call.arg<int64_t>("group");
  const auto mask = call.arg<std::array<bool, 3>>("output_mask");
  auto l = group_norm_layout(call, *call.spec("input"), group);
  const bool need_input = mask[0];
  OpPlan plan(call);
  plan.input("input", l.input);
  plan.input("grad_out",
             same_layout_with_shape(*l.input, l.input->sizes(), call.spec("grad_out")->dtype()));
  for (const char* stat : {"mean", "rstd"})
    if (call.spec(stat)) plan.input(stat, l.stats);
  if (const auto* w = call.spec("weight")) plan.input("weight", replicated(*w));
  // Once the input gradient has all-reduced the per-sample sums over space, the parameter
  // gradients are whole there and only sum over batch shards.
  const std::vector<int64_t> c{l.input->sizes()[1]};
  SpecPtr param_grad = summed_over_shards(*l.input, c);
  if (need_input) {
    Placements p(l.input->mesh().ndim(), Replicate());
    for (int64_t m = 0; m < l.input->mesh().ndim(); ++m)
      if (l.input->placement(m).is_shard(0)) p[m] = Partial();
    param_grad = std::make_shared<DTensorSpec>(l.input->mesh(), p, c, l.input->dtype());
  }
  plan.outputs = {l.input, param_grad, param_grad};
  const bool need_weight = mask[1], need_bias = mask[2];
  plan.distributed_kernel = [dims = l.spatial_mesh_dims, count = l.count, group, need_input,
                             need_weight, need_bias](KernelCall& kc, const DeviceMesh& mesh) {
    // (In float32 for half input; results in the input's and the weight's dtypes.)
    const at::Tensor x_in = kc.tensor("input"), w_in = tensor_or_undefined(kc.arg("weight"));
    const auto acc = compute_dtype(x_in);
    const at::Tensor dy = kc.tensor("grad_out").to(acc), x = x_in.to(acc);
    const at::Tensor mean = kc.tensor("mean").to(acc), rstd = kc.tensor("rstd").to(acc);
    const at::Tensor w = w_in.defined() ? w_in.to(acc) : w_in;
    const int64_t n = x.size(0), c = x.size(1), d = c / group, hw = spatial_numel(x.sizes());
    const at::Tensor dy3 = dy.reshape({n, c, hw}), x3 = x.reshape({n, c, hw});
    at::Tensor ds = (dy3 * x3).sum(-1), db = dy3.sum(-1);  // [n, C] over local space
    if (need_input) {
      auto both = sum_over(mesh, dims, at::stack({ds, db}));
      ds = both[0];
      db = both[1];
    }
    at::Tensor gx, gw, gb;
    const at::Tensor mean3 = mean.unsqueeze(-1), rstd3 = rstd.unsqueeze(-1);
    if (need_input) {
      // dx = rstd*gamma*dy + c2*x + c3 per (n, group), from the group's whole sums.
      const at::Tensor gamma =
          w.defined() ? w.reshape({1, group, d}) : at::ones({1, group, d}, x.options());
      const at::Tensor dsg = (ds.reshape({n, group, d}) * gamma).sum(-1);
      const at::Tensor dbg = (db.reshape({n, group, d}) * gamma).sum(-1);
      const at::Tensor c2 = (dbg * mean - dsg) * rstd.pow(3) / count;
      const at::Tensor c3 = -c2 * mean - dbg * rstd / count;
      const at::Tensor c1 = rstd3 * gamma;  // [n, group, d]
      gx = (c1.unsqueeze(-1) * dy.reshape({n, group, d, hw}) +
            c2.reshape({n, group, 1, 1}) * x.reshape({n, group, d, hw}) +
            c3.reshape({n, group, 1, 1}))
               .reshape(x.sizes());
    }
    if (need_weight)
      gw = ((ds.reshape({n, group, d}) - db.reshape({n, group, d}) * mean3) * rstd3)
               .sum(0)
               .reshape({c});
    if (need_bias) gb = db.sum(0);
    kc.finish({gx.defined() ? gx.to(x_in.scalar_type()) : gx, as_param(gw, w_in, x_in),
               as_param(gb, w_in, x_in)});
  };
  return plan;
}

// ---- batch_norm ---------------------------------------------------------------------------

// The batch-norm variants name their arguments alike: input, weight?, bias?, running_mean and
// running_var (absent in _native_batch_norm_legit.no_stats), training (absent where the op
// fixes it), momentum, eps. 2.x's _batch_norm_{with,no}_update return a fourth result
// (cuDNN's reserve; empty on CPU).

struct BatchNormLayout {
  SpecPtr input;
  std::vector<int64_t> reduce_mesh_dims;  // mesh dims sharding the batch or a spatial dim
  double count;                           // elements per channel, global
};

BatchNormLayout batch_norm_layout(const OpCall& call, const DTensorSpec& in, bool keep_channel) {
  TORCH_CHECK(in.ndim() >= 2, "tessera: ", call.describe(), ": batch_norm needs [N, C, ...]");
  BatchNormLayout l;
  l.input = keep_sharded(in, [keep_channel](int64_t t) { return t != 1 || keep_channel; });
  l.reduce_mesh_dims = mesh_dims_where(*l.input, [](int64_t t) { return t != 1; });
  l.count = in.sizes()[1] == 0
                ? 0.0
                : static_cast<double>(in.numel()) / static_cast<double>(in.sizes()[1]);
  return l;
}

// `fixed_training`: whether an op without a `training` argument trains.
OpPlan batch_norm_plan(const OpCall& call, bool fixed_training) {
  const bool training = call.has("training") ? call.arg<bool>("training") : fixed_training;
  const DTensorSpec& in = *call.spec("input");
  auto defined = [&](const char* name) {
    if (!call.has(name)) return false;
    const auto& v = call.arg(name);
    return v.isTensor() && v.toTensor().defined();
  };
  const bool has_stats = defined("running_mean") || defined("running_var");
  // Running stats are updated in place on every rank's whole copy, so they must stay whole:
  // then the channel dim is replicated too.
  const bool updates = training && has_stats;
  auto l = batch_norm_layout(call, in, !updates);
  const int64_t c = in.sizes()[1];
  auto channel = along_dim(*l.input, 1, {c}, in.dtype());
  OpPlan plan(call);
  plan.input("input", l.input);
  for (const char* param : {"weight", "bias"})
    if (const auto* sp = call.spec(param))
      plan.input(param, along_dim(*l.input, 1, {c}, sp->dtype()));
  for (const char* stat : {"running_mean", "running_var"}) {
    const DTensorSpec* sp = call.has(stat) ? call.spec(stat) : nullptr;
    if (!sp) continue;
    TORCH_CHECK(!updates || sp->is_replicated(), "tessera: ", call.describe(),
                ": running_mean/running_var are updated in place in training and must be "
                "replicated (or plain tensors)");
    plan.input(stat, along_dim(*l.input, 1, {c}, sp->dtype()));
  }
  // Evaluation returns empty save_mean/save_invstd, as one device does.
  auto saved =
      training ? channel
               : std::make_shared<DTensorSpec>(in.mesh(), Placements(in.mesh().ndim(), Replicate()),
                                               std::vector<int64_t>{0}, in.dtype());
  plan.outputs = {l.input, saved, saved};
  const bool reserve = call.schema().returns().size() == 4;
  if (reserve)
    plan.output(std::make_shared<DTensorSpec>(in.mesh(), Placements(in.mesh().ndim(), Replicate()),
                                              std::vector<int64_t>{0}, at::kByte));
  plan.distributed_kernel = [dims = l.reduce_mesh_dims, count = l.count, training, reserve](
                                KernelCall& kc, const DeviceMesh& mesh) {
    const at::Tensor x = kc.tensor("input");
    const at::Tensor w = tensor_or_undefined(kc.arg("weight")),
                     b = tensor_or_undefined(kc.arg("bias"));
    const bool has_running = kc.index("running_mean") >= 0;
    at::Tensor rm = has_running ? tensor_or_undefined(kc.arg("running_mean")) : at::Tensor();
    at::Tensor rv = has_running ? tensor_or_undefined(kc.arg("running_var")) : at::Tensor();
    const double momentum = kc.arg<double>("momentum"), eps = kc.arg<double>("eps");
    std::vector<int64_t> reduce{0};
    for (int64_t t = 2; t < x.dim(); ++t) reduce.push_back(t);
    at::Tensor mean, invstd, save_mean, save_invstd;
    if (training) {
      // Local moments per channel, then one all-gather per mesh dim (combine_moments).
      const int64_t channels = x.size(1), local = channels ? x.numel() / channels : 0;
      at::Tensor lmean = at::zeros({channels}, x.options().dtype(compute_dtype(x)));
      at::Tensor lvar = at::zeros_like(lmean);
      if (local > 0)
        std::tie(lvar, lmean) = at::var_mean(x.to(compute_dtype(x)), reduce, /*unbiased=*/false);
      const auto [global_mean, var_sum] = combine_moments(mesh, dims, local, lmean, lvar, count);
      const auto stats = stats_dtype(x, {w, b, rm, rv}, /*on_cuda_always=*/true);
      mean = global_mean.to(stats);
      invstd = (var_sum / count + eps).rsqrt().to(stats);
      save_mean = mean;
      save_invstd = invstd;
      // As one device: the running variance is unbiased over the global count.
      if (rm.defined()) rm.mul_(1 - momentum).add_(mean.to(rm.scalar_type()), momentum);
      if (rv.defined())
        rv.mul_(1 - momentum).add_((var_sum / (count - 1)).to(rv.scalar_type()), momentum);
    } else {
      TORCH_CHECK(rm.defined() && rv.defined(),
                  "tessera: batch_norm in evaluation needs running_mean and running_var");
      mean = rm.to(x.scalar_type());
      invstd = (rv.to(x.scalar_type()) + eps).sqrt().reciprocal();
      save_mean = at::empty({0}, x.options());
      save_invstd = at::empty({0}, x.options());
    }
    // out = x * alpha + beta per channel, as ATen's CPU kernel computes it.
    const at::Tensor alpha = w.defined() ? invstd * w : invstd;
    at::Tensor beta = -mean * alpha;
    if (b.defined()) beta = beta + b;
    at::Tensor out = (x * per_channel_view(alpha, x.dim()) + per_channel_view(beta, x.dim()))
                         .to(x.scalar_type());
    if (reserve)
      kc.finish({out, save_mean, save_invstd, at::empty({0}, x.options().dtype(at::kByte))});
    else
      kc.finish({out, save_mean, save_invstd});
  };
  return plan;
}

// The variants with a `training` argument, and those that never train
// (_native_batch_norm_legit_no_training, _batch_norm_no_update).
OpPlan batch_norm_rule(const OpCall& call) {
  return batch_norm_plan(call, /*fixed_training=*/false);
}
OpPlan batch_norm_with_update_rule(const OpCall& call) {
  return batch_norm_plan(call, /*fixed_training=*/true);
}

// native_batch_norm_backward(grad_out, input, weight?, running_mean?, running_var?,
//   save_mean?, save_invstd?, train, eps, output_mask) and (2.x) batch_norm_backward(...,
//   save_var?, update, eps, output_mask, reserve): 2.x names two arguments differently,
//   `update` for `train` and `save_var` for `save_invstd` (the same saved statistic).
OpPlan batch_norm_backward_rule(const OpCall& call) {
  const char* train_arg = call.has("train") ? "train" : "update";
  const char* invstd_arg = call.has("save_invstd") ? "save_invstd" : "save_var";
  const bool train = call.arg<bool>(train_arg);
  const auto mask = call.arg<std::array<bool, 3>>("output_mask");
  const DTensorSpec& in = *call.spec("input");
  auto l = batch_norm_layout(call, in, /*keep_channel=*/true);
  const int64_t c = in.sizes()[1];
  const bool need_input = mask[0], need_weight = mask[1], need_bias = mask[2];
  // In training the input gradient needs the whole-domain sums; then the parameter
  // gradients come from them too.
  const bool reduced = train && need_input;
  OpPlan plan(call);
  plan.input("input", l.input);
  plan.input("grad_out",
             same_layout_with_shape(*l.input, l.input->sizes(), call.spec("grad_out")->dtype()));
  for (const char* name : {"weight", "running_mean", "running_var", "save_mean", invstd_arg}) {
    const DTensorSpec* sp = call.spec(name);
    if (!sp) continue;
    const bool per_channel = sp->ndim() == 1 && sp->sizes()[0] == c;
    plan.input(name, per_channel ? along_dim(*l.input, 1, {c}, sp->dtype()) : replicated(*sp));
  }
  auto param_grad = along_dim(*l.input, 1, {c}, in.dtype(), reduced ? Replicate() : Partial());
  plan.outputs = {l.input, param_grad, param_grad};
  plan.distributed_kernel = [dims = l.reduce_mesh_dims, count = l.count, train, reduced, need_input,
                             need_weight, need_bias,
                             invstd_arg](KernelCall& kc, const DeviceMesh& mesh) {
    // (In float32 for half input; results in the input's and the weight's dtypes.)
    const at::Tensor x_in = kc.tensor("input"), w_in = tensor_or_undefined(kc.arg("weight"));
    const auto acc = compute_dtype(x_in);
    const at::Tensor dy = kc.tensor("grad_out").to(acc), x = x_in.to(acc);
    const at::Tensor w = w_in.defined() ? w_in.to(acc) : w_in;
    const double eps = kc.arg<double>("eps");
    at::Tensor mean, invstd;
    if (train) {
      mean = kc.tensor("save_mean").to(acc);
      invstd = kc.tensor(invstd_arg).to(acc);
    } else {
      mean = kc.tensor("running_mean").to(acc);
      invstd = (kc.tensor("running_var").to(acc) + eps).sqrt().reciprocal();
    }
    std::vector<int64_t> reduce{0};
    for (int64_t t = 2; t < x.dim(); ++t) reduce.push_back(t);
    const at::Tensor xc = x - per_channel_view(mean, x.dim());
    at::Tensor sum_dy = dy.sum(reduce), dot = (dy * xc).sum(reduce);
    if (reduced) {
      auto both = sum_over(mesh, dims, at::stack({sum_dy, dot}));
      sum_dy = both[0];
      dot = both[1];
    }
    const at::Tensor scale = w.defined() ? invstd * w : invstd;
    at::Tensor gx, gw, gb;
    if (need_input) {
      if (train) {
        const at::Tensor k = dot * invstd * invstd / count;
        gx = (dy - per_channel_view(sum_dy / count, x.dim()) - xc * per_channel_view(k, x.dim())) *
             per_channel_view(scale, x.dim());
      } else {
        gx = dy * per_channel_view(scale, x.dim());
      }
    }
    if (need_weight) gw = dot * invstd;
    if (need_bias) gb = sum_dy;
    kc.finish({gx.defined() ? gx.to(x_in.scalar_type()) : gx, as_param(gw, w_in, x_in),
               as_param(gb, w_in, x_in)});
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::native_layer_norm", layer_norm_rule);
  register_rule("aten::native_layer_norm_backward", layer_norm_backward_rule);
  register_rule("aten::native_group_norm", group_norm_rule);
  register_rule("aten::native_group_norm_backward", group_norm_backward_rule);
  register_rule("aten::native_batch_norm", batch_norm_rule);
  register_rule("aten::native_batch_norm_backward", batch_norm_backward_rule);
  // LibTorch 2.x spellings (rules are looked up by name: absent ops are never asked for).
  register_rule("aten::_native_batch_norm_legit", batch_norm_rule);
  register_rule("aten::_native_batch_norm_legit.no_stats", batch_norm_rule);
  register_rule("aten::_native_batch_norm_legit_no_training", batch_norm_rule);
  register_rule("aten::_batch_norm_with_update", batch_norm_with_update_rule);
  register_rule("aten::_batch_norm_no_update", batch_norm_rule);
  register_rule("aten::batch_norm_backward", batch_norm_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
