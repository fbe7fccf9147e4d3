#pragma once
// Tensor-parallel plans for the Llama-style model of llama_model.h (which itself knows
// nothing about Tessera), after torchtitan's apply_tp:
//
//   tok_embeddings          RowwiseParallel(input Replicate, output Shard(1))
//   norm                    SequenceParallel
//   output                  ColwiseParallel(input Shard(1), output Replicate)
//   layers.*.attention_norm SequenceParallel
//   layers.*.attention      PrepareModuleInput((Shard(1), -, -, -) -> (Replicate, -, -, -))
//   layers.*.attention.wq/wk/wv  ColwiseParallel
//   layers.*.attention.wo   RowwiseParallel(output Shard(1))
//   layers.*.ffn_norm       SequenceParallel
//   layers.*.feed_forward   PrepareModuleInput(Shard(1) -> Replicate)
//   layers.*.feed_forward.w1/w3  ColwiseParallel
//   layers.*.feed_forward.w2     RowwiseParallel(output Shard(1))
//
// One deliberate change: with sequence parallelism the styles that feed the residual stream
// (tok_embeddings, wo, w2) keep their outputs distributed (use_local_output(false)).
// torchtitan makes them local and relies on SequenceParallel's forward hook to re-read the
// local tensor as Shard(1); LibTorch modules have no hooks and the RMSNorm here is not one
// ATen op, so Tessera refuses a plain tensor there (NOTE: [Plain operands at modules Tessera
// cannot intercept]). Kept distributed, the residual additions are exact on uneven sequence
// shards as well.
//
// The hand-written RMSNorm's parameter is swapped through a member handle Tessera must be
// told about (NOTE: [Swapping module parameters]); before parallelize_module, once:
//   tessera::register_member_accessor<llama::RMSNormImpl>(
//       [](llama::RMSNormImpl& m, const std::string& name) -> at::Tensor* {
//         return name == "weight" ? &m.weight : nullptr;
//       });
#include <tessera/tessera.h>

#include "llama_model.h"

namespace llama {

struct PlanOptions {
  // Shard norms and residuals over the sequence (Shard(1)) between the tensor-parallel
  // blocks; else they run replicated and the blocks all-reduce.
  bool sequence_parallel = true;
  // use_local_output on the Colwise/Rowwise styles inside the blocks and on the output
  // projection. false keeps every activation distributed: needed when the batch itself is
  // a distributed tensor (sharded over a data-parallel mesh dim), so that the attention's
  // view(B, S, -1, head_dim) and the loss see global shapes.
  bool local_output = true;
  // > 0: q/k/v/wo shard whole heads of this many features (6 heads on 4 ranks: 2/2/1/1).
  // 0: torch.chunk's split of the features, which needs n_heads divisible by the tp size.
  int64_t head_dim = 0;
};

inline tessera::ParallelizePlan tensor_parallel_plan(const PlanOptions& o = {}) {
  using namespace tessera;
  const bool sp = o.sequence_parallel;
  const bool local = o.local_output;
  // Outputs that feed the residual stream: distributed under sequence parallelism.
  const bool local_residual = local && !sp;
  auto colwise = [&] { return ColwiseParallel().use_local_output(local); };
  auto head_colwise = [&] {
    auto s = colwise();
    if (o.head_dim > 0) s.shard_unit(o.head_dim);
    return s;
  };
  auto residual_rowwise = [&] {
    auto s = RowwiseParallel().use_local_output(local_residual);
    if (sp) s.output_layouts(Shard(1));
    return s;
  };
  auto wo = residual_rowwise();
  if (o.head_dim > 0) wo.shard_unit(o.head_dim);

  ParallelizePlan plan;
  plan.emplace_back("tok_embeddings", RowwiseParallel()
                                          .input_layouts(Replicate())
                                          .output_layouts(sp ? Shard(1) : Replicate())
                                          .use_local_output(local_residual));
  if (sp) plan.emplace_back("norm", SequenceParallel());
  {
    auto out = ColwiseParallel().output_layouts(Replicate()).use_local_output(local);
    if (sp) out.input_layouts(Shard(1));
    plan.emplace_back("output", out);
  }
  if (sp) {
    plan.emplace_back("layers.*.attention_norm", SequenceParallel());
    // x is laid out; the rotary tables and the mask pass through.
    plan.emplace_back(
        "layers.*.attention",
        PrepareModuleInput()
            .input_layouts({Shard(1), std::nullopt, std::nullopt, std::nullopt})
            .desired_input_layouts({Replicate(), std::nullopt, std::nullopt, std::nullopt}));
    plan.emplace_back("layers.*.ffn_norm", SequenceParallel());
    plan.emplace_back(
        "layers.*.feed_forward",
        PrepareModuleInput().input_layouts({Shard(1)}).desired_input_layouts({Replicate()}));
  }
  plan.emplace_back("layers.*.attention.wq", head_colwise());
  plan.emplace_back("layers.*.attention.wk", head_colwise());
  plan.emplace_back("layers.*.attention.wv", head_colwise());
  plan.emplace_back("layers.*.attention.wo", wo);
  plan.emplace_back("layers.*.feed_forward.w1", colwise());
  plan.emplace_back("layers.*.feed_forward.w3", colwise());
  plan.emplace_back("layers.*.feed_forward.w2", residual_rowwise());
  return plan;
}

// Context parallelism in the head-tail order (tokens [B, S] stored HeadTailShard(1) over the
// context-parallel mesh dim, as the load-balanced causal ring holds them): the rotary tables
// [S, head_dim / 2] laid out as the tokens' positions, so the rotary products run on the
// stored rows. Plain tables would be read in position order, and every use would put the
// rows back into it. `tokens` are the tokens' placements on `mesh`; `seq` their length.
inline void lay_out_rotary_tables(Transformer& model, const tessera::DeviceMesh& mesh,
                                  const tessera::Placements& tokens, int64_t seq) {
  using namespace tessera;
  Placements p;
  for (const auto& x : tokens)
    p.push_back(!x.is_shard(1)     ? Replicate()
                : x.is_head_tail() ? Placement::head_tail_shard(0)
                                   : Shard(0));
  for (auto* table : {&model->rope_cos, &model->rope_sin})
    *table = distribute_tensor(table->narrow(0, 0, seq).contiguous(), mesh, p, std::nullopt);
}

// torchtitan's plan verbatim (every Colwise/Rowwise output local). With sequence
// parallelism Tessera rejects it at the first norm (see above); kept for that check.
inline tessera::ParallelizePlan torchtitan_literal_plan() {
  using namespace tessera;
  return {
      {"tok_embeddings", RowwiseParallel().input_layouts(Replicate()).output_layouts(Shard(1))},
      {"norm", SequenceParallel()},
      {"output", ColwiseParallel().input_layouts(Shard(1)).output_layouts(Replicate())},
      {"layers.*.attention_norm", SequenceParallel()},
      {"layers.*.attention",
       PrepareModuleInput()
           .input_layouts({Shard(1), std::nullopt, std::nullopt, std::nullopt})
           .desired_input_layouts({Replicate(), std::nullopt, std::nullopt, std::nullopt})},
      {"layers.*.attention.wq", ColwiseParallel()},
      {"layers.*.attention.wk", ColwiseParallel()},
      {"layers.*.attention.wv", ColwiseParallel()},
      {"layers.*.attention.wo", RowwiseParallel().output_layouts(Shard(1))},
      {"layers.*.ffn_norm", SequenceParallel()},
      {"layers.*.feed_forward",
       PrepareModuleInput().input_layouts({Shard(1)}).desired_input_layouts({Replicate()})},
      {"layers.*.feed_forward.w1", ColwiseParallel()},
      {"layers.*.feed_forward.w2", RowwiseParallel().output_layouts(Shard(1))},
      {"layers.*.feed_forward.w3", ColwiseParallel()},
  };
}

}  // namespace llama
