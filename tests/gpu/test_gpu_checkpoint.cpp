// Checkpoints across devices: a fully_shard model and its AdamW state trained on CUDA and
// saved from there, loaded on a CPU mesh of another size and back on CUDA (another mesh, and
// a plain one-GPU model): every tensor comes back bit for bit on the device of the tensor it
// was loaded into, and training resumed from it matches the run that never stopped.
#include <atomic>
#include <filesystem>
#include <map>

#include "gpu_helpers.h"
#include "multirank/fully_shard_helpers.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using gpu_test::GpuMesh;
using tessera::test::fresh_dir;
namespace ckpt = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

// The MLP on `mesh`'s device, fully sharded over it (plain on a default mesh).
std::shared_ptr<MlpImpl> build(const std::shared_ptr<MlpImpl>& proto, const DeviceMesh& mesh,
                               at::Device device) {
  auto model = clone_of(proto);
  model->to(device);
  if (!mesh.defined()) return model;
  fully_shard(model->l0, mesh);
  fully_shard(model->l1, mesh);
  fully_shard(model->l2, mesh);
  fully_shard(*model, mesh);
  return model;
}

ckpt::StateDict state_of(MlpImpl& model, torch::optim::Optimizer& opt, int64_t step) {
  ckpt::StateDict s = ckpt::model_state(model);
  s.merge(ckpt::optimizer_state(opt, model));
  s.insert("step", step);
  return s;
}

at::Tensor full_value(const at::Tensor& t) {
  return is_dtensor(t) ? full_tensor(t.detach()) : t.detach();
}

// The batch of 10 rows, as rank `mesh` holds it (whole without a mesh).
at::Tensor batch(const at::Tensor& global, const DeviceMesh& mesh) {
  if (!mesh.defined()) return global;
  ShardTable rows(mesh.size(), 0);
  for (int64_t i = 0; i < global.size(0); ++i) rows[(3 * i) % mesh.size()]++;  // uneven
  return local_batch(global.to(mesh.device()), mesh, rows);
}

// `n` AdamW steps with `opt` (so a loaded optimizer state is what steps).
std::vector<double> steps(MlpImpl& model, torch::optim::Optimizer& opt, const at::Tensor& x,
                          const at::Tensor& y, int n) {
  std::vector<double> losses;
  for (int s = 0; s < n; ++s) {
    opt.zero_grad();
    const at::Tensor loss = at::mse_loss(model.forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// Loads `dir` into a model built on `mesh` / `device`; checks every tensor against `saved`
// (bit for bit) and its device; then resumes training for 2 steps and returns the losses.
std::vector<double> load_and_resume(const std::shared_ptr<MlpImpl>& proto, const std::string& dir,
                                    const DeviceMesh& mesh, at::Device device,
                                    const std::map<std::string, at::Tensor>& saved,
                                    const at::Tensor& x, const at::Tensor& y,
                                    const std::string& what) {
  auto model = build(proto, mesh, device);
  auto opt = make_optimizer(Opt::AdamW, model->parameters());
  auto state = state_of(*model, *opt, 0);
  ckpt::load(state, dir);
  ckpt::restore_optimizer_scalars(state, *opt, *model);
  EXPECT_EQ(state.integer("step"), 2) << what;
  for (const auto& [name, value] : state.items()) {
    const auto* t = std::get_if<at::Tensor>(&value);
    if (!t) continue;
    const at::Tensor local = is_dtensor(*t) ? to_local(t->detach()) : *t;
    EXPECT_EQ(local.device().type(), device.type()) << what << " " << name;
    const at::Tensor full = full_value(*t);  // collective
    EXPECT_TRUE(test::matches(full, saved.at(name), {0, 0})) << what << " " << name;
  }
  return steps(*model, *opt, batch(x.to(device), mesh), batch(y.to(device), mesh), 2);
}

}  // namespace

class GpuCheckpoint : public ::testing::TestWithParam<GpuMesh> {};

// Saved after 2 steps on the parameter's CUDA mesh; loaded on 3 CPU ranks, on 3 ranks sharing
// the GPU, and into a plain model on one GPU; each resumes 2 steps like the run that never
// stopped.
TEST_P(GpuCheckpoint, SavedFromCudaLoadsOnCpuAndBackOnCuda) {
  const GpuMesh m{GetParam().type, GetParam().shape, {"dp"}};
  TESSERA_REQUIRE_GPU_MESH(m);
  const auto proto = make_mlp();
  const at::Tensor x = gpu_test::randn({10, 15}, 501, gpu_test::cuda());
  const at::Tensor y = gpu_test::randn({10, 2}, 502, gpu_test::cuda());
  std::vector<double> expected;  // steps 3 and 4 of the uninterrupted one-GPU run
  {
    auto ref = clone_of(proto);
    ref->to(gpu_test::cuda());
    const auto all = train(*ref, Opt::AdamW, x, y, 4);
    expected = {all[2], all[3]};
  }
  const std::string dir = fresh_dir(m.name()) + "/step-2";
  std::map<std::string, at::Tensor> saved;  // full values, on the host
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    auto model = build(proto, mesh, mesh.device());
    auto opt = make_optimizer(Opt::AdamW, model->parameters());
    steps(*model, *opt, batch(x, mesh), batch(y, mesh), 2);
    ASSERT_TRUE(gpu_test::parameters_on_mesh_device(*model, mesh));
    auto state = state_of(*model, *opt, 2);
    ckpt::save(state, dir);
    for (const auto& [name, value] : state.items())
      if (const auto* t = std::get_if<at::Tensor>(&value)) {
        const at::Tensor full = full_value(*t).cpu();  // collective
        if (mesh.coordinate()[0] == 0) saved[name] = full.clone();
      }
  });
  ASSERT_FALSE(saved.empty());
  const at::Device cpu(at::kCPU);
  tessera::testing::run_ranks(
      3,
      [&](int) {
        auto mesh = init_device_mesh("cpu", {3}, {"dp"});
        const auto more = load_and_resume(proto, dir, mesh, cpu, saved, x, y, "cpu x3");
        expect_losses(more, expected, "resumed on 3 CPU ranks");
      },
      gpu_test::kRunOptions);
  const GpuMesh back{"cuda:gloo", {3}, {"dp"}};
  gpu_test::on_gpu_mesh(back, [&](const DeviceMesh& mesh) {
    const auto more = load_and_resume(proto, dir, mesh, mesh.device(), saved, x, y, back.name());
    expect_losses(more, expected, "resumed on " + back.name());
  });
  tessera::testing::run_ranks(
      1,
      [&](int) {
        const auto more =
            load_and_resume(proto, dir, DeviceMesh(), gpu_test::cuda(), saved, x, y, "plain");
        expect_losses(more, expected, "resumed in a plain one-GPU model");
      },
      gpu_test::kRunOptions);
  fs::remove_all(fs::path(dir).parent_path());
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuCheckpoint,
                         ::testing::Values(GpuMesh{"cuda:gloo", {2}}, GpuMesh{"cuda", {1}}),
                         gpu_test::mesh_param_name);
