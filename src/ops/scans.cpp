// Scans along a dim: cumsum, cumprod, logcumsumexp, cummax / cummin, and the backward ops
// autograd builds from plain buffers (cumprod_backward, cummaxmin_backward), which get kernels
// at the distributed-tensor key (NOTE: [How to add an op], case 2): they lay their arguments
// out with the scanned dim whole and run the op on the shards.
//
// NOTE: [Scans on a sharded dim]
// cumsum, cumprod and logcumsumexp are associative: a rank scans its own shard, then adds
// (multiplies, log-add-exps) the combined totals of the shards before it in table order. The
// totals are the last slice of each local scan (the identity for an empty shard), gathered
// along the mesh dims that shard the scanned dim, innermost first, so they arrive in table
// order: one all-gather of one slice per shard. cummax / cummin combine the same way on
// (value, global index) pairs: a later entry wins where it is NaN or at least the running
// extremum (ties go to the later index, as one device does); an earlier NaN is never beaten
// by a number. Other dims keep their shards; Partial inputs are reduced first.
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "dim_layout.h"
#include "tessera/comm/collectives.h"
#include "tessera/tensor/rule.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::ops {

namespace {

enum class Scan { Sum, Prod, LogSumExp, Max, Min };

struct ScanPlace {
  int64_t dim;
  std::vector<int64_t> mesh_dims;  // those sharding `dim`, in nesting order
  int64_t index;                   // this rank's place in the table of `dim`
  int64_t offset;                  // its global offset along `dim`
};

// Every shard's `slice` (size 1 along dim), concatenated along dim in table order.
at::Tensor gather_slices(const DeviceMesh& mesh, const ScanPlace& s, at::Tensor slice) {
  for (auto it = s.mesh_dims.rbegin(); it != s.mesh_dims.rend(); ++it)
    slice = comm::all_gather(mesh.group(*it), slice.contiguous(), s.dim,
                             std::vector<int64_t>(mesh.size(*it), slice.size(s.dim)));
  return slice;
}

at::Tensor last_or(const at::Tensor& x, int64_t dim, double identity) {
  const int64_t n = x.size(dim);
  if (n > 0) return x.narrow(dim, n - 1, 1);
  auto shape = x.sizes().vec();
  shape[dim] = 1;
  return at::full(shape, identity, x.options());
}

void scan_kernel(KernelCall& k, const DeviceMesh& mesh, const ScanPlace& s, Scan kind) {
  k.call_op();
  const at::Tensor local = only_result(k).toTensor();
  const double inf = std::numeric_limits<double>::infinity();
  const double identity = kind == Scan::Sum ? 0 : kind == Scan::Prod ? 1 : -inf;
  const at::Tensor before =
      gather_slices(mesh, s, last_or(local, s.dim, identity)).narrow(s.dim, 0, s.index);
  if (s.index == 0) return;  // nothing before the first shard: the local scan is the result
  at::Tensor out;
  switch (kind) {
    case Scan::Sum: out = local + before.sum(s.dim, true).to(local.scalar_type()); break;
    case Scan::Prod: out = local * before.prod(s.dim, true).to(local.scalar_type()); break;
    default: out = at::logaddexp(local, before.logsumexp(s.dim, true)); break;
  }
  k.finish({out});
}

// Does (v, i) win over the running (pv, pi)? pi < 0 marks no entry yet.
at::Tensor takes_over(const at::Tensor& v, const at::Tensor& pv, const at::Tensor& pi,
                      bool is_max) {
  const at::Tensor beats = is_max ? v >= pv : v <= pv;
  return (pi < 0) | at::isnan(v) | (at::isnan(pv).logical_not() & beats);
}

void cum_extremum_kernel(KernelCall& k, const DeviceMesh& mesh, const ScanPlace& s, bool is_max) {
  k.call_op();
  at::Tensor values = result_named(k, "values").toTensor();
  at::Tensor indices = result_named(k, "indices").toTensor() + s.offset;
  const int64_t n = values.size(s.dim);
  auto slice_shape = values.sizes().vec();
  slice_shape[s.dim] = 1;
  const at::Tensor last_v =
      n > 0 ? values.narrow(s.dim, n - 1, 1) : at::zeros(slice_shape, values.options());
  const at::Tensor last_i =
      n > 0 ? indices.narrow(s.dim, n - 1, 1) : at::full(slice_shape, -1, indices.options());
  const at::Tensor tv = gather_slices(mesh, s, last_v), ti = gather_slices(mesh, s, last_i);
  if (s.index > 0) {
    at::Tensor pv = tv.narrow(s.dim, 0, 1), pi = ti.narrow(s.dim, 0, 1);
    for (int64_t j = 1; j < s.index; ++j) {
      const at::Tensor v = tv.narrow(s.dim, j, 1), i = ti.narrow(s.dim, j, 1);
      const at::Tensor take = (i >= 0) & takes_over(v, pv, pi, is_max);
      pv = at::where(take, v, pv);
      pi = at::where(take, i, pi);
    }
    const at::Tensor take = takes_over(values, pv, pi, is_max);
    values = at::where(take, values, pv);
    indices = at::where(take, indices, pi);
  }
  k.finish({values, indices});
}

OpPlan scan_rule(const OpCall& call, Scan kind) {
  const auto& self = self_of(call);
  if (self.ndim() == 0) return along(call, {});
  const int64_t d = wrap_dim(call.arg<int64_t>("dim"), self.ndim());
  auto in = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  OpPlan plan(call);
  plan.input("self", in);
  for (size_t r = 0; r < call.schema().returns().size(); ++r) plan.output(in);
  ScanPlace s{d, in->mesh_dims_sharding(d), 0, 0};
  if (s.mesh_dims.empty()) return plan;
  s.index = tessera::detail::table_index(in->mesh(), s.mesh_dims, in->mesh().coordinate());
  s.offset = in->local_offsets()[d];
  if (kind == Scan::Max || kind == Scan::Min) {
    const bool is_max = kind == Scan::Max;
    plan.distributed_kernel = [s, is_max](KernelCall& k, const DeviceMesh& mesh) {
      cum_extremum_kernel(k, mesh, s, is_max);
    };
  } else {
    plan.distributed_kernel = [s, kind](KernelCall& k, const DeviceMesh& mesh) {
      scan_kernel(k, mesh, s, kind);
    };
  }
  return plan;
}

// The layout the backward of a scan along `dim` runs in: the first distributed argument's,
// with `dim` whole.
SpecPtr backward_layout(std::initializer_list<const at::Tensor*> args, int64_t dim,
                        const char* op) {
  const at::Tensor* first = nullptr;
  for (const auto* t : args)
    if (!first && is_dtensor(*t)) first = t;
  TORCH_CHECK(first, "tessera: ", op,
              " reached the distributed-tensor key without a distributed argument");
  const auto& s = dtensor_impl(*first)->spec();
  if (s.ndim() == 0) return std::make_shared<DTensorSpec>(s.partial_as_replicate());
  return whole_along(s, {wrap_dim(dim, s.ndim())});
}

at::Tensor wrap_result(const at::Tensor& local, const DTensorSpec& layout) {
  return make_dtensor(
      local, std::make_shared<DTensorSpec>(layout.mesh(), layout.placements(), layout.sizes(),
                                           local.scalar_type(), layout.shard_tables()));
}

// cumprod_backward(grad, input, dim, output)
void cumprod_backward_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::Stack args = torch::jit::pop(*stack, op.schema().arguments().size());
  KernelCall k(op, args);
  const at::Tensor grad = k.tensor("grad"), input = k.tensor("input"), output = k.tensor("output");
  const int64_t dim = k.arg<int64_t>("dim");
  auto layout = backward_layout({&grad, &input, &output}, dim, "aten::cumprod_backward");
  if (layout->ndim() == 0) {
    stack->emplace_back(grad);
    return;
  }
  const at::Tensor local = at::cumprod_backward(local_as(grad, *layout), local_as(input, *layout),
                                                dim, local_as(output, *layout));
  stack->emplace_back(wrap_result(local, *layout));
}

// cummaxmin_backward(grad, input, indices, dim): indices are global along dim.
void cummaxmin_backward_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::Stack args = torch::jit::pop(*stack, op.schema().arguments().size());
  KernelCall k(op, args);
  const at::Tensor grad = k.tensor("grad"), input = k.tensor("input"),
                   indices = k.tensor("indices");
  const int64_t dim = k.arg<int64_t>("dim");
  auto layout = backward_layout({&grad, &input, &indices}, dim, "aten::cummaxmin_backward");
  const at::Tensor local = at::cummaxmin_backward(local_as(grad, *layout), local_as(input, *layout),
                                                  local_as(indices, *layout), dim);
  stack->emplace_back(wrap_result(local, *layout));
}

const RuleRegistrar registrar{[] {
  register_rule("aten::cumsum", [](const OpCall& c) { return scan_rule(c, Scan::Sum); });
  register_rule("aten::cumprod", [](const OpCall& c) { return scan_rule(c, Scan::Prod); });
  register_rule("aten::logcumsumexp",
                [](const OpCall& c) { return scan_rule(c, Scan::LogSumExp); });
  register_rule("aten::cummax", [](const OpCall& c) { return scan_rule(c, Scan::Max); });
  register_rule("aten::cummin", [](const OpCall& c) { return scan_rule(c, Scan::Min); });
  register_kernel("aten::cumprod_backward",
                  torch::CppFunction::makeFromBoxedFunction<&cumprod_backward_kernel>());
  register_kernel("aten::cummaxmin_backward",
                  torch::CppFunction::makeFromBoxedFunction<&cummaxmin_backward_kernel>());
}};

}  // namespace

}  // namespace tessera::ops
