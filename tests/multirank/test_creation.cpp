// Creation and conversion against a one-device oracle: every rank builds the same full tensor
// from a seeded generator, distributes it, and compares shards, full values and gradients
// with what one device computes.

#include <ATen/CPUGeneratorImpl.h>

#include <numeric>
#include <optional>

#include "helpers.h"

using namespace tessera;
using tessera::test::local_block;

namespace {

using Shape = std::vector<int64_t>;

at::Tensor seeded(const Shape& shape, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto opts = at::TensorOptions().dtype(dtype);
  if (at::isIntegralType(dtype, /*includeBool=*/false))
    return at::randint(-100, 100, shape, gen, opts);
  return at::randn(shape, gen, opts);
}

int world_of(const Shape& m) {
  return static_cast<int>(std::accumulate(m.begin(), m.end(), int64_t{1}, std::multiplies<>()));
}

const std::vector<Shape> kMeshes = {{1}, {2}, {3}, {4}, {2, 2}, {2, 3}};

std::vector<Placements> placements_for(size_t mesh_ndim) {
  if (mesh_ndim == 1) return {{Shard(0)}, {Shard(1)}, {Shard(-1)}, {Replicate()}};
  return {{Shard(0), Shard(1)},      {Shard(0), Shard(0)},    {Shard(1), Shard(1)},
          {Shard(1), Shard(0)},      {Replicate(), Shard(0)}, {Shard(1), Replicate()},
          {Replicate(), Replicate()}};
}

// Every dtype for one shape only; the layout logic is dtype-blind.
std::vector<at::ScalarType> dtypes_for(const Shape& shape, std::vector<at::ScalarType> all) {
  return shape == Shape{7, 5} ? all : std::vector<at::ScalarType>{all[0]};
}

std::string ctx(const Placements& p, const Shape& shape, at::ScalarType dt, const char* how) {
  return to_string(p) + " " + shape_str(shape) + " " + c10::toString(dt) + " " + how;
}

// dt holds `full`: global metadata, this rank's block, and the gathered value.
void expect_holds(const at::Tensor& dt, const at::Tensor& full, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_TRUE(is_dtensor(dt));
  EXPECT_EQ(dt.sizes().vec(), full.sizes().vec());
  EXPECT_EQ(dt.scalar_type(), full.scalar_type());
  EXPECT_EQ(dt.numel(), full.numel());
  at::Tensor local = to_local(dt);
  EXPECT_FALSE(is_dtensor(local));
  EXPECT_EQ(local.sizes().vec(), spec(dt).local_sizes());
  EXPECT_TRUE(at::equal(local, local_block(full, spec(dt))));
  at::Tensor gathered = full_tensor(dt);
  EXPECT_FALSE(is_dtensor(gathered));
  EXPECT_TRUE(at::equal(gathered, full)) << tessera::test::describe(dt);
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_TRUE(got.defined());
  EXPECT_FALSE(is_dtensor(got));
  EXPECT_EQ(got.sizes().vec(), want.sizes().vec());
  EXPECT_TRUE(at::allclose(got, want, 1e-10, 1e-12));
}

// Runs fn(rank, mesh) on a world of the mesh's size.
template <typename Fn>
void on_mesh(const Shape& mesh_shape, Fn fn) {
  SCOPED_TRACE("mesh " + shape_str(mesh_shape));
  tessera::testing::run_ranks(world_of(mesh_shape), [&](int rank) {
    auto mesh = init_device_mesh("cpu", mesh_shape);
    fn(rank, mesh);
  });
}

}  // namespace

TEST(CreationDistribute, SweepMeshesShapesDtypesAndSources) {
  const std::vector<Shape> shapes = {{12, 6}, {7, 5}, {2, 3}, {0, 4}, {5, 0}};
  for (const auto& ms : kMeshes) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      const int world = world_of(ms);
      const int src = world - 1;
      uint64_t seed = 100;
      for (const auto& pl : placements_for(ms.size())) {
        for (const auto& shape : shapes) {
          for (auto dtype : dtypes_for(shape, {at::kFloat, at::kDouble, at::kLong})) {
            at::Tensor full = seeded(shape, dtype, ++seed);
            expect_holds(distribute_tensor(full, mesh, pl), full, ctx(pl, shape, dtype, "src 0"));
            // Non-source ranks pass other values of the same shape: they must be ignored.
            at::Tensor mine = rank == src ? full : full + 1000 * (rank + 1);
            expect_holds(distribute_tensor(mine, mesh, pl, src), full,
                         ctx(pl, shape, dtype, "src last"));
            expect_holds(distribute_tensor(full, mesh, pl, std::nullopt), full,
                         ctx(pl, shape, dtype, "local split"));
          }
        }
      }
      // A 0-dim tensor can only be replicated.
      at::Tensor scalar = seeded({}, at::kDouble, 7);
      Placements rep(mesh.ndim(), Replicate());
      expect_holds(distribute_tensor(scalar, mesh, rep), scalar, "0-dim");
      expect_holds(distribute_tensor(scalar, mesh, rep, std::nullopt), scalar, "0-dim nullopt");
    });
  }
}

TEST(CreationDistribute, ShardSizesGivenUnevenAndZero) {
  for (const auto& ms : kMeshes) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      tessera::test::Rng rng(1234);  // same sequence on every rank
      uint64_t seed = 500;
      for (const auto& pl : placements_for(ms.size())) {
        for (const Shape& shape : {Shape{9, 4}, Shape{1, 3}, Shape{0, 2}}) {
          auto tables = tessera::test::random_tables(rng, mesh, pl, shape);
          if (tables[0].empty() && tables[1].empty()) continue;
          for (auto dtype : {at::kDouble, at::kLong}) {
            at::Tensor full = seeded(shape, dtype, ++seed);
            for (std::optional<int> src : {std::optional<int>(0), std::optional<int>()}) {
              auto dt = distribute_tensor(full, mesh, pl, src, ShardSizes::Given(tables));
              for (size_t t = 0; t < shape.size(); ++t)
                if (!tables[t].empty()) {
                  EXPECT_EQ(spec(dt).shard_table(t), tables[t]);
                }
              expect_holds(dt, full, ctx(pl, shape, dtype, src ? "given src 0" : "given local"));
            }
          }
        }
      }
      // Every row on one shard, all others empty.
      const int64_t n = mesh.size(0);
      ShardTable lumped(n, 0);
      lumped[n - 1] = 6;
      at::Tensor full = seeded({6, 2}, at::kFloat, 9);
      Placements pl = {Shard(0), Replicate()};
      pl.resize(mesh.ndim(), Replicate());
      auto dt = distribute_tensor(full, mesh, pl, 0, ShardSizes::Given(0, lumped));
      EXPECT_EQ(to_local(dt).size(0), mesh.coordinate()[0] == n - 1 ? 6 : 0);
      expect_holds(dt, full, "lumped");
    });
  }
}

TEST(CreationDistribute, BackwardGoesToSourceOrEveryRank) {
  for (const auto& ms : kMeshes) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      const int world = world_of(ms);
      for (const auto& pl : placements_for(ms.size())) {
        for (const Shape& shape : {Shape{7, 5}, Shape{2, 3}}) {
          at::Tensor w = seeded(shape, at::kDouble, 42);
          for (std::optional<int> src :
               {std::optional<int>(0), std::optional<int>(world - 1), std::optional<int>()}) {
            at::Tensor x = seeded(shape, at::kDouble, 41).requires_grad_();
            auto dt = distribute_tensor(x, mesh, pl, src);
            ASSERT_TRUE(dt.requires_grad());
            (dt * w).sum().backward();
            const bool gets_grad = !src || *src == rank;
            expect_close(x.grad(), gets_grad ? w : at::zeros_like(w),
                         ctx(pl, shape, at::kDouble, src ? "src" : "local split"));
          }
        }
      }
    });
  }
}

TEST(CreationScatter, OnlySourceHoldsData) {
  for (const Shape& ms : {Shape{2}, Shape{3}, Shape{2, 2}, Shape{2, 3}}) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      const int src = world_of(ms) - 1;
      uint64_t seed = 900;
      for (const auto& pl : placements_for(ms.size())) {
        if (pl[0] == Shard(-1) || pl == Placements{Shard(1), Shard(1)}) continue;  // kept short
        for (const Shape& shape : {Shape{7, 5}, Shape{1, 3}, Shape{0, 3}}) {
          for (auto dtype : dtypes_for(shape, {at::kFloat, at::kLong})) {
            at::Tensor full = seeded(shape, dtype, ++seed);
            auto dt = scatter_tensor(rank == src ? full : at::Tensor(), src, mesh, pl);
            expect_holds(dt, full, ctx(pl, shape, dtype, "scatter"));
          }
        }
      }
      // Uneven sizes along dim 1 of mesh dim 0.
      Placements pl = {Shard(1), Replicate()};
      pl.resize(mesh.ndim(), Replicate());
      ShardTable sizes(mesh.size(0), 0);
      sizes[0] = 5;
      sizes.back() = 2;  // middle shards (if any) are empty
      at::Tensor full = seeded({3, 7}, at::kDouble, 5);
      auto dt = scatter_tensor(rank == src ? full : at::Tensor(), src, mesh, pl,
                               ShardSizes::Given(1, sizes));
      EXPECT_EQ(spec(dt).shard_table(1), sizes);
      expect_holds(dt, full, "scatter given");
    });
  }
}

TEST(CreationScatter, NestedShardTableOn2x2) {
  tessera::testing::run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    at::Tensor full = seeded({8, 3}, at::kDouble, 77);
    const ShardTable table = {3, 0, 1, 4};  // row-major over (dp, tp)
    auto dt = scatter_tensor(rank == 0 ? full : at::Tensor(), 0, mesh, {Shard(0), Shard(0)},
                             ShardSizes::Given(0, table));
    const int64_t offsets[] = {0, 3, 3, 4};
    EXPECT_EQ(spec(dt).local_sizes(), (Shape{table[rank], 3}));
    EXPECT_EQ(spec(dt).local_offsets(), (Shape{offsets[rank], 0}));
    EXPECT_TRUE(at::equal(to_local(dt), full.narrow(0, offsets[rank], table[rank])));
    // The outer (dp) level sums the inner pieces.
    EXPECT_EQ(spec(dt).shard_sizes(0), (Shape{3, 5}));
    expect_holds(dt, full, "nested");
  });
}

TEST(CreationScatter, BackwardToSourceOnly) {
  tessera::testing::run_ranks(3, [](int rank) {
    auto mesh = init_device_mesh("cpu", {3});
    const int src = 1;
    at::Tensor w = seeded({5, 4}, at::kDouble, 3);
    at::Tensor full = seeded({5, 4}, at::kDouble, 4);
    at::Tensor x = (rank == src ? full : at::zeros_like(full)).requires_grad_();
    auto dt = scatter_tensor(x, src, mesh, {Shard(0)}, ShardSizes::Given(0, {0, 4, 1}));
    expect_holds(dt.detach(), full, "scatter forward");
    (dt * w).sum().backward();
    expect_close(x.grad(), rank == src ? w : at::zeros_like(w), "scatter backward");
  });
}

TEST(CreationFromLocal, InferUnevenAndZeroShapes) {
  for (const Shape& ms : {Shape{2}, Shape{3}, Shape{4}, Shape{2, 2}, Shape{2, 3}}) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      tessera::test::Rng rng(77);
      uint64_t seed = 300;
      for (const auto& pl : placements_for(ms.size())) {
        if (pl[0] == Shard(-1)) continue;  // random_tables reads raw dims
        for (const Shape& shape : {Shape{9, 5}, Shape{3, 2}, Shape{4, 0}}) {
          auto tables = tessera::test::random_tables(rng, mesh, pl, shape);
          at::Tensor full = seeded(shape, at::kDouble, ++seed);
          DTensorSpec truth(mesh, pl, shape, at::kDouble, tables);
          at::Tensor local = local_block(full, truth).clone();
          auto dt = from_local(local, mesh, pl, {ShardSizes::Infer()});
          EXPECT_EQ(spec(dt).sizes(), shape) << truth.str();
          EXPECT_EQ(spec(dt).shard_tables(), truth.shard_tables()) << truth.str();
          EXPECT_TRUE(spec(dt) == truth) << truth.str();
          expect_holds(dt, full, ctx(pl, shape, at::kDouble, "infer"));
        }
      }
    });
  }
}

TEST(CreationFromLocal, ChunkAndGivenWithRunCheck) {
  for (const auto& ms : kMeshes) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      tessera::test::Rng rng(5);
      uint64_t seed = 700;
      for (const auto& pl : placements_for(ms.size())) {
        // Even everywhere: 12 splits into 1, 2, 3, 4 and 6 pieces.
        const Shape even = {12, 12};
        at::Tensor full = seeded(even, at::kLong, ++seed);
        DTensorSpec chunk(mesh, pl, even, at::kLong);
        at::Tensor local = local_block(full, chunk).clone();
        expect_holds(from_local(local, mesh, pl), full, ctx(pl, even, at::kLong, "chunk"));
        expect_holds(from_local(local, mesh, pl, {ShardSizes::Chunk(), /*run_check=*/true}), full,
                     ctx(pl, even, at::kLong, "chunk checked"));
        if (pl[0] == Shard(-1)) continue;
        const Shape uneven = {7, 3};
        auto tables = tessera::test::random_tables(rng, mesh, pl, uneven);
        at::Tensor f2 = seeded(uneven, at::kFloat, ++seed);
        DTensorSpec given(mesh, pl, uneven, at::kFloat, tables);
        at::Tensor l2 = local_block(f2, given).clone();
        expect_holds(from_local(l2, mesh, pl, {ShardSizes::Given(tables)}), f2,
                     ctx(pl, uneven, at::kFloat, "given"));
        expect_holds(from_local(l2, mesh, pl, {ShardSizes::Given(tables), true}), f2,
                     ctx(pl, uneven, at::kFloat, "given checked"));
      }
    });
  }
}

TEST(CreationFromLocal, BackwardIsTheLocalBlockOfTheGradient) {
  on_mesh({2, 3}, [](int rank, const DeviceMesh& mesh) {
    const Shape shape = {5, 7};
    at::Tensor full = seeded(shape, at::kDouble, 1);
    at::Tensor w = seeded(shape, at::kDouble, 2);
    const Placements pl = {Shard(1), Shard(0)};
    DTensorSpec truth(mesh, pl, shape, at::kDouble, {{1, 1, 3}, {7, 0}});
    at::Tensor local = local_block(full, truth).clone().requires_grad_();
    auto dt = from_local(local, mesh, pl, {ShardSizes::Infer()});
    (dt * w).sum().backward();
    expect_close(local.grad(), local_block(w, truth), "from_local backward");
  });
}

TEST(CreationToLocal, BackwardWithDefaultGradPlacements) {
  for (const Shape& ms : {Shape{3}, Shape{2, 2}}) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      for (const auto& pl : placements_for(ms.size())) {
        at::Tensor full = seeded({7, 5}, at::kDouble, 10);
        at::Tensor w = seeded({7, 5}, at::kDouble, 11);
        auto dt = distribute_tensor(full, mesh, pl).detach().requires_grad_();
        at::Tensor local = to_local(dt);
        ASSERT_TRUE(local.requires_grad());
        (local * local_block(w, spec(dt))).sum().backward();
        ASSERT_TRUE(is_dtensor(dt.grad()));
        EXPECT_EQ(placements(dt.grad()), placements(dt));
        expect_close(full_tensor(dt.grad()), w, to_string(pl));
      }
    });
  }
}

TEST(CreationToLocal, BackwardWithExplicitPartialGradPlacements) {
  on_mesh({3}, [](int rank, const DeviceMesh& mesh) {
    at::Tensor full = seeded({4, 2}, at::kDouble, 12);
    auto dt = distribute_tensor(full, mesh, {Replicate()}).detach().requires_grad_();
    // Each rank's loss sees its own copy; the declared Partial gradient sums the terms.
    at::Tensor local = to_local(dt, Placements{Partial()});
    (local * double(rank + 1)).sum().backward();
    expect_close(full_tensor(dt.grad()), at::full({4, 2}, 6.0, at::kDouble), "(P) grad");
  });
  on_mesh({2, 2}, [](int rank, const DeviceMesh& mesh) {
    at::Tensor full = seeded({6, 2}, at::kDouble, 13);
    at::Tensor w = seeded({6, 2}, at::kDouble, 14);
    auto dt = distribute_tensor(full, mesh, {Replicate(), Shard(0)}).detach().requires_grad_();
    at::Tensor local = to_local(dt, Placements{Partial(), Shard(0)});
    const double scale = mesh.coordinate()[0] == 0 ? 0.25 : 0.75;  // dp terms add to 1
    (local * local_block(w, spec(dt)) * scale).sum().backward();
    expect_close(full_tensor(dt.grad()), w, "(P, S(0)) grad");
  });
}

TEST(CreationFullTensor, Backward) {
  for (const auto& ms : kMeshes) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      tessera::test::Rng rng(8);
      for (const auto& pl : placements_for(ms.size())) {
        if (pl[0] == Shard(-1)) continue;
        const Shape shape = {6, 5};
        at::Tensor w = seeded(shape, at::kDouble, 21);
        auto tables = tessera::test::random_tables(rng, mesh, pl, shape);
        auto dt = distribute_tensor(seeded(shape, at::kDouble, 20), mesh, pl, 0,
                                    ShardSizes::Given(tables))
                      .detach()
                      .requires_grad_();
        (full_tensor(dt) * w).sum().backward();
        ASSERT_TRUE(dt.grad().defined());
        expect_close(to_local(dt.grad()), local_block(w, spec(dt)), to_string(pl));
        expect_close(full_tensor(dt.grad()), w, to_string(pl));
      }
    });
  }
}

TEST(CreationRedistribute, BackwardThroughPartialIsNeverDivided) {
  for (const auto& ms : kMeshes) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      const Shape shape = {6, 5};
      at::Tensor full = seeded(shape, at::kDouble, 30);
      at::Tensor w = seeded(shape, at::kDouble, 31);
      // Mesh dim 0 holds partial sum terms (rank 0 of the dim holds the value).
      Placements src_pl(mesh.ndim(), Replicate());
      src_pl[0] = Partial();
      if (mesh.ndim() > 1) src_pl[1] = Shard(0);
      DTensorSpec src_spec(mesh, src_pl, shape, at::kDouble);
      const bool holder = mesh.coordinate()[0] == 0;
      std::vector<Placements> targets = {Placements(mesh.ndim(), Replicate()), src_pl, src_pl};
      targets[1][0] = Shard(1);
      targets[2][0] = Shard(0);
      for (const auto& target : targets) {
        at::Tensor block = local_block(full, src_spec);
        at::Tensor term = (holder ? block : at::zeros_like(block)).clone().requires_grad_();
        auto dt = from_local(term, mesh, src_pl);
        auto out = redistribute(dt, target);
        EXPECT_EQ(placements(out), target);
        expect_holds(out.detach(), full, to_string(target));
        (out * w).sum().backward();
        // Every term gets the whole gradient of its block.
        expect_close(term.grad(), local_block(w, src_spec),
                     to_string(src_pl) + "->" + to_string(target));
      }
    });
  }
}

TEST(CreationInspect, ToStringAccessorsAndSizes) {
  on_mesh({2, 2}, [](int rank, const DeviceMesh& mesh) {
    at::Tensor full = seeded({7, 5}, at::kFloat, 50);
    auto dt = distribute_tensor(full, mesh, {Shard(0), Shard(-1)});
    EXPECT_TRUE(is_dtensor(dt));
    EXPECT_FALSE(is_dtensor(full) || is_dtensor(at::Tensor()) || is_dtensor(to_local(dt)));
    EXPECT_EQ(dt.sizes().vec(), (Shape{7, 5}));  // global, not local
    EXPECT_EQ(dt.numel(), 35);
    EXPECT_EQ(placements(dt), (Placements{Shard(0), Shard(1)}));  // Shard(-1) normalized
    EXPECT_TRUE(device_mesh(dt) == mesh && spec(dt).mesh() == mesh);
    EXPECT_EQ(spec(dt).dtype(), at::kFloat);
    EXPECT_EQ(spec(dt).shard_tables(), (std::vector<ShardTable>{{4, 3}, {3, 2}}));
    const Shape local = spec(dt).local_sizes();
    EXPECT_EQ(to_local(dt).sizes().vec(), local);
    const std::string s = to_string(dt);
    EXPECT_NE(s.find("(S(0), S(1))"), std::string::npos) << s;
    EXPECT_NE(s.find("[7, 5]"), std::string::npos) << s;
    EXPECT_NE(s.find(shape_str(local)), std::string::npos) << s;
    // A plain tensor prints as itself.
    EXPECT_FALSE(to_string(full).empty());
  });
}

TEST(CreationCommDebug, ScatterMovesExactlyTheOtherRanksBlocks) {
  tessera::testing::run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    const int src = 1;
    const ShardTable rows = {2, 4, 0, 5};
    const int64_t row_bytes = 3 * static_cast<int64_t>(sizeof(float));
    at::Tensor full = seeded({11, 3}, at::kFloat, 60);
    CommDebugMode comm;
    auto dt = scatter_tensor(rank == src ? full : at::Tensor(), src, mesh, {Shard(0)},
                             ShardSizes::Given(0, rows));
    auto st = comm.stats(comm::CollectiveKind::Scatter);
    EXPECT_EQ(st.calls, 1);
    const int64_t others = (rows[0] + rows[2] + rows[3]) * row_bytes;  // every block but src's
    EXPECT_EQ(st.bytes_sent, rank == src ? others : 0);
    EXPECT_EQ(st.bytes_received, rank == src ? 0 : rows[rank] * row_bytes);
    EXPECT_EQ(comm.get_total_counts(), 1);  // shape metadata is not counted
    auto counts = comm.get_comm_counts();
    EXPECT_EQ(counts["scatter"], 1);
    for (auto& [kind, calls] : counts)
      EXPECT_TRUE(kind == "scatter" || kind == "metadata") << kind << ": " << calls;
    EXPECT_EQ(comm.total_bytes_sent(), st.bytes_sent);
    EXPECT_EQ(comm.total_bytes_received(), st.bytes_received);
    const std::string table = comm.table();
    EXPECT_NE(table.find("scatter"), std::string::npos) << table;
    EXPECT_NE(table.find("total"), std::string::npos) << table;
    const std::string json = comm.to_json();
    ASSERT_FALSE(json.empty());
    EXPECT_TRUE(json.front() == '{' && json.back() == '}') << json;
    for (const std::string& key : {std::string("\"scatter\""), std::string("\"calls\":1"),
                                   "\"bytes_sent\":" + std::to_string(st.bytes_sent)})
      EXPECT_NE(json.find(key), std::string::npos) << json;
    expect_holds(dt, full, "scatter under CommDebugMode");

    // distribute_tensor from a source moves the same bytes; a local split moves none.
    comm.reset();
    distribute_tensor(full, mesh, {Shard(0)}, src, ShardSizes::Given(0, rows));
    EXPECT_EQ(comm.stats(comm::CollectiveKind::Scatter).bytes_sent, st.bytes_sent);
    EXPECT_EQ(comm.stats(comm::CollectiveKind::Scatter).bytes_received, st.bytes_received);
    comm.reset();
    distribute_tensor(full, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
    EXPECT_EQ(comm.get_total_counts(), 0);
    EXPECT_EQ(comm.total_bytes_sent(), 0);
  });
}

TEST(CreationCommDebug, ScatterOn2x3MeshCountsEveryBlock) {
  tessera::testing::run_ranks(6, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 3});
    const int src = 4;
    at::Tensor full = seeded({5, 7}, at::kDouble, 61);
    CommDebugMode comm;
    auto dt = scatter_tensor(rank == src ? full : at::Tensor(), src, mesh, {Shard(0), Shard(1)});
    DTensorSpec s(mesh, {Shard(0), Shard(1)}, {5, 7}, at::kDouble);
    int64_t others = 0;
    for (int r = 0; r < 6; ++r) {
      auto ls = s.local_sizes({r / 3, r % 3});
      if (r != src) others += ls[0] * ls[1] * 8;
    }
    auto st = comm.stats(comm::CollectiveKind::Scatter);
    const int64_t mine = to_local(dt).numel() * 8;  // doubles
    EXPECT_EQ(st.bytes_sent, rank == src ? others : 0);
    EXPECT_EQ(st.bytes_received, rank == src ? 0 : mine);
    EXPECT_EQ(comm.get_total_counts(), 1);
  });
}

// The local tensor meets distributed ones (admitted as replicated): its gradient arrives
// distributed and goes back as the whole value.
TEST(CreationToLocal, BackwardWhenTheLocalMeetsDistributedTensors) {
  for (const Shape& ms : {Shape{3}, Shape{2, 2}}) {
    on_mesh(ms, [&](int rank, const DeviceMesh& mesh) {
      for (const auto& pl : placements_for(ms.size())) {
        at::Tensor full = seeded({7, 5}, at::kDouble, 15);
        at::Tensor w = seeded({7, 5}, at::kDouble, 16);
        auto p = distribute_tensor(full, mesh, Placements(ms.size(), Replicate()))
                     .detach()
                     .requires_grad_();
        auto dw = distribute_tensor(w, mesh, pl);
        (to_local(p) * dw).sum().backward();
        ASSERT_TRUE(is_dtensor(p.grad()));
        expect_close(full_tensor(p.grad()), w, to_string(pl));
      }
    });
  }
}
