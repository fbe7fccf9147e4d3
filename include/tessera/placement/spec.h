#pragma once
// DTensorSpec: everything needed to know where each element of a distributed tensor lives.
//
// NOTE: [Shard tables]
// Shards may have arbitrary sizes (ShardTensor's model), so the spec stores, for every
// sharded tensor dim t, the size of every shard along t. If mesh dims m1 < m2 < ... all
// Shard(t), they nest (m1 splits first, m2 splits each m1 piece, ...), and the table is
// row-major over the coordinates (c[m1], c[m2], ...): entry k is the k-th piece along t.
// A rank's offset along t is the sum of the entries before its own. torch.chunk's layout is
// just the default table. A single mesh dim's "every rank's size" is a contiguous run of
// entries of this table.
//
// NOTE: [Head-tail order]
// HeadTailShard(t) on mesh dim m (the outermost split of t) cuts t into 2n chunks of sizes
// within one of each other (n = the mesh dim's size) and gives member k chunks a_k and
// 2n - 1 - a_k, the low one first in its local shard: under a causal mask every member then
// has the same work. a_k is chosen so that from an even Shard(t) half the rows stay where they
// are (detail::head_tail_windows). The table's outer level is fixed by the length: member k's
// entry is the two chunks' sum. Shard(t) on inner mesh dims cuts a member's stored run (head
// chunk, then tail chunk) as it would cut a natural shard (sequence parallelism inside a
// head-tail context split). Rows are not in position order across members, so local_offsets()
// refuses such a spec; local_ranges() gives a rank's ranges (two, or one where an inner split
// takes part of one chunk only).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "tessera/mesh/device_mesh.h"
#include "tessera/placement/placement.h"

namespace tessera {

using ShardTable = std::vector<int64_t>;

class DTensorSpec {
 public:
  // `tables[t]` is the shard table of tensor dim t (empty when t is not sharded); pass no
  // tables for the torch.chunk layout. Validates everything and throws naming the problem.
  DTensorSpec(DeviceMesh mesh, Placements placements, std::vector<int64_t> global_sizes,
              c10::ScalarType dtype, std::vector<ShardTable> tables = {});

  const DeviceMesh& mesh() const { return mesh_; }
  const Placements& placements() const { return placements_; }
  const Placement& placement(int64_t mesh_dim) const { return placements_.at(mesh_dim); }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  int64_t ndim() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t numel() const;
  c10::ScalarType dtype() const { return dtype_; }

  // Mesh dims that Shard(t), ascending (their nesting order).
  std::vector<int64_t> mesh_dims_sharding(int64_t t) const;
  const ShardTable& shard_table(int64_t t) const { return tables_.at(t); }
  const std::vector<ShardTable>& shard_tables() const { return tables_; }

  // Sizes along the tensor dim that `mesh_dim` shards, for the ranks of the mesh_dim group
  // through `coord` (this rank's coordinate when omitted).
  std::vector<int64_t> shard_sizes(int64_t mesh_dim, const std::vector<int64_t>& coord) const;
  std::vector<int64_t> shard_sizes(int64_t mesh_dim) const;

  // Local shard shape / global offsets at a coordinate (this rank's when omitted).
  std::vector<int64_t> local_sizes(const std::vector<int64_t>& coord) const;
  std::vector<int64_t> local_offsets(const std::vector<int64_t>& coord) const;
  std::vector<int64_t> local_sizes() const { return local_sizes(mesh_.coordinate()); }
  std::vector<int64_t> local_offsets() const { return local_offsets(mesh_.coordinate()); }

  // The global [begin, end) ranges of tensor dim t held at `coord`, in local order: one
  // range, or up to two on a head-tail dim (NOTE: [Head-tail order]).
  std::vector<std::pair<int64_t, int64_t>> local_ranges(int64_t t,
                                                        const std::vector<int64_t>& coord) const;
  bool has_head_tail() const { return head_tail_; }
  // The same layout with every HeadTailShard(t) as Shard(t) with the same table: what rules
  // see of a head-tail tensor once its rows are in position order.
  DTensorSpec natural_spec() const;

  bool has_partial() const;
  bool is_replicated() const;  // every mesh dim Replicate
  bool is_sharded() const;
  size_t hash() const { return hash_; }
  bool operator==(const DTensorSpec& o) const;
  bool operator!=(const DTensorSpec& o) const { return !(*this == o); }

  // Same mesh/shape/dtype, new placements (chunk layout for newly sharded dims unless tables).
  DTensorSpec with_placements(Placements placements, std::vector<ShardTable> tables = {}) const;

  // Same layout with every Partial mesh dim turned into Replicate.
  DTensorSpec partial_as_replicate() const;
  // Same layout with the mesh dims where `pred(mesh_dim, placement)` holds turned into
  // Replicate. Tables follow: a dim left unsharded drops its table; a dim that keeps only its
  // outer nesting levels keeps their sums; any other change falls back to the chunk layout.
  DTensorSpec replicate_where(const std::function<bool(int64_t, const Placement&)>& pred) const;

  std::string str() const;  // "[S(0), R] on mesh(2x2) global [8, 5] tables {0: [3, 5]}"

 private:
  DeviceMesh mesh_;
  Placements placements_;
  std::vector<int64_t> sizes_;
  c10::ScalarType dtype_;
  std::vector<ShardTable> tables_;
  size_t hash_ = 0;
  bool head_tail_ = false;
};

using SpecPtr = std::shared_ptr<const DTensorSpec>;

// torch.chunk's split of n into `parts` (ceil-sized pieces, trailing pieces may be 0).
std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts);
// The nested torch.chunk table of tensor dim t under `placements` (empty if unsharded).
ShardTable chunk_table(const DeviceMesh& mesh, const Placements& placements, int64_t t,
                       int64_t size);
std::string shape_str(const std::vector<int64_t>& v);

namespace detail {

// Shard-table arithmetic and hashing shared by the library's layers (not public API).
// Index of the table entry owned by `coord` and the sum of entries before it.
int64_t table_index(const DeviceMesh& mesh, const std::vector<int64_t>& sharding_dims,
                    const std::vector<int64_t>& coord);
// Sum out trailing nesting levels so `keep_levels` remain (levels have sizes `level_sizes`).
ShardTable marginalize(const ShardTable& table, const std::vector<int64_t>& level_sizes,
                       size_t keep_levels);

// Member k's two chunks, [lo, hi) along the dim, of a length cut head-tail over n members
// (NOTE: [Head-tail order]): low chunks `head`, high chunks `tail`.
struct HeadTailWindows {
  std::vector<int64_t> low;  // member k's low chunk a_k (of 2n)
  std::vector<std::pair<int64_t, int64_t>> head, tail;
  std::vector<int64_t> table() const;  // member k's rows: its two chunks' sizes
};
HeadTailWindows head_tail_windows(int64_t length, int64_t members);

// Order-dependent 64-bit hash step with full avalanche (splitmix64 finaliser), so that
// structured keys (small sizes, similar shapes) do not collide.
inline uint64_t hash_mix(uint64_t h, uint64_t v) {
  uint64_t z = h + 0x9e3779b97f4a7c15ULL + v * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace detail

}  // namespace tessera
