// Reductions next to reduction.cpp's families: logsumexp, any / all, count_nonzero, aminmax,
// and equal / allclose (one bool: local answers all-reduced).
// Unreduced dims keep their shards (renumbered without keepdim); Partial inputs are reduced
// first. What happens to a mesh dim that shards a reduced dim:
//   logsumexp      two all-reduces inside the op (NOTE: [logsumexp on a sharded dim]); the
//                  result is replicated on that mesh dim
//   any / all      the local op, then one all-reduce (max / min, as bytes); replicated
//   count_nonzero  the local count, Partial(sum)
//   aminmax        local extrema, the identity on an empty shard; Partial(min), Partial(max)
//
// NOTE: [logsumexp on a sharded dim]
// Exact without gathering the data: each rank takes the max of its shard (-inf when empty),
// the maxima are all-reduced (max), each rank sums exp(x - m) over its shard, the sums are
// all-reduced (sum), and every rank returns log(s) + m. An infinite m is replaced by 0 as one
// device does, so an all -inf slice gives -inf and a +inf entry gives +inf. The backward,
// exp(x - logsumexp) * grad, is pointwise on the input's layout.
#include <algorithm>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include "tessera/comm/collectives.h"
#include "tessera/tensor/rule.h"
#include "dim_layout.h"
#include "reduction_identity.h"

namespace tessera::ops {

namespace {

// Mesh dims that shard a reduced dim.
std::vector<int64_t> reducing_mesh_dims(const DTensorSpec& in, const ReducedDims& r) {
  std::vector<int64_t> out;
  for (int64_t m = 0; m < in.mesh().ndim(); ++m)
    if (in.placement(m).is_shard() && r.dims[in.placement(m).dim()]) out.push_back(m);
  return out;
}

// The result's layout: reduced dims gone (or size 1), their mesh dims `across`.
SpecPtr result_layout(const DTensorSpec& in, const ReducedDims& r, Placement across) {
  std::vector<int64_t> index(in.ndim(), -1), sizes;
  for (int64_t t = 0; t < in.ndim(); ++t) {
    if (r.dims[t] && !r.keepdim) continue;
    index[t] = static_cast<int64_t>(sizes.size());
    sizes.push_back(r.dims[t] ? 1 : in.sizes()[t]);
  }
  Placements p = in.placements();
  std::vector<ShardTable> tables(sizes.size());
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    const int64_t t = x.dim();
    if (r.dims[t]) {
      x = across;
    } else {
      tables[index[t]] = in.shard_table(t);
      x = Shard(index[t]);
    }
  }
  return std::make_shared<DTensorSpec>(in.mesh(), p, sizes, in.dtype(), tables);
}

bool empty_along(const at::Tensor& x, const std::vector<int64_t>& dims) {
  for (auto d : dims)
    if (x.size(d) == 0) return true;
  return false;
}

std::vector<int64_t> kept_shape(const at::Tensor& x, const std::vector<int64_t>& dims,
                                bool keepdim) {
  std::vector<int64_t> shape;
  for (int64_t t = 0; t < x.dim(); ++t) {
    const bool red = std::find(dims.begin(), dims.end(), t) != dims.end();
    if (!red)
      shape.push_back(x.size(t));
    else if (keepdim)
      shape.push_back(1);
  }
  return shape;
}

// Self with its Partial terms summed first: none of these reductions is linear in them.
SpecPtr whole_terms(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  TORCH_INTERNAL_ASSERT(self, call.describe());
  return std::make_shared<DTensorSpec>(self->partial_as_replicate());
}

// ---- logsumexp -------------------------------------------------------------------------------

OpPlan logsumexp_rule(const OpCall& call) {
  const SpecPtr in = whole_terms(call);
  const ReducedDims r = reduced_dims_arg(call, in->ndim());
  OpPlan plan(call);
  plan.input("self", in).output(result_layout(*in, r, Replicate()));
  const auto across = reducing_mesh_dims(*in, r);
  if (across.empty()) return plan;
  const auto dims = r.list();
  const bool keepdim = r.keepdim;
  plan.distributed_kernel = [dims, keepdim, across](KernelCall& k, const DeviceMesh& mesh) {
    at::Tensor x = k.tensor("self");
    if (!at::isFloatingType(x.scalar_type()))
      x = x.to(at::typeMetaToScalarType(at::get_default_dtype()));
    const double inf = std::numeric_limits<double>::infinity();
    at::Tensor m = empty_along(x, dims) ? at::full(kept_shape(x, dims, true), -inf, x.options())
                                        : at::amax(x, dims, true);
    for (auto md : across) m = comm::all_reduce(mesh.group(md), m, PartialOp::Max);
    m = m.masked_fill(m.abs() == inf, 0);
    at::Tensor s = at::sum(at::exp(x - m), dims, true);
    for (auto md : across) s = comm::all_reduce(mesh.group(md), s, PartialOp::Sum);
    at::Tensor out = s.log_().add_(m);
    if (!keepdim)
      for (auto it = dims.rbegin(); it != dims.rend(); ++it) out = out.squeeze(*it);
    k.finish({out});
  };
  return plan;
}

// ---- any / all / count_nonzero ---------------------------------------------------------------

OpPlan any_all_rule(const OpCall& call, bool is_any) {
  const SpecPtr in = whole_terms(call);
  const ReducedDims r = reduced_dims_arg(call, in->ndim());
  OpPlan plan(call);
  plan.input("self", in).output(result_layout(*in, r, Replicate()));
  const auto across = reducing_mesh_dims(*in, r);
  if (across.empty()) return plan;
  plan.distributed_kernel = [across, is_any](KernelCall& k, const DeviceMesh& mesh) {
    k.call_op();  // any of nothing is false, all of nothing is true: empty shards are neutral
    const at::Tensor local = only_result(k).toTensor();
    at::Tensor bytes = local.to(at::kByte);
    for (auto md : across)
      bytes = comm::all_reduce(mesh.group(md), bytes, is_any ? PartialOp::Max : PartialOp::Min);
    k.finish({bytes.to(local.scalar_type())});
  };
  return plan;
}

OpPlan count_nonzero_rule(const OpCall& call) {
  const SpecPtr in = whole_terms(call);
  OpPlan plan(call);
  plan.input("self", in).output(result_layout(*in, reduced_dims_arg(call, in->ndim()), Partial()));
  return plan;
}

// ---- aminmax ---------------------------------------------------------------------------------

OpPlan aminmax_rule(const OpCall& call) {
  const SpecPtr in = whole_terms(call);
  const ReducedDims r = reduced_dims_arg(call, in->ndim());
  OpPlan plan(call);
  plan.input("self", in)
      .output(result_layout(*in, r, Partial(PartialOp::Min)))
      .output(result_layout(*in, r, Partial(PartialOp::Max)));
  if (reducing_mesh_dims(*in, r).empty()) return plan;
  bool globally_empty = false;
  for (int64_t t = 0; t < in->ndim(); ++t) globally_empty |= r.dims[t] && in->sizes()[t] == 0;
  const auto dims = r.list();
  const bool keepdim = r.keepdim, whole = !call.has("dim") || call.arg("dim").isNone();
  plan.local_kernel = [dims, keepdim, whole, globally_empty](KernelCall& k) {
    const at::Tensor x = k.tensor("self");
    // A globally empty reduction raises one device's error on every rank.
    if (globally_empty || !empty_along(x, dims)) return k.call_op();
    const auto shape = whole && !keepdim ? std::vector<int64_t>{} : kept_shape(x, dims, keepdim);
    k.finish({identity_fill(shape, x.options(), false), identity_fill(shape, x.options(), true)});
  };
  return plan;
}

// ---- equal / allclose ------------------------------------------------------------------------

// One bool for the whole tensors: the local op on aligned shards, then an all-reduce (min) over
// the mesh dims that shard them.
OpPlan whole_bool_rule(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  const DTensorSpec* other = call.spec("other");
  if (!self || !other || self->sizes() != other->sizes()) return replicate_inputs(call);
  auto in = std::make_shared<DTensorSpec>(self->partial_as_replicate());
  OpPlan plan(call);
  plan.input("self", in).input("other", align_to(*in, *other, false));
  std::vector<int64_t> across;
  for (int64_t m = 0; m < in->mesh().ndim(); ++m)
    if (in->placement(m).is_shard()) across.push_back(m);
  if (across.empty()) return plan;
  plan.distributed_kernel = [across](KernelCall& k, const DeviceMesh& mesh) {
    k.call_op();
    at::Tensor agree = at::scalar_tensor(only_result(k).toBool() ? 1 : 0,
                                         at::TensorOptions(at::kByte).device(mesh.device()));
    for (auto md : across) agree = comm::all_reduce(mesh.group(md), agree, PartialOp::Min);
    k.finish({c10::IValue(agree.item<uint8_t>() != 0)});
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::equal", "aten::allclose"}) register_rule(op, whole_bool_rule);
  register_rule("aten::logsumexp", logsumexp_rule);
  for (const char* op : {"aten::any", "aten::any.dim", "aten::any.dims"})
    register_rule(op, [](const OpCall& c) { return any_all_rule(c, true); });
  for (const char* op : {"aten::all", "aten::all.dim", "aten::all.dims"})
    register_rule(op, [](const OpCall& c) { return any_all_rule(c, false); });
  for (const char* op : {"aten::count_nonzero", "aten::count_nonzero.dim_IntList"})
    register_rule(op, count_nonzero_rule);
  register_rule("aten::aminmax", aminmax_rule);
}};

}  // namespace

}  // namespace tessera::ops
