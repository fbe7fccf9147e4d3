// Runs a redistribute plan on the local shard: one primitive per step.
#include <algorithm>
#include <optional>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/comm/collectives.h"
#include "tessera/comm/halo.h"
#include "tessera/redistribute/redistribute.h"

namespace tessera {

namespace {

struct Extent {
  int64_t lo, hi;
  int64_t length() const { return std::max<int64_t>(hi - lo, 0); }
};
Extent intersect(Extent a, Extent b) { return {std::max(a.lo, b.lo), std::min(a.hi, b.hi)}; }

// (Natural specs only: a head-tail dim's ranges are two.)
Extent extent(const DTensorSpec& s, const std::vector<int64_t>& coord, int64_t dim) {
  const auto ranges = s.local_ranges(dim, coord);
  TORCH_INTERNAL_ASSERT(ranges.size() == 1, "a head-tail dim in an all-to-all step");
  return {ranges[0].first, ranges[0].second};
}

// Cut this rank's piece out of a replicated (along d) local tensor.
at::Tensor local_slice(const at::Tensor& x, const RedistributeStep& st) {
  const auto& mesh = st.after->mesh();
  const int64_t u = st.after->placement(st.mesh_dim).dim();
  if (st.after->placement(st.mesh_dim).is_head_tail()) {
    std::vector<at::Tensor> parts;
    for (auto [lo, hi] : st.after->local_ranges(u, mesh.coordinate()))
      parts.push_back(x.narrow(u, lo, hi - lo));
    return at::cat(parts, u);
  }
  const auto sizes = st.after->shard_sizes(st.mesh_dim);
  const int64_t me = mesh.coordinate()[st.mesh_dim];
  int64_t off = 0;
  for (int64_t i = 0; i < me; ++i) off += sizes[i];
  // A copy, so the replicated buffer can be freed: no rank keeps more than its shard.
  return x.narrow(u, off, sizes[me]).clone();
}

// S(t) -> S(u) on one mesh dim: each member sends every other member the part of its shard
// that the other owns afterwards. u == t re-cuts the boundaries of the same dim.
at::Tensor all_to_all_step(const at::Tensor& x, const RedistributeStep& st) {
  const auto& mesh = st.before->mesh();
  const int64_t d = st.mesh_dim;
  // A head-tail split kept on an outer mesh dim is the same for the whole group: extents in
  // its members' stored order (the natural spec's) are the ones to intersect.
  // (Copied only then: this step is every S(t) -> S(u) call's.)
  std::optional<DTensorSpec> natural_before, natural_after;
  const DTensorSpec& before =
      st.before->has_head_tail() ? natural_before.emplace(st.before->natural_spec()) : *st.before;
  const DTensorSpec& after =
      st.after->has_head_tail() ? natural_after.emplace(st.after->natural_spec()) : *st.after;
  const int64_t t = before.placement(d).dim();
  const int64_t u = after.placement(d).dim();
  const auto me = mesh.coordinate();
  const Extent mine_before_u = extent(before, me, u);
  const int64_t n = mesh.size(d);
  std::vector<comm::Range> send;
  std::vector<std::vector<int64_t>> recv_shapes;
  auto coord = me;
  for (int64_t j = 0; j < n; ++j) {
    coord[d] = j;
    const Extent part = intersect(mine_before_u, extent(after, coord, u));
    send.push_back({part.length() > 0 ? part.lo - mine_before_u.lo : 0, part.length()});
    std::vector<int64_t> shape = x.sizes().vec();
    for (int64_t k : {t, u})
      shape[k] = intersect(extent(before, coord, k), extent(after, me, k)).length();
    recv_shapes.push_back(std::move(shape));
  }
  return comm::all_to_all(mesh.group(d), x, u, send, t, recv_shapes);
}

// Tags of the relayout's windows in flight together (one per piece of a member's rows).
constexpr int kTagRelayout = 0x1200;

// S(t) <-> HT(t) on mesh dim d: every member fetches its new rows from their owners, one
// halo window per piece. Its new rows are ranges of positions; each maps to windows of the
// old layout's stored order (the members' shards one after another), split where the old
// layout's ranges end, in position order. Every row moves once, to the one member that
// needs it; rows a member keeps are copied locally.
at::Tensor relayout(const at::Tensor& x, const RedistributeStep& st) {
  const auto& mesh = st.before->mesh();
  const int64_t d = st.mesh_dim;
  const int64_t t = st.before->placement(d).dim();
  const int64_t n = mesh.size(d);
  const std::vector<int64_t> sizes = st.before->shard_sizes(d);
  auto coord = mesh.coordinate();
  // Old layout: member j's ranges and where each starts in the stored order.
  std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> stored;  // (range, start)
  int64_t at = 0;
  for (int64_t j = 0; j < n; ++j) {
    coord[d] = j;
    for (auto r : st.before->local_ranges(t, coord)) {
      stored.push_back({r, at});
      at += r.second - r.first;
    }
  }
  std::vector<std::vector<comm::Window>> pieces(n);  // member j's windows, in its new order
  size_t most = 0;
  for (int64_t j = 0; j < n; ++j) {
    coord[d] = j;
    for (auto [lo, hi] : st.after->local_ranges(t, coord)) {
      std::vector<std::pair<int64_t, comm::Window>> found;  // (position, stored window)
      for (const auto& [r, start] : stored) {
        const int64_t a = std::max(lo, r.first), b = std::min(hi, r.second);
        if (a < b) found.push_back({a, {start + a - r.first, start + b - r.first}});
      }
      std::sort(found.begin(), found.end(),
                [](const auto& p, const auto& q) { return p.first < q.first; });
      for (const auto& f : found) pieces[j].push_back(f.second);
    }
    most = std::max(most, pieces[j].size());
  }
  const int64_t me = mesh.coordinate()[d];
  std::vector<comm::PendingWindow> pending;
  for (size_t p = 0; p < most; ++p) {
    std::vector<comm::Window> windows(n);
    for (int64_t j = 0; j < n; ++j)
      if (p < pieces[j].size()) windows[j] = pieces[j][p];
    pending.push_back(comm::fetch_window_async(mesh.group(d), x, t, sizes, windows,
                                               comm::HaloBoundary::Zeros, 0.0,
                                               kTagRelayout + static_cast<int>(p)));
  }
  std::vector<at::Tensor> parts;
  for (size_t p = 0; p < pending.size(); ++p) {
    at::Tensor part = pending[p].wait();
    if (p < pieces[me].size()) parts.push_back(std::move(part));
  }
  if (parts.empty()) {
    auto shape = x.sizes().vec();
    shape[t] = 0;
    return at::empty(shape, x.options());
  }
  if (parts.size() > 1) return at::cat(parts, t);
  // (a window that is the whole shard comes back as the input itself: never alias it on
  // some ranks only)
  return parts[0].is_same(x) ? parts[0].clone() : parts[0];
}

// Rows gathered from head-tail shards along t (member after member, each its two ranges in
// stored order) put back in position order: a local reorder, no communication.
at::Tensor in_position_order(const at::Tensor& gathered, const RedistributeStep& st) {
  const auto& mesh = st.before->mesh();
  const int64_t d = st.mesh_dim;
  const int64_t t = st.before->placement(d).dim();
  std::vector<std::pair<int64_t, at::Tensor>> pieces;  // (position, rows)
  auto coord = mesh.coordinate();
  int64_t at = 0;
  for (int64_t j = 0; j < mesh.size(d); ++j) {
    coord[d] = j;
    for (auto [lo, hi] : st.before->local_ranges(t, coord)) {
      pieces.push_back({lo, gathered.narrow(t, at, hi - lo)});
      at += hi - lo;
    }
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<at::Tensor> rows;
  for (auto& p : pieces) rows.push_back(std::move(p.second));
  return at::cat(rows, t);
}

at::Tensor run_step(const at::Tensor& x, const RedistributeStep& st) {
  const auto& mesh = st.before->mesh();
  const int64_t d = st.mesh_dim;
  switch (st.kind) {
    case StepKind::AllGather: {
      const int64_t t = st.before->placement(d).dim();
      at::Tensor gathered = comm::all_gather(mesh.group(d), x, t, st.before->shard_sizes(d));
      return st.before->placement(d).is_head_tail() ? in_position_order(gathered, st) : gathered;
    }
    case StepKind::LocalSlice: return local_slice(x, st);
    case StepKind::AllReduce:
      return comm::all_reduce(mesh.group(d), x, st.before->placement(d).reduce_op());
    case StepKind::ReduceScatter: {
      const int64_t u = st.after->placement(d).dim();
      return comm::reduce_scatter(mesh.group(d), x, u, st.after->shard_sizes(d),
                                  st.before->placement(d).reduce_op());
    }
    case StepKind::AllToAll: return all_to_all_step(x, st);
    case StepKind::Relayout: return relayout(x, st);
    case StepKind::ToPartial: {
      // Sum: the value lives on coordinate 0, zeros elsewhere (exact for every dtype).
      // Avg/Max/Min: every rank keeps the value.
      const bool zero =
          st.after->placement(d).reduce_op() == PartialOp::Sum && mesh.coordinate()[d] != 0;
      return zero ? at::zeros_like(x) : x;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown redistribute step");
}

}  // namespace

at::Tensor redistribute_local(const at::Tensor& local, const SpecPtr& from, const SpecPtr& to) {
  if (*from == *to) return local;
  if (!from->mesh().contains_this_rank()) return local;
  auto plan = plan_redistribute(from, to);
  at::Tensor x = local;
  for (const auto& st : plan->steps) x = run_step(x, st);
  return x;
}

}  // namespace tessera
