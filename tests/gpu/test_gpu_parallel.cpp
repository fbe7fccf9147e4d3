// Data parallelism on the GPU, each trained against the same model trained on one GPU:
// replicate with distributed inputs (uneven and empty batch shards, gradients summed) and
// with plain per-rank batches (torch DDP: gradients averaged; default options and
// local_batches), fully_shard (uneven and empty parameter shards), HSDP on a 2x2 mesh. Every
// parameter and gradient stays on the GPU.
#include "gpu_helpers.h"
#include "multirank/fully_shard_helpers.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using gpu_test::GpuMesh;

namespace {

constexpr int kSteps = 4;

// The batch rows each rank holds (uneven; an empty shard on 3 ranks).
ShardTable batch_rows(int64_t world) {
  switch (world) {
    case 1: return {10};
    case 2: return {7, 3};
    case 3: return {6, 0, 4};
    default: return {4, 3, 0, 3};
  }
}

// The one-GPU reference, and the inputs, on the test thread's device.
struct Reference {
  std::shared_ptr<MlpImpl> proto, trained;
  at::Tensor x, y;
  std::vector<double> losses;
};
Reference reference(Opt o, int64_t rows, uint64_t seed) {
  Reference r;
  r.proto = make_mlp();
  r.x = gpu_test::randn({rows, 15}, seed, gpu_test::cuda());
  r.y = gpu_test::randn({rows, 2}, seed + 1, gpu_test::cuda());
  r.trained = clone_of(r.proto);
  r.trained->to(gpu_test::cuda());
  r.losses = train(*r.trained, o, r.x, r.y, kSteps);
  return r;
}

// The prototype's values on this rank's device.
std::shared_ptr<MlpImpl> model_on(const Reference& r, const DeviceMesh& mesh) {
  auto m = clone_of(r.proto);
  m->to(mesh.device());
  return m;
}

// Every parameter's global value equals the reference's.
void expect_values(MlpImpl& model, MlpImpl& ref, const std::string& ctx) {
  for (const auto& item : ref.named_parameters()) {
    const at::Tensor p = model.named_parameters()[item.key()];
    const at::Tensor expected = item.value().detach();
    if (is_dtensor(p)) {
      ASSERT_TRUE(test::full_matches(p, expected, {1e-9, 1e-10})) << ctx << " " << item.key();
    } else
      ASSERT_TRUE(test::matches(p.detach(), expected, {1e-9, 1e-10})) << ctx << " " << item.key();
  }
}

GpuMesh named(GpuMesh m, std::vector<std::string> names) {
  m.names = std::move(names);
  return m;
}

}  // namespace

class GpuDataParallel : public ::testing::TestWithParam<GpuMesh> {};

// Distributed inputs: the batch is a distributed tensor (uneven rows), the loss the global
// mean, the gradients Partial sums reduced in (tiny, so several) buckets.
TEST_P(GpuDataParallel, ReplicateWithDistributedInputsTrainsLikeOneDevice) {
  const GpuMesh m = named(GetParam(), {"dp"});
  TESSERA_REQUIRE_GPU_MESH(m);
  const auto ref = reference(Opt::AdamW, 10, 301);
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    auto model = model_on(ref, mesh);
    auto ddp = replicate(*model, mesh,
                         ReplicateOptions().first_bucket_cap_mb(0.0005).bucket_cap_mb(0.001));
    ASSERT_GT(ddp->bucket_parameter_names().size(), 1u);
    const auto rows = batch_rows(mesh.size());
    const auto x = local_batch(ref.x.to(mesh.device()), mesh, rows);
    const auto y = local_batch(ref.y.to(mesh.device()), mesh, rows);
    ASSERT_TRUE(gpu_test::on_mesh_device(x, mesh));
    const auto losses = train(*model, Opt::AdamW, x, y, kSteps);
    ASSERT_TRUE(gpu_test::parameters_on_mesh_device(*model, mesh));
    expect_losses(losses, ref.losses, m.name() + " replicate");
    expect_values(*model, *ref.trained, m.name() + " replicate");
  });
}

// Plain per-rank batches of equal size, fed as torch DDP is: with the default options
// (parameters replicated distributed tensors, gradients averaged) and with local_batches
// (parameters stay plain CUDA tensors). Either way the mean of the ranks' losses is one
// device's loss on the whole batch, and the parameters follow one device's.
TEST_P(GpuDataParallel, ReplicateWithPlainPerRankBatchesAveragesLikeTorchDDP) {
  const GpuMesh m = named(GetParam(), {"dp"});
  TESSERA_REQUIRE_GPU_MESH(m);
  const int64_t per_rank = 3;
  const auto ref = reference(Opt::Sgd, per_rank * m.world(), 311);
  for (bool local_batches : {false, true}) {
    const std::string what = m.name() + (local_batches ? " local_batches" : " default options");
    gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
      const int64_t me = mesh.coordinate()[0];
      auto model = model_on(ref, mesh);
      if (me > 0) {  // ranks start apart: replicate() takes the first rank's values
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.add_(1.0);
      }
      auto ddp = replicate(*model, mesh,
                           ReplicateOptions().local_batches(local_batches).bucket_cap_mb(0.001));
      if (local_batches) {
        for (const auto& p : model->parameters()) ASSERT_FALSE(is_dtensor(p)) << what;
      }
      const at::Tensor x = ref.x.to(mesh.device()).narrow(0, me * per_rank, per_rank);
      const at::Tensor y = ref.y.to(mesh.device()).narrow(0, me * per_rank, per_rank);
      auto opt = make_optimizer(Opt::Sgd, model->parameters());
      for (int s = 0; s < kSteps; ++s) {
        opt->zero_grad();
        const at::Tensor loss = at::mse_loss(model->forward(x), y);
        loss.backward();
        opt->step();
        const at::Tensor mine = (is_dtensor(loss) ? to_local(loss) : loss).detach().reshape({1});
        ASSERT_TRUE(gpu_test::on_mesh_device(mine, mesh)) << what;
        const at::Tensor mean = comm::all_reduce(mesh.group(0), mine.clone(), PartialOp::Avg);
        ASSERT_NEAR(mean.item<double>(), ref.losses[s], 1e-9 * (1 + std::abs(ref.losses[s])))
            << what << " step " << s;
      }
      ASSERT_TRUE(gpu_test::parameters_on_mesh_device(*model, mesh)) << what;
      expect_values(*model, *ref.trained, what);
    });
  }
}

// fully_shard on each Linear and the root: the head's 2 rows leave empty shards on 3 ranks.
TEST_P(GpuDataParallel, FullyShardTrainsLikeOneDevice) {
  const GpuMesh m = named(GetParam(), {"dp"});
  TESSERA_REQUIRE_GPU_MESH(m);
  const auto ref = reference(Opt::AdamW, 10, 321);
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    auto model = model_on(ref, mesh);
    fully_shard(model->l0, mesh);
    fully_shard(model->l1, mesh);
    fully_shard(model->l2, mesh);
    fully_shard(*model, mesh);
    const auto rows = batch_rows(mesh.size());
    const auto losses = train(*model, Opt::AdamW, local_batch(ref.x.to(mesh.device()), mesh, rows),
                              local_batch(ref.y.to(mesh.device()), mesh, rows), kSteps);
    ASSERT_TRUE(gpu_test::parameters_on_mesh_device(*model, mesh));
    expect_losses(losses, ref.losses, m.name() + " fully_shard");
    expect_parameters(*model, *ref.trained, mesh.size(), mesh.coordinate()[0],
                      m.name() + " fully_shard");
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuDataParallel,
                         ::testing::Values(GpuMesh{"cuda:gloo", {2}}, GpuMesh{"cuda:gloo", {3}},
                                           GpuMesh{"cuda", {1}}, GpuMesh{"cuda", {2}}),
                         gpu_test::mesh_param_name);

// HSDP: parameters sharded over "shard", replicated over "replicate"; the batch split over
// both dims, unevenly (an empty shard).
class GpuHsdp : public ::testing::TestWithParam<GpuMesh> {};

TEST_P(GpuHsdp, TwoByTwoMeshTrainsLikeOneDevice) {
  const GpuMesh m = named(GetParam(), {"replicate", "shard"});
  TESSERA_REQUIRE_GPU_MESH(m);
  const auto ref = reference(Opt::AdamW, 10, 331);
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    auto model = model_on(ref, mesh);
    fully_shard(model->l0, mesh);
    fully_shard(model->l1, mesh);
    fully_shard(model->l2, mesh);
    fully_shard(*model, mesh);
    const ShardSizes rows = ShardSizes::Given(0, batch_rows(4));
    const Placements batch = {Shard(0), Shard(0)};
    const auto x = distribute_tensor(ref.x, mesh, batch, std::nullopt, rows);
    const auto y = distribute_tensor(ref.y, mesh, batch, std::nullopt, rows);
    ASSERT_TRUE(gpu_test::on_mesh_device(x, mesh));
    const auto losses = train(*model, Opt::AdamW, x, y, kSteps);
    ASSERT_TRUE(gpu_test::parameters_on_mesh_device(*model, mesh));
    expect_losses(losses, ref.losses, m.name() + " hsdp");
    expect_parameters(*model, *ref.trained, 2, mesh.coordinate()[1], m.name() + " hsdp");
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuHsdp,
                         ::testing::Values(GpuMesh{"cuda:gloo", {2, 2}}, GpuMesh{"cuda", {2, 2}}),
                         gpu_test::mesh_param_name);
