// docs/data_parallel.md, "Gradient accumulation: no_sync": two backward passes, the first
// without communication; the accumulated gradients against one device's.
#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"

int main() {
  tessera::init_process_group();
  auto mesh = tessera::init_device_mesh("cpu", {4}, {"dp"});
  torch::manual_seed(0);  // same values on every rank
  auto model = torch::nn::Sequential(torch::nn::Linear(5, 8), torch::nn::Tanh(),
                                     torch::nn::Linear(8, 3));
  model->to(at::kDouble);
  auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  auto ddp = tessera::replicate(model, mesh);
  // Two micro-batches of 8 rows, 2 per rank; the one-device losses read them whole.
  const auto xa = at::randn({8, 5}, at::kDouble), ya = at::randn({8, 3}, at::kDouble);
  const auto xb = at::randn({8, 5}, at::kDouble), yb = at::randn({8, 3}, at::kDouble);
  auto shard = [&](const at::Tensor& t) {
    return tessera::from_local(t.narrow(0, 2 * tessera::get_rank(), 2), mesh, {tessera::Shard(0)});
  };
  auto loss_a = torch::mse_loss(model->forward(shard(xa)), shard(ya));
  auto loss_b = torch::mse_loss(model->forward(shard(xb)), shard(yb));

  // doc:begin
{
  auto guard = ddp->no_sync();       // or ddp->set_requires_gradient_sync(false)
  loss_a.backward();                 // gradients accumulate locally, no communication
}
loss_b.backward();                   // reduces the accumulated sum, once
  // doc:end

  torch::mse_loss(reference->forward(xa), ya).backward();
  torch::mse_loss(reference->forward(xb), yb).backward();
  doc::expect_same_parameters("accumulated", *model, *reference, /*gradients=*/true);
  return doc::finish("docs/data_parallel.md no_sync");
}
