// README, "Domain parallelism": a small convolutional model on a field split over a 2x2 mesh
// into uneven rows and columns; loss and weight gradients against one device.
#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"

using namespace tessera;

int main() {
  init_process_group();
  torch::manual_seed(0);  // same values on every rank
  auto make_model = [] {
    namespace nn = torch::nn;
    nn::Sequential m(nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1)), nn::ReLU(),
                     nn::Conv2d(nn::Conv2dOptions(4, 1, 5).padding(2).padding_mode(torch::kCircular)));
    m->to(at::kDouble);
    return m;
  };
  auto model = make_model();
  auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  const auto field = at::randn({2, 2, 64, 64}, at::kDouble);
  const auto target = at::randn({2, 1, 64, 64}, at::kDouble);

  // doc:begin
auto mesh = init_device_mesh("cpu", {2, 2}, {"h", "w"});
distribute_module(*model, mesh);  // parameters replicated
auto x = distribute_tensor(field, mesh, {Shard(2), Shard(3)}, std::nullopt,
                           ShardSizes::Given({{}, {}, {24, 40}, {36, 28}}));
auto loss = at::mse_loss(model->forward(x), target);  // halos exchanged where needed
loss.backward();  // gradient halos sent home; weight gradients summed over the domain
  // doc:end

  auto ref_loss = at::mse_loss(reference->forward(field), target);
  ref_loss.backward();
  doc::expect_close("loss", loss, ref_loss);
  doc::expect_same_parameters("domain parallel", *model, *reference, /*gradients=*/true);
  return doc::finish("README domain parallelism");
}
