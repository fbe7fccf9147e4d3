// Ops that work along some dims of a tensor and leave the others alone: scans (cumsum,
// cumprod, logcumsumexp, cummax / cummin), sort / argsort, _safe_softmax, topk, kthvalue, median /
// nanmedian / mode along a dim, glu, flip, roll, tril / triu, unfold, repeat, diagonal, trace,
// linalg_cross; ops over the trailing dims that keep the batch dims' shards (adaptive max
// pooling, pixel (un)shuffle, channel_shuffle, im2col / col2im); and the backward ops these
// need.
//
// NOTE: [Dim-wise ops]
// The op's own dims must be whole on every rank; every other dim keeps its shards. A mesh
// dim that shards one of the op's dims moves its shard to a free dim (the largest tensor dim
// the op does not touch and no mesh dim shards), which is one all-to-all, or replicates when
// there is none. Partial inputs are reduced first (none of these ops is linear in a way a
// Partial could pass through for every overload). Outputs have the redistributed input's
// layout, with the op's dims resized (topk, unfold) or reduced (kthvalue, median); indices get
// their own dtype from the local result.
//
// Two exceptions keep a shard on the op's dim where the exact distributed form is cheap:
//   - scans (NOTE: [Scans on a sharded dim]): a local scan plus an exclusive scan of the shard
//     totals, one small all-gather of one slice per shard;
//   - trace: each rank sums the part of the diagonal inside its block, Partial(sum).
//
// Backward ops that autograd builds from plain buffers (cumprod_backward, cummaxmin_backward,
// trace_backward) and one_hot get kernels at the distributed-tensor key instead (NOTE: [How to
// add an op], case 2): the backward ops lay their arguments out with the op's dim whole and
// run the op on the shards.
#include <algorithm>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "dim_layout.h"

#include "tessera/comm/collectives.h"
#include "tessera/ops/rule.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::ops {

namespace {

int64_t wrap(int64_t d, int64_t nd) { return c10::maybe_wrap_dim(d, nd); }

const DTensorSpec& self_of(const OpCall& call) {
  // Every op here has a `self`; the other tensor arguments are laid out after it.
  const DTensorSpec* self = call.spec("self");
  TORCH_INTERNAL_ASSERT(self != nullptr, call.describe());
  return *self;
}

// A layout with new global sizes (dims that change size must be unsharded in `like`).
SpecPtr resized(const DTensorSpec& like, std::vector<int64_t> sizes) {
  return std::make_shared<DTensorSpec>(like.mesh(), like.placements(), std::move(sizes),
                                       like.dtype(), like.shard_tables());
}

// `like` with unsharded `dim` reduced: kept with size 1, or removed (later dims renumbered).
SpecPtr reduced(const DTensorSpec& like, int64_t dim, bool keepdim) {
  auto sizes = like.sizes();
  if (keepdim) {
    sizes[dim] = 1;
    return resized(like, sizes);
  }
  Placements p = like.placements();
  for (auto& x : p)
    if (x.is_shard() && x.dim() > dim) x = Shard(x.dim() - 1);
  auto tables = like.shard_tables();
  sizes.erase(sizes.begin() + dim);
  tables.erase(tables.begin() + dim);
  return std::make_shared<DTensorSpec>(like.mesh(), p, sizes, like.dtype(), tables);
}

// `self` made whole along `dims`; every return gets `out` (the redistributed input if null).
OpPlan along(const OpCall& call, const std::vector<int64_t>& dims, SpecPtr out = nullptr) {
  OpPlan plan(call);
  auto in = whole_along(self_of(call), dims);
  plan.input("self", in);
  for (size_t r = 0; r < call.schema().returns().size(); ++r) plan.output(out ? out : in);
  return plan;
}

std::vector<int64_t> every_dim(const DTensorSpec& s) {
  std::vector<int64_t> all(static_cast<size_t>(s.ndim()));
  for (size_t t = 0; t < all.size(); ++t) all[t] = static_cast<int64_t>(t);
  return all;
}

// sort, sort.stable, argsort.stable, _safe_softmax: one `dim`, results of the input's shape.
OpPlan along_dim(const OpCall& call) {
  if (self_of(call).ndim() == 0) return along(call, {});
  return along(call, {call.arg<int64_t>("dim")});
}

// flip(dims); roll(shifts, dims) with no dims rolls the flattened tensor: every dim whole.
OpPlan along_dims(const OpCall& call) {
  auto dims = call.arg<std::vector<int64_t>>("dims");
  if (dims.empty()) dims = every_dim(self_of(call));
  return along(call, dims);
}

// tril / triu: the last two dims.
OpPlan along_last_two(const OpCall& call) {
  TORCH_CHECK(self_of(call).ndim() >= 2, "tessera: ", call.describe(), ": needs 2 or more dims");
  return along(call, {-2, -1});
}

// topk(self, k, dim, largest, sorted): `dim` whole, k entries along it.
OpPlan topk_rule(const OpCall& call) {
  const auto& self = self_of(call);
  if (self.ndim() == 0) return along(call, {});
  const int64_t d = wrap(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  auto sizes = in->sizes();
  sizes[d] = call.arg<int64_t>("k");
  return along(call, {d}, resized(*in, sizes));
}

// kthvalue, median.dim, nanmedian.dim, mode: `dim` whole, reduced to one value and index.
OpPlan select_along_dim(const OpCall& call) {
  const auto& self = self_of(call);
  if (self.ndim() == 0) return along(call, {});
  const int64_t d = wrap(call.arg<int64_t>("dim"), self.ndim());
  return along(call, {d}, reduced(*whole_along(self, {d}), d, call.arg<bool>("keepdim")));
}

// median() / nanmedian() of the whole tensor: gathered, one replicated value.
OpPlan whole_tensor_rule(const OpCall& call) {
  const auto& self = self_of(call);
  OpPlan plan = replicate_inputs(call);
  plan.output(std::make_shared<DTensorSpec>(self.mesh(),
                                            Placements(self.mesh().ndim(), Replicate()),
                                            std::vector<int64_t>{}, self.dtype()));
  return plan;
}

// glu(self, dim): `dim` whole, halved.
OpPlan glu_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const int64_t d = wrap(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  auto sizes = in->sizes();
  sizes[d] /= 2;
  return along(call, {d}, resized(*in, sizes));
}

// glu_backward(grad_output, self, dim): self's layout with `dim` whole; the gradient follows.
OpPlan glu_backward_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const int64_t d = wrap(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  auto half = in->sizes();
  half[d] /= 2;
  OpPlan plan(call);
  plan.input("self", in);
  if (const auto* g = call.spec("grad_output"))
    plan.input("grad_output", std::make_shared<DTensorSpec>(in->mesh(), in->placements(), half,
                                                            g->dtype(), in->shard_tables()));
  plan.output(in);
  return plan;
}

// unfold(self, dimension, size, step): `dimension` whole, resized to the window count; the
// windows are a new last dim.
OpPlan unfold_rule(const OpCall& call) {
  const auto& self = self_of(call);
  TORCH_CHECK(self.ndim() > 0, "tessera: ", call.describe(), ": unfold of a 0-dim tensor");
  const int64_t d = wrap(call.arg<int64_t>("dimension"), self.ndim());
  const int64_t size = call.arg<int64_t>("size"), step = call.arg<int64_t>("step");
  TORCH_CHECK(size <= self.sizes()[d] && step > 0, "tessera: ", call.describe(), ": window ", size,
              " with step ", step, " does not fit dim ", d, " of size ", self.sizes()[d]);
  auto in = whole_along(self, {d});
  auto sizes = in->sizes();
  sizes[d] = (sizes[d] - size) / step + 1;
  sizes.push_back(size);
  auto tables = in->shard_tables();
  tables.emplace_back();
  return along(
      call, {d},
      std::make_shared<DTensorSpec>(in->mesh(), in->placements(), sizes, in->dtype(), tables));
}

// A backward op that builds its result of `input_sizes`: the gradient laid out as `grad`, the
// result as `out`, and the op run with the local sizes of its shard of the result.
OpPlan with_local_sizes(const OpCall& call, const char* grad_name, SpecPtr grad, SpecPtr out) {
  OpPlan plan(call);
  plan.input(grad_name, std::move(grad));
  const auto local = out->local_sizes();
  plan.output(std::move(out));
  plan.local_kernel = [local](KernelCall& k) {
    k.set("input_sizes", c10::IValue(local));
    k.call_op();
  };
  return plan;
}

// unfold_backward(grad_in, input_sizes, dim, size, step): the window dims whole; the result
// drops the last dim.
OpPlan unfold_backward_rule(const OpCall& call) {
  const auto* g = call.spec("grad_in");
  TORCH_INTERNAL_ASSERT(g, call.describe());
  const auto input_sizes = call.arg<std::vector<int64_t>>("input_sizes");
  const int64_t nd = static_cast<int64_t>(input_sizes.size());
  const int64_t d = wrap(call.arg<int64_t>("dim"), std::max<int64_t>(nd, 1));
  auto in = whole_along(*g, {d, g->ndim() - 1});
  auto tables = in->shard_tables();
  tables.pop_back();
  return with_local_sizes(call, "grad_in", in,
                          std::make_shared<DTensorSpec>(in->mesh(), in->placements(), input_sizes,
                                                        in->dtype(), tables));
}

// repeat(self, repeats): dims repeated more than once are whole (a shard would have to appear
// at several places); the others keep their shards; new leading dims are unsharded.
OpPlan repeat_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const auto repeats = call.arg<std::vector<int64_t>>("repeats");
  const int64_t nd = self.ndim(), lead = static_cast<int64_t>(repeats.size()) - nd;
  TORCH_CHECK(lead >= 0, "tessera: ", call.describe(), ": ", repeats.size(), " repeats for a ", nd,
              "-dim tensor");
  std::vector<int64_t> dims;
  for (int64_t t = 0; t < nd; ++t)
    if (repeats[lead + t] != 1) dims.push_back(t);
  auto in = whole_along(self, dims);
  Placements p = in->placements();
  for (auto& x : p)
    if (x.is_shard()) x = Shard(x.dim() + lead);
  std::vector<int64_t> sizes(repeats.begin(), repeats.begin() + lead);
  std::vector<ShardTable> tables(lead);
  for (int64_t t = 0; t < nd; ++t) {
    sizes.push_back(in->sizes()[t] * repeats[lead + t]);
    tables.push_back(in->shard_table(t));
  }
  return along(call, dims,
               std::make_shared<DTensorSpec>(in->mesh(), p, sizes, in->dtype(), tables));
}

int64_t diagonal_length(int64_t n1, int64_t n2, int64_t offset) {
  const int64_t len = offset >= 0 ? std::min(n1, n2 - offset) : std::min(n1 + offset, n2);
  return std::max<int64_t>(len, 0);
}

// diagonal(self, offset, dim1, dim2): both dims whole; they leave, the diagonal is appended.
OpPlan diagonal_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const int64_t nd = self.ndim();
  const int64_t d1 = wrap(call.arg<int64_t>("dim1"), nd), d2 = wrap(call.arg<int64_t>("dim2"), nd);
  auto in = whole_along(self, {d1, d2});
  Placements p = in->placements();
  for (auto& x : p)
    if (x.is_shard()) x = Shard(x.dim() - (x.dim() > d1) - (x.dim() > d2));
  std::vector<int64_t> sizes;
  std::vector<ShardTable> tables;
  for (int64_t t = 0; t < nd; ++t) {
    if (t == d1 || t == d2) continue;
    sizes.push_back(in->sizes()[t]);
    tables.push_back(in->shard_table(t));
  }
  sizes.push_back(diagonal_length(in->sizes()[d1], in->sizes()[d2], call.arg<int64_t>("offset")));
  tables.emplace_back();
  return along(call, {d1, d2},
               std::make_shared<DTensorSpec>(in->mesh(), p, sizes, in->dtype(), tables));
}

// diagonal_backward(grad_output, input_sizes, offset, dim1, dim2): the diagonal dim whole; the
// other dims keep their shards at their places in the input.
OpPlan diagonal_backward_rule(const OpCall& call) {
  const auto* g = call.spec("grad_output");
  TORCH_INTERNAL_ASSERT(g, call.describe());
  const auto sizes = call.arg<std::vector<int64_t>>("input_sizes");
  const int64_t nd = static_cast<int64_t>(sizes.size());
  const int64_t d1 = wrap(call.arg<int64_t>("dim1"), nd), d2 = wrap(call.arg<int64_t>("dim2"), nd);
  auto in = whole_along(*g, {g->ndim() - 1});
  std::vector<int64_t> to_input;  // grad dim -> input dim
  for (int64_t t = 0; t < nd; ++t)
    if (t != d1 && t != d2) to_input.push_back(t);
  Placements p = in->placements();
  std::vector<ShardTable> tables(nd);
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    tables[to_input[x.dim()]] = in->shard_table(x.dim());
    x = Shard(to_input[x.dim()]);
  }
  return with_local_sizes(call, "grad_output", in,
                          std::make_shared<DTensorSpec>(in->mesh(), p, sizes, in->dtype(), tables));
}

// diag(self, diagonal): gathered (it turns a vector into a matrix and back).
OpPlan replicated_rule(const OpCall& call) {
  OpPlan plan = replicate_inputs(call);
  plan.data_dependent_shapes = true;  // replicated results of whatever shape the op gives
  return plan;
}

// trace(self): each rank sums the diagonal entries inside its block; mesh dims that shard
// either dim give Partial(sum). Partial(sum) inputs pass through (trace is linear).
OpPlan trace_rule(const OpCall& call) {
  const auto& self = self_of(call);
  TORCH_CHECK(self.ndim() == 2, "tessera: ", call.describe(), ": trace needs a matrix");
  auto in = std::make_shared<DTensorSpec>(self.replicate_where([](int64_t, const Placement& x) {
    return x.is_partial() && x.reduce_op() != PartialOp::Sum;
  }));
  Placements out(in->mesh().ndim(), Replicate());
  for (int64_t m = 0; m < in->mesh().ndim(); ++m)
    if (!in->placement(m).is_replicate()) out[m] = Partial();
  OpPlan plan(call);
  plan.input("self", in);
  plan.output(std::make_shared<DTensorSpec>(in->mesh(), out, std::vector<int64_t>{}, in->dtype()));
  const auto off = in->local_offsets();
  const int64_t shift = off[0] - off[1];  // local (a, a + shift) is global (r0 + a, r0 + a)
  plan.local_kernel = [shift](KernelCall& k) {
    k.finish({at::sum(k.tensor("self").diagonal(shift))});
  };
  return plan;
}

// linalg_cross(self, other, dim): `dim` whole on both.
OpPlan cross_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const DTensorSpec* other = call.spec("other");
  if (other && other->sizes() != self.sizes()) return replicated_rule(call);  // broadcasting
  const int64_t d = wrap(call.arg<int64_t>("dim"), self.ndim());
  auto in = whole_along(self, {d});
  OpPlan plan(call);
  plan.input("self", in).output(in);
  if (other) plan.input("other", align_to(*in, *other, false));
  return plan;
}

// ---- ops over the trailing dims, batch dims kept ------------------------------------------------
// Pooling to a fixed size, pixel (un)shuffle and im2col / col2im (nn::Unfold / Fold) read whole
// channel or spatial planes: the trailing dims they touch are whole, the leading (batch) dims
// keep their shards. (Sharded spatial dims with halos are the window ops' business, spatial.h.)

// `self` made whole on its last `k` dims; results of `sizes` over those dims.
OpPlan trailing(const OpCall& call, int64_t k, const std::vector<int64_t>& trailing_sizes,
                size_t results = 1) {
  const auto& self = self_of(call);
  TORCH_CHECK(self.ndim() >= k, "tessera: ", call.describe(), ": needs ", k, " or more dims");
  std::vector<int64_t> dims;
  for (int64_t t = self.ndim() - k; t < self.ndim(); ++t) dims.push_back(t);
  auto in = whole_along(self, dims);
  const int64_t lead = self.ndim() - k;
  std::vector<int64_t> sizes(in->sizes().begin(), in->sizes().begin() + lead);
  sizes.insert(sizes.end(), trailing_sizes.begin(), trailing_sizes.end());
  auto tables = in->shard_tables();
  tables.resize(lead);
  tables.resize(sizes.size());
  auto out =
      std::make_shared<DTensorSpec>(in->mesh(), in->placements(), sizes, in->dtype(), tables);
  OpPlan plan(call);
  plan.input("self", in);
  for (size_t r = 0; r < results; ++r) plan.output(out);
  // An empty shard: some of these ops return their empty input as it is (pixel_unshuffle).
  const auto local = out->local_sizes();
  plan.local_kernel = [local](KernelCall& k) {
    const bool empty = k.tensor("self").numel() == 0;
    k.call_op();
    if (!empty) return;
    for (auto& r : k.stack())
      if (r.isTensor()) r = r.toTensor().reshape(local);
  };
  return plan;
}

std::vector<int64_t> last(const DTensorSpec& s, int64_t k) {
  return std::vector<int64_t>(s.sizes().end() - k, s.sizes().end());
}

// adaptive_max_pool2d / 3d(self, output_size) -> (values, indices)
OpPlan adaptive_max_pool_rule(const OpCall& call) {
  const auto out = call.arg<std::vector<int64_t>>("output_size");
  return trailing(call, static_cast<int64_t>(out.size()), out, 2);
}

// adaptive_max_poolNd_backward(grad_output, self, indices): the planes whole on all three.
OpPlan adaptive_max_pool_backward_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const DTensorSpec* g = call.spec("grad_output");
  TORCH_INTERNAL_ASSERT(g, call.describe());
  const int64_t planes = call.name().find("3d") != std::string::npos ? 3 : 2;
  std::vector<int64_t> dims;
  for (int64_t t = self.ndim() - planes; t < self.ndim(); ++t) dims.push_back(t);
  auto in = whole_along(self, dims);
  auto grad_layout = [&](const DTensorSpec& like) {  // the planes differ in size only
    return std::make_shared<DTensorSpec>(in->mesh(), in->placements(), like.sizes(), like.dtype(),
                                         in->shard_tables());
  };
  OpPlan plan(call);
  plan.input("self", in).input("grad_output", grad_layout(*g)).output(in);
  if (const auto* idx = call.spec("indices")) plan.input("indices", grad_layout(*idx));
  return plan;
}

// pixel_shuffle(self, upscale_factor): [..., C r^2, H, W] -> [..., C, H r, W r]
OpPlan pixel_shuffle_rule(const OpCall& call) {
  const int64_t r = call.arg<int64_t>("upscale_factor");
  auto s = last(self_of(call), 3);
  return trailing(call, 3, {s[0] / (r * r), s[1] * r, s[2] * r});
}

// pixel_unshuffle(self, downscale_factor): [..., C, H, W] -> [..., C r^2, H / r, W / r]
OpPlan pixel_unshuffle_rule(const OpCall& call) {
  const int64_t r = call.arg<int64_t>("downscale_factor");
  auto s = last(self_of(call), 3);
  return trailing(call, 3, {s[0] * r * r, s[1] / r, s[2] / r});
}

// channel_shuffle(self, groups): [N, C, ...] with C and the planes whole.
OpPlan channel_shuffle_rule(const OpCall& call) {
  const auto& self = self_of(call);
  return trailing(call, self.ndim() - 1, last(self, self.ndim() - 1));
}

int64_t windows(int64_t n, int64_t k, int64_t d, int64_t p, int64_t s) {
  return (n + 2 * p - d * (k - 1) - 1) / s + 1;
}

// im2col(self, kernel_size, dilation, padding, stride): [N?, C, H, W] -> [N?, C kh kw, L]
OpPlan im2col_rule(const OpCall& call) {
  const auto k = call.arg<std::vector<int64_t>>("kernel_size");
  const auto d = call.arg<std::vector<int64_t>>("dilation");
  const auto p = call.arg<std::vector<int64_t>>("padding");
  const auto st = call.arg<std::vector<int64_t>>("stride");
  auto s = last(self_of(call), 3);
  const int64_t l = windows(s[1], k[0], d[0], p[0], st[0]) * windows(s[2], k[1], d[1], p[1], st[1]);
  return trailing(call, 3, {s[0] * k[0] * k[1], l});
}

// col2im(self, output_size, kernel_size, dilation, padding, stride): [N?, C kh kw, L] -> [N?, C, H,
// W]
OpPlan col2im_rule(const OpCall& call) {
  const auto out = call.arg<std::vector<int64_t>>("output_size");
  const auto k = call.arg<std::vector<int64_t>>("kernel_size");
  auto s = last(self_of(call), 2);
  return trailing(call, 2, {s[0] / (k[0] * k[1]), out[0], out[1]});
}

// ---- scans ---------------------------------------------------------------------------------

// NOTE: [Scans on a sharded dim]
// cumsum, cumprod and logcumsumexp are associative: a rank scans its own shard, then adds
// (multiplies, log-add-exps) the combined totals of the shards before it in table order. The
// totals are the last slice of each local scan (the identity for an empty shard), gathered
// along the mesh dims that shard the scanned dim, innermost first, so they arrive in table
// order: one all-gather of one slice per shard. cummax / cummin combine the same way on
// (value, global index) pairs: a later entry wins where it is NaN or at least the running
// extremum (ties go to the later index, as one device does); an earlier NaN is never beaten
// by a number. Other dims keep their shards; Partial inputs are reduced first.
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
  const at::Tensor local = k.stack()[0].toTensor();
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
  at::Tensor values = k.stack()[0].toTensor();
  at::Tensor indices = k.stack()[1].toTensor() + s.offset;
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
  const int64_t d = wrap(call.arg<int64_t>("dim"), self.ndim());
  auto in = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  OpPlan plan(call);
  plan.input("self", in);
  for (size_t r = 0; r < call.schema().returns().size(); ++r) plan.output(in);
  ScanPlace s{d, in->mesh_dims_sharding(d), 0, 0};
  if (s.mesh_dims.empty()) return plan;
  s.index = table_index(in->mesh(), s.mesh_dims, in->mesh().coordinate());
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

// ---- backward kernels ------------------------------------------------------------------------

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
  return whole_along(s, {wrap(dim, s.ndim())});
}

at::Tensor wrap_result(const at::Tensor& local, const DTensorSpec& layout) {
  return make_dtensor(
      local, std::make_shared<DTensorSpec>(layout.mesh(), layout.placements(), layout.sizes(),
                                           local.scalar_type(), layout.shard_tables()));
}

// cumprod_backward(grad, input, dim, output)
void cumprod_backward_kernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const at::Tensor grad = (*stack)[n - 4].toTensor(), input = (*stack)[n - 3].toTensor();
  const int64_t dim = (*stack)[n - 2].toInt();
  const at::Tensor output = (*stack)[n - 1].toTensor();
  stack->resize(n - 4);
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
void cummaxmin_backward_kernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const at::Tensor grad = (*stack)[n - 4].toTensor(), input = (*stack)[n - 3].toTensor(),
                   indices = (*stack)[n - 2].toTensor();
  const int64_t dim = (*stack)[n - 1].toInt();
  stack->resize(n - 4);
  auto layout = backward_layout({&grad, &input, &indices}, dim, "aten::cummaxmin_backward");
  const at::Tensor local = at::cummaxmin_backward(local_as(grad, *layout), local_as(input, *layout),
                                                  local_as(indices, *layout), dim);
  stack->emplace_back(wrap_result(local, *layout));
}

// trace_backward(grad, sizes): the gradient times the identity pattern, replicated (the
// forward input's layout is not known here).
void trace_backward_kernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const at::Tensor grad = (*stack)[n - 2].toTensor();
  const auto sizes = (*stack)[n - 1].toIntVector();
  stack->resize(n - 2);
  TORCH_CHECK(sizes.size() == 2, "tessera: aten::trace_backward: expected a matrix, got sizes ",
              shape_str(sizes));
  // A plain tensor next to a distributed one is a replicated value (docs/design.md).
  const at::Tensor eye = at::eye(sizes[0], sizes[1], grad.options().device(grad.device()));
  stack->emplace_back(grad * eye);
}

// one_hot(self, num_classes): the labels' layout plus a whole class dim. The class count and
// the range check use global reductions, so every rank raises the same error.
void one_hot_kernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = stack->size();
  at::Tensor self = (*stack)[n - 2].toTensor();
  int64_t classes = (*stack)[n - 1].toInt();
  stack->resize(n - 2);
  const auto* d = dtensor_impl(self, "aten::one_hot");
  if (d->spec().has_partial())
    self = redistribute(self, std::make_shared<DTensorSpec>(d->spec().partial_as_replicate()));
  const auto& spec = dtensor_impl(self)->spec();
  TORCH_CHECK(self.scalar_type() == at::kLong, "tessera: aten::one_hot(", spec.str(),
              "): one_hot is only applicable to index tensors");
  if (self.numel() > 0) {
    const int64_t lo = self.min().item<int64_t>(), hi = self.max().item<int64_t>();
    TORCH_CHECK(lo >= 0, "tessera: aten::one_hot(", spec.str(),
                "): class values must be non-negative");
    if (classes < 0) classes = hi + 1;
    TORCH_CHECK(hi < classes, "tessera: aten::one_hot(", spec.str(),
                "): class values must be smaller than num_classes ", classes);
  }
  TORCH_CHECK(classes >= 0, "tessera: aten::one_hot(", spec.str(),
              "): cannot infer the number of classes from an empty tensor");
  const at::Tensor local = at::one_hot(dtensor_impl(self)->local(), classes);
  auto sizes = spec.sizes();
  sizes.push_back(classes);
  auto tables = spec.shard_tables();
  tables.emplace_back();
  stack->emplace_back(make_dtensor(
      local,
      std::make_shared<DTensorSpec>(spec.mesh(), spec.placements(), sizes, at::kLong, tables)));
}

const RuleRegistrar registrar{[] {
  register_rule("aten::cumsum", [](const OpCall& c) { return scan_rule(c, Scan::Sum); });
  register_rule("aten::cumprod", [](const OpCall& c) { return scan_rule(c, Scan::Prod); });
  register_rule("aten::logcumsumexp",
                [](const OpCall& c) { return scan_rule(c, Scan::LogSumExp); });
  register_rule("aten::cummax", [](const OpCall& c) { return scan_rule(c, Scan::Max); });
  register_rule("aten::cummin", [](const OpCall& c) { return scan_rule(c, Scan::Min); });
  // _safe_softmax: what LibTorch 2.5+'s attention math path calls instead of softmax.
  for (const char* op :
       {"aten::sort", "aten::sort.stable", "aten::argsort.stable", "aten::_safe_softmax"})
    register_rule(op, along_dim);
  register_rule("aten::topk", topk_rule);
  for (const char* op : {"aten::kthvalue", "aten::median.dim", "aten::nanmedian.dim", "aten::mode"})
    register_rule(op, select_along_dim);
  for (const char* op : {"aten::median", "aten::nanmedian"}) register_rule(op, whole_tensor_rule);
  register_rule("aten::glu", glu_rule);
  register_rule("aten::glu_backward", glu_backward_rule);
  for (const char* op : {"aten::flip", "aten::roll"}) register_rule(op, along_dims);
  for (const char* op : {"aten::tril", "aten::triu"}) register_rule(op, along_last_two);
  register_rule("aten::unfold", unfold_rule);
  register_rule("aten::unfold_backward", unfold_backward_rule);
  register_rule("aten::repeat", repeat_rule);
  for (const char* op : {"aten::diagonal", "aten::diagonal_copy"}) register_rule(op, diagonal_rule);
  register_rule("aten::diagonal_backward", diagonal_backward_rule);
  register_rule("aten::diag", replicated_rule);
  register_rule("aten::trace", trace_rule);
  register_rule("aten::linalg_cross", cross_rule);
  for (const char* op : {"aten::adaptive_max_pool2d", "aten::adaptive_max_pool3d"})
    register_rule(op, adaptive_max_pool_rule);
  for (const char* op :
       {"aten::adaptive_max_pool2d_backward", "aten::adaptive_max_pool3d_backward"})
    register_rule(op, adaptive_max_pool_backward_rule);
  register_rule("aten::pixel_shuffle", pixel_shuffle_rule);
  register_rule("aten::pixel_unshuffle", pixel_unshuffle_rule);
  register_rule("aten::channel_shuffle", channel_shuffle_rule);
  register_rule("aten::im2col", im2col_rule);
  register_rule("aten::col2im", col2im_rule);
  register_kernel("aten::cumprod_backward",
                  torch::CppFunction::makeFromBoxedFunction<&cumprod_backward_kernel>());
  register_kernel("aten::cummaxmin_backward",
                  torch::CppFunction::makeFromBoxedFunction<&cummaxmin_backward_kernel>());
  register_kernel("aten::trace_backward",
                  torch::CppFunction::makeFromBoxedFunction<&trace_backward_kernel>());
  register_kernel("aten::one_hot", torch::CppFunction::makeFromBoxedFunction<&one_hot_kernel>());
}};

}  // namespace

}  // namespace tessera::ops
