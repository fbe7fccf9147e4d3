// docs/fsdp.md, first snippet: fully_shard on each block, then on the root, over "dp" of a
// (dp, domain) mesh, with each rank's own samples and rows (batch 3 + 2, height 7 + 5); loss
// and the parameters after one AdamW step against one device.
#include <vector>

#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"

namespace {

// Two convolutional blocks and a 1x1 head: the head is what the root's call shards.
struct Net : torch::nn::Module {
  Net() {
    namespace nn = torch::nn;
    blocks.push_back(register_module(
        "block0", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1)), nn::ReLU())));
    blocks.push_back(register_module(
        "block1", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(4, 4, 3).padding(1)), nn::Tanh())));
    head = register_module("head", nn::Conv2d(nn::Conv2dOptions(4, 1, 1)));
    to(at::kDouble);
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) x = block->forward(x);
    return head(x);
  }
  std::vector<torch::nn::Sequential> blocks;
  torch::nn::Conv2d head{nullptr};
};

}  // namespace

int main() {
  tessera::init_process_group();
  const int64_t dp = 2, domain = 2;
  torch::manual_seed(1);
  const auto batch = at::randn({5, 2, 12, 10}, at::kDouble);
  const auto target = at::randn({5, 1, 12, 10}, at::kDouble);
  // The 2x2 mesh is row-major: rank = 2 * dp coordinate + domain coordinate.
  const int64_t p = tessera::get_rank() / 2, q = tessera::get_rank() % 2;
  auto mine = [&](const at::Tensor& t) {
    return t.narrow(0, p == 0 ? 0 : 3, p == 0 ? 3 : 2).narrow(2, q == 0 ? 0 : 7, q == 0 ? 7 : 5);
  };
  const auto local_x = mine(batch), local_y = mine(target);
  torch::manual_seed(0);
  auto reference = std::make_shared<Net>();
  torch::manual_seed(0);

  {
    // doc:begin
#include <tessera/tessera.h>
using namespace tessera;

auto mesh = init_device_mesh("cpu", {dp, domain}, {"dp", "domain"});
auto model = std::make_shared<Net>();                 // same initial values on every rank
for (auto& block : model->blocks) fully_shard(*block, mesh["dp"]);   // bottom-up
fully_shard(*model, mesh["dp"]);                      // the root: whatever is left
torch::optim::AdamW opt(model->parameters(), 1e-3);   // the sharded parameters

// Each rank's own samples, declared as the rows of one global batch:
auto x = from_local(local_x, mesh, {Shard(0), Shard(2)}, {ShardSizes::Infer()});
auto loss = at::mse_loss(model->forward(x), from_local(local_y, mesh, {Shard(0), Shard(2)},
                                                       {ShardSizes::Infer()}));
loss.backward();
opt.step();
    // doc:end

    torch::optim::AdamW ref_opt(reference->parameters(), 1e-3);
    auto ref_loss = at::mse_loss(reference->forward(batch), target);
    ref_loss.backward();
    ref_opt.step();
    doc::expect_close("loss", loss, ref_loss);
    doc::expect_same_parameters("after one step", *model, *reference, /*gradients=*/false);
  }
  return doc::finish("docs/fsdp.md");
}
