// EmbeddingBag's ops: _embedding_bag and _embedding_bag_forward_only, and their backward
// (_embedding_bag_backward, which LibTorch 2.x runs as a kernel and 1.13 decomposes into
// _embedding_bag_dense_backward, and _embedding_bag_per_sample_weights_backward).
//
// NOTE: [Bags on shards]
// _embedding_bag(weight [V, D], indices [N], offsets [B] (or [B + 1] with
// include_last_offset), per_sample_weights [N]?) -> (output [B, D], offset2bag, bag_size,
// max_indices) reduces the rows of bag b, indices[offsets[b] : offsets[b + 1]], to one. On
// each mesh dim, one of:
//   weight S(1)   the embedding dim: each rank reduces its own columns; the output (and
//                 max_indices [B, D]) is S(1), everything else whole. No communication.
//   indices S(0)  bags: nn::EmbeddingBag's 2-D input [B, L] arrives flattened, with offsets
//                 0, L, 2L, ... (a plain tensor). When N = B * L and every shard of the
//                 indices holds whole bags (a multiple of L), each rank reduces its own
//                 bags: the output is S(0) with the indices' table divided by L, the
//                 per-sample weights follow the indices, and the weight is whole there. The
//                 local op gets local offsets; the kernel checks that the offsets really are
//                 0, L, 2L, ... and stops with an error otherwise (the layout is chosen from
//                 shapes, before the values are seen). offset2bag holds global bag numbers.
//   anything else is made whole: a weight sharded over the vocabulary (S(0)) is gathered
//                 (not worth a masked lookup here), as are indices whose shards split bags.
// The other results' global shapes depend on the mode and on LibTorch's path (offset2bag is
// empty on the fast sum path), so the rule runs the op once on tiny plain tensors whose
// sizes tell N, B and D apart, and lays out each result by what its dims turn out to be.
//
// Backward (the incoming gradient is [B, D]): S(1) on it keeps the embedding dim sharded (the
// weight's gradient is S(1)); S(0) keeps the bags sharded (indices, offset2bag, bag_size and
// max_indices follow; the weight's gradient is Partial(sum), the per-sample weights'
// gradient S(0)); Partial(sum) passes through (the gradient is linear in it). With
// scale_grad_by_freq the counts span the whole batch, so the bags are made whole.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"
#include "dim_layout.h"

namespace tessera::ops {

namespace {

// What a dim of an argument or result runs over. Empty: a dim of size 0 (a result LibTorch
// leaves empty on this path).
enum class Dim { Indices, Bags, Embedding, Empty };

// Probe sizes, pairwise distinct, so a probe result's dim names what it is.
constexpr int64_t kProbeBags = 2, kProbeLength = 3, kProbeWidth = 5;

const DTensorSpec& need(const OpCall& call, const char* name) {
  const DTensorSpec* s = call.spec(name);
  TORCH_CHECK(s, "tessera: ", call.describe(), ": ", name, " must be a tensor");
  return *s;
}

struct ResultShape {
  std::vector<Dim> dims;
  c10::ScalarType dtype = c10::kLong;
};

// The global result shapes, as dims: runs the op on plain tensors of probe sizes.
std::vector<ResultShape> result_shapes(const OpCall& call) {
  const auto& w = need(call, "weight");
  const bool last = call.arg<bool>("include_last_offset");
  const int64_t pad = call.arg<int64_t>("padding_idx");
  const int64_t n = kProbeBags * kProbeLength;
  torch::jit::Stack stack(call.args.begin(), call.args.end());
  KernelCall k(call.op, stack);
  auto set = [&](const char* name, at::Tensor t) { k.set(name, std::move(t)); };
  set("weight", at::zeros({std::max<int64_t>(pad + 1, 1), kProbeWidth}, at::dtype(w.dtype())));
  set("indices", at::zeros({n}, at::dtype(need(call, "indices").dtype())));
  set("offsets",
      at::arange(0, n + (last ? 1 : 0), kProbeLength, at::dtype(need(call, "offsets").dtype())));
  if (const auto* p = call.spec("per_sample_weights"))
    set("per_sample_weights", at::zeros({n}, at::dtype(p->dtype())));
  k.call_op();
  std::vector<ResultShape> out;
  for (const auto& r : stack) {
    std::vector<Dim> dims;
    for (int64_t s : r.toTensor().sizes()) {
      if (s == n)
        dims.push_back(Dim::Indices);
      else if (s == kProbeBags)
        dims.push_back(Dim::Bags);
      else if (s == kProbeWidth)
        dims.push_back(Dim::Embedding);
      else if (s == 0)
        dims.push_back(Dim::Empty);
      else
        TORCH_INTERNAL_ASSERT(false, call.describe(), ": unexpected probe result size ", s);
    }
    out.push_back({std::move(dims), r.toTensor().scalar_type()});
  }
  return out;
}

// Where the bags are sharded: one mesh dim, the length L of every bag and the tables of
// the indices and of the bags along it. mesh_dim < 0: nowhere.
struct Bags {
  int64_t mesh_dim = -1;
  int64_t length = 0;
  ShardTable index_table, bag_table;
};

// Bags sharded on mesh dim m: N = bags * L, and `table` (of the indices or of the bags,
// `per_index` telling which) cuts only between bags.
Bags bags_on(int64_t m, int64_t n, int64_t bags, const ShardTable& table, bool per_index) {
  if (bags <= 0 || n <= 0 || n % bags != 0) return {};
  const int64_t length = n / bags;
  Bags b{m, length, {}, {}};
  for (int64_t x : table) {
    if (per_index && x % length != 0) return {};
    b.index_table.push_back(per_index ? x : x * length);
    b.bag_table.push_back(per_index ? x / length : x);
  }
  return b;
}

// The mesh dim that alone shards tensor dim 0 of `s`, or -1.
int64_t only_sharding_mesh_dim(const DTensorSpec& s) {
  const auto dims = s.mesh_dims_sharding(0);
  return dims.size() == 1 ? dims[0] : -1;
}

// A spec of `sizes` whose dims are `what`: Bags / Indices sharded on b.mesh_dim, Embedding
// where `emb` has Shard(1) (with `emb_table`), everything else whole.
SpecPtr laid_out(const DeviceMesh& mesh, const std::vector<int64_t>& sizes,
                 const std::vector<Dim>& what, c10::ScalarType dtype, const Bags& b,
                 const Placements& emb, const ShardTable& emb_table) {
  Placements p(mesh.ndim(), Replicate());
  std::vector<ShardTable> tables(sizes.size());
  for (size_t t = 0; t < what.size(); ++t) {
    const auto tt = static_cast<int64_t>(t);
    if (what[t] == Dim::Embedding) {
      for (int64_t m = 0; m < mesh.ndim(); ++m)
        if (emb[m].is_shard(1)) p[m] = Shard(tt);
      if (!emb_table.empty()) tables[t] = emb_table;
    } else if (what[t] != Dim::Empty && b.mesh_dim >= 0) {
      p[b.mesh_dim] = Shard(tt);
      tables[t] = what[t] == Dim::Bags ? b.bag_table : b.index_table;
    }
  }
  return std::make_shared<DTensorSpec>(mesh, p, sizes, dtype, tables);
}

// Local offsets for `bags` whole bags of `length`: 0, L, ..., with the end when `last`.
at::Tensor local_offsets(int64_t bags, int64_t length, bool last, const at::TensorOptions& o) {
  return at::arange(0, (bags + (last ? 1 : 0)) * length, length, o);
}

// _embedding_bag / _embedding_bag_forward_only(weight, indices, offsets, scale_grad_by_freq,
// mode, sparse, per_sample_weights?, include_last_offset, padding_idx).
OpPlan embedding_bag_rule(const OpCall& call) {
  const auto& w = need(call, "weight");
  const auto& idx = need(call, "indices");
  const auto& off = need(call, "offsets");
  const DTensorSpec* psw = call.spec("per_sample_weights");
  const auto& mesh = w.mesh();
  const bool last = call.arg<bool>("include_last_offset");
  const int64_t n = idx.ndim() == 1 ? idx.sizes()[0] : -1;
  const int64_t bags = off.ndim() == 1 ? off.sizes()[0] - (last ? 1 : 0) : -1;

  Placements pw(mesh.ndim(), Replicate());
  for (int64_t m = 0; m < mesh.ndim(); ++m)
    if (w.placement(m).is_shard(1)) pw[m] = w.placement(m);
  const ShardTable emb_table = w.mesh_dims_sharding(1).empty() ? ShardTable{} : w.shard_table(1);
  Bags b;
  const int64_t m = only_sharding_mesh_dim(idx);
  if (m >= 0 && n > 0 && pw[m].is_replicate())
    b = bags_on(m, n, bags, idx.shard_table(0), /*per_index=*/true);

  const std::vector<Dim> flat = {Dim::Indices};
  OpPlan plan(call);
  plan.input("weight", std::make_shared<DTensorSpec>(mesh, pw, w.sizes(), w.dtype(),
                                                     std::vector<ShardTable>{{}, emb_table}));
  plan.input("indices", laid_out(mesh, idx.sizes(), n >= 0 ? flat : std::vector<Dim>{}, idx.dtype(),
                                 b, pw, {}));
  plan.input("offsets", replicated(off));
  if (psw)
    plan.input("per_sample_weights",
               laid_out(mesh, psw->sizes(), psw->ndim() == 1 ? flat : std::vector<Dim>{},
                        psw->dtype(), b, pw, {}));

  const std::vector<int64_t> global = {n, bags, w.sizes()[1], 0};  // by Dim
  std::vector<SpecPtr> outs;
  for (const auto& r : result_shapes(call)) {
    std::vector<int64_t> sizes;
    for (Dim d : r.dims) sizes.push_back(global[static_cast<int>(d)]);
    outs.push_back(laid_out(mesh, sizes, r.dims, r.dtype, b, pw, emb_table));
    plan.output(outs.back());
  }
  if (b.mesh_dim < 0) return plan;

  const int64_t coord = mesh.coordinate()[b.mesh_dim];
  int64_t first_bag = 0;
  for (int64_t i = 0; i < coord; ++i) first_bag += b.bag_table[i];
  const int64_t my_bags = b.bag_table[coord], length = b.length;
  std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>> empty;
  for (auto& o : outs) empty.emplace_back(o->local_sizes(), o->dtype());
  plan.local_kernel = [=](KernelCall& k) {
    const at::Tensor offsets = k.tensor("offsets");
    TORCH_CHECK(at::equal(offsets, local_offsets(bags, length, last, offsets.options())),
                "tessera: ", k.op().schema().name(), ": the indices are sharded in whole bags of ",
                length, " (their shapes say so), but the offsets are not 0, ", length, ", ",
                2 * length, ", ...; replicate the indices, or pass 2-D input");
    if (my_bags == 0) {
      auto zeros = [&](size_t r) {
        return at::zeros(empty[r].first, offsets.options().dtype(empty[r].second));
      };
      k.finish({zeros(0), zeros(1), zeros(2), zeros(3)});
      return;
    }
    k.set("offsets", local_offsets(my_bags, length, last, offsets.options()));
    k.call_op();
    // The schema names no results: (output, offset2bag, bag_size, max_indices).
    auto& r = k.stack();
    at::Tensor offset2bag = r.at(1).toTensor();
    k.finish({r.at(0).toTensor(), offset2bag.numel() > 0 ? offset2bag + first_bag : offset2bag,
              r.at(2).toTensor(), r.at(3).toTensor()});
  };
  return plan;
}

// ---- backward ------------------------------------------------------------------------------

// How the incoming gradient [B, D] is laid out, per mesh dim.
struct GradLayout {
  Placements grad;  // Shard(0), Shard(1), Partial(sum) or Replicate
  Bags bags;
  ShardTable emb_table;
};

GradLayout grad_layout(const OpCall& call, int64_t n, bool whole_bags) {
  const auto& g = need(call, "grad");
  const auto& mesh = g.mesh();
  GradLayout l{Placements(mesh.ndim(), Replicate()), {}, {}};
  const int64_t m0 = only_sharding_mesh_dim(g);
  if (!whole_bags && m0 >= 0 && n > 0)
    l.bags = bags_on(m0, n, g.sizes()[0], g.shard_table(0), false);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& x = g.placement(m);
    if (x.is_shard(1) || x == Partial()) l.grad[m] = x;
    if (m == l.bags.mesh_dim) l.grad[m] = Shard(0);
  }
  if (!g.mesh_dims_sharding(1).empty()) l.emb_table = g.shard_table(1);
  return l;
}

// The inputs the backward ops share: grad, indices, offsets, offset2bag, bag_size,
// maximum_indices (those the op has), laid out for `l`.
void backward_inputs(const OpCall& call, const GradLayout& l, OpPlan& plan) {
  const auto& g = need(call, "grad");
  const auto& mesh = g.mesh();
  std::vector<ShardTable> gt(2);
  if (l.bags.mesh_dim >= 0) gt[0] = l.bags.bag_table;
  gt[1] = l.emb_table;
  plan.input("grad", std::make_shared<DTensorSpec>(mesh, l.grad, g.sizes(), g.dtype(), gt));
  const int64_t bags = g.sizes()[0], width = g.sizes()[1];
  const int64_t n = need(call, "indices").numel();
  // What each dim of an argument is, from its name and size: offset2bag and the indices run
  // over the indices, bag_size and maximum_indices over the bags ([B, D] in max mode).
  auto dims_of = [&](const std::string& name, const DTensorSpec& s) {
    std::vector<Dim> what;
    if (s.ndim() == 0 || name == "offsets") return what;
    const bool per_index = name == "indices" || name == "offset2bag";
    if (s.sizes()[0] != (per_index ? n : bags) || s.numel() == 0) return what;  // whole
    what.push_back(per_index ? Dim::Indices : Dim::Bags);
    if (s.ndim() == 2 && s.sizes()[1] == width) what.push_back(Dim::Embedding);
    return what;
  };
  for (const char* name : {"indices", "offsets", "offset2bag", "bag_size", "maximum_indices"}) {
    if (!call.has(name) || !call.spec(name)) continue;
    const auto& s = *call.spec(name);
    plan.input(name,
               laid_out(mesh, s.sizes(), dims_of(name, s), s.dtype(), l.bags, l.grad, l.emb_table));
  }
}

// The local kernel for sharded bags: offset2bag to this rank's bag numbers, offsets for its
// bags; an empty shard gives `empty` zeros.
LocalKernel local_bags_kernel(const OpCall& call, const GradLayout& l, std::vector<int64_t> empty) {
  const auto& g = need(call, "grad");
  const auto& b = l.bags;
  const int64_t coord = g.mesh().coordinate()[b.mesh_dim];
  int64_t first_bag = 0;
  for (int64_t i = 0; i < coord; ++i) first_bag += b.bag_table[i];
  const int64_t my_bags = b.bag_table[coord], length = b.length, bags = g.sizes()[0];
  const bool has_offsets = call.has("offsets");
  const bool last = has_offsets && need(call, "offsets").numel() == bags + 1;
  return [=](KernelCall& k) {
    if (my_bags == 0) {
      k.finish({at::zeros(empty, k.tensor("grad").options())});
      return;
    }
    const at::Tensor o2b = k.tensor("offset2bag");
    if (o2b.numel() > 0) k.set("offset2bag", o2b - first_bag);
    if (has_offsets) {
      const at::Tensor offsets = k.tensor("offsets");
      k.set("offsets", local_offsets(my_bags, length, last, offsets.options()));
    }
    k.call_op();
  };
}

// _embedding_bag_backward / _embedding_bag_dense_backward -> the weight's gradient [V, D].
OpPlan embedding_bag_backward_rule(const OpCall& call) {
  TORCH_CHECK(!call.has("sparse") || !call.arg<bool>("sparse"), "tessera: ", call.describe(),
              ": sparse gradients of a distributed embedding bag are not supported");
  const auto& idx = need(call, "indices");
  const bool by_freq = call.arg<bool>("scale_grad_by_freq");
  const auto l = grad_layout(call, idx.ndim() == 1 ? idx.sizes()[0] : -1, by_freq);
  const auto& g = need(call, "grad");
  const auto& mesh = g.mesh();
  OpPlan plan(call);
  backward_inputs(call, l, plan);
  if (const auto* p = call.spec("per_sample_weights"))
    plan.input("per_sample_weights",
               laid_out(mesh, p->sizes(),
                        p->ndim() == 1 ? std::vector<Dim>{Dim::Indices} : std::vector<Dim>{},
                        p->dtype(), l.bags, l.grad, {}));
  Placements po(mesh.ndim(), Replicate());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (l.grad[m].is_shard(1))
      po[m] = Shard(1);
    else if (l.grad[m].is_shard(0) || l.grad[m] == Partial())
      po[m] = Partial();
  }
  const int64_t v = call.arg<int64_t>("num_weights");
  auto out = std::make_shared<DTensorSpec>(mesh, po, std::vector<int64_t>{v, g.sizes()[1]},
                                           g.dtype(), std::vector<ShardTable>{{}, l.emb_table});
  plan.output(out);
  if (l.bags.mesh_dim >= 0) plan.local_kernel = local_bags_kernel(call, l, out->local_sizes());
  return plan;
}

// _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag,
// mode, padding_idx) -> [N]: one dot product per index, of its bag's gradient row and its
// weight row. Sharded bags shard it like the indices; a sharded embedding dim makes it
// Partial(sum).
OpPlan per_sample_weights_backward_rule(const OpCall& call) {
  const auto& idx = need(call, "indices");
  const auto l = grad_layout(call, idx.ndim() == 1 ? idx.sizes()[0] : -1, false);
  const auto& g = need(call, "grad");
  const auto& w = need(call, "weight");
  const auto& mesh = g.mesh();
  OpPlan plan(call);
  backward_inputs(call, l, plan);
  Placements pw(mesh.ndim(), Replicate()), po(mesh.ndim(), Replicate());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (l.grad[m].is_shard(1))
      pw[m] = Shard(1), po[m] = Partial();
    else if (l.grad[m] == Partial())
      po[m] = Partial();
    else if (m == l.bags.mesh_dim)
      po[m] = Shard(0);
  }
  plan.input("weight", std::make_shared<DTensorSpec>(mesh, pw, w.sizes(), w.dtype(),
                                                     std::vector<ShardTable>{{}, l.emb_table}));
  std::vector<ShardTable> ot(1);
  if (l.bags.mesh_dim >= 0) ot[0] = l.bags.index_table;
  auto out = std::make_shared<DTensorSpec>(mesh, po, idx.sizes(), g.dtype(), ot);
  plan.output(out);
  if (l.bags.mesh_dim >= 0) plan.local_kernel = local_bags_kernel(call, l, out->local_sizes());
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::_embedding_bag", embedding_bag_rule);
  register_rule("aten::_embedding_bag_forward_only", embedding_bag_rule);
  register_rule("aten::_embedding_bag_backward", embedding_bag_backward_rule);
  register_rule("aten::_embedding_bag_dense_backward", embedding_bag_backward_rule);
  register_rule("aten::_embedding_bag_per_sample_weights_backward",
                per_sample_weights_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
