// Every redistribute transition (S(i) <-> S(j), S <-> R, R -> S, P -> R, P -> S, for every
// partial op) on CUDA tensors, on 1-D and 2x2 meshes over cuda:gloo and NCCL, with random
// uneven (and empty) shards; forward and backward against the full tensor. Also the entry
// points that must move a tensor to the mesh's device (distribute_tensor, from_local).
#include "gpu_helpers.h"
#include "support/placements.h"

using namespace tessera;
using gpu_test::GpuMesh;

namespace {

using tessera::test::placement_combinations;

const std::vector<Placement> kTargets = {Shard(0), Shard(1), Replicate()};
const std::vector<Placement> kSources = {Shard(0),
                                         Shard(1),
                                         Replicate(),
                                         Partial(PartialOp::Sum),
                                         Partial(PartialOp::Avg),
                                         Partial(PartialOp::Max),
                                         Partial(PartialOp::Min)};

void run_matrix(const DeviceMesh& mesh, at::ScalarType dtype) {
  const std::vector<int64_t> shape = {7, 5};  // uneven over 2, 3 and 4 shards
  const at::Device dev = mesh.device();
  const at::Tensor full = test::randn(shape, 1234, dtype).to(dev);
  const at::Tensor grad = test::randn(shape, 99, dtype).to(dev);
  const bool floating = at::isFloatingType(dtype);
  test::Rng rng(77);  // the same draws on every rank
  int64_t checked = 0;
  for (const auto& src : placement_combinations(mesh.ndim(), kSources)) {
    for (const auto& dst : placement_combinations(mesh.ndim(), kTargets)) {
      const auto src_tables = test::random_tables(rng, mesh, src, shape);
      const auto dst_tables = test::random_tables(rng, mesh, dst, shape);
      const std::string ctx =
          mesh.str() + " " + to_string(src) + " -> " + to_string(dst) + " " + c10::toString(dtype);
      at::Tensor x = test::make_dtensor_from_full(full, mesh, src, src_tables);
      ASSERT_TRUE(gpu_test::on_mesh_device(x, mesh)) << ctx << " (input)";
      if (floating) x = x.detach().requires_grad_();
      // Alternate the two entry points: a complete target spec, and placements plus sizes
      // (which first agrees on the arguments with one exchange over the mesh).
      at::Tensor y;
      if (checked % 2 == 0) {
        auto target = std::make_shared<DTensorSpec>(mesh, dst, shape, dtype, dst_tables);
        y = redistribute(x, target);
        ASSERT_TRUE(spec(y) == *target) << ctx << ": got " << spec(y).str();
      } else {
        y = redistribute(x, dst, ShardSizes::Given(dst_tables));
        ASSERT_EQ(spec(y).placements(), dst) << ctx;
      }
      ASSERT_TRUE(gpu_test::on_mesh_device(y, mesh)) << ctx << " (output)";
      ASSERT_TRUE(test::shard_matches(y, full)) << ctx;
      if (floating) {
        // d(sum(y * g))/dx = g whatever the layouts.
        to_local(y).backward(test::local_block(grad, spec(y)).contiguous());
        const at::Tensor gx = x.grad();
        ASSERT_TRUE(is_dtensor(gx)) << ctx;
        ASSERT_TRUE(gpu_test::on_mesh_device(gx, mesh)) << ctx << " (gradient)";
        EXPECT_FALSE(spec(gx).has_partial()) << ctx << ": the gradient must not stay partial";
        ASSERT_TRUE(test::full_matches(gx, grad)) << ctx << " (backward)";
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

using Param = std::tuple<GpuMesh, at::ScalarType>;

}  // namespace

class GpuRedistribute : public ::testing::TestWithParam<Param> {};

TEST_P(GpuRedistribute, EveryTransitionOnUnevenShardsMatchesOneDevice) {
  const GpuMesh m = std::get<0>(GetParam());
  TESSERA_REQUIRE_GPU_MESH(m);
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    ASSERT_EQ(mesh.backend(), m.backend());
    ASSERT_EQ(mesh.device_type(), m.device_type());
    ASSERT_EQ(mesh.device().type(), gpu_test::cuda().type());
    run_matrix(mesh, std::get<1>(GetParam()));
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuRedistribute,
                         ::testing::Combine(::testing::ValuesIn(gpu_test::standard_gpu_meshes()),
                                            ::testing::Values(at::kFloat, at::kDouble, at::kLong)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return std::get<0>(info.param).name() + "_" +
                                  c10::toString(std::get<1>(info.param));
                         });

// distribute_tensor and from_local take a tensor from anywhere (host or GPU) to the mesh's
// device, as PyTorch does; full_tensor and the gradients come back there too. Each rank's
// mesh picks its GPU by local rank.
class GpuPlacementEntry : public ::testing::TestWithParam<GpuMesh> {};

TEST_P(GpuPlacementEntry, HostTensorsMoveToTheMeshDevice) {
  const GpuMesh m = GetParam();
  TESSERA_REQUIRE_GPU_MESH(m);
  const at::Tensor host = test::randn({9, 4}, 5, at::kDouble);
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    // A CUDA mesh runs on device local rank % device count (ranks as threads: local = global).
    if (!gpu_test::on_cpu_instead()) {
      EXPECT_EQ(mesh.device().index(),
                get_local_rank() % static_cast<int>(torch::cuda::device_count()));
    }
    const int64_t n = mesh.size(0);
    ShardTable rows(n, 0);
    for (int64_t i = 0; i < 9; ++i) rows[(i * i) % n]++;  // uneven, possibly empty
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    const at::Tensor d =
        distribute_tensor(host, mesh, p, std::nullopt, ShardSizes::Given(0, rows)).requires_grad_();
    ASSERT_TRUE(gpu_test::on_mesh_device(d, mesh));
    const at::Tensor full = full_tensor(d);
    ASSERT_EQ(full.device().type(), gpu_test::cuda().type()) << full.device();
    ASSERT_TRUE(test::matches(full, host));
    // from_local of a host shard, inferring uneven sizes.
    const auto block = test::local_block(host, spec(d)).clone();
    const at::Tensor f = from_local(block, mesh, p, {ShardSizes::Infer()});
    ASSERT_TRUE(gpu_test::on_mesh_device(f, mesh));
    ASSERT_EQ(spec(f).shard_tables(), spec(d).shard_tables());
    // Backward reaches the distributed leaf on the GPU.
    (d * d).sum().backward();
    ASSERT_TRUE(gpu_test::on_mesh_device(d.grad(), mesh));
    ASSERT_TRUE(test::full_matches(d.grad(), host * 2));
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuPlacementEntry,
                         ::testing::ValuesIn(gpu_test::standard_gpu_meshes()),
                         gpu_test::mesh_param_name);
