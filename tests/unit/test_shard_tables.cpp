// Shard-table arithmetic (include/tessera/placement/spec.h) against references built from
// ATen: torch.chunk for chunk layouts, reshape + sum for marginals, reshape + index for the
// row-major table index. No ranks: meshes are detached (support/meshes.h).
#include "helpers.h"

using namespace tessera;
using tessera::test::Rng;

namespace {

// Piece sizes of torch.chunk(n, parts), padded with empty pieces to `parts`.
std::vector<int64_t> torch_chunk(int64_t n, int64_t parts) {
  std::vector<int64_t> out;
  for (const auto& piece : at::arange(n).chunk(parts)) out.push_back(piece.numel());
  out.resize(parts, 0);
  return out;
}

std::vector<int64_t> random_mesh_shape(Rng& rng) {
  std::vector<int64_t> shape(rng.uniform(1, 3));
  for (auto& s : shape) s = rng.uniform(1, 3);
  return shape;
}

std::vector<int64_t> to_vec(const at::Tensor& t) {
  auto c = t.contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

}  // namespace

TEST(ShardTables, ChunkSizesAreTorchChunk) {
  tessera::test::Sweep sweep;
  sweep.cases(500).run([](Rng& rng, int64_t) {
    const int64_t n = rng.uniform(0, 40), parts = rng.uniform(1, 9);
    EXPECT_EQ(chunk_sizes(n, parts), torch_chunk(n, parts)) << "n " << n << " parts " << parts;
  });
}

// Nested layouts: the outermost sharding mesh dim chunks the whole dim, each further one
// chunks every piece of the previous level.
TEST(ShardTables, ChunkTableNestsTorchChunk) {
  tessera::test::Sweep sweep;
  sweep.cases(300).run([](Rng& rng, int64_t) {
    const auto mesh_shape = random_mesh_shape(rng);
    const auto mesh = tessera::test::detached_mesh(mesh_shape);
    Placements p;
    for (size_t m = 0; m < mesh_shape.size(); ++m)
      p.push_back(rng.coin(0.7) ? Shard(rng.uniform(0, 1)) : Replicate());
    const int64_t t = rng.uniform(0, 1), size = rng.uniform(0, 20);
    std::vector<int64_t> pieces;
    for (size_t m = 0; m < p.size(); ++m) {
      if (!p[m].is_shard(t)) continue;
      if (pieces.empty()) pieces = {size};
      std::vector<int64_t> next;
      for (auto piece : pieces)
        for (auto s : torch_chunk(piece, mesh_shape[m])) next.push_back(s);
      pieces = next;
    }
    EXPECT_EQ(chunk_table(mesh, p, t, size), pieces)
        << to_string(p) << " on " << shape_str(mesh_shape) << " dim " << t << " size " << size;
  });
}

TEST(ShardTables, TableIndexIsRowMajorOverTheShardingDims) {
  tessera::test::Sweep sweep;
  sweep.cases(300).run([](Rng& rng, int64_t) {
    const auto mesh_shape = random_mesh_shape(rng);
    const auto mesh = tessera::test::detached_mesh(mesh_shape);
    std::vector<int64_t> dims, levels, coord;
    for (int64_t m = 0; m < static_cast<int64_t>(mesh_shape.size()); ++m) {
      coord.push_back(rng.uniform(0, mesh_shape[m] - 1));
      if (rng.coin()) dims.push_back(m), levels.push_back(mesh_shape[m]);
    }
    at::Tensor index = at::arange(c10::multiply_integers(levels)).reshape(levels);
    for (auto m : dims) index = index.select(0, coord[m]);
    EXPECT_EQ(tessera::detail::table_index(mesh, dims, coord), index.item<int64_t>())
        << "mesh " << shape_str(mesh_shape) << " dims " << shape_str(dims) << " coord "
        << shape_str(coord);
  });
}

TEST(ShardTables, MarginalizeSumsTheInnerLevels) {
  tessera::test::Sweep sweep;
  sweep.cases(300).run([](Rng& rng, int64_t) {
    std::vector<int64_t> levels(rng.uniform(1, 3));
    for (auto& l : levels) l = rng.uniform(1, 4);
    const int64_t n = c10::multiply_integers(levels);
    const auto table = tessera::test::random_table(rng, rng.uniform(0, 30), n);
    const size_t keep = static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(levels.size())));
    at::Tensor t = at::tensor(table, at::kLong).reshape(levels);
    std::vector<int64_t> inner;
    for (size_t i = keep; i < levels.size(); ++i) inner.push_back(static_cast<int64_t>(i));
    if (!inner.empty()) t = t.sum(inner);
    EXPECT_EQ(tessera::detail::marginalize(table, levels, keep), to_vec(t.reshape(-1)))
        << "table " << shape_str(table) << " levels " << shape_str(levels) << " keep " << keep;
  });
}
