#pragma once
// Layout helpers shared by the indexing and joining rule files (tensor.cpp, index.cpp).
#include <algorithm>
#include <limits>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops::layout {

using torch::jit::Stack;

using torch::jit::Stack;

inline int64_t wrap_dim(int64_t d, int64_t ndim) {
  TORCH_CHECK(d >= -ndim && d < ndim, "tessera: dim ", d, " out of range for a tensor with ",
              ndim, " dims");
  return d < 0 ? d + ndim : d;
}

inline std::vector<int64_t> sharding(const Placements& p, int64_t t) {
  std::vector<int64_t> out;
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_shard(t)) out.push_back(static_cast<int64_t>(m));
  return out;
}

inline int64_t sum(const ShardTable& t) {
  int64_t s = 0;
  for (auto x : t) s += x;
  return s;
}

// The table of tensor dim t under placements p: `want` where it has the right number of
// pieces and total, else the chunk layout (empty where p does not shard t).
inline ShardTable fit(const DeviceMesh& mesh, const Placements& p, int64_t t, int64_t size,
               const ShardTable& want) {
  auto dims = sharding(p, t);
  if (dims.empty()) return {};
  int64_t parts = 1;
  for (auto m : dims) parts *= mesh.size(m);
  if (static_cast<int64_t>(want.size()) == parts && sum(want) == size) return want;
  return chunk_table(mesh, p, t, size);
}

// The table of a tensor dim shared by several operands (self, index, source): the first
// candidate sharding it over exactly the target's mesh dims, else the chunk layout.
inline ShardTable shared_table(const DeviceMesh& mesh, const Placements& p, int64_t t, int64_t size,
                        std::initializer_list<const DTensorSpec*> candidates) {
  auto dims = sharding(p, t);
  if (dims.empty()) return {};
  for (const auto* c : candidates)
    if (c && t < c->ndim() && c->sizes()[t] == size && c->mesh_dims_sharding(t) == dims)
      return c->shard_table(t);
  return chunk_table(mesh, p, t, size);
}

inline SpecPtr make(const DeviceMesh& mesh, const Placements& p, const std::vector<int64_t>& sizes,
             c10::ScalarType dtype, std::vector<ShardTable> tables) {
  tables.resize(sizes.size());
  for (int64_t t = 0; t < static_cast<int64_t>(sizes.size()); ++t)
    tables[t] = fit(mesh, p, t, sizes[t], tables[t]);
  return std::make_shared<DTensorSpec>(mesh, p, sizes, dtype, std::move(tables));
}

// The same spec with every mesh dim in `dims` turned into Replicate.
inline SpecPtr replicate_on(const DTensorSpec& s, const std::vector<int64_t>& dims) {
  Placements p = s.placements();
  for (auto m : dims) p[m] = Replicate();
  return make(s.mesh(), p, s.sizes(), s.dtype(), s.shard_tables());
}

inline bool only_sum_partials(const DTensorSpec& s) {
  for (const auto& p : s.placements())
    if (p.is_partial() && p.reduce_op() != PartialOp::Sum) return false;
  return true;
}

// Tensor dim d removed: S(d) becomes `replacement`, S(t > d) shifts down.
inline void drop_dim(Placements& p, std::vector<ShardTable>& tables, int64_t d, Placement replacement) {
  for (auto& x : p) {
    if (x.is_shard(d)) x = replacement;
    else if (x.is_shard() && x.dim() > d) x = Shard(x.dim() - 1);
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
