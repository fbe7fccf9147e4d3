// Gathers, scatters and embedding: index_select/index_add, gather/scatter(_add),
// embedding and embedding_dense_backward (the slicing and joining ops are in tensor.cpp).
//
// Gathers and scatters (index_select, gather, scatter, index_add): a sharded indexed dim is
// replicated first, except where the local form is exact: index_add into a self sharded on
// the indexed dim adds only the index entries in its own range; scatter_add with the index
// sharded on the scattered dim gives Partial(sum); index_select/gather keep the index's
// sharding in the result. Other dims shard alike on self, index and source where their sizes
// agree. Indices are never partial. Slices and gathers commute with elementwise reductions,
// so any Partial input passes through them; index_add and scatter(_add) are linear in self
// and source together, so Partial(sum) passes (a Replicate partner becomes Partial locally).
//
// embedding(weight [V, D], indices):
//   weight S(1)  output sharded on its last dim, no communication.
//   weight S(0)  vocab-parallel: each shard looks up the indices in its own range, zero rows
//                elsewhere; the output is Partial(sum).
//   weight R     the output follows the indices' sharding.
//
// Backward ops do not see the forward input's layout (only its global sizes). Shardings of
// the incoming gradient are mirrored through the op; where the gradient is Replicate the
// result stays Replicate (local, and free to slice into any layout later), except
// embedding_dense_backward, whose result is as large as the whole table: there Replicate
// mesh dims give Shard(0) in the chunk layout, each rank accumulating only its vocab range.
#include "tensor_layout.h"

namespace tessera::ops {

namespace {

using namespace layout;

// ---- gathers and scatters ------------------------------------------------------------------

// index_select(self, dim, index): the indexed dim is replicated; an index sharded on a mesh
// dim where self is replicated shards the result's dim alike.
OpPlan index_select_rule(const OpCall& call) {
  const auto& self = *call.spec("self");
  const auto& mesh = self.mesh();
  const int64_t d = dim_arg(call, self.ndim());
  const DTensorSpec* idx = call.spec("index");
  Placements ps = self.placements(), pi(mesh.ndim(), Replicate());
  for (size_t m = 0; m < ps.size(); ++m) {
    if (ps[m].is_shard(d)) ps[m] = Replicate();
    if (idx && idx->placement(m).is_shard(0) && ps[m].is_replicate()) pi[m] = Shard(0);
  }
  auto self_t = fitted_spec(mesh, ps, self.sizes(), self.dtype(), self.shard_tables());
  SpecPtr idx_t =
      idx ? fitted_spec(mesh, pi, idx->sizes(), idx->dtype(), idx->shard_tables()) : nullptr;
  auto out_sizes = self.sizes();
  out_sizes[d] = idx ? idx->numel() : 1;
  Placements po = ps;
  for (size_t m = 0; m < po.size(); ++m)
    if (pi[m].is_shard()) po[m] = Shard(d);
  auto tables = self_t->shard_tables();
  if (idx_t && !idx_t->shard_table(0).empty()) tables[d] = idx_t->shard_table(0);
  OpPlan plan(call);
  plan.input("self", self_t).input("index", idx_t);
  plan.output(std::make_shared<DTensorSpec>(mesh, po, out_sizes, self.dtype(), tables));
  return plan;
}

// Keeps only the entries of argument `index` in [off, off + n) (shifted to local) and the
// matching slices of argument `source` along d.
void keep_local_entries(KernelCall& k, const char* index, const char* source, int64_t d,
                        int64_t off, int64_t n) {
  auto idx = k.tensor(index).reshape(-1);
  auto keep = ((idx >= off) & (idx < off + n)).nonzero().squeeze(1);
  k.set(index, idx.index_select(0, keep) - off);
  if (k.arg(source).isTensor()) {
    auto src = k.tensor(source);
    if (src.dim() > d) k.set(source, src.index_select(d, keep));
  }
}

// index_add(self, dim, index, source, alpha) and index_add_. The index is replicated. A self
// sharded on dim keeps its shards: each adds the entries that land in its range.
OpPlan index_add_rule(const OpCall& call) {
  const auto& self = *call.spec("self");
  const auto& mesh = self.mesh();
  const int64_t d = dim_arg(call, self.ndim());
  const DTensorSpec* src = call.spec("source");
  const bool summable = self.dtype() != at::kBool;
  auto same = [&](int64_t t) {
    return !src || (t < src->ndim() && src->sizes()[t] == self.sizes()[t]);
  };
  Placements ps(mesh.ndim(), Replicate()), pr = ps;
  bool masked = false;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = self.placement(m);
    const auto b = src ? src->placement(m) : Replicate();
    if (a.is_shard(d)) {
      ps[m] = a;
      masked = true;
    } else if (b.is_shard() && b.dim() != d && same(b.dim())) {
      ps[m] = pr[m] = b;
    } else if (a.is_shard() && same(a.dim())) {
      ps[m] = pr[m] = a;
    } else if (summable && (a == Partial() || b == Partial())) {
      ps[m] = pr[m] = Partial();
    }
  }
  std::vector<ShardTable> ts(self.ndim()), tr(src ? src->ndim() : 0);
  for (int64_t t = 0; t < self.ndim(); ++t) {
    if (t == d) {
      ts[t] = fit_table(mesh, ps, t, self.sizes()[t], self.shard_table(t));
    } else {
      ts[t] = shared_table(mesh, ps, t, self.sizes()[t], {src, &self});
      if (t < static_cast<int64_t>(tr.size())) tr[t] = ts[t];
    }
  }
  auto self_t = std::make_shared<DTensorSpec>(mesh, ps, self.sizes(), self.dtype(), ts);
  OpPlan plan(call);
  plan.input("self", self_t);
  if (const auto* idx = call.spec("index")) plan.input("index", replicated(*idx));
  if (src) plan.input("source", fitted_spec(mesh, pr, src->sizes(), src->dtype(), tr));
  plan.output(self_t);
  if (!masked) return plan;
  const int64_t off = self_t->local_offsets()[d], n = self_t->local_sizes()[d];
  plan.local_kernel = [d, off, n](KernelCall& k) {
    keep_local_entries(k, "index", "source", d, off, n);
    k.call_op();
  };
  return plan;
}

// gather(self, dim, index, sparse_grad): the result has the index's shape and layout. Self
// is replicated on the gathered dim; other dims shard alike where self and index agree in size.
OpPlan gather_rule(const OpCall& call) {
  const auto& self = *call.spec("self");
  const auto& mesh = self.mesh();
  const int64_t d = dim_arg(call, self.ndim());
  TORCH_CHECK(call.spec("index"), "tessera: ", call.describe(), ": gather needs a tensor index");
  const auto& idx = *call.spec("index");
  auto same = [&](int64_t t) { return t < self.ndim() && self.sizes()[t] == idx.sizes()[t]; };
  Placements ps(mesh.ndim(), Replicate()), pi = ps, po = ps;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = self.placement(m);
    const auto& b = idx.placement(m);
    if (b.is_shard()) {
      if (b.dim() == d)
        pi[m] = po[m] = b;
      else if (same(b.dim()))
        ps[m] = pi[m] = po[m] = b;
    } else if (a.is_shard()) {
      if (a.dim() != d && same(a.dim())) ps[m] = pi[m] = po[m] = a;
    } else if (a.is_partial()) {
      ps[m] = po[m] = a;
    }
  }
  std::vector<ShardTable> ts(self.ndim()), ti(idx.ndim());
  for (int64_t t = 0; t < idx.ndim(); ++t) {
    if (t == d)
      ti[t] = fit_table(mesh, pi, t, idx.sizes()[t], idx.shard_table(t));
    else
      ti[t] = ts[t] = shared_table(mesh, pi, t, idx.sizes()[t], {&idx, &self});
  }
  OpPlan plan(call);
  plan.input("self", std::make_shared<DTensorSpec>(mesh, ps, self.sizes(), self.dtype(), ts));
  plan.input("index", std::make_shared<DTensorSpec>(mesh, pi, idx.sizes(), idx.dtype(), ti));
  plan.output(std::make_shared<DTensorSpec>(mesh, po, idx.sizes(), self.dtype(), ti));
  return plan;
}

enum class ScatterKind { Assign, Value, Add };

// scatter(self, dim, index, src|value) and scatter_add: the result has self's shape. Dims
// other than dim shard alike on self, index and src where all three agree in size; an index
// sharded on dim gives Partial(sum) for scatter_add (each shard adds its own entries).
OpPlan scatter_rule(const OpCall& call, ScatterKind kind) {
  const auto& self = *call.spec("self");
  const auto& mesh = self.mesh();
  const int64_t d = dim_arg(call, self.ndim());
  TORCH_CHECK(call.spec("index"), "tessera: ", call.describe(), ": scatter needs a tensor index");
  const auto& idx = *call.spec("index");
  const DTensorSpec* src = kind == ScatterKind::Value ? nullptr : call.spec("src");
  const bool summable = kind != ScatterKind::Value && self.dtype() != at::kBool;
  auto same = [&](int64_t t) {
    return t != d && self.sizes()[t] == idx.sizes()[t] &&
           (!src || src->sizes()[t] == idx.sizes()[t]);
  };
  Placements ps(mesh.ndim(), Replicate()), pi = ps, pr = ps;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = self.placement(m);
    const auto& b = idx.placement(m);
    const auto c = src ? src->placement(m) : Replicate();
    if (b.is_shard() && same(b.dim())) {
      ps[m] = pi[m] = pr[m] = b;
    } else if (b.is_shard(d) && kind == ScatterKind::Add && summable &&
               (!src || src->sizes()[d] == idx.sizes()[d])) {
      pi[m] = pr[m] = b;
      ps[m] = Partial();
    } else if (b.is_shard()) {
      continue;  // replicate all three
    } else if (a.is_shard() && same(a.dim())) {
      ps[m] = pi[m] = pr[m] = a;
    } else if (c.is_shard() && same(c.dim())) {
      ps[m] = pi[m] = pr[m] = c;
    } else if (summable && (a == Partial() || c == Partial())) {
      ps[m] = pr[m] = Partial();
    }
  }
  std::vector<ShardTable> ts(self.ndim()), ti(idx.ndim());
  for (int64_t t = 0; t < idx.ndim(); ++t) {
    if (t == d)
      ti[t] = fit_table(mesh, pi, t, idx.sizes()[t], idx.shard_table(t));
    else
      ti[t] = ts[t] = shared_table(mesh, pi, t, idx.sizes()[t], {&idx, &self, src});
  }
  for (int64_t t = 0; t < self.ndim(); ++t) ts[t] = fit_table(mesh, ps, t, self.sizes()[t], ts[t]);
  auto self_t = std::make_shared<DTensorSpec>(mesh, ps, self.sizes(), self.dtype(), ts);
  OpPlan plan(call);
  plan.input("self", self_t);
  plan.input("index", std::make_shared<DTensorSpec>(mesh, pi, idx.sizes(), idx.dtype(), ti));
  if (src) plan.input("src", fitted_spec(mesh, pr, src->sizes(), src->dtype(), ti));
  plan.output(self_t);
  return plan;
}

OpPlan scatter_src_rule(const OpCall& call) { return scatter_rule(call, ScatterKind::Assign); }
OpPlan scatter_value_rule(const OpCall& call) { return scatter_rule(call, ScatterKind::Value); }
OpPlan scatter_add_rule(const OpCall& call) { return scatter_rule(call, ScatterKind::Add); }

// ---- embedding -----------------------------------------------------------------------------

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse).
OpPlan embedding_rule(const OpCall& call) {
  TORCH_CHECK(call.spec("weight"), "tessera: ", call.describe(),
              ": the weight must be distributed");
  const auto& w = *call.spec("weight");
  const auto& mesh = w.mesh();
  const DTensorSpec* idx = call.spec("indices");
  const auto idx_sizes = idx ? idx->sizes() : std::vector<int64_t>{};
  const int64_t last = static_cast<int64_t>(idx_sizes.size());
  const bool vocab_ok = only_sum_partials(w);
  Placements pw(mesh.ndim(), Replicate()), pi = pw, po = pw;
  bool masked = false;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = w.placement(m);
    const auto b = idx ? idx->placement(m) : Replicate();
    if (a.is_shard(1)) {
      pw[m] = a;
      po[m] = Shard(last);
    } else if (a.is_shard(0) && vocab_ok) {
      pw[m] = a;
      po[m] = Partial();
      masked = true;
    } else if (a.is_partial()) {
      pw[m] = po[m] = a;
    } else if (b.is_shard()) {
      pi[m] = po[m] = b;
    }
  }
  auto w_t = fitted_spec(mesh, pw, w.sizes(), w.dtype(), w.shard_tables());
  SpecPtr idx_t =
      idx ? fitted_spec(mesh, pi, idx_sizes, idx->dtype(), idx->shard_tables()) : nullptr;
  auto out_sizes = idx_sizes;
  out_sizes.push_back(w.sizes()[1]);
  auto tables = idx_t ? idx_t->shard_tables() : std::vector<ShardTable>{};
  tables.push_back(w_t->shard_table(1));
  auto out = std::make_shared<DTensorSpec>(mesh, po, out_sizes, w.dtype(), tables);
  OpPlan plan(call);
  plan.input("weight", w_t).input("indices", idx_t).output(out);
  if (!masked) return plan;
  // Vocab-parallel: look up the indices in this shard's range, zero rows for the rest.
  const int64_t off = w_t->local_offsets()[0], n = w_t->local_sizes()[0];
  const auto local = out->local_sizes();
  plan.local_kernel = [off, n, local](KernelCall& k) {
    const at::Tensor weight = k.tensor("weight");
    if (n == 0) {
      k.finish({at::zeros(local, weight.options())});
      return;
    }
    const at::Tensor indices = k.tensor("indices");
    auto in_range = (indices >= off) & (indices < off + n);
    auto rows = at::embedding(weight, (indices - off).masked_fill(~in_range, 0));
    k.finish({rows.masked_fill_(~in_range.unsqueeze(-1), 0)});
  };
  // The kernel uses the weight's vocabulary offset, a dim it sums over (so the fallback
  // relays a head-tail table), and no place along the result's dims: the indices' rows
  // (head-tail ones included) are looked up alike.
  plan.place_dims.emplace();
  return plan;
}

// embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq).
//   grad S(last)          -> S(1), indices replicated
//   grad S(t), t < last   -> Partial(sum): indices sharded alike (data parallel)
//   grad P(sum)           -> P(sum)
//   grad R                -> S(0) chunk layout: each rank accumulates its own vocab rows
OpPlan embedding_backward_rule(const OpCall& call) {
  const auto& g = *call.spec("grad_output");
  const auto& mesh = g.mesh();
  const DTensorSpec* idx = call.spec("indices");
  const int64_t last = g.ndim() - 1;
  const int64_t num_weights = call.arg<int64_t>("num_weights");
  const auto idx_sizes = idx ? idx->sizes() : std::vector<int64_t>{};
  Placements pg(mesh.ndim(), Replicate()), pi = pg, po = pg;
  bool masked = false;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = g.placement(m);
    if (a.is_shard(last)) {
      pg[m] = a;
      po[m] = Shard(1);
    } else if (a.is_shard() && idx) {
      pg[m] = pi[m] = a;
      po[m] = Partial();
    } else if (a == Partial()) {
      pg[m] = po[m] = a;
    } else {
      po[m] = Shard(0);
      masked = true;
    }
  }
  std::vector<ShardTable> tg(g.ndim()), ti(idx_sizes.size());
  for (int64_t t = 0; t < g.ndim(); ++t) {
    if (t == last)
      tg[t] = fit_table(mesh, pg, t, g.sizes()[t], g.shard_table(t));
    else
      ti[t] = tg[t] = shared_table(mesh, pg, t, g.sizes()[t], {&g, idx});
  }
  std::vector<ShardTable> to = {ShardTable{}, tg[last]};
  auto out = fitted_spec(mesh, po, {num_weights, g.sizes()[last]}, g.dtype(), to);
  OpPlan plan(call);
  plan.input("grad_output", std::make_shared<DTensorSpec>(mesh, pg, g.sizes(), g.dtype(), tg));
  if (idx)
    plan.input("indices", std::make_shared<DTensorSpec>(mesh, pi, idx_sizes, idx->dtype(), ti));
  plan.output(out);
  const int64_t off = out->local_offsets()[0], n = out->local_sizes()[0];
  plan.local_kernel = [masked, off, n](KernelCall& k) {
    if (masked) {
      // Rows of the gradient, one per index, so the two can be filtered together.
      const at::Tensor grad = k.tensor("grad_output");
      k.set("grad_output", grad.reshape({k.tensor("indices").numel(), grad.size(-1)}));
      keep_local_entries(k, "indices", "grad_output", 0, off, n);
      const int64_t pad = k.arg<int64_t>("padding_idx");
      k.set("padding_idx", pad >= off && pad < off + n ? pad - off : int64_t{-1});
    }
    k.set("num_weights", n);
    k.call_op();
  };
  // The vocabulary rows this rank holds; the positions it sums over are read alike.
  plan.place_dims = std::vector<int64_t>{0};
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::index_select", index_select_rule);
  register_rule("aten::index_add", index_add_rule);
  register_rule("aten::index_add_", index_add_rule);
  register_rule("aten::gather", gather_rule);
  register_rule("aten::scatter.src", scatter_src_rule);
  register_rule("aten::scatter_.src", scatter_src_rule);
  register_rule("aten::scatter.value", scatter_value_rule);
  register_rule("aten::scatter_.value", scatter_value_rule);
  register_rule("aten::scatter_add", scatter_add_rule);
  register_rule("aten::scatter_add_", scatter_add_rule);
  register_rule("aten::embedding", embedding_rule);
  register_rule("aten::embedding_dense_backward", embedding_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
