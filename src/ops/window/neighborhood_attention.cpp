// Neighbourhood attention (tessera::neighborhood_attention and its backward) on q, k, v
// sharded along batch, spatial and head dims: the rule family of the op in
// src/nn/neighborhood_attention.cpp.
//
// NOTE: [Neighbourhood attention on sharded spatial dims]
// Output row i is computed by the owner of query row i, so the output keeps q's shard tables
// and Q never moves. Along each cut spatial dim a rank fetches exactly the K and V rows its
// queries' windows read: the union of the windows, worked out from *global* positions
// (NeighborhoodAxis below). Near a global edge windows shift inward, so a shard there needs
// up to (k-1)*d rows from one side, possibly from several thin neighbours; a causal axis
// needs none on the right. The local kernel builds its tap tables from the same global
// positions, offset by the window's first row, and so computes exactly what one device does
// for those queries. Backward reuses the forward's K/V windows (NOTE: [K/V windows kept for
// backward] in na_local.h; fetched again only without them), and sends the window gradients
// of K and V home, so each pass moves the forward's halo once; the gradients
// of rpb and of the extra keys/values are Partial(sum) over the mesh dims that shard batch or
// space, and Shard(0) / Shard(2) where heads are sharded.
// Bytes per cut spatial dim and direction: halo rows x other local extents x H_kv x (D + Dv).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "na_local.h"
#include "window_internal.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

using nn::detail::NAAxis;
using spatial::Axis;
using spatial::DimCut;
using spatial::Window;

// The window of one NA axis as a toolkit axis map: an output row is its query row, and
// outputs [lo, hi) read the union of their queries' windows.
struct NeighborhoodAxis final : spatial::AxisMap {
  explicit NeighborhoodAxis(NAAxis a) : na(a) {}
  NAAxis na;
  int64_t source_row(int64_t o) const override { return o; }
  Window reads(int64_t lo, int64_t hi) const override { return nn::detail::reads(na, lo, hi); }
  std::string str() const override {
    return "neighborhood(L " + std::to_string(na.length) + ", kernel " + std::to_string(na.kernel) +
           ", dilation " + std::to_string(na.dilation) + ", stride " + std::to_string(na.stride) +
           (na.causal ? ", causal" : "") + (na.circular ? ", circular" : "") + ")";
  }
};

at::Tensor optional_tensor(const c10::IValue& v) {
  return v.isTensor() ? v.toTensor() : at::Tensor();
}

// The per-axis arguments; the op receives them already expanded to one entry per axis.
std::vector<NAAxis> na_axes(const OpCall& call, const std::vector<int64_t>& q_sizes) {
  auto bools = [&](const char* name) {
    std::vector<bool> v;
    for (bool b : call.arg(name).toBoolList()) v.push_back(b);
    return v;
  };
  return nn::detail::make_axes(
      call.describe().c_str(), q_sizes, call.arg<std::vector<int64_t>>("kernel_size"),
      call.arg<std::vector<int64_t>>("stride"), call.arg<std::vector<int64_t>>("dilation"),
      bools("is_causal"), bools("circular"));
}

bool any_circular(const std::vector<NAAxis>& axes) {
  for (const auto& a : axes)
    if (a.circular) return true;
  return false;
}

// Scales a heads table from `from` heads to `to` heads; empty when some entry does not divide.
ShardTable scale_heads(const ShardTable& t, int64_t from, int64_t to) {
  ShardTable r;
  for (auto n : t) {
    if ((n * to) % from != 0) return {};
    r.push_back(n * to / from);
  }
  return r;
}

// Everything both rules derive from the operands' specs.
struct NALayout {
  std::vector<NAAxis> axes;
  std::vector<DimCut> cuts;
  bool windowed = false;  // some spatial dim is cut: the distributed kernel runs
  SpecPtr q, k, v, out, lse;
  SpecPtr rpb, extra_k, extra_v;     // null when the argument is absent
  SpecPtr drpb, dextra_k, dextra_v;  // gradients; an absent one is an empty replicated tensor
  SpecPtr empty;
};

std::vector<int64_t> sizes_of(const OpCall& call, const char* name) {
  if (const auto* s = call.spec(name)) return s->sizes();
  return call.arg(name).toTensor().sizes().vec();
}

// The operand the layout comes from: q when it is distributed, else the first distributed
// operand (all of q, k, v have the layout [B, *S, heads, dim]).
const DTensorSpec& reference_operand(const OpCall& call, int64_t nd) {
  const DTensorSpec* ref = call.spec("query");
  if (!ref) ref = call.spec("key");
  if (!ref) ref = call.spec("value");
  if (!ref) ref = &call.first();
  TORCH_CHECK(ref->ndim() == nd + 3, "tessera: ", call.describe(),
              ": the distributed operands must all be [B, *spatial, heads, dim]");
  return *ref;
}

// The layout q, k and v share: batch, spatial dims (their outermost mesh dim) and heads keep
// their shards; the head dim and Partial become Replicate. GQA: q head h reads kv head
// h / (H / H_kv), so the heads stay sharded only when every shard holds whole groups; their
// tables for q's and kv's head counts go to `q_heads` / `kv_heads` (empty otherwise).
DTensorSpec shared_layout(const DTensorSpec& r, int64_t nd, int64_t h_q, int64_t h_kv,
                          ShardTable* q_heads, ShardTable* kv_heads) {
  const int64_t heads = nd + 1, dim = nd + 2;
  DTensorSpec base = r.replicate_where([&](int64_t m, const Placement& p) {
    if (!p.is_shard()) return true;
    const int64_t t = p.dim();
    if (t >= 1 && t <= nd) return m != r.mesh_dims_sharding(t).front();
    return t == dim;
  });
  const int64_t h_ref = r.sizes()[heads];
  if (!base.mesh_dims_sharding(heads).empty()) {
    *q_heads = scale_heads(base.shard_table(heads), h_ref, h_q);
    *kv_heads = scale_heads(base.shard_table(heads), h_ref, h_kv);
    if (q_heads->empty() || kv_heads->empty() || scale_heads(*kv_heads, h_kv, h_q) != *q_heads) {
      base = base.replicate_where([&](int64_t, const Placement& p) { return p.is_shard(heads); });
      q_heads->clear(), kv_heads->clear();
    }
  }
  return base;
}

// q, k, v, the output and the log-sum-exp [B, *S, heads] in the shared layout.
void operand_layouts(const DTensorSpec& base, int64_t nd, const std::vector<int64_t>& qs,
                     const std::vector<int64_t>& ks, const std::vector<int64_t>& vs,
                     const ShardTable& q_heads, const ShardTable& kv_heads, NALayout& l) {
  const int64_t heads = nd + 1, dim = nd + 2;
  const auto& mesh = base.mesh();
  const auto& pl = base.placements();
  const auto dtype = base.dtype();
  auto spec_of = [&](std::vector<int64_t> sizes, const ShardTable& heads_table) {
    auto tables = base.shard_tables();
    tables.resize(nd + 3);
    if (!heads_table.empty()) tables[heads] = heads_table;
    tables.resize(sizes.size());
    return std::make_shared<DTensorSpec>(mesh, pl, std::move(sizes), dtype, std::move(tables));
  };
  l.q = spec_of(qs, q_heads);
  l.k = spec_of(ks, kv_heads);
  l.v = spec_of(vs, kv_heads);
  auto os = qs;
  os[dim] = vs[dim];
  l.out = spec_of(os, q_heads);
  std::vector<int64_t> lse_sizes(qs.begin(), qs.end() - 1);
  auto tables = l.q->shard_tables();
  tables.resize(lse_sizes.size());
  l.lse = std::make_shared<DTensorSpec>(mesh, pl, lse_sizes,
                                        dtype == at::kDouble ? at::kDouble : at::kFloat, tables);
}

// rpb [H, 2k-1, ...] follows the q heads; the extra keys/values [B, N, H_kv, D] follow the
// batch and kv heads. Their gradients sum over the mesh dims that shard batch or space.
SpecPtr side_spec(const DTensorSpec& base, int64_t heads, const std::vector<int64_t>& sizes,
                  int64_t batch_dim, int64_t heads_dim, const ShardTable& heads_table,
                  bool gradient) {
  const auto& pl = base.placements();
  Placements p(pl.size(), Placement::replicate());
  std::vector<ShardTable> tables(sizes.size());
  for (size_t m = 0; m < pl.size(); ++m) {
    if (!pl[m].is_shard()) continue;
    const int64_t t = pl[m].dim();
    if (t == heads) {
      p[m] = Placement::shard(heads_dim);
      tables[heads_dim] = heads_table;
    } else if (t == 0 && batch_dim >= 0) {
      p[m] = Placement::shard(batch_dim);
      tables[batch_dim] = base.shard_table(0);
    } else if (gradient) {
      p[m] = Placement::partial(PartialOp::Sum);
    }
  }
  return std::make_shared<DTensorSpec>(base.mesh(), p, sizes, base.dtype(), tables);
}

// The optional operands (rpb, additional keys / values) and their gradients.
void side_layouts(const OpCall& call, const DTensorSpec& base, int64_t heads,
                  const ShardTable& q_heads, const ShardTable& kv_heads, NALayout& l) {
  if (optional_tensor(call.arg("rpb")).defined()) {
    const auto s = sizes_of(call, "rpb");
    l.rpb = side_spec(base, heads, s, -1, 0, q_heads, false);
    l.drpb = side_spec(base, heads, s, -1, 0, q_heads, true);
  }
  if (optional_tensor(call.arg("additional_keys")).defined()) {
    const auto s = sizes_of(call, "additional_keys");
    l.extra_k = side_spec(base, heads, s, 0, 2, kv_heads, false);
    l.dextra_k = side_spec(base, heads, s, 0, 2, kv_heads, true);
  }
  if (optional_tensor(call.arg("additional_values")).defined()) {
    const auto s = sizes_of(call, "additional_values");
    l.extra_v = side_spec(base, heads, s, 0, 2, kv_heads, false);
    l.dextra_v = side_spec(base, heads, s, 0, 2, kv_heads, true);
  }
}

NALayout na_layout(const OpCall& call) {
  const auto qs = sizes_of(call, "query"), ks = sizes_of(call, "key"), vs = sizes_of(call, "value");
  const int64_t nd = static_cast<int64_t>(qs.size()) - 3;
  TORCH_CHECK(nd >= 1 && nd <= 3, "tessera: ", call.describe(),
              ": query must be [B, *spatial, heads, dim] with 1 to 3 spatial dims, got ",
              shape_str(qs));
  NALayout l;
  l.axes = na_axes(call, qs);
  const auto rpb = optional_tensor(call.arg("rpb"));
  const auto ek = optional_tensor(call.arg("additional_keys"));
  const auto ev = optional_tensor(call.arg("additional_values"));
  // On global sizes, so every rank raises the same error.
  const std::string op = call.describe();
  nn::detail::check_arguments(op.c_str(), qs, ks, vs, l.axes,
                              rpb.defined() ? c10::optional<at::Tensor>(rpb) : c10::nullopt,
                              ek.defined() ? c10::optional<at::Tensor>(ek) : c10::nullopt,
                              ev.defined() ? c10::optional<at::Tensor>(ev) : c10::nullopt);

  const int64_t heads = nd + 1;
  ShardTable q_heads, kv_heads;
  const DTensorSpec base =
      shared_layout(reference_operand(call, nd), nd, qs[heads], ks[heads], &q_heads, &kv_heads);
  operand_layouts(base, nd, qs, ks, vs, q_heads, kv_heads, l);
  side_layouts(call, base, heads, q_heads, kv_heads, l);
  l.empty = std::make_shared<DTensorSpec>(
      base.mesh(), Placements(base.placements().size(), Placement::replicate()),
      std::vector<int64_t>{0}, base.dtype());

  std::vector<int64_t> spatial_dims;
  for (int64_t i = 1; i <= nd; ++i) spatial_dims.push_back(i);
  std::vector<Axis> axes;
  for (const auto& a : l.axes)
    axes.push_back(Axis::custom(a.length, a.length, std::make_shared<NeighborhoodAxis>(a)));
  l.cuts = spatial::make_cuts(*l.q, spatial_dims, axes);
  l.windowed = spatial::any_window_dim_sharded(*l.q, spatial_dims);
  return l;
}

// This rank's tap tables: its queries (its output rows) against its fetched K/V windows.
std::vector<nn::detail::TapTable> rank_tables(const std::vector<DimCut>& cuts,
                                              const std::vector<NAAxis>& axes, bool* empty) {
  std::vector<nn::detail::TapTable> tables;
  *empty = false;
  for (size_t i = 0; i < cuts.size(); ++i) {
    const Window q = cuts[i].my_outputs();
    const Window w = cuts[i].axis.reads(q.lo, q.hi);
    if (q.size() == 0) *empty = true;
    tables.push_back(nn::detail::tap_table(axes[i], q.lo, q.size(), w.lo, w.size()));
  }
  return tables;
}

// Fetches this rank's K/V windows: the rows its queries read, from their owners.
std::pair<at::Tensor, at::Tensor> fetch_kv(KernelCall& kc, const DeviceMesh& mesh,
                                           const std::vector<DimCut>& cuts, bool periodic) {
  const auto boundary = periodic ? spatial::HaloBoundary::Periodic : spatial::HaloBoundary::Zeros;
  return {spatial::fetch(mesh, kc.tensor("key"), cuts, boundary),
          spatial::fetch(mesh, kc.tensor("value"), cuts, boundary)};
}

void na_forward_kernel(KernelCall& kc, const DeviceMesh& mesh, const NALayout& l) {
  const bool periodic = any_circular(l.axes);
  auto [kw, vw] = fetch_kv(kc, mesh, l.cuts, periodic);
  // NOTE: [K/V windows kept for backward] (na_local.h)
  if (nn::detail::KVWindows* keep = nn::detail::windows_to_keep()) *keep = {kw, vw};
  const at::Tensor q = kc.tensor("query");
  bool empty = false;
  const auto tables = rank_tables(l.cuts, l.axes, &empty);
  at::Tensor out, lse;
  if (empty || q.numel() == 0) {  // no queries here (the rank still served its rows to the others)
    auto os = q.sizes().vec();
    os.back() = vw.size(-1);
    out = at::zeros(os, q.options());
    lse = at::zeros(q.sizes().slice(0, q.dim() - 1),
                    q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  } else {
    std::tie(out, lse) = nn::detail::forward(
        q, kw, vw, tables, kc.arg<double>("scale"), optional_tensor(kc.arg("rpb")),
        optional_tensor(kc.arg("additional_keys")), optional_tensor(kc.arg("additional_values")));
  }
  kc.finish({out, lse});
}

// The forward's windows when the autograd kernel offers them and they fit this call's layout,
// else fetched again.
std::pair<at::Tensor, at::Tensor> backward_kv(KernelCall& kc, const DeviceMesh& mesh,
                                              const NALayout& l, bool periodic) {
  if (const nn::detail::KVWindows* w = nn::detail::take_offered_windows()) {
    const at::Tensor k = kc.tensor("key"), v = kc.tensor("value");
    auto fits = [](const at::Tensor& win, const at::Tensor& local) {
      return win.dim() == local.dim() && win.size(0) == local.size(0) &&
             win.size(-1) == local.size(-1) && win.size(-2) == local.size(-2) &&
             win.scalar_type() == local.scalar_type() && win.device() == local.device();
    };
    if (fits(w->k, k) && fits(w->v, v)) return {w->k, w->v};
  }
  return fetch_kv(kc, mesh, l.cuts, periodic);
}

void na_backward_kernel(KernelCall& kc, const DeviceMesh& mesh, const NALayout& l) {
  const bool periodic = any_circular(l.axes);
  auto [kw, vw] = backward_kv(kc, mesh, l, periodic);
  const at::Tensor q = kc.tensor("query");
  const at::Tensor rpb = optional_tensor(kc.arg("rpb"));
  const at::Tensor ek = optional_tensor(kc.arg("additional_keys"));
  const at::Tensor ev = optional_tensor(kc.arg("additional_values"));
  bool empty = false;
  const auto tables = rank_tables(l.cuts, l.axes, &empty);
  at::Tensor dq, dkw, dvw, drpb, dek, dev;
  if (empty || q.numel() == 0) {
    dq = at::zeros_like(q), dkw = at::zeros_like(kw), dvw = at::zeros_like(vw);
    if (rpb.defined()) drpb = at::zeros_like(rpb);
    if (ek.defined()) dek = at::zeros_like(ek);
    if (ev.defined()) dev = at::zeros_like(ev);
  } else {
    std::tie(dq, dkw, dvw, drpb, dek, dev) =
        nn::detail::backward(kc.tensor("grad_out"), q, kw, vw, kc.tensor("out"), kc.tensor("lse"),
                             tables, kc.arg<double>("scale"), rpb, ek, ev);
  }
  const auto boundary = periodic ? spatial::HaloBoundary::Periodic : spatial::HaloBoundary::Zeros;
  at::Tensor dk = spatial::fetch_backward(mesh, dkw, l.cuts, boundary);
  at::Tensor dv = spatial::fetch_backward(mesh, dvw, l.cuts, boundary);
  auto or_empty = [&](const at::Tensor& t) {
    return t.defined() ? t : at::empty({0}, q.options());
  };
  kc.finish({dq, dk, dv, or_empty(drpb), or_empty(dek), or_empty(dev)});
}

void add_side_inputs(OpPlan& plan, const OpCall& call, const NALayout& l) {
  if (l.rpb && call.arg("rpb").isTensor()) plan.input("rpb", l.rpb);
  if (l.extra_k) plan.input("additional_keys", l.extra_k);
  if (l.extra_v) plan.input("additional_values", l.extra_v);
}

// neighborhood_attention(query, key, value, kernel_size, stride, dilation, is_causal, circular,
//                        scale, rpb?, additional_keys?, additional_values?) -> (out, lse)
OpPlan na_rule(const OpCall& call) {
  auto l = std::make_shared<const NALayout>(na_layout(call));
  OpPlan plan(call);
  plan.input("query", l->q).input("key", l->k).input("value", l->v);
  add_side_inputs(plan, call, *l);
  plan.output(l->out).output(l->lse);
  if (l->windowed)
    plan.distributed_kernel = [l](KernelCall& kc, const DeviceMesh& mesh) {
      na_forward_kernel(kc, mesh, *l);
    };
  return plan;
}

// neighborhood_attention_backward(grad_out, query, key, value, out, lse, <as above>)
//   -> (grad_query, grad_key, grad_value, grad_rpb, grad_additional_keys, grad_additional_values)
OpPlan na_backward_rule(const OpCall& call) {
  auto l = std::make_shared<const NALayout>(na_layout(call));
  OpPlan plan(call);
  plan.input("grad_out", l->out).input("query", l->q).input("key", l->k).input("value", l->v);
  plan.input("out", l->out).input("lse", l->lse);
  add_side_inputs(plan, call, *l);
  plan.output(l->q).output(l->k).output(l->v);
  plan.output(l->drpb ? l->drpb : l->empty)
      .output(l->dextra_k ? l->dextra_k : l->empty)
      .output(l->dextra_v ? l->dextra_v : l->empty);
  if (l->windowed)
    plan.distributed_kernel = [l](KernelCall& kc, const DeviceMesh& mesh) {
      na_backward_kernel(kc, mesh, *l);
    };
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("tessera::neighborhood_attention", na_rule);
  register_rule("tessera::neighborhood_attention_backward", na_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
