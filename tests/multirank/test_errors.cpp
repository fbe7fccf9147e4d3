// Errors, not hangs: every bad input raises a c10::Error on every rank, promptly, with a
// message that names the function or op and the placements/shapes involved.
#include "helpers.h"

#include <atomic>
#include <chrono>
#include <mutex>

using namespace tessera;
using tessera::test::expect_error_everywhere;

namespace {

using Shape = std::vector<int64_t>;
using Clock = std::chrono::steady_clock;
using Needles = std::vector<std::string>;

// Same, with a mesh of `mesh_shape` over the whole world made before the body runs.
void on_mesh_fails(const Shape& mesh_shape, const std::function<void(int, const DeviceMesh&)>& body,
                   const Needles& needles) {
  int64_t world = 1;
  for (auto s : mesh_shape) world *= s;
  expect_error_everywhere(
      static_cast<int>(world),
      [&](int rank) {
        auto mesh = init_device_mesh("cpu", mesh_shape);
        body(rank, mesh);
      },
      needles);
}

at::Tensor values(const Shape& shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return at::arange(n, at::kFloat).reshape(shape);
}

const FromLocalOptions kChecked{ShardSizes::Chunk(), /*run_check=*/true};
const FromLocalOptions kInfer{ShardSizes::Infer()};

}  // namespace

TEST(ErrorsFromLocal, RunCheckShapesDisagree) {
  // 3 + 1 rows are not the chunk layout of 4 rows (2 + 2).
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  from_local(at::ones({rank == 0 ? 3 : 1, 4}), m, {Shard(0)}, kChecked);
                },
                {"from_local", "(S(0))", "run_check", "[3, 4]", "[2, 4]"});
  // The replicated dim differs on a 2-D mesh.
  on_mesh_fails(
      {2, 2},
      [](int rank, const DeviceMesh& m) {
        from_local(at::ones({3, rank == 3 ? 5 : 4}), m, {Replicate(), Shard(0)}, kChecked);
      },
      {"from_local", "(R, S(0))", "[3, 5]"});
  // Given tables: rank 2's shard does not match its entry.
  on_mesh_fails({3},
                [](int rank, const DeviceMesh& m) {
                  const Shape rows = {1, 4, 2};
                  from_local(at::ones({rank == 2 ? 3 : rows[rank], 2}), m, {Shard(0)},
                             {ShardSizes::Given(0, {1, 4, 2}), true});
                },
                {"from_local", "rank 2", "[3, 2]", "[2, 2]"});
  // Different numbers of dims.
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  from_local(rank == 0 ? at::ones({2, 2}) : at::ones({2}), m, {Shard(0)}, kChecked);
                },
                {"from_local", "(S(0))", "number of dims"});
}

TEST(ErrorsFromLocal, RunCheckDimsDisagreeOnShardedDim) {
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  from_local(rank == 0 ? at::ones({2, 2}) : at::ones({2}), m, {Shard(1)}, kChecked);
                },
                {"from_local", "S(1)"});
}

TEST(ErrorsFromLocal, InferReplicatedDimDisagrees) {
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  from_local(at::ones({rank + 1, rank == 0 ? 4 : 5}), m, {Shard(0)}, kInfer);
                },
                {"from_local", "(S(0))", "replicated extent of tensor dim 1", "[1, 4]", "[2, 5]"});
  // Two ranks holding the same shard on a 2-D mesh disagree on its size.
  on_mesh_fails({2, 2},
                [](int rank, const DeviceMesh& m) {
                  from_local(at::ones({rank == 2 ? 6 : 3, 2}), m, {Replicate(), Shard(0)}, kInfer);
                },
                {"from_local", "(R, S(0))", "[3, 2]", "[6, 2]"});
  // Number of dims disagrees.
  on_mesh_fails(
      {3},
      [](int rank, const DeviceMesh& m) {
        from_local(rank == 1 ? at::ones({2, 2, 2}) : at::ones({2, 2}), m, {Shard(0)}, kInfer);
      },
      {"from_local", "number of dims", "2-d", "3-d"});
}

TEST(ErrorsPlacement, ShardDimOutOfRange) {
  for (int64_t dim : {2, -3}) {
    const Needles needles = {"Shard(" + std::to_string(dim) + ")", "2 dims"};
    on_mesh_fails(
        {2},
        [&](int, const DeviceMesh& m) {
          distribute_tensor(values({4, 3}), m, {Shard(dim)});
        },
        needles);
    on_mesh_fails(
        {2},
        [&](int, const DeviceMesh& m) {
          from_local(values({2, 3}), m, {Shard(dim)}, kChecked);
        },
        needles);
    on_mesh_fails(
        {2},
        [&](int, const DeviceMesh& m) {
          from_local(values({2, 3}), m, {Shard(dim)}, kInfer);
        },
        needles);
    on_mesh_fails(
        {2},
        [&](int rank, const DeviceMesh& m) {
          scatter_tensor(rank == 0 ? values({4, 3}) : at::Tensor(), 0, m, {Shard(dim)});
        },
        needles);
    on_mesh_fails(
        {2, 2},
        [&](int, const DeviceMesh& m) {
          auto dt = distribute_tensor(values({4, 3}), m, {Shard(0), Replicate()});
          redistribute(dt, {Shard(0), Shard(dim)});
        },
        needles);
  }
}

TEST(ErrorsPlacement, GivenSizesDoNotSum) {
  on_mesh_fails(
      {3},
      [](int, const DeviceMesh& m) {
        distribute_tensor(values({7, 2}), m, {Shard(0)}, 0, ShardSizes::Given(0, {3, 3, 3}));
      },
      {"[3, 3, 3]", "sum to 9", "global size is 7", "[7, 2]", "(S(0))"});
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  scatter_tensor(rank == 1 ? values({2, 5}) : at::Tensor(), 1, m, {Shard(1)},
                                 ShardSizes::Given(1, {4, 4}));
                },
                {"[4, 4]", "sum to 8", "global size is 5", "(S(1))"});
  on_mesh_fails(
      {2, 2},
      [](int, const DeviceMesh& m) {
        // A nested table needs 4 entries.
        distribute_tensor(values({8, 2}), m, {Shard(0), Shard(0)}, 0, ShardSizes::Given(0, {4, 4}));
      },
      {"tensor dim 0", "2 entries", "(S(0), S(0))", "4 shards"});
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({6, 2}), m, {Shard(0)});
                  redistribute(dt, {Shard(1)}, ShardSizes::Given(1, {1, 2}));
                },
                {"[1, 2]", "sum to 3", "global size is 2"});
}

TEST(ErrorsPlacement, WrongNumberOfPlacements) {
  on_mesh_fails({2, 2},
                [](int, const DeviceMesh& m) {
                  distribute_tensor(values({4, 4}), m, {Shard(0)});
                },
                {"(S(0))", "1 entries", "2 dims"});
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  from_local(values({2, 4}), m, {Shard(0), Replicate()}, kChecked);
                },
                {"(S(0), R)", "2 entries", "1 dims"});
  on_mesh_fails({2, 2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({4, 4}), m, {Shard(0), Replicate()});
                  redistribute(dt, {Replicate()});
                },
                {"(R)", "1 entries", "2 dims"});
  on_mesh_fails(
      {2},
      [](int rank, const DeviceMesh& m) {
        scatter_tensor(rank == 0 ? values({4, 4}) : at::Tensor(), 0, m, {Replicate(), Shard(0)});
      },
      {"(R, S(0))", "2 entries", "1 dims"});
}

TEST(ErrorsPlacement, WrongNumberOfPlacementsWithInfer) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  from_local(values({2, 4}), m, {Replicate(), Shard(0)}, kInfer);
                },
                {"from_local", "(R, S(0))", "2 entries", "1 dims"});
}

TEST(ErrorsPlacement, SpecErrorsNameTheFunction) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  distribute_tensor(values({4, 3}), m, {Shard(2)});
                },
                {"distribute_tensor", "Shard(2)", "[4, 3]"});
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  from_local(values({2, 3}), m, {Shard(-3)});
                },
                {"from_local", "Shard(-3)", "[2, 3]"});
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  scatter_tensor(rank == 1 ? values({2, 5}) : at::Tensor(), 1, m, {Shard(1)},
                                 ShardSizes::Given(1, {4, 4}));
                },
                {"scatter_tensor", "[4, 4]"});
  on_mesh_fails({2, 2},
                [](int, const DeviceMesh& m) {
                  distribute_tensor(values({4, 4}), m, {Shard(0)});
                },
                {"distribute_tensor", "(S(0))"});
  on_mesh_fails({2, 2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({4, 4}), m, {Shard(0), Replicate()});
                  redistribute(dt, {Replicate()});
                },
                {"redistribute", "(R)"});
}

TEST(ErrorsMesh, MeshLargerThanWorld) {
  expect_error_everywhere(2, [](int) { init_device_mesh("cpu", {3}); },
                          {"init_device_mesh", "[3]", "needs 3 ranks", "world has 2"});
  expect_error_everywhere(2,
                          [](int) {
                            init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
                          },
                          {"init_device_mesh", "[2, 2]", "needs 4 ranks"});
  expect_error_everywhere(2,
                          [](int) {
                            DeviceMesh("cpu", {2}, {0, 2});
                          },
                          {"DeviceMesh", "world has only 2"});
}

TEST(ErrorsMesh, TensorsOnDifferentMeshes) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& mesh_a) {
                  auto mesh_b = init_device_mesh("cpu", {2});
                  auto a = distribute_tensor(values({4, 2}), mesh_a, {Shard(0)});
                  auto b = distribute_tensor(values({4, 2}), mesh_b, {Shard(0)});
                  auto c = a + b;
                },
                {"aten::add", "different meshes"});
  expect_error_everywhere(
      4,
      [](int) {
        auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
        auto a = distribute_tensor(values({4, 2}), mesh["tp"], {Replicate()}, std::nullopt);
        auto b = distribute_tensor(values({4, 2}), mesh["dp"], {Replicate()}, std::nullopt);
        auto c = a * b;
      },
      {"aten::mul", "different meshes"});
}

TEST(ErrorsOps, NoShardingRuleOnShardedInput) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({6, 3}), m, {Shard(0)});
                  at::histc(dt, 4);
                },
                {"aten::histc", "(S(0))", "[6, 3]", "no sharding rule"});
  on_mesh_fails({2, 2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({6, 4}), m, {Replicate(), Shard(1)});
                  at::histc(dt, 4);
                },
                {"aten::histc", "(R, S(1))", "no sharding rule"});
}

TEST(ErrorsOps, TriangleOfOneDimTensor) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({6}), m, {Shard(0)});
                  at::tril(dt);
                },
                {"aten::tril", "S(0)", "[6]", "needs 2 or more dims"});
}

TEST(ErrorsRedistribute, PartialTargetRefused) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({4, 2}), m, {Shard(0)});
                  redistribute(dt, {Partial()});
                },
                {"redistribute", "(S(0)) -> (P(sum))", "Partial"});
  on_mesh_fails({2, 2},
                [](int, const DeviceMesh& m) {
                  auto dt = distribute_tensor(values({4, 2}), m, {Replicate(), Replicate()});
                  redistribute(dt, {Replicate(), Partial(PartialOp::Max)});
                },
                {"redistribute", "(R, R) -> (R, P(max))"});
}

TEST(ErrorsCreation, PartialPlacementRefused) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) {
                  distribute_tensor(values({4, 2}), m, {Partial()});
                },
                {"distribute_tensor", "(P(sum))", "from_local"});
  on_mesh_fails(
      {2, 2},
      [](int, const DeviceMesh& m) {
        distribute_tensor(values({4, 2}), m, {Shard(0), Partial(PartialOp::Avg)}, std::nullopt);
      },
      {"distribute_tensor", "(S(0), P(avg))"});
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  scatter_tensor(rank == 0 ? values({4, 2}) : at::Tensor(), 0, m, {Partial()});
                },
                {"scatter_tensor", "(P(sum))"});
}

TEST(ErrorsCreation, SourceRankNotInMesh) {
  for (int src : {5, -1}) {
    const std::string who = "source rank " + std::to_string(src);
    on_mesh_fails({2},
                  [&](int rank, const DeviceMesh& m) {
                    scatter_tensor(rank == 0 ? values({4, 2}) : at::Tensor(), src, m, {Shard(0)});
                  },
                  {"scatter_tensor", who, "is not in", "DeviceMesh"});
    on_mesh_fails({2},
                  [&](int, const DeviceMesh& m) {
                    distribute_tensor(values({4, 2}), m, {Shard(0)}, src);
                  },
                  {"distribute_tensor", who});
  }
  // In the world but outside a subset mesh.
  expect_error_everywhere(
      3,
      [](int rank) {
        DeviceMesh mesh("cpu", {2}, {0, 1});
        scatter_tensor(rank == 2 ? values({4, 2}) : at::Tensor(), 2, mesh, {Shard(0)});
      },
      {"scatter_tensor", "source rank 2", "ranks=[0,1]"});
}

TEST(ErrorsCreation, SourceHasNoTensor) {
  on_mesh_fails({2},
                [](int, const DeviceMesh& m) { scatter_tensor(at::Tensor(), 0, m, {Shard(0)}); },
                {"scatter_tensor", "source rank 0", "undefined"});
}

TEST(ErrorsCreation, DistributeShapesDisagreeAcrossRanks) {
  // With a source rank the other ranks' values are ignored, but their shapes must match.
  on_mesh_fails({2},
                [](int rank, const DeviceMesh& m) {
                  distribute_tensor(values({rank == 0 ? 4 : 6, 2}), m, {Shard(0)}, 0);
                },
                {"distribute_tensor", "[4, 2]", "[6, 2]"});
}

TEST(ErrorsInspect, PlainTensorWhereDistributedExpected) {
  on_mesh_fails({2},
                [](int, const DeviceMesh&) {
                  to_local(values({2, 2}));
                },
                {"expected a distributed tensor", "to_local"});
  on_mesh_fails({2},
                [](int, const DeviceMesh&) {
                  redistribute(values({2, 2}), {Replicate()});
                },
                {"expected a distributed tensor"});
}

// An in-place op that must change a view's layout (relu_ on Partial terms reduces them first)
// would leave the base unchanged: an error on every rank rather than a silent miss.
TEST(ErrorsOps, InPlaceOnAViewThatMustChangeLayout) {
  on_mesh_fails(
      {2},
      [](int, const DeviceMesh& m) {
        auto terms = distribute_tensor(values({6, 3}), m, {Shard(0)}).sum(0);  // Partial(sum)
        terms.narrow(0, 0, 2).relu_();
      },
      {"aten::relu_", "P(sum)", "view"});
}
