// Reductions: sum/mean/nansum, amax/amin/max/min, prod, max.dim/min.dim/argmax/argmin,
// var/std (+ _mean), p-norms. Every rule is exact on uneven shards (zero-size ones included).
//
// NOTE: [Reduction layouts]
// How a mesh dim that shards a reduced tensor dim is handled depends on the reduction:
//   decomposable (sum, mean, nansum -> Partial(sum); amax, max() -> Partial(max);
//                 amin, min() -> Partial(min)):   reduced locally, no communication here
//                 (mean = local sum / *global* count, never a mean of means; an empty local
//                 shard contributes the identity: 0, -inf or +inf)
//   whole-dim     (prod, var, std, var_mean, std_mean, norm, linalg_vector_norm, max.dim,
//                 min.dim, argmax, argmin):         the reduced dim must be whole on every
//                 rank. There is no Partial(prod), a variance or a p-norm cannot be finished
//                 from per-shard terms inside one op (the root / the global mean are not
//                 available to a rule), and max.dim/argmax must return *global* indices.
// Partial inputs pass through only the decomposable reduction of their own op
// (Partial(sum) and Partial(avg) through sum/mean, Partial(max) through amax/max(), ...);
// anything else has to be reduced first.
//
// Cost: every mesh dim that cannot stay where it is moves either to Replicate or to
// Shard(u) on a tensor dim u the op keeps whole (an unreduced dim for whole-dim ops, any dim
// for decomposable ones) that no other mesh dim shards; `cheapest` picks by modelled bytes.
// Moving a shard to an unreduced dim is one all-to-all ((n-1)/n·B per rank, and the output
// stays sharded on u) where replicating is an all-gather ((n-1)·B per rank); with no such
// dim (every dim reduced, or the kept dims smaller than the mesh dim) the all-gather is the
// known cost, e.g. var()/prod()/norm() of a sharded tensor gather the whole tensor. A
// Partial becomes S(u) by one reduce-scatter where an all-reduce would cost twice that.
// Unreduced shards always keep their tables; outputs are renumbered for keepdim=false.
//
// The decision cache keys dims/keepdim/dtype but not Scalars, so a rule never looks at a
// norm's p: every p shares one plan (a p=inf norm could otherwise be Partial(max) of local
// abs-maxima without moving data).
#include <functional>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "tensor/out_form.h"
#include "tessera/tensor/rule.h"
#include "dim_layout.h"
#include "reduction_identity.h"

namespace tessera::ops {

namespace {

// How reduced shards combine; see NOTE: [Reduction layouts].
enum class Kind { Sum, NanSum, Max, Min, Whole };

const DTensorSpec& self_spec(const OpCall& call);

ReducedDims parse_dims(const OpCall& call) {
  return reduced_dims_arg(call, self_spec(call).ndim());
}

PartialOp partial_of(Kind k) {
  return k == Kind::Max ? PartialOp::Max : k == Kind::Min ? PartialOp::Min : PartialOp::Sum;
}

// Can a Partial(op) mesh dim pass through this reduction unchanged? (Sums are linear, so
// Partial(sum) and Partial(avg) pass through sum and mean.)
bool passes(Kind k, PartialOp op) {
  return (k == Kind::Sum && (op == PartialOp::Sum || op == PartialOp::Avg)) ||
         (k == Kind::Max && op == PartialOp::Max) || (k == Kind::Min && op == PartialOp::Min);
}

const DTensorSpec& self_spec(const OpCall& call) {
  const auto* self = call.spec("self");
  TORCH_CHECK(self, "tessera: ", call.describe(),
              ": reducing a plain 0-dim tensor into a distributed `out` is not supported");
  return *self;
}

// The result's layout when the input has layout `in`: unreduced shards keep their tables
// (renumbered without keepdim), reduced shards become Partial, Partial mesh dims stay.
SpecPtr output_layout(const DTensorSpec& in, const ReducedDims& d, Kind kind) {
  std::vector<int64_t> new_index(in.ndim(), -1), out_sizes;
  for (int64_t t = 0; t < in.ndim(); ++t) {
    if (d.dims[t] && !d.keepdim) continue;
    new_index[t] = static_cast<int64_t>(out_sizes.size());
    out_sizes.push_back(d.dims[t] ? 1 : in.sizes()[t]);
  }
  Placements p = in.placements();
  std::vector<ShardTable> tables(out_sizes.size());
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    const int64_t t = x.dim();
    if (d.dims[t]) {
      TORCH_INTERNAL_ASSERT(kind != Kind::Whole, "whole-dim reduction over a sharded dim");
      x = Partial(partial_of(kind));
    } else {
      tables[new_index[t]] = in.shard_table(t);
      x = Shard(new_index[t]);
    }
  }
  return std::make_shared<DTensorSpec>(in.mesh(), p, out_sizes, in.dtype(), tables);
}

// Every input layout the reduction could run on: each mesh dim in `move` goes to Replicate
// or to Shard(u) for a dim u in `may_take` that no staying mesh dim shards (one moving mesh
// dim per u, and only where u has at least one element per rank of that mesh dim). Dims are
// tried in `order`, so among equal costs a kept dim (sharded output) wins over a reduced one.
std::vector<SpecPtr> input_targets(const DTensorSpec& in, const std::vector<bool>& move,
                                   const std::vector<bool>& may_take,
                                   const std::vector<int64_t>& order) {
  const DeviceMesh& mesh = in.mesh();
  std::vector<bool> taken(in.ndim(), false);
  std::vector<int64_t> moving;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (move[m])
      moving.push_back(m);
    else if (in.placement(m).is_shard())
      taken[in.placement(m).dim()] = true;
  }
  std::vector<ShardTable> tables(in.ndim());
  for (int64_t t = 0; t < in.ndim(); ++t)
    if (taken[t]) tables[t] = in.shard_table(t);
  Placements p = in.placements();
  std::vector<SpecPtr> out;
  std::function<void(size_t)> choose = [&](size_t i) {
    if (i == moving.size()) {
      out.push_back(std::make_shared<DTensorSpec>(mesh, p, in.sizes(), in.dtype(), tables));
      return;
    }
    const int64_t m = moving[i];
    for (int64_t u : order) {
      if (!may_take[u] || taken[u] || in.sizes()[u] < mesh.size(m)) continue;
      taken[u] = true;
      p[m] = Shard(u);
      choose(i + 1);
      taken[u] = false;
    }
    p[m] = Replicate();
    choose(i + 1);
  };
  choose(0);
  return out;
}

// The plan of a reduction with `n_outputs` results of one layout (values/indices, var/mean).
OpPlan plan_reduction(const OpCall& call, const ReducedDims& d, Kind kind, size_t n_outputs = 1) {
  const auto& in = self_spec(call);
  std::vector<bool> move(in.mesh().ndim(), false), may_take(in.ndim(), true);
  for (int64_t m = 0; m < in.mesh().ndim(); ++m) {
    const auto& x = in.placement(m);
    if (x.is_partial()) move[m] = !passes(kind, x.reduce_op());
    if (x.is_shard()) move[m] = kind == Kind::Whole && d.dims[x.dim()];
  }
  if (kind == Kind::Whole)
    for (int64_t t = 0; t < in.ndim(); ++t) may_take[t] = !d.dims[t];
  std::vector<int64_t> order;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t t = 0; t < in.ndim(); ++t)
      if (d.dims[t] == (pass == 1)) order.push_back(t);
  std::vector<Strategy> candidates;
  for (auto& target : input_targets(in, move, may_take, order)) {
    Strategy s;
    s.inputs.resize(call.args.size());
    s.inputs[call.index("self")] = target;
    s.outputs.assign(n_outputs, output_layout(*target, d, kind));
    candidates.push_back(std::move(s));
  }
  return cheapest(call, candidates);
}

// ---- sum, mean, nansum -------------------------------------------------------------------

OpPlan sum_rule(const OpCall& call) { return plan_reduction(call, parse_dims(call), Kind::Sum); }

// nansum is not linear in Partial terms (a NaN term is skipped, the others are not).
OpPlan nansum_rule(const OpCall& call) {
  return plan_reduction(call, parse_dims(call), Kind::NanSum);
}

OpPlan mean_rule(const OpCall& call) {
  const ReducedDims d = parse_dims(call);
  OpPlan plan = plan_reduction(call, d, Kind::Sum);
  const auto& in = self_spec(call);
  int64_t count = 1;
  std::vector<int64_t> dims;
  for (int64_t t = 0; t < in.ndim(); ++t) {
    if (!d.dims[t]) continue;
    count *= in.sizes()[t];
    dims.push_back(t);
  }
  const auto dtype = call.arg<c10::optional<at::ScalarType>>("dtype");
  const bool keepdim = d.keepdim;
  const bool out_variant = call.has("out");
  // Local sum over the reduced dims divided by the *global* count: exact on uneven shards.
  plan.local_kernel = [count, dims, keepdim, dtype, out_variant](KernelCall& k) {
    at::Tensor s = at::sum(k.tensor("self"), dims, keepdim, dtype).div(static_cast<double>(count));
    if (out_variant) {
      at::Tensor out = k.tensor("out");
      out.resize_(s.sizes()).copy_(s);
      s = out;
    }
    k.finish({s});
  };
  plan.place_dims.emplace();  // a local sum over the reduced dims: no place used
  return plan;
}

// ---- amax, amin, max(), min() --------------------------------------------------------------

// Runs the op locally, except where a reduced dim's shard is empty (max of nothing is an
// error in ATen): that shard contributes the identity of the Partial(max/min) it becomes.
OpPlan extremum(const OpCall& call, Kind kind) {
  const ReducedDims d = parse_dims(call);
  OpPlan plan = plan_reduction(call, d, kind);
  const bool is_max = kind == Kind::Max;
  plan.local_kernel = [d, is_max](KernelCall& k) {
    const at::Tensor x = k.tensor("self");
    std::vector<int64_t> out_shape;
    bool empty = false;
    for (int64_t t = 0; t < x.dim(); ++t) {
      if (d.dims[t]) empty = empty || x.size(t) == 0;
      if (!d.dims[t])
        out_shape.push_back(x.size(t));
      else if (d.keepdim)
        out_shape.push_back(1);
    }
    if (!empty) {
      k.call_op();
      return;
    }
    k.finish({identity_fill(out_shape, x.options(), is_max)});
  };
  return plan;
}

OpPlan max_rule(const OpCall& call) { return extremum(call, Kind::Max); }
OpPlan min_rule(const OpCall& call) { return extremum(call, Kind::Min); }

// ---- whole-dim reductions -------------------------------------------------------------------

// prod, var, std, norms, argmax/argmin: the local op on whole reduced dims.
OpPlan whole_rule(const OpCall& call) {
  return plan_reduction(call, parse_dims(call), Kind::Whole, call.schema().returns().size());
}

// ---- backward of max.dim / min.dim ---------------------------------------------------------

// NOTE: [value_selecting_reduction_backward]
// Autograd's formula for max.dim/min.dim (also kthvalue, mode, sort, topk) is this composite
// op, which fills a *plain* at::zeros buffer with an in-place scatter_: on distributed inputs
// the gradient would come back as a plain tensor. For distributed tensors, one index per
// slice (max.dim, min.dim, kthvalue, mode) becomes a one-hot mask (indices == position along
// `dim`) selecting the gradient: pointwise ops on the indices' layout, no communication, the
// unreduced shards kept. Several indices per slice (sort, topk) scatter out of place into
// distributed zeros, as the op itself does for tensor subclasses.
at::Tensor value_selecting_backward(KernelCall& k) {
  const at::Tensor grad = k.tensor("grad");
  const at::Tensor indices = k.tensor("indices");
  const auto sizes = k.arg<std::vector<int64_t>>("sizes");
  const bool keepdim = k.arg<bool>("keepdim");
  const int64_t nd = static_cast<int64_t>(sizes.size());
  if (nd == 0) return grad.clone();  // max(dim=0) of a 0-dim tensor selects the only element
  const int64_t dim = c10::maybe_wrap_dim(k.arg<int64_t>("dim"), nd);
  const at::Tensor g = keepdim ? grad : grad.unsqueeze(dim);
  at::Tensor idx = keepdim ? indices : indices.unsqueeze(dim);
  if (idx.size(dim) != 1) return g.new_zeros(sizes).scatter(dim, idx, g);
  idx = idx.expand(sizes);
  std::vector<int64_t> along(nd, 1);
  along[dim] = sizes[dim];
  // A plain tensor next to distributed ones is a replicated value (docs/design.md).
  const at::Tensor position =
      at::arange(sizes[dim], at::TensorOptions().dtype(idx.scalar_type()).device(idx.device()))
          .view(along);
  return at::where(idx == position, g, at::zeros({}, g.options()));
}

// The boxed kernel: the op's arguments are the top of the stack, its result replaces them.
void value_selecting_backward_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t base = stack->size() - op.schema().arguments().size();
  torch::jit::Stack args(stack->begin() + base, stack->end());
  stack->resize(base);
  KernelCall k(op, args);
  stack->emplace_back(value_selecting_backward(k));
}

const RuleRegistrar registrar{[] {
  register_kernel("aten::value_selecting_reduction_backward",
                  torch::CppFunction::makeFromBoxedFunction<&value_selecting_backward_boxed>());

  register_rule("aten::sum", sum_rule);
  register_rule("aten::sum.dim_IntList", sum_rule);
  register_rule("aten::sum.IntList_out", sum_rule);
  register_rule("aten::nansum", nansum_rule);
  register_rule("aten::nansum.out", nansum_rule);
  register_rule("aten::mean", mean_rule);
  register_rule("aten::mean.dim", mean_rule);
  register_rule("aten::mean.out", mean_rule);

  register_rule("aten::amax", max_rule);
  register_rule("aten::max", max_rule);
  register_rule("aten::amin", min_rule);
  register_rule("aten::min", min_rule);

  for (const char* op :
       {"aten::prod", "aten::prod.dim_int", "aten::max.dim", "aten::min.dim", "aten::argmax",
        "aten::argmin", "aten::var.correction", "aten::std.correction", "aten::var_mean.correction",
        "aten::std_mean.correction", "aten::norm.Scalar", "aten::norm.ScalarOpt_dim",
        "aten::norm.ScalarOpt_dtype", "aten::norm.ScalarOpt_dim_dtype", "aten::linalg_vector_norm"})
    register_rule(op, whole_rule);
}};

}  // namespace

}  // namespace tessera::ops
