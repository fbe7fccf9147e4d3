// Every redistribute transition, on 1-D and 2-D meshes, even / uneven / zero-size shards,
// float / double / int64, forward and backward, against the full tensor on one device.
// On 1-D meshes the bytes CommDebugMode records must equal the minimum for the transition.
#include "helpers.h"
#include "support/placements.h"

using namespace tessera;
using tessera::test::full_matches;
using tessera::test::local_block;
using tessera::test::make_dtensor_from_full;

namespace {

enum class Layout { Even, Uneven, ZeroSize };

std::vector<Placement> candidates(bool with_partial) {
  std::vector<Placement> out = {Shard(0), Shard(1), Replicate()};
  if (with_partial) {
    for (auto op : {PartialOp::Sum, PartialOp::Avg, PartialOp::Max, PartialOp::Min})
      out.push_back(Partial(op));
  }
  return out;
}

// Every combination of per-mesh-dim placements.
std::vector<Placements> all_placements(int64_t mesh_ndim, bool with_partial) {
  return tessera::test::placement_combinations(mesh_ndim, candidates(with_partial));
}

std::vector<ShardTable> tables_for(Layout layout, const DeviceMesh& mesh, const Placements& p,
                                   const std::vector<int64_t>& sizes, unsigned salt) {
  if (layout == Layout::Even) return {};
  std::vector<ShardTable> tables(sizes.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    int64_t parts = 1;
    bool sharded = false;
    for (size_t m = 0; m < p.size(); ++m)
      if (p[m].is_shard(static_cast<int64_t>(t))) parts *= mesh.size(m), sharded = true;
    if (!sharded) continue;
    ShardTable tab(parts, 0);
    if (layout == Layout::ZeroSize) {
      tab[(salt + t) % parts] = sizes[t];  // everything on one shard, the rest empty
    } else {
      tessera::test::Rng rng(salt * 31 + static_cast<unsigned>(t));
      tab = tessera::test::random_table(rng, sizes[t], parts);
    }
    tables[t] = tab;
  }
  return tables;
}

// Bytes of one slice along the dim `a`'s only mesh dim shards (a 1-D mesh: the other dims whole).
int64_t full_row_bytes(const DTensorSpec& a, int64_t item) {
  int64_t e = item;
  for (int64_t t = 0; t < a.ndim(); ++t)
    if (t != a.placement(0).dim()) e *= a.sizes()[t];
  return e;
}

// Bytes the cheapest schedule must move for a single-mesh-dim transition.
std::pair<int64_t, int64_t> min_bytes_1d(const DTensorSpec& a, const DTensorSpec& b, int64_t item) {
  const auto& mesh = a.mesh();
  const int64_t n = mesh.size(0), me = mesh.coordinate()[0];
  const auto& pa = a.placement(0);
  const auto& pb = b.placement(0);
  auto bytes_at = [&](const DTensorSpec& s, int64_t c) {
    int64_t e = item;
    for (auto x : s.local_sizes({c})) e *= x;
    return e;
  };
  // Element overlap of my shard under a with coordinate c's shard under b (global boxes).
  auto overlap = [&](int64_t ca, int64_t cb) {
    auto oa = a.local_offsets({ca}), la = a.local_sizes({ca});
    auto ob = b.local_offsets({cb}), lb = b.local_sizes({cb});
    int64_t e = item;
    for (int64_t t = 0; t < a.ndim(); ++t)
      e *= std::max<int64_t>(0, std::min(oa[t] + la[t], ob[t] + lb[t]) - std::max(oa[t], ob[t]));
    return e;
  };
  if (pa == pb && a == b) return {0, 0};
  if (pa.is_shard() && pb.is_replicate()) {
    int64_t recv = 0, largest = 0, total = 0;
    const auto& table = a.shard_table(pa.dim());
    for (int64_t c = 0; c < n; ++c) {
      recv += c == me ? 0 : bytes_at(a, c);
      largest = std::max(largest, table[c]);
      total += table[c];
    }
    // Uneven shards within half again of even go padded (comm/collectives.cpp): every member
    // sends and receives the largest shard's bytes.
    const bool even = largest * n == total;
    if (!even && 2 * n * largest <= 3 * total) {
      const int64_t row = total == 0 ? 0 : full_row_bytes(a, item);
      return {(n - 1) * largest * row, (n - 1) * largest * row};
    }
    return {n == 1 ? 0 : (n - 1) * bytes_at(a, me), recv};
  }
  if (pa.is_shard() && pb.is_shard()) {
    int64_t sent = 0, recv = 0;
    for (int64_t c = 0; c < n; ++c) {
      if (c == me) continue;
      sent += overlap(me, c);
      recv += overlap(c, me);
    }
    return {sent, recv};
  }
  if (pa.is_replicate()) return {0, 0};  // R -> S, R -> P: local
  const int64_t full = bytes_at(a, me);
  if (pb.is_replicate() || pb.is_partial()) {
    const int64_t ring = 2 * (n - 1) * full / n;
    return {ring, ring};
  }
  // P -> S: reduce-scatter
  const int64_t own = bytes_at(b, me);
  return {full - own, (n - 1) * own};
}

struct MeshCase {
  std::vector<int64_t> shape;
};

void run_transitions(const std::vector<int64_t>& mesh_shape, at::ScalarType dtype) {
  int world = 1;
  for (auto s : mesh_shape) world *= static_cast<int>(s);
  tessera::testing::run_ranks(world, [&](int rank) {
    auto mesh = init_device_mesh("cpu", mesh_shape);
    const std::vector<int64_t> shape = {7, 5};
    auto full = tessera::test::randn(shape, 1234, dtype);
    auto grad_full = tessera::test::randn(shape, 99, dtype == at::kLong ? at::kFloat : dtype);
    const bool floating = dtype != at::kLong;
    unsigned salt = 0;
    int checked = 0;
    for (auto layout : {Layout::Even, Layout::Uneven, Layout::ZeroSize}) {
      for (const auto& src_p : all_placements(mesh.ndim(), /*with_partial=*/true)) {
        // Max/Min partials of floats are exact; Avg of int64 uses floor division (exact here).
        const auto src_tables = tables_for(layout, mesh, src_p, shape, ++salt);
        for (const auto& dst_p : all_placements(mesh.ndim(), false)) {
          const auto dst_tables = tables_for(layout, mesh, dst_p, shape, ++salt);
          std::string ctx = "mesh " + shape_str(mesh_shape) + " " + to_string(src_p) + " -> " +
                            to_string(dst_p) + " layout " + std::to_string(int(layout)) +
                            " dtype " + c10::toString(dtype);
          auto x = make_dtensor_from_full(full, mesh, src_p, src_tables);
          if (floating) x = x.detach().requires_grad_();
          auto target = std::make_shared<DTensorSpec>(mesh, dst_p, shape, dtype, dst_tables);
          CommDebugMode comm;
          auto y = redistribute(x, target);
          const int64_t sent = comm.total_bytes_sent(), recv = comm.total_bytes_received();
          ASSERT_TRUE(spec(y) == *target) << ctx;
          ASSERT_TRUE(tessera::test::shard_matches(y, full)) << ctx;  // spec(y) == *target
          if (mesh.ndim() == 1) {
            auto expected = min_bytes_1d(spec(x), *target, full.element_size());
            EXPECT_EQ(sent, expected.first) << ctx << " (bytes sent)";
            EXPECT_EQ(recv, expected.second) << ctx << " (bytes received)";
          }
          if (floating) {
            // d(sum(y * g))/dx = g whatever the layouts: the gradient of a layout change.
            to_local(y).backward(local_block(grad_full, *target).to(dtype));
            auto gx = x.grad();
            ASSERT_TRUE(is_dtensor(gx)) << ctx;
            EXPECT_FALSE(spec(gx).has_partial()) << ctx << " gradient must not stay partial";
            ASSERT_TRUE(full_matches(gx, grad_full.to(dtype))) << ctx << " (backward)";
          }
          ++checked;
        }
      }
    }
    if (rank == 0) {
      EXPECT_GT(checked, 0);
    }
  });
}

}  // namespace

class RedistributeMatrix
    : public ::testing::TestWithParam<std::tuple<std::vector<int64_t>, at::ScalarType>> {};

TEST_P(RedistributeMatrix, EveryTransitionMatchesOneDevice) {
  run_transitions(std::get<0>(GetParam()), std::get<1>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, RedistributeMatrix,
    ::testing::Combine(::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                         std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                         std::vector<int64_t>{2, 2}, std::vector<int64_t>{2, 3}),
                       ::testing::Values(at::kFloat, at::kDouble, at::kLong)),
    [](const auto& info) {
      std::string s = "mesh";
      for (auto d : std::get<0>(info.param)) s += std::to_string(d) + "x";
      s.pop_back();
      return s + "_" + c10::toString(std::get<1>(info.param));
    });

// Half-precision sums (Partial(sum / avg / max) to Replicate and to Shard(0)) on 1-3 ranks:
// Gloo has no bfloat16 all_reduce in LibTorch 1.13, so such buffers reduce in float32 and
// round once, as one device sums them; float16 reduces as it is. Pieces stored row-major on
// some ranks and column-major on others. Against the ranks' pieces summed in float32 on one
// device, within one rounding.
TEST(RedistributePlan, HalfPrecisionSumsMatchOneDevice) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (const PartialOp op : {PartialOp::Sum, PartialOp::Avg, PartialOp::Max}) {
      for (const int world : {1, 2, 3}) {
        std::vector<at::Tensor> pieces;
        for (int r = 0; r < world; ++r) pieces.push_back(test::randn({5, 3}, 40 + r).to(dtype));
        at::Tensor expected = pieces[0].to(at::kFloat);
        for (int r = 1; r < world; ++r)
          expected = op == PartialOp::Max ? at::maximum(expected, pieces[r].to(at::kFloat))
                                          : expected + pieces[r].to(at::kFloat);
        if (op == PartialOp::Avg) expected = expected / world;
        expected = expected.to(dtype);
        const std::string what = std::string(c10::toString(dtype)) + ", " + Partial(op).str() +
                                 ", " + std::to_string(world) + " ranks";
        tessera::testing::run_ranks(world, [&](int rank) {
          auto mesh = init_device_mesh("cpu", {world});
          // Odd ranks hold theirs column-major (same values, other strides).
          const at::Tensor& piece = pieces[static_cast<size_t>(rank)];
          const auto x =
              from_local(rank % 2 ? piece.t().contiguous().t() : piece, mesh, {Partial(op)});
          const test::Tolerance tol{1e-2, 1e-2};
          auto whole = redistribute(x, mesh, {Replicate()});
          EXPECT_EQ(whole.scalar_type(), dtype) << what;
          EXPECT_TRUE(test::full_matches(whole, expected, tol)) << what << ": to Replicate";
          EXPECT_TRUE(test::full_matches(redistribute(x, mesh, {Shard(0)}), expected, tol))
              << what << ": to Shard(0)";
        });
      }
    }
  }
}

// comm::all_gather of uneven shards equals their concatenation, on every path it takes
// (comm/collectives.cpp): near-even shards padded and compacted in the gathered buffer (dim
// 0, or a dim after size-1 ones), padded and concatenated (padding over 1/8, or a dim after
// a larger one), and far-apart shards by all-to-all-v; 1- to 8-byte elements, empty shards.
TEST(RedistributePlan, UnevenAllGatherIsTheConcatenation) {
  const std::vector<std::vector<int64_t>> tables = {
      {8, 8, 7}, {5, 4}, {9, 9, 9, 8}, {3, 2, 3}, {4, 1, 4}, {6, 0, 6, 6}, {0, 5}, {1, 0, 0}};
  struct Layout {
    std::vector<int64_t> shape;  // the gathered dim's size is the table's total
    int64_t dim;
  };
  const std::vector<Layout> layouts = {{{0, 3}, 0}, {{1, 0, 2}, 1}, {{2, 0, 3}, 1}};
  for (const auto& sizes : tables) {
    const int n = static_cast<int>(sizes.size());
    int64_t total = 0;
    for (int64_t v : sizes) total += v;
    for (const at::ScalarType dtype : {at::kFloat, at::kLong, at::kByte}) {
      for (const Layout& l : layouts) {
        auto shape = l.shape;
        shape[l.dim] = total;
        // Distinct values everywhere, so a block out of place shows.
        const auto full = at::arange(c10::multiply_integers(shape), at::kLong)
                              .remainder(251)
                              .view(shape)
                              .to(dtype);
        const std::string what = std::to_string(n) + " ranks, table " +
                                 c10::str(at::IntArrayRef(sizes)) + ", dim " +
                                 std::to_string(l.dim) + " of " + c10::str(at::IntArrayRef(shape)) +
                                 ", " + c10::toString(dtype);
        tessera::testing::run_ranks(n, [&](int rank) {
          auto mesh = init_device_mesh("cpu", {n});
          int64_t lo = 0;
          for (int r = 0; r < rank; ++r) lo += sizes[r];
          const auto mine = full.narrow(l.dim, lo, sizes[rank]).contiguous();
          const auto got = comm::all_gather(mesh.group(0), mine, l.dim, sizes);
          EXPECT_TRUE(got.is_contiguous()) << what;
          EXPECT_TRUE(at::equal(got, full)) << what << ", rank " << rank;
          // Compacted in place: the result views the padded buffer, a little larger than it.
          const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
          const bool padded = largest * n != total && 2 * n * largest <= 3 * total;
          const bool compacted =
              padded && l.shape[0] <= 1 && 8 * (n * largest - total) <= total && total > 0;
          EXPECT_EQ(got.storage().nbytes() > got.nbytes(), compacted) << what;
        });
      }
    }
  }
}

// Known plans: the planner must pick the single cheapest primitive.
TEST(RedistributePlan, NamedPrimitives) {
  tessera::testing::run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    auto plan = [&](Placements a, Placements b) {
      auto sa = std::make_shared<DTensorSpec>(mesh, a, std::vector<int64_t>{8, 8}, at::kFloat);
      auto sb = std::make_shared<DTensorSpec>(mesh, b, std::vector<int64_t>{8, 8}, at::kFloat);
      return plan_redistribute(sa, sb)->str();
    };
    EXPECT_EQ(plan({Shard(0), Shard(1)}, {Shard(0), Shard(1)}), "(no-op)");
    EXPECT_EQ(plan({Shard(0), Replicate()}, {Shard(1), Replicate()}),
              "mesh dim 0: S(0)->S(1) all_to_all");
    EXPECT_EQ(plan({Partial(), Replicate()}, {Shard(0), Replicate()}),
              "mesh dim 0: P(sum)->S(0) reduce_scatter");
    EXPECT_EQ(plan({Replicate(), Replicate()}, {Shard(0), Shard(1)}),
              "mesh dim 0: R->S(0) local_slice; mesh dim 1: R->S(1) local_slice");
    // Replicate innermost first, so no rank ever holds more than it must.
    EXPECT_EQ(plan({Shard(0), Shard(0)}, {Replicate(), Replicate()}),
              "mesh dim 1: S(0)->R all_gather; mesh dim 0: S(0)->R all_gather");
    // Partials reduce while the data is still sharded (smallest).
    EXPECT_EQ(plan({Shard(0), Partial()}, {Replicate(), Replicate()}),
              "mesh dim 1: P(sum)->R all_reduce; mesh dim 0: S(0)->R all_gather");
  });
}
