// Advanced indexing: x.index({idx, ...}) (aten::index.Tensor), index_put / index_put_ /
// _index_put_impl_ (also the backward of index), masked_scatter (the backward of
// masked_select).
//
// NOTE: [Advanced indexing on shards]
// index and index_put are kernels at the distributed-tensor key (NOTE: [How to add an op],
// case 2), not rules: their layouts depend on the index list (which dims it indexes, the
// shapes of its tensors), and each call works them out afresh.
//   - Index tensors are taken whole: distributed ones are gathered, plain ones are replicated
//     values. A boolean mask becomes its nonzero positions, one index tensor per dim it covers,
//     as ATen expands it; shapes then follow from the (same on every rank) positions.
//   - index: the indexed dims of self are made whole (NOTE: [Dim-wise ops]); every other dim
//     keeps its shards and reappears in the result where ATen puts it: in place when the
//     indexed dims are adjacent, after the broadcast index dims otherwise. Partial inputs pass
//     through (a gather commutes with the sum of the terms).
//   - index_put: self keeps its layout, sharded indexed dims included: each rank writes the
//     entries whose indices fall in its rows (shifted to local positions) with the matching
//     values, so nothing of self moves. Values follow the indexing result's layout (kept dims
//     as self's, index dims whole). A replicated self that is not a view takes values' shards
//     on the dims it keeps (a free slice): the backward of index, zeros then an accumulate,
//     keeps the gradient sharded.
//   - Writes never change a Partial self's layout (it may be a view, whose base would not see
//     a new layout): a rank where a Partial(sum) mesh dim's coordinate is not 0 writes zeros,
//     its term of the written values; every other rank writes the values (the avg, max or min
//     of equal terms is the term, and adding to every term adds to their avg, max or min).
//
// index_fill / index_copy (rules) write the index entries in a rank's own rows the same way,
// Partial self included.
//
// masked_scatter(self, mask, source) is a rule: self keeps its layout, mask and source are
// replicated, and each rank picks, for the mask entries in its block, the source elements their
// global row-major position selects (a cumulative count over the whole mask).
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::ops {

namespace {

const DeviceMesh* mesh_of(const at::Tensor& t) {
  return is_dtensor(t) ? &dtensor_impl(t)->spec().mesh() : nullptr;
}

// A Tensor?[] index list as whole long tensors, one per self dim it indexes (masks expanded).
struct Index {
  std::vector<c10::optional<at::Tensor>> entries;
  std::vector<int64_t> dims;   // self dims with an index tensor
  std::vector<int64_t> shape;  // their broadcast shape
  bool adjacent = true;
  c10::List<c10::optional<at::Tensor>> list() const {
    c10::List<c10::optional<at::Tensor>> l;
    for (const auto& e : entries) l.push_back(e);
    return l;
  }
};

at::Tensor whole(const at::Tensor& t) {
  if (!is_dtensor(t)) return t;
  const auto* d = dtensor_impl(t);
  if (d->spec().is_replicated()) return d->local();
  return redistribute_local(d->local(), d->spec_ptr(), replicated(d->spec()));
}

Index read_index(const c10::IValue& list, int64_t self_ndim, const std::string& what) {
  Index ix;
  for (const c10::IValue& e : list.toListRef()) {
    if (!e.isTensor() || !e.toTensor().defined()) {
      ix.entries.emplace_back();
      continue;
    }
    const at::Tensor t = whole(e.toTensor());
    if (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte) {
      const at::Tensor nz = t.nonzero();
      for (int64_t j = 0; j < t.dim(); ++j) ix.entries.emplace_back(nz.select(1, j));
    } else {
      ix.entries.emplace_back(t);
    }
  }
  TORCH_CHECK(static_cast<int64_t>(ix.entries.size()) <= self_ndim, "tessera: ", what,
              ": too many indices for a ", self_ndim, "-dim tensor");
  for (size_t k = 0; k < ix.entries.size(); ++k)
    if (ix.entries[k]) {
      ix.dims.push_back(static_cast<int64_t>(k));
      ix.shape = broadcast_shapes(ix.shape, ix.entries[k]->sizes().vec(), what);
    }
  ix.adjacent = ix.dims.empty() ||
                ix.dims.back() - ix.dims.front() + 1 == static_cast<int64_t>(ix.dims.size());
  return ix;
}

// The layout of self[index] for self laid out as `self` (indexed dims unsharded), and where
// each self dim lands in it (-1 for indexed dims).
SpecPtr index_result(const DTensorSpec& self, const Index& ix,
                     std::vector<int64_t>* landing = nullptr) {
  const int64_t nd = self.ndim();
  std::vector<int64_t> to_out(nd, -1), sizes;
  auto keep = [&](int64_t t) {
    to_out[t] = static_cast<int64_t>(sizes.size());
    sizes.push_back(self.sizes()[t]);
  };
  const auto& pos = ix.dims;
  auto indexed = [&](int64_t t) { return std::find(pos.begin(), pos.end(), t) != pos.end(); };
  if (ix.adjacent && !pos.empty()) {
    for (int64_t t = 0; t < pos.front(); ++t) keep(t);
    sizes.insert(sizes.end(), ix.shape.begin(), ix.shape.end());
    for (int64_t t = pos.back() + 1; t < nd; ++t) keep(t);
  } else {
    sizes = ix.shape;
    for (int64_t t = 0; t < nd; ++t)
      if (!indexed(t)) keep(t);
  }
  if (landing) *landing = to_out;
  Placements p = self.placements();
  std::vector<ShardTable> tables(sizes.size());
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    TORCH_INTERNAL_ASSERT(to_out[x.dim()] >= 0, "an indexed dim is still sharded");
    tables[to_out[x.dim()]] = self.shard_table(x.dim());
    x = Shard(to_out[x.dim()]);
  }
  return std::make_shared<DTensorSpec>(self.mesh(), p, sizes, self.dtype(), tables);
}

SpecPtr with_dtype(const DTensorSpec& s, c10::ScalarType dtype) {
  return std::make_shared<DTensorSpec>(s.mesh(), s.placements(), s.sizes(), dtype,
                                       s.shard_tables());
}

// A plain self next to distributed indices is a replicated value.
SpecPtr layout_of(const at::Tensor& t, const DeviceMesh& mesh) {
  if (is_dtensor(t)) return dtensor_impl(t)->spec_ptr();
  return std::make_shared<DTensorSpec>(mesh, Placements(mesh.ndim(), Replicate()), t.sizes().vec(),
                                       t.scalar_type());
}

// index.Tensor(self, indices)
// These kernels read shard offsets: head-tail operands are relayed into position order
// first (NOTE: [Head-tail order]); a head-tail tensor written in place is refused, as its
// write would land in the relayed copy.
at::Tensor in_position_order(const at::Tensor& t) {
  if (!is_dtensor(t) || !dtensor_impl(t)->spec().has_head_tail()) return t;
  return redistribute(t, std::make_shared<DTensorSpec>(dtensor_impl(t)->spec().natural_spec()));
}

void relay_head_tail(const c10::OperatorHandle& op, torch::jit::Stack& args, bool writes_self) {
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = args[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      TORCH_CHECK(!(i == 0 && writes_self && is_dtensor(t) && spec(t).has_head_tail()),
                  "tessera: ", op.schema().name(), " writes into a head-tail tensor (",
                  spec(t).str(), "); redistribute it to the natural order (",
                  to_string(spec(t).natural_spec().placements()), ") first");
      v = in_position_order(t);
    } else if (v.isList()) {
      bool any = false;
      for (const auto& e : v.toListRef())
        any =
            any || (e.isTensor() && is_dtensor(e.toTensor()) && spec(e.toTensor()).has_head_tail());
      if (!any) continue;
      c10::List<c10::optional<at::Tensor>> out;
      for (const auto& e : v.toListRef())
        out.push_back(e.isTensor() ? c10::optional<at::Tensor>(in_position_order(e.toTensor()))
                                   : c10::nullopt);
      v = out;
    }
  }
}

void index_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::Stack args = torch::jit::pop(*stack, op.schema().arguments().size());
  relay_head_tail(op, args, false);
  KernelCall k(op, args);
  const at::Tensor self = k.tensor("self");
  const c10::IValue list = k.arg("indices");
  const DeviceMesh* mesh = mesh_of(self);
  for (const c10::IValue& e : list.toListRef())
    if (!mesh && e.isTensor()) mesh = mesh_of(e.toTensor());
  TORCH_INTERNAL_ASSERT(mesh, "aten::index.Tensor without a distributed argument");
  const auto layout = layout_of(self, *mesh);
  const Index ix = read_index(list, self.dim(), "aten::index.Tensor(" + layout->str() + ")");
  const auto in = whole_along(*layout, ix.dims, /*keep_partial=*/true);
  const at::Tensor local = at::index(local_as(self, *in), ix.list());
  stack->emplace_back(make_dtensor(local, with_dtype(*index_result(*in, ix), local.scalar_type())));
}

// `lay` with the indexed dims' shards replicated: the layout of self the result follows.
SpecPtr without_indexed_shards(const DTensorSpec& lay, const Index& ix) {
  return std::make_shared<DTensorSpec>(lay.replicate_where([&](int64_t, const Placement& x) {
    return x.is_shard() && std::find(ix.dims.begin(), ix.dims.end(), x.dim()) != ix.dims.end();
  }));
}

// `lay` (a layout of self) where it is replicated, sharding the kept dims that `values` shards
// in the indexing result (no data moves: a replicated tensor is sliced).
SpecPtr adopt_shards(const SpecPtr& lay, const DTensorSpec& values, const Index& ix) {
  std::vector<int64_t> landing;
  const auto result = index_result(*without_indexed_shards(*lay, ix), ix, &landing);
  std::vector<int64_t> from_out(result->ndim(), -1);  // result dim -> self dim
  for (int64_t t = 0; t < lay->ndim(); ++t)
    if (landing[t] >= 0) from_out[landing[t]] = t;
  Placements p = lay->placements();
  auto tables = lay->shard_tables();
  std::vector<bool> sharded(lay->ndim(), false);
  for (const auto& x : p)
    if (x.is_shard()) sharded[x.dim()] = true;
  const int64_t shift = result->ndim() - values.ndim();
  bool changed = false;
  for (int64_t m = 0; m < lay->mesh().ndim(); ++m) {
    const auto& v = values.placement(m);
    if (!p[m].is_replicate() || !v.is_shard()) continue;
    const int64_t r = v.dim() + shift;
    if (r < 0 || from_out[r] < 0 || values.sizes()[v.dim()] != result->sizes()[r]) continue;
    const int64_t t = from_out[r];
    if (sharded[t]) continue;
    sharded[t] = changed = true;
    p[m] = Shard(t);
    tables[t] = values.mesh_dims_sharding(v.dim()) == std::vector<int64_t>{m}
                    ? values.shard_table(v.dim())
                    : chunk_table(lay->mesh(), p, t, lay->sizes()[t]);
  }
  if (!changed) return lay;
  return std::make_shared<DTensorSpec>(lay->mesh(), p, lay->sizes(), lay->dtype(), tables);
}

// Does this rank hold a Partial(sum) term other than coordinate 0's? It writes zeros.
bool writes_zeros(const DTensorSpec& s) {
  for (int64_t m = 0; m < s.mesh().ndim(); ++m)
    if (s.placement(m).is_partial() && s.placement(m).reduce_op() == PartialOp::Sum &&
        s.mesh().coordinate()[m] != 0)
      return true;
  return false;
}

bool writes_self(const c10::FunctionSchema& schema) {
  const auto* a = schema.arguments()[0].alias_info();
  return a && a->isWrite();
}

// index_put_(self, indices, values, accumulate), index_put, _index_put_impl_(..., unsafe)
void index_put_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size(), base = stack->size() - nargs;
  torch::jit::Stack args(stack->begin() + base, stack->end());
  stack->resize(base);
  relay_head_tail(op, args, writes_self(schema));
  KernelCall in(op, args);
  const at::Tensor self = in.tensor("self");
  const at::Tensor values = in.tensor("values");
  const bool inplace = writes_self(schema);
  const std::string name = schema.name();
  TORCH_CHECK(is_dtensor(self), "tessera: ", name, ": writing distributed values into a plain ",
              "tensor; distribute the tensor first");
  const auto* impl = dtensor_impl(self);
  const DeviceMesh& mesh = impl->spec().mesh();
  const Index ix = read_index(in.arg("indices"), self.dim(), name + "(" + impl->spec().str() + ")");
  SpecPtr lay = impl->spec_ptr();
  if (is_dtensor(values) && !(inplace && self.is_view()))
    lay = adopt_shards(lay, dtensor_impl(values)->spec(), ix);
  // Values, laid out as the indexing result (index dims whole), expanded to its local shape.
  const auto result = index_result(*without_indexed_shards(*lay, ix), ix);
  at::Tensor vals;
  if (values.dim() == 0 && !is_dtensor(values)) {
    vals = values;
  } else {
    const auto vlay = is_dtensor(values) ? align_to(*result, dtensor_impl(values)->spec(), false)
                                         : align_to(*result, *layout_of(values, mesh), false);
    vals = local_as(values, *vlay).expand(result->local_sizes());
  }
  if (writes_zeros(*lay)) vals = at::zeros_like(vals);
  at::Tensor local = local_as(self, *lay);
  // Sharded indexed dims: keep the entries in this rank's rows, at local positions.
  const auto off = lay->local_offsets(), len = lay->local_sizes();
  auto entries = ix.entries;
  std::vector<int64_t> cut;
  for (int64_t t : ix.dims)
    if (!lay->mesh_dims_sharding(t).empty()) cut.push_back(t);
  if (!cut.empty()) {
    std::vector<at::Tensor> present;
    for (int64_t t : ix.dims) present.push_back(*entries[t]);
    present = at::broadcast_tensors(present);
    at::Tensor keep = at::ones(ix.shape, at::TensorOptions().dtype(at::kBool));
    for (size_t j = 0; j < ix.dims.size(); ++j) {
      const int64_t t = ix.dims[j];
      at::Tensor i = present[j];
      i = at::where(i < 0, i + self.size(t), i);
      if (!lay->mesh_dims_sharding(t).empty()) {
        keep = keep & (i >= off[t]) & (i < off[t] + len[t]);
        i = i - off[t];
      }
      present[j] = i;
    }
    const at::Tensor rows = keep.reshape(-1).nonzero().squeeze(1);
    for (size_t j = 0; j < ix.dims.size(); ++j)
      entries[ix.dims[j]] = present[j].reshape(-1).index_select(0, rows);
    if (vals.dim() > 0) {
      // The index dims of the result, flattened, keep the same rows.
      const int64_t b0 = ix.adjacent && !ix.dims.empty() ? ix.dims.front() : 0;
      const int64_t nb = static_cast<int64_t>(ix.shape.size());
      auto shape = vals.sizes().vec();
      std::vector<int64_t> flat(shape.begin(), shape.begin() + b0);
      flat.push_back(-1);
      flat.insert(flat.end(), shape.begin() + b0 + nb, shape.end());
      vals = vals.reshape(flat).index_select(b0, rows);
    }
  }
  torch::jit::Stack local_args = args;
  KernelCall k(op, local_args);
  k.set("self", local);
  c10::List<c10::optional<at::Tensor>> l;
  for (const auto& e : entries) l.push_back(e);
  k.set("indices", l);
  k.set("values", vals);
  k.call_op();
  if (inplace) {
    if (lay != impl->spec_ptr() || !local.is_same(impl->local()))
      dtensor_impl(self)->set_local_and_spec(local, lay);
    stack->push_back(self);
  } else {
    const at::Tensor out = only_result(k).toTensor();
    stack->emplace_back(make_dtensor(out, with_dtype(*lay, out.scalar_type())));
  }
}

// masked_scatter(_)(self, mask, source)
OpPlan masked_scatter_rule(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  TORCH_CHECK(self, "tessera: ", call.describe(), ": scattering into a plain 0-dim tensor");
  const DTensorSpec* mask = call.spec("mask");
  const DTensorSpec* source = call.spec("source");
  const auto mask_sizes = mask ? mask->sizes() : call.arg("mask").toTensor().sizes().vec();
  OpPlan plan(call);
  if (mask) plan.input("mask", replicated(*mask));
  if (source) plan.input("source", replicated(*source));
  if (broadcast_shapes(self->sizes(), mask_sizes, call.describe()) !=
      self->sizes()) {  // the mask widens self
    plan.input("self", replicated(*self));
    plan.data_dependent_shapes = true;
    return plan;
  }
  auto in = std::make_shared<DTensorSpec>(*self);
  plan.input("self", in).output(in);
  if (in->is_replicated()) return plan;
  const auto sizes = in->sizes(), off = in->local_offsets(), len = in->local_sizes();
  const bool inplace = writes_self(call.schema()), zeros = writes_zeros(*in);
  const std::string what = call.describe();
  plan.local_kernel = [sizes, off, len, inplace, zeros, what](KernelCall& k) {
    at::Tensor self = k.tensor("self");
    const at::Tensor full = k.tensor("mask").to(at::kBool).expand(sizes);
    const at::Tensor source = k.tensor("source").reshape(-1);
    const at::Tensor pos = full.reshape(-1).to(at::kLong).cumsum(0).sub_(1).view(sizes);
    const int64_t ones = pos.numel() > 0 ? pos.reshape(-1)[-1].item<int64_t>() + 1 : 0;
    TORCH_CHECK(ones <= source.numel(), "tessera: ", what, ": the mask selects ", ones,
                " elements but the source has only ", source.numel());
    at::Tensor m = full, p = pos;
    for (size_t t = 0; t < sizes.size(); ++t) {
      m = m.narrow(static_cast<int64_t>(t), off[t], len[t]);
      p = p.narrow(static_cast<int64_t>(t), off[t], len[t]);
    }
    const at::Tensor picked =
        source.numel() == 0 || zeros
            ? at::zeros_like(self)
            : source.index_select(0, p.clamp_min(0).reshape(-1)).view(self.sizes());
    const at::Tensor out = at::where(m, picked, self);
    if (inplace) {
      self.copy_(out);
      k.finish({self});
    } else {
      k.finish({out});
    }
  };
  return plan;
}

// index_fill(self, dim, index, value) and index_copy(self, dim, index, source), in place too:
// self keeps its layout; where its shard cuts `dim`, a rank fills / copies only the index
// entries in its rows (the index is replicated). index_copy's source follows self with `dim`
// whole.
OpPlan index_fill_copy_rule(const OpCall& call) {
  const DTensorSpec* self = call.spec("self");
  TORCH_CHECK(self, "tessera: ", call.describe(), ": writing into a plain 0-dim tensor");
  const int64_t nd = std::max<int64_t>(self->ndim(), 1);
  int64_t d = call.arg<int64_t>("dim");
  if (d < 0) d += nd;
  auto in = std::make_shared<DTensorSpec>(*self);
  OpPlan plan(call);
  plan.input("self", in).output(in);
  if (const auto* idx = call.spec("index")) plan.input("index", replicated(*idx));
  if (call.has("value"))
    if (const auto* v = call.spec("value")) plan.input("value", replicated(*v));
  const bool copy = call.has("source");
  if (copy)
    if (const auto* src = call.spec("source")) {
      const auto lay = in->replicate_where(
          [d](int64_t, const Placement& x) { return x.is_partial() || x.is_shard(d); });
      plan.input("source", std::make_shared<DTensorSpec>(lay.mesh(), lay.placements(), src->sizes(),
                                                         src->dtype(), lay.shard_tables()));
    }
  const bool cut = in->ndim() > 0 && !in->mesh_dims_sharding(d).empty(), zeros = writes_zeros(*in);
  if (!cut && !zeros) return plan;
  const int64_t off = cut ? in->local_offsets()[d] : 0, len = cut ? in->local_sizes()[d] : 0;
  const int64_t size = in->ndim() > 0 ? in->sizes()[d] : 1;
  plan.local_kernel = [d, off, len, size, copy, cut, zeros](KernelCall& k) {
    if (zeros) {
      if (copy)
        k.set("source", at::zeros_like(k.tensor("source")));
      else if (k.arg("value").isTensor())
        k.set("value", at::zeros_like(k.tensor("value")));
      else
        k.set("value", c10::IValue(c10::Scalar(0)));
    }
    if (!cut) return k.call_op();
    at::Tensor idx = k.tensor("index").reshape(-1);
    idx = at::where(idx < 0, idx + size, idx);
    const at::Tensor rows = ((idx >= off) & (idx < off + len)).nonzero().squeeze(1);
    k.set("index", idx.index_select(0, rows) - off);
    if (copy) k.set("source", k.tensor("source").index_select(d, rows));
    k.call_op();
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* base :
       {"aten::index_fill", "aten::index_fill_", "aten::index_copy", "aten::index_copy_"})
    register_rule_for_overloads(base, index_fill_copy_rule);
  register_kernel("aten::index.Tensor", torch::CppFunction::makeFromBoxedFunction<&index_kernel>());
  for (const char* op : {"aten::index_put_", "aten::index_put", "aten::_index_put_impl_"})
    register_kernel(op, torch::CppFunction::makeFromBoxedFunction<&index_put_kernel>());
  for (const char* op : {"aten::masked_scatter_", "aten::masked_scatter"})
    register_rule(op, masked_scatter_rule);
}};

}  // namespace

}  // namespace tessera::ops
