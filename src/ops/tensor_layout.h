#pragma once
// Layout helpers shared by the slicing/joining and the gather/scatter rule files
// (tensor.cpp, index.cpp).
#include <numeric>

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops::layout {

// The op's `dim` argument wrapped as ATen does, against `ndim` dims (a 0-dim tensor has none
// to name).
inline int64_t dim_arg(const OpCall& call, int64_t ndim) {
  return c10::maybe_wrap_dim(call.arg<int64_t>("dim"), ndim, /*wrap_scalar=*/false);
}

// The mesh dims that shard tensor dim t under placements p, ascending.
inline std::vector<int64_t> shard_mesh_dims(const Placements& p, int64_t t) {
  std::vector<int64_t> out;
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_shard(t)) out.push_back(static_cast<int64_t>(m));
  return out;
}

// The table of tensor dim t under placements p: `want` where it has the right number of
// pieces and total, else the chunk layout (empty where p does not shard t).
inline ShardTable fit_table(const DeviceMesh& mesh, const Placements& p, int64_t t, int64_t size,
                            const ShardTable& want) {
  auto dims = shard_mesh_dims(p, t);
  if (dims.empty()) return {};
  int64_t parts = 1;
  for (auto m : dims) parts *= mesh.size(m);
  if (static_cast<int64_t>(want.size()) == parts &&
      std::accumulate(want.begin(), want.end(), int64_t{0}) == size)
    return want;
  return chunk_table(mesh, p, t, size);
}

// The table of a tensor dim shared by several operands (self, index, source): the first
// candidate sharding it over exactly the target's mesh dims, else the chunk layout.
inline ShardTable shared_table(const DeviceMesh& mesh, const Placements& p, int64_t t, int64_t size,
                               std::initializer_list<const DTensorSpec*> candidates) {
  auto dims = shard_mesh_dims(p, t);
  if (dims.empty()) return {};
  for (const auto* c : candidates)
    if (c && t < c->ndim() && c->sizes()[t] == size && c->mesh_dims_sharding(t) == dims)
      return c->shard_table(t);
  return chunk_table(mesh, p, t, size);
}

// A spec under placements p whose tables are `tables` where they fit (see fit_table).
inline SpecPtr fitted_spec(const DeviceMesh& mesh, const Placements& p,
                           const std::vector<int64_t>& sizes, c10::ScalarType dtype,
                           std::vector<ShardTable> tables) {
  tables.resize(sizes.size());
  for (int64_t t = 0; t < static_cast<int64_t>(sizes.size()); ++t)
    tables[t] = fit_table(mesh, p, t, sizes[t], tables[t]);
  return std::make_shared<DTensorSpec>(mesh, p, sizes, dtype, std::move(tables));
}

inline bool only_sum_partials(const DTensorSpec& s) {
  for (const auto& p : s.placements())
    if (p.is_partial() && p.reduce_op() != PartialOp::Sum) return false;
  return true;
}

// Tensor dim d removed: S(d) becomes `replacement`, S(t > d) shifts down.
inline void drop_dim(Placements& p, std::vector<ShardTable>& tables, int64_t d,
                     Placement replacement) {
  for (auto& x : p) {
    if (x.is_shard(d))
      x = replacement;
    else if (x.is_shard() && x.dim() > d)
      x = Shard(x.dim() - 1);
  }
  tables.erase(tables.begin() + d);
}

// A new tensor dim at d (unsharded): S(t >= d) shifts up.
inline void insert_dim(Placements& p, std::vector<ShardTable>& tables, int64_t d) {
  for (auto& x : p)
    if (x.is_shard() && x.dim() >= d) x = Shard(x.dim() + 1);
  tables.insert(tables.begin() + d, ShardTable{});
}

}  // namespace tessera::ops::layout
