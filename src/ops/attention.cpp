// Scaled dot-product attention with the query's sequence dim sharded (context parallelism):
// queries stay where they are and every rank attends its query rows to every key. K and V
// come by one of two ways (NOTE: [Ring attention] in attention_ring.h):
//  - all-gather: K and V gathered whole in the plan; their gradients come back Partial(sum)
//    over the mesh dims that split the sequence (the autograd engine's redistribute
//    reduce-scatters them);
//  - ring (sequence split along any mesh dims: one ring over their members per slice of the
//    others): K and V keep that sequence split and the ring kernels bring their blocks over;
//    dK / dV come back in that layout.
//
// Ops: LibTorch 2.x's fused CPU kernel pair
//   _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, *,
//       attn_mask, scale) -> (output, logsumexp)
//   _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
//       logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (grad_query, grad_key,
//       grad_value)
// Layouts [B, H, L, E]; batch and heads may be sharded alike on q, k and v; q's sequence dim
// (2) may be sharded; E, k/v's sequence dim and every Partial are made whole. A causal call
// on sharded queries runs as two calls, the keys before the rank's rows and the diagonal
// block (attention::causal_forward); a given mask is split with the query's rows (and batch
// and heads where it has them).
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "attention_ring.h"
#include "tensor/out_form.h"
#include "tessera/comm/collectives.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

constexpr int64_t kSeq = 2;

// Whole along `dims` (and no Partial).
SpecPtr whole_along(const DTensorSpec& s, std::initializer_list<int64_t> dims) {
  return std::make_shared<DTensorSpec>(s.replicate_where([&](int64_t, const Placement& p) {
    if (p.is_partial()) return true;
    if (!p.is_shard()) return false;
    for (int64_t d : dims)
      if (p.dim() == d) return true;
    return false;
  }));
}

// Query heads per K/V head (grouped-query attention; 1 when the counts match).
int64_t groups(const DTensorSpec& q, const DTensorSpec& kv) {
  return kv.sizes()[1] == 0 ? 1 : q.sizes()[1] / kv.sizes()[1];
}

// k / v: batch and heads split exactly as q's (whatever layout k / v arrive in: the kernel
// needs the same local batch and heads; grouped K/V heads each rank's query heads / groups),
// everything else whole.
SpecPtr kv_layout(const DTensorSpec& kv, const DTensorSpec& q) {
  Placements p(kv.mesh().ndim(), Replicate());
  std::vector<ShardTable> tables(kv.ndim());
  const int64_t g = groups(q, kv);
  for (int64_t m = 0; m < q.mesh().ndim(); ++m) {
    const Placement& qp = q.placement(m);
    if (!qp.is_shard() || qp.dim() >= kSeq) continue;
    p[m] = qp;
    ShardTable t = q.shard_table(qp.dim());
    if (qp.dim() == 1)
      for (int64_t& n : t) n /= g;
    tables[qp.dim()] = std::move(t);
  }
  return std::make_shared<DTensorSpec>(kv.mesh(), p, kv.sizes(), kv.dtype(), tables);
}

// Whether K/V with these heads can be split as q's heads are: each rank's query heads a
// whole number of groups (sdpa_entry repeats the K/V heads on the distributed tensors
// otherwise).
bool groups_split_with(const DTensorSpec& q, int64_t kv_heads) {
  if (kv_heads == q.sizes()[1]) return true;
  if (kv_heads <= 0 || q.sizes()[1] % kv_heads != 0) return false;
  const int64_t g = q.sizes()[1] / kv_heads;
  if (g == 1 || q.mesh_dims_sharding(1).empty()) return true;
  for (int64_t n : q.shard_table(1))
    if (n % g != 0) return false;
  return true;
}

// q's layout with the last dim's size `last` (the output: Ev) or without it (logsumexp, in
// the kernels' accumulation dtype: float32 for bfloat16 and float16 queries).
SpecPtr resized(const DTensorSpec& q, int64_t last, bool drop_last) {
  auto sizes = q.sizes();
  auto tables = q.shard_tables();
  if (drop_last) {
    sizes.pop_back();
    if (!tables.empty()) tables.pop_back();
  } else {
    sizes.back() = last;
  }
  return std::make_shared<DTensorSpec>(q.mesh(), q.placements(), sizes,
                                       drop_last ? accumulate_type(q.dtype()) : q.dtype(), tables);
}

bool seq_sharded(const DTensorSpec& q) { return !q.mesh_dims_sharding(kSeq).empty(); }

// An attention mask broadcasts against the scores [B, H, L, S]: each of its dims that is not
// broadcast follows the query's split of the matching dim (rows with the query's rows);
// keys (its last dim) stay whole.
SpecPtr mask_layout(const DTensorSpec& mask, const DTensorSpec& q) {
  const int64_t off = q.ndim() - mask.ndim();
  Placements p(mask.mesh().ndim(), Replicate());
  std::vector<ShardTable> tables(mask.ndim());
  for (int64_t m = 0; m < q.mesh().ndim(); ++m) {
    const Placement& qp = q.placement(m);
    if (!qp.is_shard() || qp.dim() >= kSeq + 1) continue;
    const int64_t md = qp.dim() - off;
    if (md < 0 || mask.sizes()[md] != q.sizes()[qp.dim()] || mask.sizes()[md] == 1) continue;
    p[m] = Shard(md);
    if (!q.shard_tables().empty()) tables[md] = q.shard_tables()[qp.dim()];
  }
  return std::make_shared<DTensorSpec>(mask.mesh(), p, mask.sizes(), mask.dtype(), tables);
}

// The mesh dims whose ring brings K/V over (NOTE: [Ring attention]), when the method for
// this size is the ring: those that shard the query's sequence. Their members, row-major
// over those dims, are the order of the nested shard table (a sequence split over a 2-D
// field's mesh is one ring; beside a data-parallel dim, one ring per slice of it).
// Empty: the all-gather.
std::vector<int64_t> ring_dims(const DTensorSpec& q, const DTensorSpec& k, const DTensorSpec& v) {
  const auto dims = q.mesh_dims_sharding(kSeq);
  if (dims.empty()) return {};
  // What one rank would gather: the whole sequence of its batch and heads.
  const auto local = q.local_sizes();
  const int64_t bytes = k.sizes()[kSeq] * local[0] * (local[1] / groups(q, k)) *
                        (k.sizes()[3] + v.sizes()[3]) *
                        static_cast<int64_t>(c10::elementSize(k.dtype()));
  int64_t members = 1;
  for (int64_t m : dims) members *= q.mesh().size(m);
  return attention::kv_method_for(bytes, members) == attention::KVMethod::kRing
             ? dims
             : std::vector<int64_t>{};
}

// K / V for the ring kernels: the query's batch and heads split, and one sequence split
// along the ring's mesh dims for both: the key's own table when it arrives so split (the
// kernels take any), else the query's when the lengths match, else even.
SpecPtr kv_ring_layout(const DTensorSpec& kv, const DTensorSpec& key, const DTensorSpec& q,
                       const std::vector<int64_t>& dims) {
  const SpecPtr base = kv_layout(kv, q);
  Placements p = base->placements();
  for (int64_t m : dims) p[m] = Shard(kSeq);
  std::vector<ShardTable> tables = base->shard_tables();
  tables.resize(kv.ndim());
  const bool own = key.mesh_dims_sharding(kSeq) == dims;
  if (own && !key.shard_tables().empty())
    tables[kSeq] = key.shard_tables()[kSeq];
  else if (!own && key.sizes()[kSeq] == q.sizes()[kSeq] && !q.shard_tables().empty())
    tables[kSeq] = q.shard_tables()[kSeq];
  return std::make_shared<DTensorSpec>(kv.mesh(), p, kv.sizes(), kv.dtype(), tables);
}

struct Layout {
  SpecPtr q, kv_k, kv_v, out, lse, mask;
  bool sharded_seq = false;
  std::vector<int64_t> ring;  // ring_dims(q, k, v); empty: the all-gather
};

Layout layout_of(const OpCall& call) {
  const DTensorSpec& q = *call.spec("query");
  const DTensorSpec& k = *call.spec("key");
  const DTensorSpec& v = *call.spec("value");
  TORCH_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "tessera: ", call.describe(),
              ": query, key and value must be [B, H, L, E]");
  TORCH_CHECK(k.sizes()[1] == v.sizes()[1] && groups_split_with(q, k.sizes()[1]),
              "tessera: ", call.describe(), ": query ", q.str(), " with key ", k.str(),
              " and value ", v.str(),
              ": key and value need the same heads, and each rank's query heads a multiple of "
              "them; split the heads so, or repeat the key and value heads");
  Layout l;
  l.q = whole_along(q, {3});
  l.ring = ring_dims(*l.q, k, v);
  l.kv_k = !l.ring.empty() ? kv_ring_layout(k, k, *l.q, l.ring) : kv_layout(k, *l.q);
  l.kv_v = !l.ring.empty() ? kv_ring_layout(v, k, *l.q, l.ring) : kv_layout(v, *l.q);
  l.out = resized(*l.q, v.sizes()[3], false);
  l.lse = resized(*l.q, 0, true);
  l.sharded_seq = seq_sharded(*l.q);
  // The kernel's dropout would draw per rank, not one device's mask (NOTE: [Random numbers]).
  TORCH_CHECK(call.arg<double>("dropout_p") == 0.0, "tessera: ", call.describe(),
              ": dropout inside the fused attention kernel is not supported on distributed "
              "tensors (",
              q.str(),
              "); call scaled_dot_product_attention, whose dropout "
              "draws as one device does");
  if (const DTensorSpec* mask = call.spec("attn_mask")) l.mask = mask_layout(*mask, *l.q);
  return l;
}

// The op on this rank's block: empty blocks answered without the kernel, and on sharded
// queries is_causal applied at the rows' global positions (attention::causal_forward).
LocalKernel local_kernel(const DTensorSpec& q, bool sharded_seq) {
  const int64_t lo = q.local_offsets()[kSeq];
  return [lo, sharded_seq](KernelCall& kc) {
    const at::Tensor query = kc.tensor("query");
    if (query.numel() == 0) {  // no query rows here (the fused kernel divides by them)
      const at::Tensor key = kc.tensor("key"), value = kc.tensor("value");
      auto out_sizes = query.sizes().vec();
      out_sizes.back() = value.size(3);
      const auto lse_sizes = query.sizes().slice(0, 3);
      if (kc.has("grad_out"))
        kc.finish({at::zeros_like(query), at::zeros_like(key), at::zeros_like(value)});
      else
        kc.finish({at::zeros(out_sizes, query.options()),
                   at::zeros(lse_sizes, query.options().dtype(query.scalar_type() == at::kDouble
                                                                  ? at::kDouble
                                                                  : at::kFloat))});
      return;
    }
    attention::Args a;
    a.q = query;
    a.k = kc.tensor("key");
    a.v = kc.tensor("value");
    if (kc.has("attn_mask") && !kc.arg("attn_mask").isNone()) a.mask = kc.tensor("attn_mask");
    a.causal = kc.arg<bool>("is_causal");
    a.scale = kc.arg("scale").toOptional<double>();
    // Rows at their global positions under is_causal; otherwise the kernel as it is (grouped
    // K/V heads as they are; see groups_of in attention_ring.cpp).
    const bool cut = sharded_seq && a.causal;
    if (!kc.has("grad_out")) {
      auto r = cut ? attention::causal_forward(a, lo) : attention::forward(a);
      kc.finish({std::get<0>(r), std::get<1>(r)});
      return;
    }
    const at::Tensor go = kc.tensor("grad_out"), out = kc.tensor("out");
    const at::Tensor lse = kc.tensor("logsumexp");
    auto r = cut ? attention::causal_backward(a, lo, go, out, lse)
                 : attention::backward(a, go, out, lse);
    kc.finish({std::get<0>(r), std::get<1>(r), std::get<2>(r)});
  };
}

// The group of the ring along `dims`: the mesh dim's, the mesh's, or the slice's over those
// dims, whose ranks are row-major over them as the shard table's members (`me` checks it).
compat::BackendPtr ring_group(const DeviceMesh& mesh, const std::vector<int64_t>& dims,
                              int64_t me) {
  if (dims.size() == 1) return mesh.group(dims[0]);
  auto pg = tessera::detail::mesh_over_dims(mesh, dims).mesh_group();
  TORCH_INTERNAL_ASSERT(comm::group_rank(pg) == me, "ring member ", me, " is rank ",
                        comm::group_rank(pg), " of its slice's group");
  return pg;
}

// The ring kernels (attention_ring.h) on this call's local tensors, over the group of the
// ring's mesh dims (ring_group).
DistributedKernel ring_kernel(const Layout& l, bool backward, bool stored = false) {
  const std::vector<int64_t> dims = l.ring;
  const bool one = dims.size() == 1;
  const std::vector<int64_t> q_sizes = one ? l.q->shard_sizes(dims[0]) : l.q->shard_table(kSeq);
  const std::vector<int64_t> kv_sizes =
      one ? l.kv_k->shard_sizes(dims[0]) : l.kv_k->shard_table(kSeq);
  return [dims, one, q_sizes, kv_sizes, backward, stored](KernelCall& kc, const DeviceMesh& mesh) {
    const int64_t me = one ? mesh.local_rank(dims[0])
                           : tessera::detail::table_index(mesh, dims, mesh.coordinate());
    const attention::SeqSplit split{q_sizes, kv_sizes, me, stored};
    attention::Args a;
    a.q = kc.tensor("query");
    a.k = kc.tensor("key");
    a.v = kc.tensor("value");
    if (kc.has("attn_mask") && !kc.arg("attn_mask").isNone()) a.mask = kc.tensor("attn_mask");
    a.causal = kc.arg<bool>("is_causal");
    a.scale = kc.arg("scale").toOptional<double>();
    const auto pg = ring_group(mesh, dims, me);
    if (!backward) {
      auto r = attention::ring_forward(pg, split, a);
      kc.finish({std::get<0>(r), std::get<1>(r)});
      return;
    }
    auto r = attention::ring_backward(pg, split, a, kc.tensor("grad_out"), kc.tensor("out"),
                                      kc.tensor("logsumexp"));
    kc.finish({std::get<0>(r), std::get<1>(r), std::get<2>(r)});
  };
}

// NOTE: [Attention on the head-tail order]
// The rules below see head-tail specs as stored (let_rule_see_head_tail). When q, k and v are
// all HeadTailShard(2) on one mesh dim, self-attention without a mask, the ring runs on the
// stored order (NOTE: [Load-balanced causal ring]: under is_causal each step is the same
// work on every member) and the results are head-tail too: nothing is dealt or sent home per
// call. Any other call plans for the natural order: its head-tail operands are relayed first.
std::optional<int64_t> stored_ring_dim(const OpCall& call) {
  const DTensorSpec *q = call.spec("query"), *k = call.spec("key"), *v = call.spec("value");
  if (!q || !k || !v || q->ndim() != 4 || k->ndim() != 4 || v->ndim() != 4) return {};
  if (call.spec("attn_mask") || (call.has("attn_mask") && call.arg("attn_mask").isTensor() &&
                                 call.arg("attn_mask").toTensor().defined()))
    return {};
  if (q->sizes()[kSeq] != k->sizes()[kSeq] || v->sizes()[kSeq] != k->sizes()[kSeq] ||
      v->sizes()[1] != k->sizes()[1] || call.arg<double>("dropout_p") != 0.0)
    return {};
  const auto dims = q->mesh_dims_sharding(kSeq);
  if (dims.size() != 1 || !q->placement(dims[0]).is_head_tail()) return {};
  for (const DTensorSpec* x : {k, v})
    if (x->placement(dims[0]) != q->placement(dims[0])) return {};
  return dims[0];
}

Layout stored_layout(const OpCall& call, int64_t m) {
  const DTensorSpec& q = *call.spec("query");
  TORCH_CHECK(groups_split_with(q, call.spec("key")->sizes()[1]), "tessera: ", call.describe(),
              ": key and value need each rank's query heads a multiple of theirs");
  Layout l;
  l.q = whole_along(q, {3});
  auto head_tail_kv = [&](const DTensorSpec& kv) {
    Placements p = kv_layout(kv, *l.q)->placements();
    p[m] = HeadTailShard(kSeq);
    return std::make_shared<DTensorSpec>(kv.mesh(), p, kv.sizes(), kv.dtype(),
                                         kv_layout(kv, *l.q)->shard_tables());
  };
  l.kv_k = head_tail_kv(*call.spec("key"));
  l.kv_v = head_tail_kv(*call.spec("value"));
  l.out = resized(*l.q, call.spec("value")->sizes()[3], false);
  l.lse = resized(*l.q, 0, true);
  l.sharded_seq = true;
  l.ring = {m};
  return l;
}

// `rule` planned for the natural order: head-tail specs swapped for theirs, and the
// head-tail operands the plan leaves as they are relayed into them.
OpPlan for_natural_order(const OpCall& call, OpPlan (*rule)(const OpCall&)) {
  OpCall natural{call.op, call.args, {}, call.list_specs, call.reference};
  natural.specs.assign(call.specs.begin(), call.specs.end());
  std::vector<SpecPtr> keep(call.specs.size());
  for (size_t i = 0; i < call.specs.size(); ++i) {
    if (!call.specs[i] || !call.specs[i]->has_head_tail()) continue;
    keep[i] = std::make_shared<DTensorSpec>(call.specs[i]->natural_spec());
    if (natural.reference == call.specs[i]) natural.reference = keep[i].get();
    natural.specs[i] = keep[i].get();
  }
  if (natural.reference->has_head_tail())  // (a list element: these ops take none)
    natural.reference = nullptr;
  for (size_t i = 0; i < natural.specs.size() && !natural.reference; ++i)
    natural.reference = natural.specs[i];
  OpPlan plan = rule(natural);
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i] && i < plan.inputs.size() && !plan.inputs[i]) plan.inputs[i] = keep[i];
  return plan;
}

OpPlan sdpa_natural_rule(const OpCall& call) {
  const Layout l = layout_of(call);
  OpPlan plan(call);
  plan.input("query", l.q).input("key", l.kv_k).input("value", l.kv_v);
  if (l.mask) plan.input("attn_mask", l.mask);
  plan.output(l.out).output(l.lse);
  if (!l.ring.empty())
    plan.distributed_kernel = ring_kernel(l, false);
  else
    plan.local_kernel = local_kernel(*l.q, l.sharded_seq);
  return plan;
}

// K/V gradients: Partial(sum) over the mesh dims that shard the query's sequence.
SpecPtr kv_grad(const DTensorSpec& kv, const DTensorSpec& q) {
  Placements p = kv.placements();
  for (int64_t m : q.mesh_dims_sharding(kSeq)) p[m] = Partial(PartialOp::Sum);
  return std::make_shared<DTensorSpec>(kv.with_placements(p, kv.shard_tables()));
}

OpPlan sdpa_rule(const OpCall& call) {
  if (const auto m = stored_ring_dim(call)) {
    const Layout l = stored_layout(call, *m);
    OpPlan plan(call);
    plan.input("query", l.q).input("key", l.kv_k).input("value", l.kv_v);
    plan.output(l.out).output(l.lse);
    plan.distributed_kernel = ring_kernel(l, false, /*stored=*/true);
    return plan;
  }
  return for_natural_order(call, sdpa_natural_rule);
}

OpPlan sdpa_backward_natural_rule(const OpCall& call) {
  const Layout l = layout_of(call);
  OpPlan plan(call);
  plan.input("grad_out", l.out).input("query", l.q).input("key", l.kv_k).input("value", l.kv_v);
  plan.input("out", l.out).input("logsumexp", l.lse);
  if (l.mask) plan.input("attn_mask", l.mask);
  if (!l.ring.empty()) {
    plan.output(l.q).output(l.kv_k).output(l.kv_v);
    plan.distributed_kernel = ring_kernel(l, true);
    return plan;
  }
  plan.output(l.q).output(kv_grad(*l.kv_k, *l.q)).output(kv_grad(*l.kv_v, *l.q));
  plan.local_kernel = local_kernel(*l.q, l.sharded_seq);
  return plan;
}

OpPlan sdpa_backward_rule(const OpCall& call) {
  if (const auto m = stored_ring_dim(call)) {
    // The output gradient may arrive in the natural order: relayed (one of six tensors).
    const Layout l = stored_layout(call, *m);
    OpPlan plan(call);
    plan.input("grad_out", l.out).input("query", l.q).input("key", l.kv_k).input("value", l.kv_v);
    plan.input("out", l.out).input("logsumexp", l.lse);
    plan.output(l.q).output(l.kv_k).output(l.kv_v);
    plan.distributed_kernel = ring_kernel(l, true, /*stored=*/true);
    return plan;
  }
  return for_natural_order(call, sdpa_backward_natural_rule);
}

// The masks LibTorch's fused kernel takes (its backend choice sends others to the math path):
// [L or 1, S or 1] or [B or 1, H or 1, L or 1, S or 1].
bool mask_shape_fits(const at::Tensor& m, const at::Tensor& q, const at::Tensor& k) {
  const auto fits = [](int64_t d, int64_t n) { return d == n || d == 1; };
  if ((m.dim() != 2 && m.dim() != 4) || !fits(m.size(-2), q.size(2)) ||
      !fits(m.size(-1), k.size(2)))
    return false;
  return m.dim() == 2 || (fits(m.size(0), q.size(0)) && fits(m.size(1), q.size(1)));
}

// LibTorch's math path (bmm, softmax, dropout) on `kc`'s arguments, `mask` for its mask.
// Off the CPU, LibTorch's backend choice reads a distributed tensor's device and would send
// the call to CUDA's flash / efficient / cuDNN kernels, which have no sharding rules (their
// signatures differ per version): calls that the fused op pair does not take run here as
// one device's math path would run them. Its arguments are matched by name, so every
// version's schema is served.
bool math_path(KernelCall& kc, const c10::optional<at::Tensor>& mask) {
  static const auto math =  // (looked up once, not per call)
      c10::Dispatcher::singleton().findOp({"aten::_scaled_dot_product_attention_math", ""});
  if (!math) return false;
  torch::jit::Stack s;
  for (const auto& a : math->schema().arguments()) {
    if (a.name() == "attn_mask")
      s.emplace_back(mask);
    else if (kc.has(a.name().c_str()))
      s.push_back(kc.arg(a.name().c_str()));
    else if (a.default_value())
      s.push_back(*a.default_value());
    else
      return false;
  }
  math->callBoxed(&s);
  kc.finish({s.at(0)});
  return true;
}

// scaled_dot_product_attention is composite: on a distributed tensor LibTorch's backend
// choice falls to its math path (bmm, softmax), which gathers the sequence. Calls with a
// distributed tensor on any device are sent to the fused op pair above instead (autograd from
// derivatives.yaml; off the CPU its kernels are matrix products per block, NOTE: [Block kernels]).
// Calls with dropout keep the math path: its dropout draws as one device does (the fused kernel's
// would draw per rank).
void sdpa_entry(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  KernelCall kc(op, *stack);
  const at::Tensor q = kc.tensor("query");
  const bool gqa = kc.has("enable_gqa") && kc.arg<bool>("enable_gqa");
  at::Tensor k = kc.tensor("key"), v = kc.tensor("value");
  // Grouped-query heads: each K/V head serves q.size(1) / k.size(1) query heads. The fused op
  // takes them so (the K/V exchange carries only theirs; the block kernels take them as they
  // are or repeat per block, see groups_of in attention_ring.cpp) where each rank's query
  // heads are whole groups; otherwise they are repeated on the distributed tensors first (as
  // the composite's repeat_interleave).
  const bool grouped = gqa && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                       k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                       q.size(1) != k.size(1);
  // The fused kernel's own limits (LibTorch's backend choice checks the same).
  const bool fits = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(3) == k.size(3) &&
                    k.size(3) == v.size(3) && q.size(0) == k.size(0) && k.size(0) == v.size(0) &&
                    k.size(2) == v.size(2) && q.scalar_type() == k.scalar_type() &&
                    k.scalar_type() == v.scalar_type() &&
                    (grouped || (q.size(1) == k.size(1) && k.size(1) == v.size(1)));
  // The fused kernel takes an additive mask in the query's dtype; a boolean one becomes
  // that (0 where kept, -inf where not) as LibTorch's composite does; another dtype keeps
  // the composite path.
  c10::optional<at::Tensor> mask = kc.arg("attn_mask").toOptional<at::Tensor>();
  if (mask && mask->scalar_type() == at::kBool)
    mask = at::zeros(mask->sizes(), q.options())
               .masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
  // A mask and is_causal together: LibTorch's own input checks decide, so the composite path
  // answers as one device does. A mask that requires grad (a learned bias) or of a shape the
  // fused kernel does not take takes the composite path too, as LibTorch's backend choice
  // does: the fused op has no gradient for it.
  const bool mask_fits =
      !mask || (mask->scalar_type() == q.scalar_type() && !kc.arg<bool>("is_causal") &&
                !mask->requires_grad() && mask_shape_fits(*mask, q, k));
  // (Some argument is a distributed tensor: this kernel is at their key.)
  if (fits && mask_fits && kc.arg<double>("dropout_p") == 0.0) {
    if (grouped && !(is_dtensor(q) && groups_split_with(dtensor_impl(q)->spec(), k.size(1)))) {
      const int64_t groups = q.size(1) / k.size(1);
      k = attention::repeat_heads(k, groups);
      v = attention::repeat_heads(v, groups);
    }
    static const auto fused =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("aten::_scaled_dot_product_flash_attention_for_cpu", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool,
                const c10::optional<at::Tensor>&, c10::optional<double>)>();
    auto r = fused.call(q, k, v, kc.arg<double>("dropout_p"), kc.arg<bool>("is_causal"), mask,
                        kc.arg("scale").toOptional<double>());
    kc.finish({std::get<0>(r)});
    return;
  }
  // A mask with is_causal keeps the composite: LibTorch versions answer it differently (2.6's
  // fused CPU kernel applies both, 2.15 and the math op refuse it).
  const bool mask_and_causal = kc.arg("attn_mask").isTensor() && kc.arg<bool>("is_causal");
  if (attention::composite_by_math(q) &&
      !mask_and_causal) {  // (kProducts: CPU tests of this route)
    // LibTorch's own input checks first, as the composite makes them.
    TORCH_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(),
                "Expected query, key, and value to have the same dtype, but got query.dtype: ",
                q.dtype(), " key.dtype: ", k.dtype(), " and value.dtype: ", v.dtype(), " instead.");
    const auto given = kc.arg("attn_mask").toOptional<at::Tensor>();
    TORCH_CHECK(!given || given->scalar_type() == at::kBool || given->scalar_type() == at::kFloat ||
                    given->dtype() == q.dtype(),
                "Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                "attn_mask.dtype: ",
                given ? given->dtype() : q.dtype(), " and  query.dtype: ", q.dtype(), " instead.");
    if (math_path(kc, mask)) return;
  }
  c10::Dispatcher::singleton().callBoxedForDispatchKey(
      op, c10::DispatchKey::CompositeImplicitAutograd, stack);
}

const RuleRegistrar registrar{[] {
  if (!c10::Dispatcher::singleton().findOp(
          {"aten::_scaled_dot_product_flash_attention_for_cpu", ""}))
    return;  // LibTorch 1.13: no fused CPU attention
  register_rule("aten::_scaled_dot_product_flash_attention_for_cpu", sdpa_rule);
  register_rule("aten::_scaled_dot_product_flash_attention_for_cpu_backward", sdpa_backward_rule);
  // NOTE: [Attention on the head-tail order]
  detail::let_rule_see_head_tail("aten::_scaled_dot_product_flash_attention_for_cpu");
  detail::let_rule_see_head_tail("aten::_scaled_dot_product_flash_attention_for_cpu_backward");
  register_autograd_kernel("aten::scaled_dot_product_attention",
                           torch::CppFunction::makeFromBoxedFunction<&sdpa_entry>());
  // Under InferenceMode (no autograd keys) too: the composite's backend choice would pick
  // kernels without rules on CUDA.
  register_kernel("aten::scaled_dot_product_attention",
                  torch::CppFunction::makeFromBoxedFunction<&sdpa_entry>());
}};

}  // namespace

}  // namespace tessera::ops
