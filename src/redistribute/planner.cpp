// NOTE: [Redistribute planning]
// A plan moves one mesh dim at a time, in three phases:
//  1. Partial dims first, while the data is smallest: P -> S(u) as one reduce-scatter when
//     the new shard can nest right away, else P -> R (all-reduce).
//  2. Shard dims that are not "stable" (see below), innermost mesh dim first: S(t) -> S(u) as
//     one all-to-all when u can take this mesh dim right away (u == t re-cuts boundaries),
//     else S(t) -> R (all-gather). Never S -> R -> S when one all-to-all does it.
//  3. Remaining differences, outermost first: R -> S(u) (local slice) and R -> P (internal).
// A mesh dim d with S(t) is stable when source and target agree on it, on every mesh dim
// nested outside it on t, and on the shard table up to d. Nesting (see NOTE: [Shard tables])
// means only the innermost mesh dim of a tensor dim can be added or removed; the phases are
// ordered so that each step obeys this.
//
// Head-tail dims (NOTE: [Head-tail order] in spec.h) wrap this: a head-tail split that both
// ends keep is stable (its table is fixed and it is its dim's outermost split), so the three
// phases plan in the natural order around it, inner splits of its dim included; one that goes
// away is relayed into the natural order first (splits nested inside it gathered before), and
// one that appears is relayed into from the natural order last (inner splits cut after), or
// cut out of a replicated tensor directly where phase 3 slices it.
#include <atomic>
#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include "tessera/redistribute/redistribute.h"
#include "redistribute/agreement_ledger.h"

namespace tessera {

namespace {

// Set from any thread (tests flip it while rank threads plan): atomic.
std::atomic<bool> g_debug{std::getenv("TESSERA_DEBUG_REDISTRIBUTE") != nullptr};

std::vector<int64_t> level_sizes(const DTensorSpec& s, const std::vector<int64_t>& dims) {
  std::vector<int64_t> out;
  for (auto m : dims) out.push_back(s.mesh().size(m));
  return out;
}

std::vector<int64_t> dims_before(const DTensorSpec& s, int64_t t, int64_t d) {
  std::vector<int64_t> out;
  for (auto m : s.mesh_dims_sharding(t))
    if (m < d) out.push_back(m);
  return out;
}

// Table of tensor dim t keeping the nesting levels up to and including mesh dim d.
ShardTable prefix_table(const DTensorSpec& s, int64_t t, int64_t d) {
  auto dims = s.mesh_dims_sharding(t);
  size_t keep = 0;
  while (keep < dims.size() && dims[keep] <= d) ++keep;
  return detail::marginalize(s.shard_table(t), level_sizes(s, dims), keep);
}

bool stable(const DTensorSpec& cur, const DTensorSpec& dst, int64_t d) {
  const auto& a = cur.placement(d);
  if (!a.is_shard() || a != dst.placement(d)) return false;
  const int64_t t = a.dim();
  return dims_before(cur, t, d) == dims_before(dst, t, d) &&
         prefix_table(cur, t, d) == prefix_table(dst, t, d);
}

// Can mesh dim d start sharding tensor dim u now, as the target wants?
bool can_append(const DTensorSpec& cur, int64_t d, int64_t u, const DTensorSpec& dst) {
  std::vector<int64_t> cur_dims;
  for (auto m : cur.mesh_dims_sharding(u))
    if (m != d) cur_dims.push_back(m);
  if (cur_dims != dims_before(dst, u, d)) return false;
  for (auto m : cur_dims)
    if (!stable(cur, dst, m)) return false;
  return true;
}

SpecPtr make_spec(const DTensorSpec& like, Placements p, std::vector<ShardTable> tables) {
  return std::make_shared<DTensorSpec>(like.mesh(), std::move(p), like.sizes(), like.dtype(),
                                       std::move(tables));
}

// State after mesh dim d stops sharding whatever it shards (d must be innermost).
SpecPtr without(const DTensorSpec& cur, int64_t d) {
  Placements p = cur.placements();
  auto tables = cur.shard_tables();
  if (p[d].is_shard()) {
    const int64_t t = p[d].dim();
    auto dims = cur.mesh_dims_sharding(t);
    TORCH_INTERNAL_ASSERT(dims.back() == d, "unsharding a mesh dim that is not innermost");
    tables[t] = dims.size() == 1
                    ? ShardTable{}
                    : detail::marginalize(tables[t], level_sizes(cur, dims), dims.size() - 1);
  }
  p[d] = Replicate();
  return make_spec(cur, std::move(p), std::move(tables));
}

// State after mesh dim d takes placement `to` (Shard: nests innermost with dst's table).
SpecPtr with(const DTensorSpec& cur, int64_t d, const Placement& to, const DTensorSpec& dst) {
  Placements p = cur.placements();
  auto tables = cur.shard_tables();
  p[d] = to;
  if (to.is_shard()) tables[to.dim()] = prefix_table(dst, to.dim(), d);
  return make_spec(cur, std::move(p), std::move(tables));
}

std::shared_ptr<RedistributePlan> build_natural_plan(const SpecPtr& from, const SpecPtr& to) {
  auto plan = std::make_shared<RedistributePlan>();
  SpecPtr cur = from;
  const DTensorSpec& dst = *to;
  const int64_t nd = from->mesh().ndim();
  auto step = [&](StepKind k, int64_t d, SpecPtr next) {
    plan->steps.push_back({k, d, cur, next});
    cur = std::move(next);
  };
  // Phase 1: partial sums, while the data is smallest.
  for (int64_t d = 0; d < nd; ++d) {
    const auto& a = cur->placement(d);
    const auto& b = dst.placement(d);
    if (!a.is_partial() || a == b) continue;
    if (b.is_shard() && can_append(*cur, d, b.dim(), dst))
      step(StepKind::ReduceScatter, d, with(*cur, d, b, dst));
    else
      step(StepKind::AllReduce, d, with(*cur, d, Replicate(), dst));
  }
  // Phase 2: unstable shards, innermost first.
  for (int64_t d = nd - 1; d >= 0; --d) {
    const auto& a = cur->placement(d);
    if (!a.is_shard() || stable(*cur, dst, d)) continue;
    auto bare = without(*cur, d);
    const auto& b = dst.placement(d);
    if (b.is_shard() && can_append(*bare, d, b.dim(), dst))
      step(StepKind::AllToAll, d, with(*bare, d, b, dst));
    else
      step(StepKind::AllGather, d, bare);
  }
  // Phase 3: what is left, outermost first.
  for (int64_t d = 0; d < nd; ++d) {
    const auto& a = cur->placement(d);
    const auto& b = dst.placement(d);
    if (a == b && (!a.is_shard() || stable(*cur, dst, d))) continue;
    TORCH_INTERNAL_ASSERT(a.is_replicate(), "planner left ", a.str(), " on mesh dim ", d);
    step(b.is_shard() ? StepKind::LocalSlice : StepKind::ToPartial, d, with(*cur, d, b, dst));
  }
  TORCH_INTERNAL_ASSERT(*cur == dst, "redistribute plan ends at ", cur->str(), " not ", dst.str());
  return plan;
}

// `s` with mesh dim d's placement made head-tail (same table: the natural one of it).
SpecPtr head_tail_on(const SpecPtr& s, int64_t d) {
  Placements p = s->placements();
  p[d] = Placement::head_tail_shard(p[d].dim());
  return make_spec(*s, std::move(p), s->shard_tables());
}

SpecPtr natural_of(const SpecPtr& s) {
  return s->has_head_tail() ? std::make_shared<DTensorSpec>(s->natural_spec()) : s;
}

// Mesh dim d's split is the only one of its tensor dim.
bool only_split(const DTensorSpec& s, int64_t d) {
  const Placement& p = s.placement(d);
  return p.is_shard() && s.mesh_dims_sharding(p.dim()) == std::vector<int64_t>{d};
}

// `s` with the mesh dims nested inside each head-tail split that `other` lacks made Replicate.
SpecPtr without_nested_in_moved_head_tail(const SpecPtr& s, const DTensorSpec& other) {
  Placements p = s->placements();
  auto tables = s->shard_tables();
  bool changed = false;
  for (int64_t d = 0; d < s->mesh().ndim(); ++d) {
    if (!p[d].is_head_tail() || other.placement(d) == p[d]) continue;
    const int64_t t = p[d].dim();
    for (auto m : s->mesh_dims_sharding(t)) {
      if (m == d) continue;
      p[m] = Replicate();
      tables[t].clear();  // the head-tail table, fixed by the length
      changed = true;
    }
  }
  return changed ? make_spec(*s, std::move(p), std::move(tables)) : s;
}

std::shared_ptr<RedistributePlan> build_plan(const SpecPtr& from, const SpecPtr& to);

// from -> via -> to.
std::shared_ptr<RedistributePlan> build_plan_via(const SpecPtr& from, const SpecPtr& via,
                                                 const SpecPtr& to) {
  auto plan = build_plan(from, via);
  const auto rest = build_plan(via, to);  // (held: a range over a temporary's member dangles)
  for (auto& st : rest->steps) plan->steps.push_back(std::move(st));
  return plan;
}

std::shared_ptr<RedistributePlan> build_plan(const SpecPtr& from, const SpecPtr& to) {
  if (!from->has_head_tail() && !to->has_head_tail()) return build_natural_plan(from, to);
  // A head-tail split that goes away or appears moves whole member runs (a relayout, a
  // gather, a cut): splits nested inside it are gathered before and cut after, where the
  // head-tail split stays and the natural planning below handles them.
  if (auto bare = without_nested_in_moved_head_tail(from, *to); bare != from)
    return build_plan_via(from, bare, to);
  if (auto bare = without_nested_in_moved_head_tail(to, *from); bare != to)
    return build_plan_via(from, bare, to);
  const int64_t nd = from->mesh().ndim();
  auto kept = [&](int64_t d) {
    return from->placement(d).is_head_tail() && from->placement(d) == to->placement(d);
  };
  // A head-tail split and a natural one of the same dim on the same mesh dim: one relayout
  // goes straight between them, whatever the natural one's table.
  auto natural_partner = [](const DTensorSpec& s, int64_t d, const Placement& ht) {
    return s.placement(d) == ht.natural() && only_split(s, d);
  };
  auto plan = std::make_shared<RedistributePlan>();
  SpecPtr cur = from;
  bool partial = false;
  for (const auto& p : from->placements()) partial = partial || p.is_partial();
  for (int64_t d = 0; d < nd; ++d) {
    const Placement& ht = from->placement(d);
    if (!ht.is_head_tail() || kept(d)) continue;
    Placements p = cur->placements();
    auto tables = cur->shard_tables();
    StepKind kind = StepKind::Relayout;
    if (to->placement(d).is_replicate() && !partial) {
      // HT(t) -> R: gather the stored shards and put the rows in position order locally
      // (the executor), no relayout first. (With a Partial to reduce, the natural plan
      // reduces before it gathers: left to it.)
      kind = StepKind::AllGather;
      p[d] = Replicate();
      tables[ht.dim()].clear();
    } else {
      p[d] = ht.natural();
      if (natural_partner(*to, d, ht)) tables[ht.dim()] = to->shard_table(ht.dim());
    }
    auto next = make_spec(*cur, std::move(p), std::move(tables));
    plan->steps.push_back({kind, d, cur, next});
    cur = std::move(next);
  }
  // The middle in the natural order; kept head-tail dims are not touched by it.
  SpecPtr mid_to = natural_of(to);
  for (int64_t d = 0; d < nd; ++d) {
    const Placement& ht = to->placement(d);
    if (!ht.is_head_tail() || kept(d) || !natural_partner(*cur, d, ht)) continue;
    auto tables = mid_to->shard_tables();
    tables[ht.dim()] = cur->shard_table(ht.dim());
    mid_to = make_spec(*mid_to, mid_to->placements(), std::move(tables));
  }
  auto middle = build_natural_plan(natural_of(cur), mid_to);
  auto restore = [&](SpecPtr s) {
    for (int64_t d = 0; d < nd; ++d)
      if (kept(d)) s = head_tail_on(s, d);
    return s;
  };
  for (auto& st : middle->steps) {
    st.before = restore(st.before);
    st.after = restore(st.after);
  }
  // A head-tail split that phase 3 cuts out of a replicated tensor: cut it so at once.
  for (int64_t d = 0; d < nd; ++d) {
    if (!to->placement(d).is_head_tail() || kept(d)) continue;
    auto& steps = middle->steps;
    size_t i = 0;
    while (i < steps.size() && !(steps[i].kind == StepKind::LocalSlice && steps[i].mesh_dim == d))
      ++i;
    for (size_t j = i; j < steps.size(); ++j) {
      if (j > i) steps[j].before = head_tail_on(steps[j].before, d);
      steps[j].after = head_tail_on(steps[j].after, d);
    }
  }
  if (!middle->steps.empty()) cur = middle->steps.back().after;
  for (auto& st : middle->steps) plan->steps.push_back(std::move(st));
  for (int64_t d = 0; d < nd; ++d) {
    const Placement& ht = to->placement(d);
    if (!ht.is_head_tail() || cur->placement(d).is_head_tail()) continue;
    Placements p = cur->placements();
    p[d] = ht;
    auto tables = cur->shard_tables();
    tables[ht.dim()].clear();  // the head-tail table, fixed by the length
    auto next = make_spec(*cur, std::move(p), std::move(tables));
    plan->steps.push_back({StepKind::Relayout, d, cur, next});
    cur = std::move(next);
  }
  TORCH_INTERNAL_ASSERT(*cur == *to, "redistribute plan ends at ", cur->str(), " not ", to->str());
  return plan;
}

// Plans live in the mesh's cache slot (they die with the mesh) and refer to it unowned.
// What the mesh's cache slot holds: the plans, and the agreement ledger of redistribute's entry.
struct PlanCache {
  struct Entry {
    SpecPtr from, to;
    std::shared_ptr<const RedistributePlan> plan;
  };
  std::unordered_map<size_t, std::vector<Entry>> map;
  detail::AgreementLedger ledger;
};

PlanCache& cache_of(const DeviceMesh& mesh) {  // the caller holds the mesh's cache mutex
  auto& slot = detail::mesh_cache_slot(mesh);
  if (!slot) slot = std::make_shared<PlanCache>();
  return *static_cast<PlanCache*>(slot.get());
}

SpecPtr unowned_copy(const DTensorSpec& s) {
  return std::make_shared<DTensorSpec>(s.mesh().unowned(), s.placements(), s.sizes(), s.dtype(),
                                       s.shard_tables());
}

}  // namespace

const char* to_string(StepKind k) {
  switch (k) {
    case StepKind::AllGather: return "all_gather";
    case StepKind::LocalSlice: return "local_slice";
    case StepKind::AllReduce: return "all_reduce";
    case StepKind::ReduceScatter: return "reduce_scatter";
    case StepKind::AllToAll: return "all_to_all";
    case StepKind::ToPartial: return "to_partial";
    case StepKind::Relayout: return "relayout";
  }
  return "?";
}

std::string RedistributePlan::str() const {
  if (steps.empty()) return "(no-op)";
  std::string s;
  for (auto& st : steps) {
    s += (s.empty() ? "" : "; ") + std::string("mesh dim ") + std::to_string(st.mesh_dim) + ": " +
         st.before->placement(st.mesh_dim).str() + "->" + st.after->placement(st.mesh_dim).str() +
         " " + to_string(st.kind);
  }
  return s;
}

void set_redistribute_debug(bool on) { g_debug.store(on, std::memory_order_relaxed); }

namespace {
double average_bytes(const DTensorSpec& s) {
  double shards = 1;
  for (int64_t m = 0; m < s.mesh().ndim(); ++m)
    if (s.placement(m).is_shard()) shards *= static_cast<double>(s.mesh().size(m));
  return static_cast<double>(s.numel()) * static_cast<double>(c10::elementSize(s.dtype())) / shards;
}
}  // namespace

double redistribute_cost(const SpecPtr& from, const SpecPtr& to) {
  if (*from == *to) return 0;
  double bytes = 0;
  for (const auto& st : plan_redistribute(from, to)->steps) {
    const double n = static_cast<double>(st.before->mesh().size(st.mesh_dim));
    const double b = average_bytes(*st.before);
    switch (st.kind) {
      case StepKind::AllGather: bytes += (n - 1) * b; break;
      case StepKind::AllReduce: bytes += 2 * (n - 1) / n * b; break;
      case StepKind::ReduceScatter:
      case StepKind::AllToAll:
      case StepKind::Relayout: bytes += (n - 1) / n * b; break;
      case StepKind::LocalSlice:
      case StepKind::ToPartial: bytes += 1e-3; break;  // free, but prefer fewer steps
    }
  }
  return bytes;
}

std::shared_ptr<const RedistributePlan> plan_redistribute(const SpecPtr& from, const SpecPtr& to) {
  TORCH_CHECK(from->mesh() == to->mesh(), "tessera: redistribute from ", from->mesh().str(), " to ",
              to->mesh().str(), ": moving between meshes is not supported yet");
  TORCH_CHECK(from->sizes() == to->sizes(), "tessera: redistribute: global shapes differ (",
              shape_str(from->sizes()), " vs ", shape_str(to->sizes()), ")");
  TORCH_CHECK(from->dtype() == to->dtype(), "tessera: redistribute: the target spec has dtype ",
              to->dtype(), " but the tensor is ", from->dtype(), "; cast with .to() first");
  const DeviceMesh& mesh = from->mesh();
  const size_t key = c10::hash_combine(from->hash(), to->hash());
  std::lock_guard<std::mutex> lock(detail::mesh_cache_mutex(mesh));
  auto& bucket = cache_of(mesh).map[key];
  for (auto& e : bucket)
    if (*e.from == *from && *e.to == *to) return e.plan;
  auto plan = build_plan(unowned_copy(*from), unowned_copy(*to));
  if (g_debug.load(std::memory_order_relaxed)) {
    fprintf(stderr, "tessera: redistribute %s -> %s: %s\n", from->str().c_str(), to->str().c_str(),
            plan->str().c_str());
  }
  bucket.push_back({unowned_copy(*from), unowned_copy(*to), plan});
  return plan;
}

void detail::with_agreement_ledger(const DeviceMesh& mesh,
                                   const std::function<void(AgreementLedger&)>& f) {
  std::lock_guard<std::mutex> lock(detail::mesh_cache_mutex(mesh));
  f(cache_of(mesh).ledger);
}

}  // namespace tessera
