// Tensor-parallel training of a small Llama-style transformer. The model (llama_model.h) is
// plain torch::nn; parallelize_module lays it out over every rank with torchtitan's plan
// (llama_plan.h): attention heads and the SwiGLU width split over the ranks (Colwise q/k/v
// and w1/w3, Rowwise wo and w2), the vocabulary split in the embedding and the output
// projection, and with sequence parallelism (the default) the norms and residual stream cut
// along the sequence between the blocks. It learns a synthetic next-token task (arithmetic
// sequences modulo the vocabulary), shows the collectives of one step and checks the final
// loss and parameters against the same training on one device.
//
// With --dp N and --cp M the ranks form an N x M x (ranks / NM) mesh ("dp", "cp", "tp"): the
// plan runs on "tp"; each batch is split over "dp" and fully_shard over "dp" (each block,
// then the root) keeps 1/N of every tensor-parallel shard per rank, gathered for use; each
// sequence is split over "cp" (context parallelism: the attention is
// scaled_dot_product_attention, whose K/V blocks go round a ring on LibTorch 2.x), with the
// parameters replicated over "cp" (replicate() sums their gradients). Sequence parallelism
// composes with it: between the blocks each rank's positions are split again over "tp".
// With the attention's causal mask, positions split in order give the last rank of "cp"
// about 2 x cp - 1 times the first one's work; --cp-layout head-tail (the default where the
// attention is one fused call) stores each rank's positions as a head chunk and a tail
// chunk (HeadTailShard(1)), where every rank has the same work, from the batch to the loss:
// the rotary tables are laid out alike, and no op in between puts them back in order.
//
//   tessera-run -n 4 ./build/examples/tp_transformer [--steps 40] [--no-sequence-parallel]
//   tessera-run -n 4 ./build/examples/tp_transformer --dp 2
//   tessera-run -n 4 ./build/examples/tp_transformer --cp 2     (cp x tp)
//   tessera-run -n 4 ./build/examples/tp_transformer --cp 2 --dp 2
//   tessera-run -n 4 ./build/examples/tp_transformer --cp 2 --cp-layout contiguous
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "llama_plan.h"
#include "progress_bar.h"
#include "tessera/tessera.h"

using namespace tessera;
using llama::LlamaConfig;
using llama::Transformer;

namespace {

struct Batch {
  at::Tensor tokens, targets;
};

// Rows of an arithmetic sequence modulo the vocabulary (random start and stride); the target
// is the next token. The same seed gives every rank the same batch without communication.
Batch make_batch(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto start = at::randint(0, vocab, {batch, 1}, gen, at::kLong);
  const auto stride = at::randint(1, 8, {batch, 1}, gen, at::kLong);
  const auto walk =
      at::remainder(start + stride * at::arange(seq + 1, at::kLong).view({1, -1}), vocab);
  return {walk.narrow(1, 0, seq).contiguous(), walk.narrow(1, 1, seq).contiguous()};
}

double train_step(Transformer& model, torch::optim::AdamW& opt, const Batch& b) {
  opt.zero_grad();
  const auto logits = model->forward(b.tokens);
  auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, model->config.vocab_size}),
                                                   b.targets.reshape({-1}));
  loss.backward();
  opt.step();
  return is_dtensor(loss) ? full_tensor(loss.detach()).item<double>() : loss.item<double>();
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"Tensor-parallel training of a small Llama-style transformer (torchtitan's plan)"};
  int steps = 40;
  LlamaConfig c;
  c.vocab_size = 4 * 64 + 1;  // splits unevenly over the ranks
  c.dim = 96;
  c.n_layers = 2;
  c.n_heads = 6;
  c.ffn_hidden = 256;
  c.max_seq_len = 64;
  int64_t batch = 8, seq = 31, dp = 1, cp = 1;
  double lr = 1e-2;
  bool no_sp = false;
  app.add_option("--steps", steps, "training steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "sequences per step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "tokens per sequence")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{64}));
  app.add_option("--dim", c.dim, "model width")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--heads", c.n_heads, "attention heads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", c.n_layers, "transformer blocks")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--ffn", c.ffn_hidden, "SwiGLU hidden width")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--vocab", c.vocab_size, "vocabulary size")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  app.add_option("--lr", lr, "AdamW learning rate")->capture_default_str();
  app.add_flag("--no-sequence-parallel", no_sp,
               "tensor parallel only: norms replicated, all-reduces");
  app.add_option("--dp", dp, "data-parallel size: batch split and fully_shard over it")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--cp", cp,
                 "context-parallel size: each sequence split over it (with sequence "
                 "parallelism, split over \"tp\" too between the blocks)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  std::string cp_method = "ring";
  std::string cp_layout = "auto";
  app.add_option("--cp-layout", cp_layout,
                 "how --cp stores each sequence: head-tail (every rank the same causal work; "
                 "needs the fused attention, LibTorch 2.x), contiguous (positions in order), "
                 "or auto (head-tail where it can)")
      ->check(CLI::IsMember({"auto", "head-tail", "contiguous"}));
  app.add_option("--cp-method", cp_method,
                 "how the attention brings K/V over with --cp (auto takes the ring once K and V "
                 "would pass 16 MiB per rank; this model's are far smaller); a head-tail "
                 "layout always takes the ring")
      ->capture_default_str()
      ->check(CLI::IsMember({"ring", "allgather", "auto"}));
  CLI11_PARSE(app, argc, argv);
  if (c.dim % c.n_heads != 0 || (c.dim / c.n_heads) % 2 != 0) {
    std::fprintf(stderr, "--dim must split into --heads heads of an even size\n");
    return 2;
  }

  at::set_num_threads(1);  // several ranks share few cores
  const auto started = std::chrono::steady_clock::now();
  init_process_group();
  const int rank = get_rank(), world = get_world_size();
  if (world % (dp * cp) != 0) {
    if (rank == 0)
      std::fprintf(stderr, "--dp %lld x --cp %lld does not divide %d ranks\n",
                   static_cast<long long>(dp), static_cast<long long>(cp), world);
    return 2;
  }
  const int64_t tp = world / (dp * cp);
  auto mesh = init_device_mesh("cpu", {dp, cp, tp}, {"dp", "cp", "tp"});
  // One scaled_dot_product_attention call where LibTorch has it: under a sequence split its
  // K/V blocks travel round the ring instead of being gathered.
  c.fused_attention = cp > 1 && LLAMA_HAS_SDPA;
  if (cp_layout == "head-tail" && !c.fused_attention) {
    if (rank == 0)
      std::fprintf(stderr,
                   "--cp-layout head-tail needs --cp > 1 and LibTorch 2.x (the fused "
                   "attention)\n");
    return 2;
  }
  const bool head_tail = c.fused_attention && cp_layout != "contiguous";
  set_context_parallel_method(cp_method == "ring"        ? ContextParallelMethod::kRing
                              : cp_method == "allgather" ? ContextParallelMethod::kAllGather
                                                         : ContextParallelMethod::kAuto);

  // The hand-written RMSNorm's parameter handle, so Tessera can swap in a distributed one.
  register_member_accessor<llama::RMSNormImpl>(
      [](llama::RMSNormImpl& m, const std::string& name) -> at::Tensor* {
        return name == "weight" ? &m.weight : nullptr;
      });

  // Same seed, same weights (parallelize_module also takes every parameter from rank 0).
  torch::manual_seed(0);
  Transformer model(c);
  torch::manual_seed(0);
  Transformer reference(c);

  llama::PlanOptions plan;
  plan.sequence_parallel = !no_sp;
  plan.head_dim = c.head_dim();  // whole heads per rank, even when they do not divide
  // A batch split over "dp" stays a distributed tensor through the blocks (the attention's
  // reshapes read its global batch size), so the projections keep distributed outputs.
  plan.local_output = dp == 1 && cp == 1;
  parallelize_module(model, mesh["tp"], llama::tensor_parallel_plan(plan));
  if (dp > 1) {
    for (const auto& layer : *model->layers) fully_shard(*layer, mesh["dp"]);
    fully_shard(*model, mesh["dp"]);
  }
  std::shared_ptr<ReplicatedModule> over_cp;
  if (cp > 1 && dp == 1) over_cp = replicate(model, mesh["cp"]);
  // Rows over "dp", positions over "cp" (the loss is then the global mean).
  const Placements split = {dp > 1 ? Shard(0) : Replicate(),
                            !head_tail ? (cp > 1 ? Shard(1) : Replicate()) : HeadTailShard(1),
                            Replicate()};
  if (head_tail) llama::lay_out_rotary_tables(model, mesh, split, seq);
  if (rank == 0) {
    std::printf(
        "%lld-layer transformer, dim %lld, %lld heads, vocab %lld on %d ranks: %lld x %lld x "
        "%lld (dp x cp x tp, %s%s%s)\n",
        static_cast<long long>(c.n_layers), static_cast<long long>(c.dim),
        static_cast<long long>(c.n_heads), static_cast<long long>(c.vocab_size), world,
        static_cast<long long>(dp), static_cast<long long>(cp), static_cast<long long>(tp),
        no_sp ? "tensor parallel" : "tensor + sequence parallel",
        dp > 1 ? ", fully_shard over dp" : "",
        cp > 1 ? (c.fused_attention
                      ? std::string(head_tail ? ", sequence split head-tail over cp, K/V by "
                                                "ring (head-tail storage rings)"
                                              : ", sequence split over cp, K/V by " + cp_method)
                      : std::string(", sequence split over cp, K/V gathered"))
                     .c_str()
               : "");
    // The parameters the optimizer steps (with fully_shard: this rank's rows of its shard).
    const auto params = model->named_parameters();
    const auto& wq = params["layers.0.attention.wq.weight"];
    const auto& emb = params["tok_embeddings.weight"];
    std::printf("rank 0 holds wq %s of %s, tok_embeddings %s of %s\n",
                shape_str(spec(wq).local_sizes()).c_str(), shape_str(wq.sizes().vec()).c_str(),
                shape_str(spec(emb).local_sizes()).c_str(), shape_str(emb.sizes().vec()).c_str());
  }

  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(lr).weight_decay(0.01));
  std::string step_communication;
  const int print_every = std::max(1, steps / 8);
  double loss = 0, training_seconds = 0;
  for (int step = 1; step <= steps; ++step) {
    Batch b = make_batch(batch, seq, c.vocab_size, 1000 + step);
    if (dp > 1 || cp > 1) {
      b = {distribute_tensor(b.tokens, mesh, split, std::nullopt),
           distribute_tensor(b.targets, mesh, split, std::nullopt)};
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (step == 2) {
      CommDebugMode comm;  // a steady-state step
      loss = train_step(model, optimizer, b);
      step_communication = comm.table();
    } else {
      loss = train_step(model, optimizer, b);
    }
    training_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0 && (step == 1 || step % print_every == 0 || step == steps))
      std::printf("%s step %*d/%d  loss %.4f\n", progress_bar(step, steps).c_str(),
                  static_cast<int>(std::to_string(steps).size()), step, steps, loss);
  }

  // Gather the trained parameters (collective: every rank, same order), then train the
  // one-device twin on rank 0 and compare.
  std::vector<std::pair<std::string, at::Tensor>> trained;
  for (const auto& item : model->named_parameters())
    trained.emplace_back(item.key(), is_dtensor(item.value()) ? full_tensor(item.value()).detach()
                                                              : item.value().detach());
  if (rank != 0) return 0;
  std::printf("trained %d steps in %.1f s (%.0f ms/step)\n", steps, training_seconds,
              1000 * training_seconds / steps);
  if (!step_communication.empty())
    std::printf("communication of one training step (rank 0):\n%s", step_communication.c_str());
  torch::optim::AdamW reference_optimizer(reference->parameters(),
                                          torch::optim::AdamWOptions(lr).weight_decay(0.01));
  double reference_loss = 0;
  for (int step = 1; step <= steps; ++step)
    reference_loss = train_step(reference, reference_optimizer,
                                make_batch(batch, seq, c.vocab_size, 1000 + step));
  double max_param_diff = 0;
  const auto reference_params = reference->named_parameters();
  for (const auto& [name, value] : trained)
    max_param_diff =
        std::max(max_param_diff, (value - reference_params[name]).abs().max().item<double>());
  // float32 with other summation orders: the losses agree to a few units in the 4th digit;
  // a parameter may differ by up to about one AdamW step (lr) where its gradient is near 0.
  const double loss_diff = std::abs(loss - reference_loss);
  const bool ok = loss_diff <= 2e-3 * (1 + std::abs(reference_loss)) && max_param_diff <= lr;
  std::printf("final loss %.5f, one device %.5f (|Δ| %.1e); max parameter |Δ| %.1e -> %s\n", loss,
              reference_loss, loss_diff, max_param_diff, ok ? "OK" : "MISMATCH");
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("%s in %.1f s\n", ok ? "OK" : "FAILED", total);
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "tp_transformer: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_transformer: %s\n", e.what());
  }
  return 1;
}
