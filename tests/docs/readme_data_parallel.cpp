// README, "Data parallelism": replicate over the "dp" dim of a 2-D mesh, one AdamW step on
// uneven per-rank batches, against the same step on one device with the whole batch.
#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"

int main() {
  tessera::init_process_group();
  auto mesh = tessera::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});

  // Same seed on every rank: same initial values and the same whole batch everywhere.
  torch::manual_seed(0);
  auto make_model = [] {
    torch::nn::Sequential m(torch::nn::Linear(5, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
    m->to(at::kDouble);
    return m;
  };
  torch::nn::Sequential model = make_model();
  torch::nn::Sequential reference = make_model();
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    torch::NoGradGuard no_grad;
    reference->parameters()[i].copy_(model->parameters()[i]);
  }
  const auto batch = at::randn({10, 5}, at::kDouble);
  const auto target = at::randn({10, 3}, at::kDouble);
  // Each "dp" coordinate holds its own rows, unevenly: 7 and 3 (the "tp" ranks repeat them).
  const int64_t dp = mesh.local_rank(0);
  const int64_t start = dp == 0 ? 0 : 7, rows = dp == 0 ? 7 : 3;
  const auto local_batch = batch.narrow(0, start, rows);
  const auto y = tessera::from_local(target.narrow(0, start, rows), mesh,
                                     {tessera::Shard(0), tessera::Replicate()},
                                     {tessera::ShardSizes::Infer()});

  // doc:begin
auto ddp = tessera::replicate(model, mesh["dp"]);  // parameters replicated, first rank's values
torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
auto x = tessera::from_local(local_batch, mesh, {tessera::Shard(0), tessera::Replicate()},
                             {tessera::ShardSizes::Infer()});
at::mse_loss(model->forward(x), y).backward();  // gradients summed in buckets during backward
opt.step();
  // doc:end

  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  at::mse_loss(reference->forward(batch), target).backward();
  doc::expect_same_parameters("gradient", *model, *reference, /*gradients=*/true);
  ref_opt.step();
  doc::expect_same_parameters("after one step", *model, *reference, /*gradients=*/false);
  return doc::finish("README data parallelism");
}
