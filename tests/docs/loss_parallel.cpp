// docs/loss_parallel.md: a vocabulary projection (21 classes: 6/5/5/5 over 4 ranks) whose
// logits stay sharded on the class dim, cross entropy with ignore_index and label smoothing
// under loss_parallel; the gradients of the projection and of its input against one device.
#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"

int main() {
  tessera::init_process_group();
  auto mesh = tessera::init_device_mesh("cpu", {4}, {"tp"});
  torch::manual_seed(0);  // same values on every rank
  torch::nn::Linear lm_head(torch::nn::LinearOptions(8, 21));
  lm_head->to(at::kDouble);
  auto reference = std::dynamic_pointer_cast<torch::nn::LinearImpl>(lm_head->clone());
  tessera::parallelize_module(lm_head, mesh, tessera::ColwiseParallel().use_local_output(false));
  const auto h = at::randn({6, 8}, at::kDouble).requires_grad_();
  auto target = at::randint(0, 21, {6}, at::kLong);
  target[2] = -100;  // ignored

  {
    // doc:begin
#include <tessera/tessera.h>
namespace F = torch::nn::functional;

auto logits = lm_head(h);                 // distributed, Shard(1) on the tp mesh dim
{
  tessera::LossParallel scope;            // or: auto scope = tessera::loss_parallel();
  auto loss = F::cross_entropy(logits, target,
                               F::CrossEntropyFuncOptions().ignore_index(-100)
                                   .label_smoothing(0.1));
  loss.backward();
}
    // doc:end
  }

  namespace F = torch::nn::functional;
  const auto ref_h = h.detach().clone().requires_grad_();
  F::cross_entropy(reference->forward(ref_h), target,
                   F::CrossEntropyFuncOptions().ignore_index(-100).label_smoothing(0.1))
      .backward();
  doc::expect_close("input grad", h.grad(), ref_h.grad());
  doc::expect_same_parameters("lm_head", *lm_head, *reference, /*gradients=*/true);
  return doc::finish("docs/loss_parallel.md");
}
