// Runs a redistribute plan on the local shard: one primitive per step.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/comm/collectives.h"
#include "tessera/redistribute/redistribute.h"

namespace tessera {

namespace {

struct Extent {
  int64_t lo, hi;
  int64_t length() const { return std::max<int64_t>(hi - lo, 0); }
};
Extent intersect(Extent a, Extent b) { return {std::max(a.lo, b.lo), std::min(a.hi, b.hi)}; }

Extent extent(const DTensorSpec& s, const std::vector<int64_t>& coord, int64_t dim) {
  const int64_t off = s.local_offsets(coord)[dim];
  return {off, off + s.local_sizes(coord)[dim]};
}

// Cut this rank's piece out of a replicated (along d) local tensor.
at::Tensor local_slice(const at::Tensor& x, const RedistributeStep& st) {
  const auto& mesh = st.after->mesh();
  const int64_t u = st.after->placement(st.mesh_dim).dim();
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
  const int64_t t = st.before->placement(d).dim();
  const int64_t u = st.after->placement(d).dim();
  const auto me = mesh.coordinate();
  const Extent mine_before_u = extent(*st.before, me, u);
  const int64_t n = mesh.size(d);
  std::vector<comm::Range> send;
  std::vector<std::vector<int64_t>> recv_shapes;
  auto coord = me;
  for (int64_t j = 0; j < n; ++j) {
    coord[d] = j;
    const Extent part = intersect(mine_before_u, extent(*st.after, coord, u));
    send.push_back({part.length() > 0 ? part.lo - mine_before_u.lo : 0, part.length()});
    std::vector<int64_t> shape = x.sizes().vec();
    for (int64_t k : {t, u})
      shape[k] = intersect(extent(*st.before, coord, k), extent(*st.after, me, k)).length();
    recv_shapes.push_back(std::move(shape));
  }
  return comm::all_to_all(mesh.group(d), x, u, send, t, recv_shapes);
}

at::Tensor run_step(const at::Tensor& x, const RedistributeStep& st) {
  const auto& mesh = st.before->mesh();
  const int64_t d = st.mesh_dim;
  switch (st.kind) {
    case StepKind::AllGather: {
      const int64_t t = st.before->placement(d).dim();
      return comm::all_gather(mesh.group(d), x, t, st.before->shard_sizes(d));
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
