// docs/checkpoint.md: its two halves, one per function. A model fully sharded over 4 ranks
// takes one AdamW step and is saved at step 1000; a fresh model fully sharded over "dp" of a
// 2x2 mesh (another layout) loads it and takes a second step. Parameters and the step count
// against two steps on one device.
#include <filesystem>

#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"

namespace ckpt = tessera::checkpoint;  // for the second half, which does not repeat it

namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(0);  // same initial values on every rank and for the reference
  torch::nn::Sequential m(torch::nn::Linear(6, 10), torch::nn::Tanh(), torch::nn::Linear(10, 4));
  m->to(at::kDouble);
  return m;
}

// The first half: saving, here after the step that made `step` 1000.
void save_checkpoint(torch::nn::Sequential& model, torch::optim::AdamW& optimizer, int64_t step) {
  // doc:begin
namespace ckpt = tessera::checkpoint;

ckpt::StateDict state = ckpt::model_state(*model);         // parameters and buffers
state.merge(ckpt::optimizer_state(optimizer, *model));     // Adam / AdamW / SGD state
state.insert("step", int64_t{step});
ckpt::save(state, "ckpt/step-1000");                       // collective
  // doc:end
}

// The second half: resuming into a fresh model and optimizer; returns the loaded step.
int64_t load_checkpoint(torch::nn::Sequential& model, torch::optim::AdamW& optimizer) {
  // doc:begin

// Later, on any number of ranks, any mesh, any placements:
ckpt::StateDict state = ckpt::model_state(*model);
state.merge(ckpt::optimizer_state(optimizer, *model));     // creates missing state as zeros
state.insert("step", int64_t{0});
ckpt::load(state, "ckpt/step-1000");                       // fills the tensors in place
ckpt::restore_optimizer_scalars(state, optimizer, *model); // steps and learning rates
int64_t step = state.integer("step");
// an LR schedule: state.merge(ckpt::scheduler_state(scheduler)) before both calls, then
// ckpt::restore_scheduler(state, scheduler) after load
  // doc:end
  return step;
}

void train_step(torch::nn::Sequential& model, torch::optim::AdamW& optimizer, const at::Tensor& x,
                const at::Tensor& y) {
  optimizer.zero_grad();
  torch::mse_loss(model->forward(x), y).backward();
  optimizer.step();
}

}  // namespace

int main() {
  tessera::init_process_group();
  auto line = tessera::init_device_mesh("cpu", {4}, {"dp"});
  auto square = tessera::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  // A checkpoint left by an earlier run would make save fail; the all-gather below keeps the
  // other ranks from saving before rank 0 has removed it.
  if (tessera::get_rank() == 0) std::filesystem::remove_all("ckpt");
  tessera::full_tensor(tessera::distribute_tensor(at::zeros({4}), line, {tessera::Shard(0)},
                                                  std::nullopt));
  torch::manual_seed(1);
  const auto x1 = at::randn({10, 6}, at::kDouble), y1 = at::randn({10, 4}, at::kDouble);
  const auto x2 = at::randn({10, 6}, at::kDouble), y2 = at::randn({10, 4}, at::kDouble);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);

  auto reference = make_model();
  torch::optim::AdamW ref_opt(reference->parameters(), options);
  train_step(reference, ref_opt, x1, y1);
  train_step(reference, ref_opt, x2, y2);

  {  // 4 ranks, each parameter sharded over all of them
    auto model = make_model();
    tessera::fully_shard(model, line);
    torch::optim::AdamW optimizer(model->parameters(), options);
    const tessera::Placements rows = {tessera::Shard(0)};
    train_step(model, optimizer, tessera::distribute_tensor(x1, line, rows, std::nullopt),
               tessera::distribute_tensor(y1, line, rows, std::nullopt));
    save_checkpoint(model, optimizer, 1000);
  }
  // 2 x 2, each parameter sharded over "dp" and replicated over "tp"
  auto model = make_model();
  tessera::fully_shard(model, square["dp"]);
  torch::optim::AdamW optimizer(model->parameters(), options);
  const int64_t step = load_checkpoint(model, optimizer);
  if (step != 1000) {
    std::fprintf(stderr, "rank %d: loaded step %lld, saved 1000\n", tessera::get_rank(),
                 static_cast<long long>(step));
    ++doc::failures;
  }
  const tessera::Placements rows = {tessera::Shard(0), tessera::Replicate()};
  train_step(model, optimizer, tessera::distribute_tensor(x2, square, rows, std::nullopt),
             tessera::distribute_tensor(y2, square, rows, std::nullopt));
  doc::expect_same_parameters("resumed", *model, *reference, /*gradients=*/false);
  return doc::finish("docs/checkpoint.md");
}
