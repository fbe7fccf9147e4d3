// docs/fsdp.md, "FSDP over tensor parallel": the Llama-style model of examples/llama_model.h,
// torchtitan's plan (examples/llama_plan.h) on "tp", fully_shard on "dp"; the batch sharded
// over "dp". Loss and the parameters after one AdamW step against one device.
#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"
#include "llama_plan.h"

using namespace tessera;

int main() {
  init_process_group();
  // The hand-written RMSNorm keeps its weight in a member that the plan and fully_shard swap.
  register_member_accessor<llama::RMSNormImpl>(
      [](llama::RMSNormImpl& m, const std::string& name) -> at::Tensor* {
        return name == "weight" ? &m.weight : nullptr;
      });
  llama::LlamaConfig c;
  c.vocab_size = 65;  // uneven over 2 ranks
  c.dim = 32;
  c.n_heads = 4;
  c.ffn_hidden = 40;
  c.max_seq_len = 16;
  auto make_model = [&] {
    torch::manual_seed(1);  // same initial values on every rank and for the reference
    llama::Transformer m(c);
    m->to(at::kDouble);
    return m;
  };
  llama::Transformer model = make_model();
  llama::Transformer reference = make_model();
  llama::PlanOptions o;
  o.local_output = false;  // the batch is distributed (see llama_plan.h)
  const auto plan = llama::tensor_parallel_plan(o);
  torch::manual_seed(2);
  const auto tokens = at::randint(0, c.vocab_size, {3, 7}, at::kLong);
  const auto targets = at::randint(0, c.vocab_size, {3, 7}, at::kLong);

  // doc:begin
auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
parallelize_module(model, mesh["tp"], plan);
for (auto& layer : *model->layers) fully_shard(*layer, mesh["dp"]);
fully_shard(*model, mesh["dp"]);
  // doc:end

  auto step = [&](llama::Transformer& m, const at::Tensor& x, const at::Tensor& y) {
    torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(3e-3));
    auto loss = torch::nn::functional::cross_entropy(m->forward(x).reshape({-1, c.vocab_size}),
                                                     y.reshape({-1}));
    loss.backward();
    opt.step();
    return loss;
  };
  const Placements batch = {Shard(0), Replicate()};  // rows 2 + 1 over "dp"
  auto loss = step(model, distribute_tensor(tokens, mesh, batch, std::nullopt),
                   distribute_tensor(targets, mesh, batch, std::nullopt));
  auto ref_loss = step(reference, tokens, targets);
  doc::expect_close("loss", loss, ref_loss);
  doc::expect_same_parameters("after one step", *model, *reference, /*gradients=*/false);
  return doc::finish("docs/fsdp.md FSDP over tensor parallel");
}
