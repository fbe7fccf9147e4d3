// docs/data_parallel.md, first snippet: replicate on a 1-D mesh of 4, two AdamW steps on
// uneven per-rank batches (3, 1, 2 and 4 rows), against the same training on one device.
#include <torch/torch.h>
#include <utility>
#include <vector>

#include <tessera/tessera.h>

#include "doc_check.h"

int main() {
  tessera::init_process_group();
  torch::manual_seed(0);  // same values on every rank
  auto model = torch::nn::Sequential(torch::nn::Linear(5, 8), torch::nn::Tanh(),
                                     torch::nn::Linear(8, 3));
  model->to(at::kDouble);
  auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  const std::vector<int64_t> rows = {3, 1, 2, 4}, start = {0, 3, 4, 6};
  const int rank = tessera::get_rank();
  std::vector<std::pair<at::Tensor, at::Tensor>> whole_batches, batches;
  for (int step = 0; step < 2; ++step) {
    auto x = at::randn({10, 5}, at::kDouble), y = at::randn({10, 3}, at::kDouble);
    whole_batches.emplace_back(x, y);
    batches.emplace_back(x.narrow(0, start[rank], rows[rank]), y.narrow(0, start[rank], rows[rank]));
  }

  // doc:begin
#include <tessera/tessera.h>

auto mesh = tessera::init_device_mesh("cpu", {4}, {"dp"});
auto ddp = tessera::replicate(model, mesh);               // keep the handle while training
torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));  // after replicate
for (auto& [x, y] : batches) {
  auto dx = tessera::from_local(x, mesh, {tessera::Shard(0)}, {tessera::ShardSizes::Infer()});
  auto dy = tessera::from_local(y, mesh, {tessera::Shard(0)}, {tessera::ShardSizes::Infer()});
  opt.zero_grad();
  torch::mse_loss(model->forward(dx), dy).backward();  // buckets all-reduce during backward
  opt.step();
}
  // doc:end

  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  for (auto& [x, y] : whole_batches) {
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    ref_opt.step();
  }
  doc::expect_same_parameters("after two steps", *model, *reference, /*gradients=*/false);
  return doc::finish("docs/data_parallel.md");
}
