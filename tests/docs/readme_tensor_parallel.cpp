// README, "Tensor parallelism": the Llama-style model of examples/llama_model.h with the
// snippet's plan on the "tp" dim of a 2x2 mesh, and cross entropy under loss_parallel on the
// vocabulary-sharded logits; loss and every gradient against one device.
#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"
#include "llama_model.h"

int main() {
  tessera::init_process_group();
  auto mesh = tessera::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  llama::LlamaConfig c;
  c.vocab_size = 65;  // uneven over 2 ranks
  c.dim = 48;
  c.n_heads = 6;      // whole heads of 8: 3 and 3
  c.ffn_hidden = 40;
  c.max_seq_len = 16;
  const int64_t head_dim = c.head_dim();
  auto make_model = [&] {
    torch::manual_seed(1);  // same initial values on every rank and for the reference
    llama::Transformer m(c);
    m->to(at::kDouble);
    return m;
  };
  llama::Transformer model = make_model();
  llama::Transformer reference = make_model();
  torch::manual_seed(2);
  const auto tokens = at::randint(0, c.vocab_size, {3, 7}, at::kLong);
  const auto targets = at::randint(0, c.vocab_size, {3, 7}, at::kLong);

  // doc:begin
tessera::parallelize_module(model, mesh["tp"], {
    {"layers.*.attention.w[qkv]", tessera::ColwiseParallel().shard_unit(head_dim)},
    {"layers.*.attention.wo", tessera::RowwiseParallel().shard_unit(head_dim)},
    {"output", tessera::ColwiseParallel().use_local_output(false)},
});
  // doc:end
  // The logits the snippet's loss reads: [B, S, vocab], sharded on the vocabulary.
  auto logits = model->forward(tokens);
  // doc:begin
tessera::LossParallel scope;  // cross entropy without gathering the logits
auto loss = torch::nn::functional::cross_entropy(logits.flatten(0, 1), targets.flatten());
  // doc:end
  loss.backward();

  auto ref_loss = torch::nn::functional::cross_entropy(reference->forward(tokens).flatten(0, 1),
                                                       targets.flatten());
  ref_loss.backward();
  doc::expect_close("loss", loss, ref_loss);
  doc::expect_same_parameters("tensor parallel", *model, *reference, /*gradients=*/true);
  return doc::finish("README tensor parallelism");
}
