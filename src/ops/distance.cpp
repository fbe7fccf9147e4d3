// Pairwise distances: _cdist_forward and _euclidean_dist (what cdist calls), _cdist_backward.
//
// x1 [..., P, M], x2 [..., R, M] -> [..., P, R]. Rows are independent: a mesh dim sharding
// x1's rows shards the result's rows (x2 whole on it), one sharding x2's rows shards the
// result's columns (x1 whole), one sharding a batch dim both have shards both and the result
// alike. The feature dim M is whole (a p-norm cannot be finished from per-shard terms) and
// Partial inputs are reduced first. The backward (the gradient for x1; autograd swaps the
// arguments for x2's) keeps x1's rows or the batch sharded, and a gradient sharded on the
// columns gives Partial(sum): each rank sums over its own x2 rows.
#include <vector>

#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// The table of tensor dim t under placements p: `from`'s table of its dim `u` when `from`
// shards u over exactly the same mesh dims and sizes agree, else the chunk layout.
ShardTable table_for(const DeviceMesh& mesh, const Placements& p, int64_t t, int64_t size,
                     const DTensorSpec* from, int64_t u) {
  std::vector<int64_t> dims;
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_shard(t)) dims.push_back(static_cast<int64_t>(m));
  if (dims.empty()) return {};
  if (from && u >= 0 && u < from->ndim() && from->sizes()[u] == size &&
      from->mesh_dims_sharding(u) == dims)
    return from->shard_table(u);
  return chunk_table(mesh, p, t, size);
}

SpecPtr laid_out(const DTensorSpec& s, const Placements& p,
                 const std::vector<std::pair<const DTensorSpec*, int64_t>>& sources) {
  std::vector<ShardTable> tables(s.ndim());
  for (int64_t t = 0; t < s.ndim(); ++t) {
    tables[t] = table_for(s.mesh(), p, t, s.sizes()[t], sources[t].first, sources[t].second);
  }
  return std::make_shared<DTensorSpec>(s.mesh(), p, s.sizes(), s.dtype(), tables);
}

// Batch dim b (counted from the left of the result's batch dims) in a tensor with nb batch
// dims of a result with nbo: its dim there, or -1 when the tensor has none (broadcast).
int64_t batch_dim(int64_t b, int64_t nb, int64_t nbo) {
  const int64_t t = b - (nbo - nb);
  return t >= 0 ? t : -1;
}

const DTensorSpec& operand(const OpCall& call, const char* name) {
  const DTensorSpec* s = call.spec(name);
  TORCH_CHECK(s, "tessera: ", call.describe(), ": ", name, " must be a tensor with 2 or more dims");
  TORCH_CHECK(s->ndim() >= 2, "tessera: ", call.describe(), ": ", name, " needs 2 or more dims");
  return *s;
}

// _cdist_forward(x1, x2, p, compute_mode), _euclidean_dist(x1, x2)
OpPlan cdist_rule(const OpCall& call) {
  const auto& a = operand(call, "x1");
  const auto& b = operand(call, "x2");
  const auto& mesh = a.mesh();
  const int64_t n1 = a.ndim(), n2 = b.ndim(), nb1 = n1 - 2, nb2 = n2 - 2;
  const int64_t nbo = std::max(nb1, nb2), no = nbo + 2;
  std::vector<int64_t> out_sizes(no);
  for (int64_t d = 0; d < nbo; ++d) {
    const int64_t t1 = batch_dim(d, nb1, nbo), t2 = batch_dim(d, nb2, nbo);
    out_sizes[d] = std::max(t1 >= 0 ? a.sizes()[t1] : 1, t2 >= 0 ? b.sizes()[t2] : 1);
  }
  out_sizes[no - 2] = a.sizes()[n1 - 2];
  out_sizes[no - 1] = b.sizes()[n2 - 2];
  Placements p1(mesh.ndim(), Replicate()), p2 = p1, po = p1;
  std::vector<bool> used(no, false);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& x = a.placement(m);
    const auto& y = b.placement(m);
    if (x.is_shard(n1 - 2)) {
      p1[m] = x, po[m] = Shard(no - 2);
    } else if (y.is_shard(n2 - 2)) {
      p2[m] = y, po[m] = Shard(no - 1);
    } else {
      // A batch dim: both operands shard it where they have it at full size.
      int64_t d = -1;
      if (x.is_shard() && x.dim() < nb1)
        d = x.dim() + (nbo - nb1);
      else if (y.is_shard() && y.dim() < nb2)
        d = y.dim() + (nbo - nb2);
      if (d < 0 || used[d]) continue;
      const int64_t t1 = batch_dim(d, nb1, nbo), t2 = batch_dim(d, nb2, nbo);
      const bool full1 = t1 >= 0 && a.sizes()[t1] == out_sizes[d];
      const bool full2 = t2 >= 0 && b.sizes()[t2] == out_sizes[d];
      // An operand that broadcasts along d stays whole; one that has d at full size shards.
      if ((t1 >= 0 && !full1 && a.sizes()[t1] != 1) || (t2 >= 0 && !full2 && b.sizes()[t2] != 1))
        continue;
      if (full1) p1[m] = Shard(t1);
      if (full2) p2[m] = Shard(t2);
      po[m] = Shard(d);
      used[d] = true;
    }
  }
  // Batch dims take the table of the operand whose shard decided them.
  std::vector<std::pair<const DTensorSpec*, int64_t>> owner(nbo, {nullptr, -1});
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!po[m].is_shard() || po[m].dim() >= nbo) continue;
    const int64_t d = po[m].dim();
    const auto& x = a.placement(m);
    owner[d] = x.is_shard() && x.dim() < nb1 ? std::make_pair(&a, x.dim())
                                             : std::make_pair(&b, b.placement(m).dim());
  }
  std::vector<std::pair<const DTensorSpec*, int64_t>> s1(n1), s2(n2), so(no);
  for (int64_t t = 0; t < n1; ++t) s1[t] = t < nb1 ? owner[t + (nbo - nb1)] : std::make_pair(&a, t);
  for (int64_t t = 0; t < n2; ++t) s2[t] = t < nb2 ? owner[t + (nbo - nb2)] : std::make_pair(&b, t);
  for (int64_t d = 0; d < nbo; ++d) so[d] = owner[d];
  auto t1 = laid_out(a, p1, s1), t2 = laid_out(b, p2, s2);
  DTensorSpec out_shape(mesh, Placements(mesh.ndim(), Replicate()), out_sizes, a.dtype());
  so[no - 2] = {t1.get(), n1 - 2};
  so[no - 1] = {t2.get(), n2 - 2};
  OpPlan plan(call);
  plan.input("x1", t1).input("x2", t2).output(laid_out(out_shape, po, so));
  return plan;
}

// _cdist_backward(grad, x1, x2, p, cdist): the gradient for x1, [..., P, M]. (Newer LibTorch
// names the first argument grad_output.)
OpPlan cdist_backward_rule(const OpCall& call) {
  const auto& a = operand(call, "x1");
  const auto& b = operand(call, "x2");
  const char* grad_name = call.has("grad") ? "grad" : "grad_output";
  const DTensorSpec* g = call.spec(grad_name);
  const DTensorSpec* c = call.spec("cdist");
  TORCH_CHECK(g && c, "tessera: ", call.describe(), ": grad and cdist must be tensors");
  const auto& mesh = a.mesh();
  const int64_t n1 = a.ndim(), n2 = b.ndim(), no = g->ndim();
  const int64_t nb1 = n1 - 2, nb2 = n2 - 2, nbo = no - 2;
  Placements pg(mesh.ndim(), Replicate()), p1 = pg, p2 = pg, px = pg;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& x = g->placement(m);
    const auto& y = a.placement(m);
    if (x.is_shard(no - 2) || (!x.is_shard() && y.is_shard(n1 - 2))) {
      pg[m] = Shard(no - 2), p1[m] = Shard(n1 - 2), px[m] = Shard(n1 - 2);
    } else if (x.is_shard(no - 1)) {
      pg[m] = Shard(no - 1), p2[m] = Shard(n2 - 2), px[m] = Partial();
    } else if (x.is_shard() && x.dim() < nbo) {
      const int64_t t1 = batch_dim(x.dim(), nb1, nbo), t2 = batch_dim(x.dim(), nb2, nbo);
      if (t1 < 0 || a.sizes()[t1] != g->sizes()[x.dim()]) continue;  // x1 broadcasts: whole
      pg[m] = x, p1[m] = Shard(t1), px[m] = Shard(t1);
      if (t2 >= 0 && b.sizes()[t2] == g->sizes()[x.dim()]) p2[m] = Shard(t2);
    }
  }
  std::vector<std::pair<const DTensorSpec*, int64_t>> sg(no), s1(n1), s2(n2);
  for (int64_t t = 0; t < no; ++t) sg[t] = {g, t};
  if (g->mesh_dims_sharding(no - 2).empty()) sg[no - 2] = {&a, n1 - 2};  // rows cut as x1's
  auto tg = laid_out(*g, pg, sg);
  for (int64_t t = 0; t < n1; ++t) {
    const int64_t u = t == n1 - 2 ? no - 2 : t < nb1 ? t + (nbo - nb1) : -1;
    s1[t] = {tg.get(), u};
  }
  for (int64_t t = 0; t < n2; ++t) {
    const int64_t u = t == n2 - 2 ? no - 1 : t < nb2 ? t + (nbo - nb2) : -1;
    s2[t] = {tg.get(), u};
  }
  auto t1 = laid_out(a, p1, s1), t2 = laid_out(b, p2, s2);
  auto tc = std::make_shared<DTensorSpec>(tg->mesh(), tg->placements(), c->sizes(), c->dtype(),
                                          tg->shard_tables());
  std::vector<std::pair<const DTensorSpec*, int64_t>> sx(n1);
  for (int64_t t = 0; t < n1; ++t) sx[t] = {t1.get(), t};
  OpPlan plan(call);
  plan.input(grad_name, tg).input("x1", t1).input("x2", t2).input("cdist", tc);
  plan.output(laid_out(a, px, sx));
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::_cdist_forward", cdist_rule);
  register_rule("aten::_euclidean_dist", cdist_rule);
  register_rule("aten::_cdist_backward", cdist_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
