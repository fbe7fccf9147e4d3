// DTensorSpec's view of who holds what (local_sizes / local_offsets / shard_sizes at any
// coordinate, replicate_where) against references written from the nesting rule of
// NOTE: [Shard tables], on detached meshes (no ranks).
#include "helpers.h"

using namespace tessera;
using tessera::test::Rng;

namespace {

struct SpecLayout {
  std::vector<int64_t> mesh_shape, sizes;
  Placements placements;
  std::vector<ShardTable> tables;  // empty: torch.chunk layout
};

SpecLayout random_layout(Rng& rng) {
  SpecLayout l;
  l.mesh_shape.resize(rng.uniform(1, 3));
  for (auto& s : l.mesh_shape) s = rng.uniform(1, 3);
  l.sizes.resize(rng.uniform(1, 3));
  for (auto& s : l.sizes) s = rng.uniform(0, 7);
  const int64_t nd = static_cast<int64_t>(l.sizes.size());
  for (size_t m = 0; m < l.mesh_shape.size(); ++m) {
    const int64_t k = rng.uniform(0, 5);
    l.placements.push_back(k < 3 ? Shard(rng.uniform(0, nd - 1)) : k < 5 ? Replicate() : Partial());
  }
  return l;
}

std::string str(const SpecLayout& l) {
  std::string s = to_string(l.placements) + " on mesh" + shape_str(l.mesh_shape) + " global " +
                  shape_str(l.sizes);
  for (size_t t = 0; t < l.tables.size(); ++t)
    if (!l.tables[t].empty()) s += " t" + std::to_string(t) + "=" + shape_str(l.tables[t]);
  return s;
}

// Every coordinate of a mesh, row-major.
std::vector<std::vector<int64_t>> coordinates(const std::vector<int64_t>& shape) {
  std::vector<std::vector<int64_t>> out = {{}};
  for (auto n : shape) {
    std::vector<std::vector<int64_t>> next;
    for (const auto& c : out)
      for (int64_t i = 0; i < n; ++i) {
        next.push_back(c);
        next.back().push_back(i);
      }
    out = next;
  }
  return out;
}

int64_t sum(const ShardTable& t, size_t from, size_t to) {
  int64_t s = 0;
  for (size_t i = from; i < to; ++i) s += t[i];
  return s;
}

// The extent [offset, offset + size) along tensor dim t at `coord`, walking the sharding mesh
// dims outermost first: each splits the current run of table entries into equal groups and
// keeps the coordinate's group. `stop_after` >= 0 ends the walk after that mesh dim.
std::pair<int64_t, int64_t> extent(const SpecLayout& l, const ShardTable& table, int64_t t,
                                   const std::vector<int64_t>& coord, int64_t stop_after = -1) {
  size_t lo = 0, hi = table.size();
  bool sharded = false;
  for (int64_t m = 0; m < static_cast<int64_t>(l.placements.size()); ++m) {
    if (!l.placements[m].is_shard(t)) continue;
    sharded = true;
    const size_t group = (hi - lo) / static_cast<size_t>(l.mesh_shape[m]);
    lo += group * static_cast<size_t>(coord[m]);
    hi = lo + group;
    if (m == stop_after) break;
  }
  if (!sharded) return {0, l.sizes[t]};
  return {sum(table, 0, lo), sum(table, lo, hi)};
}

// torch.chunk's nested table for tensor dim t (the default layout), by splitting pieces.
ShardTable chunked(const SpecLayout& l, int64_t t) {
  ShardTable pieces;
  for (size_t m = 0; m < l.placements.size(); ++m) {
    if (!l.placements[m].is_shard(t)) continue;
    if (pieces.empty()) pieces = {l.sizes[t]};
    ShardTable next;
    for (auto piece : pieces) {
      std::vector<int64_t> parts;
      for (const auto& c : at::arange(piece).chunk(l.mesh_shape[m])) parts.push_back(c.numel());
      parts.resize(l.mesh_shape[m], 0);
      next.insert(next.end(), parts.begin(), parts.end());
    }
    pieces = next;
  }
  return pieces;
}

ShardTable table_of(const SpecLayout& l, int64_t t) {
  return t < static_cast<int64_t>(l.tables.size()) && !l.tables[t].empty() ? l.tables[t]
                                                                           : chunked(l, t);
}

// Checks `s` against the reference extents of layout `l` at every coordinate.
void expect_extents(const DTensorSpec& s, const SpecLayout& l) {
  for (const auto& c : coordinates(l.mesh_shape)) {
    std::vector<int64_t> off, len;
    for (int64_t t = 0; t < static_cast<int64_t>(l.sizes.size()); ++t) {
      auto [o, n] = extent(l, table_of(l, t), t, c);
      off.push_back(o);
      len.push_back(n);
    }
    EXPECT_EQ(s.local_offsets(c), off) << str(l) << " at " << shape_str(c);
    EXPECT_EQ(s.local_sizes(c), len) << str(l) << " at " << shape_str(c);
  }
}

}  // namespace

TEST(Spec, LocalBlocksFollowTheNesting) {
  tessera::test::Sweep sweep;
  sweep.cases(400).run([](Rng& rng, int64_t) {
    SpecLayout l = random_layout(rng);
    const auto mesh = tessera::test::detached_mesh(l.mesh_shape);
    if (rng.coin(0.7)) l.tables = tessera::test::random_tables(rng, mesh, l.placements, l.sizes);
    const DTensorSpec s(mesh, l.placements, l.sizes, at::kFloat, l.tables);
    expect_extents(s, l);
    // Per mesh dim: the sizes of the group along it (levels nested inside dropped).
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      if (!l.placements[m].is_shard()) continue;
      const int64_t t = l.placements[m].dim();
      for (const auto& c : coordinates(l.mesh_shape)) {
        std::vector<int64_t> expected;
        for (int64_t i = 0; i < l.mesh_shape[m]; ++i) {
          auto ci = c;
          ci[m] = i;
          expected.push_back(extent(l, table_of(l, t), t, ci, m).second);
        }
        EXPECT_EQ(s.shard_sizes(m, c), expected)
            << str(l) << " mesh dim " << m << " at " << shape_str(c);
      }
    }
  });
}

// The blocks of the ranks that differ only along Shard mesh dims tile the tensor: every
// element is held exactly once.
TEST(Spec, ShardsTileTheTensor) {
  tessera::test::Sweep sweep;
  sweep.cases(300).run([](Rng& rng, int64_t) {
    SpecLayout l = random_layout(rng);
    const auto mesh = tessera::test::detached_mesh(l.mesh_shape);
    if (rng.coin(0.7)) l.tables = tessera::test::random_tables(rng, mesh, l.placements, l.sizes);
    const DTensorSpec s(mesh, l.placements, l.sizes, at::kFloat, l.tables);
    at::Tensor count = at::zeros(l.sizes, at::kLong);
    for (const auto& c : coordinates(l.mesh_shape)) {
      bool first_copy = true;  // coordinate 0 on every mesh dim that does not shard
      for (size_t m = 0; m < c.size(); ++m)
        if (!l.placements[m].is_shard() && c[m] != 0) first_copy = false;
      if (!first_copy) continue;
      at::Tensor block = count;
      const auto off = s.local_offsets(c), len = s.local_sizes(c);
      for (size_t t = 0; t < l.sizes.size(); ++t) block = block.narrow(t, off[t], len[t]);
      block.add_(1);
    }
    EXPECT_TRUE(at::equal(count, at::ones_like(count))) << str(l);
  });
}

// replicate_where: a tensor dim that loses its outer levels' shards only keeps those levels'
// sums (each block is the union of the blocks it merges); any other change gives the chunk
// layout; a dim left unsharded is whole.
TEST(Spec, ReplicateWhereMergesBlocks) {
  tessera::test::Sweep sweep;
  sweep.cases(400).run([](Rng& rng, int64_t) {
    SpecLayout l = random_layout(rng);
    const auto mesh = tessera::test::detached_mesh(l.mesh_shape);
    if (rng.coin(0.8)) l.tables = tessera::test::random_tables(rng, mesh, l.placements, l.sizes);
    const DTensorSpec s(mesh, l.placements, l.sizes, at::kFloat, l.tables);
    std::vector<bool> drop(l.mesh_shape.size());
    for (size_t m = 0; m < drop.size(); ++m) drop[m] = rng.coin(0.4);
    const DTensorSpec r =
        s.replicate_where([&](int64_t m, const Placement&) { return drop.at(m); });

    SpecLayout after = l;
    after.tables.clear();
    for (size_t m = 0; m < drop.size(); ++m)
      if (drop[m]) after.placements[m] = Replicate();
    EXPECT_EQ(r.placements(), after.placements) << str(l);
    for (const auto& c : coordinates(l.mesh_shape)) {
      for (int64_t t = 0; t < static_cast<int64_t>(l.sizes.size()); ++t) {
        std::vector<int64_t> before_dims, kept;
        for (int64_t m = 0; m < static_cast<int64_t>(drop.size()); ++m)
          if (l.placements[m].is_shard(t)) {
            before_dims.push_back(m);
            if (!drop[m]) kept.push_back(m);
          }
        const bool prefix = std::equal(kept.begin(), kept.end(), before_dims.begin());
        std::pair<int64_t, int64_t> expected;
        if (kept.empty()) {
          expected = {0, l.sizes[t]};
        } else if (prefix) {
          // The union of the original blocks of all coordinates that agree on the kept dims.
          int64_t lo = l.sizes[t], hi = 0;
          for (const auto& c2 : coordinates(l.mesh_shape)) {
            bool same = true;
            for (auto m : kept) same = same && c2[m] == c[m];
            if (!same) continue;
            auto [o, n] = extent(l, table_of(l, t), t, c2);
            lo = std::min(lo, o), hi = std::max(hi, o + n);
          }
          expected = {lo, hi - lo};
        } else {
          expected = extent(after, chunked(after, t), t, c);
        }
        EXPECT_EQ(r.local_offsets(c)[t], expected.first)
            << str(l) << " dropping mesh dims " << ::testing::PrintToString(drop) << " dim " << t
            << " at " << shape_str(c);
        EXPECT_EQ(r.local_sizes(c)[t], expected.second)
            << str(l) << " dropping mesh dims " << ::testing::PrintToString(drop) << " dim " << t
            << " at " << shape_str(c);
      }
    }
  });
}
