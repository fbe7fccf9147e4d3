#include "dim_layout.h"

#include <algorithm>

#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>

#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::ops {

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
// whole_along is that layout; along, trailing and the helpers below build the plans of
// scans.cpp, sorting.cpp, vector_ops.cpp, reorder.cpp, triangular.cpp, diagonal.cpp,
// unfold.cpp and window/im2col.cpp, window/pool.cpp's adaptive max pooling.
SpecPtr whole_along(const DTensorSpec& in, const std::vector<int64_t>& dims, bool keep_partial) {
  const int64_t nd = in.ndim();
  std::vector<bool> touched(nd, false), sharded(nd, false), changed(nd, false);
  for (int64_t d : dims) touched[c10::maybe_wrap_dim(d, nd)] = true;
  Placements p = in.placements();
  for (const auto& x : p)
    if (x.is_shard() && !touched[x.dim()]) sharded[x.dim()] = true;
  for (auto& x : p) {
    if (x.is_partial() && !keep_partial) x = Replicate();
    if (!x.is_shard() || !touched[x.dim()]) continue;
    changed[x.dim()] = true;
    int64_t free_dim = -1;
    for (int64_t t = 0; t < nd; ++t)
      if (!touched[t] && !sharded[t] && (free_dim < 0 || in.sizes()[t] > in.sizes()[free_dim]))
        free_dim = t;
    if (free_dim < 0) {
      x = Replicate();
    } else {
      x = Shard(free_dim);
      sharded[free_dim] = changed[free_dim] = true;
    }
  }
  // Tables survive for dims whose sharding mesh dims did not change; new shards are chunks.
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t)
    if (sharded[t] && !changed[t]) tables[t] = in.shard_table(t);
  return std::make_shared<DTensorSpec>(in.mesh(), p, in.sizes(), in.dtype(), tables);
}

at::Tensor local_as(const at::Tensor& t, const DTensorSpec& target) {
  auto spec = std::make_shared<DTensorSpec>(target.mesh(), target.placements(), target.sizes(),
                                            t.scalar_type(), target.shard_tables());
  if (is_dtensor(t)) {
    const auto* d = dtensor_impl(t);
    return *d->spec_ptr() == *spec ? d->local()
                                   : redistribute_local(d->local(), d->spec_ptr(), spec);
  }
  at::Tensor block = t;
  const auto off = spec->local_offsets(), len = spec->local_sizes();
  for (int64_t i = 0; i < spec->ndim(); ++i) block = block.narrow(i, off[i], len[i]);
  return block;
}

std::vector<int64_t> broadcast_shapes(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                                      const std::string& who) {
  const size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n, 1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TORCH_CHECK(x == y || x == 1 || y == 1, "tessera: ", who, ": shapes ", shape_str(a), " and ",
                shape_str(b), " do not broadcast");
    out[i] = x == 1 ? y : x;
  }
  return out;
}

// ---- dim-wise rules --------------------------------------------------------------------------

const DTensorSpec& self_of(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  TORCH_INTERNAL_ASSERT(self != nullptr, call.describe());
  return *self;
}

SpecPtr resized(const DTensorSpec& like, std::vector<int64_t> sizes) {
  return std::make_shared<DTensorSpec>(like.mesh(), like.placements(), std::move(sizes),
                                       like.dtype(), like.shard_tables());
}

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

OpPlan along(const OpCall& call, const std::vector<int64_t>& dims, SpecPtr out) {
  OpPlan plan(call);
  auto in = whole_along(self_of(call), dims);
  plan.input("self", in);
  for (size_t r = 0; r < call.schema().returns().size(); ++r) plan.output(out ? out : in);
  return plan;
}

OpPlan along_dim(const OpCall& call) {
  if (self_of(call).ndim() == 0) return along(call, {});
  return along(call, {call.arg<int64_t>("dim")});
}

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

OpPlan computed_replicated(const OpCall& call) {
  OpPlan plan = replicate_inputs(call);
  plan.data_dependent_shapes = true;  // replicated results of whatever shape the op gives
  return plan;
}

// Pooling to a fixed size, pixel (un)shuffle and im2col / col2im (nn::Unfold / Fold) read whole
// channel or spatial planes: the trailing dims they touch are whole, the leading (batch) dims
// keep their shards. (Sharded spatial dims with halos are the window ops' business.)
OpPlan trailing(const OpCall& call, int64_t k, const std::vector<int64_t>& trailing_sizes,
                size_t results) {
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

std::vector<int64_t> last_sizes(const DTensorSpec& s, int64_t k) {
  return std::vector<int64_t>(s.sizes().end() - k, s.sizes().end());
}

ReducedDims reduced_dims_arg(const OpCall& call, int64_t nd) {
  ReducedDims r;
  r.dims.assign(nd, true);
  if (call.has("keepdim")) r.keepdim = call.arg<bool>("keepdim");
  if (!call.has("dim") || nd == 0) return r;
  const c10::IValue& v = call.arg("dim");
  std::vector<int64_t> dims;
  if (v.isInt())
    dims.push_back(v.toInt());
  else if (v.isIntList())
    dims = v.toIntVector();
  if (dims.empty()) return r;
  r.dims.assign(nd, false);
  for (int64_t d : dims) {
    TORCH_CHECK(d >= -nd && d < nd, "tessera: ", call.describe(), ": dim ", d,
                " is out of range for a ", nd, "-dim tensor");
    r.dims[d < 0 ? d + nd : d] = true;
  }
  return r;
}

std::vector<int64_t> ReducedDims::list() const {
  std::vector<int64_t> out;
  for (size_t t = 0; t < dims.size(); ++t)
    if (dims[t]) out.push_back(static_cast<int64_t>(t));
  return out;
}

c10::IValue& result_named(KernelCall& k, const char* name) {
  const auto& returns = k.op().schema().returns();
  TORCH_INTERNAL_ASSERT(k.stack().size() == returns.size(), k.op().schema().name(),
                        ": results read before call_op()");
  for (size_t i = 0; i < returns.size(); ++i)
    if (returns[i].name() == name) return k.stack()[i];
  TORCH_INTERNAL_ASSERT(false, k.op().schema().name(), " has no result named ", name);
}

c10::IValue& only_result(KernelCall& k) {
  TORCH_INTERNAL_ASSERT(k.op().schema().returns().size() == 1 && k.stack().size() == 1,
                        k.op().schema().name(), ": one result expected, after call_op()");
  return k.stack()[0];
}

}  // namespace tessera::ops
