// docs/tensor_parallel.md: the snippet's plan on the Llama-style model of
// examples/llama_model.h, on the "tp" dim of a 2x2 mesh, with sequence parallel attention
// norms; the logits and every parameter's gradient against one device.
#include <torch/torch.h>

#include <tessera/tessera.h>

#include "doc_check.h"
#include "llama_model.h"

int main() {
  tessera::init_process_group();
  // The hand-written RMSNorm keeps its weight in a member the SequenceParallel style swaps.
  tessera::register_member_accessor<llama::RMSNormImpl>(
      [](llama::RMSNormImpl& m, const std::string& name) -> at::Tensor* {
        return name == "weight" ? &m.weight : nullptr;
      });
  llama::LlamaConfig c;
  c.vocab_size = 64;
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
  torch::manual_seed(2);
  const auto tokens = at::randint(0, c.vocab_size, {3, 7}, at::kLong);  // 7: uneven over 2

  // doc:begin
#include <tessera/tessera.h>

auto mesh = tessera::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
tessera::parallelize_module(model, mesh["tp"], {
    {"tok_embeddings", tessera::RowwiseParallel().input_layouts(tessera::Replicate())
                                                 .output_layouts(tessera::Shard(1))
                                                 .use_local_output(false)},
    {"layers.*.attention_norm", tessera::SequenceParallel()},
    {"layers.*.attention", tessera::PrepareModuleInput().input_layouts({tessera::Shard(1)})
                                                        .desired_input_layouts({tessera::Replicate()})},
    {"layers.*.attention.w[qkv]", tessera::ColwiseParallel()},
    {"layers.*.attention.wo", tessera::RowwiseParallel().output_layouts(tessera::Shard(1))
                                                        .use_local_output(false)},
});
  // doc:end

  auto logits = model->forward(tokens);
  auto ref_logits = reference->forward(tokens);
  doc::expect_close("logits", logits, ref_logits);
  // A fixed, non-uniform weighting of the logits, so every gradient path is exercised.
  const auto w = at::linspace(-1, 1, ref_logits.numel(), at::kDouble).view(ref_logits.sizes());
  (ref_logits * w).sum().backward();
  (logits * w).sum().backward();  // a plain operand is read as the global value
  doc::expect_same_parameters("tensor parallel", *model, *reference, /*gradients=*/true);
  return doc::finish("docs/tensor_parallel.md");
}
