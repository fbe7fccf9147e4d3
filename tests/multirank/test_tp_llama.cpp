// End to end: the Llama-style model of examples/llama_model.h (plain torch::nn), laid out
// with parallelize_module and torchtitan's plan (examples/llama_plan.h), trained 10 steps
// with torch::optim::AdamW on a synthetic next-token task, gives the losses and every
// parameter of the same training on one device:
//  * tensor parallel only and tensor + sequence parallel, on 2, 3 and 4 ranks, with sizes
//    that do not divide (6 heads on 4 ranks in whole heads, vocabulary 4N+1, a SwiGLU
//    width and a sequence length that split unevenly);
//  * a 2x2 data x tensor parallel mesh: the plan on mesh["tp"], the batch a distributed
//    tensor sharded over "dp", the loss a global mean; then with replicate or fully_shard
//    over "dp" on top;
//  * data parallel alone: replicate and fully_shard on 2 and 3 ranks;
//  * context parallel: the sequence split over "cp" (alone, with "dp", with "tp"), the
//    attention in both forms (matmul-softmax, scaled_dot_product_attention);
//  * the collectives of one training step (CommDebugMode) equal the analytic count.
#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "helpers.h"
#include "llama_plan.h"

using namespace tessera;

namespace {

using llama::LlamaConfig;
using llama::Transformer;
using Counts = std::map<std::string, int64_t>;

constexpr int kSteps = 10;

void register_rmsnorm_member() {
  static const bool once = [] {
    register_member_accessor<llama::RMSNormImpl>(
        [](llama::RMSNormImpl& m, const std::string& name) -> at::Tensor* {
          return name == "weight" ? &m.weight : nullptr;
        });
    return true;
  }();
  (void)once;
}

// 6 heads of 8 (whole heads split 2/2/1/1 on 4 ranks), vocabulary 4 * 16 + 1, SwiGLU width
// 94 (uneven on 3 and 4 ranks).
LlamaConfig uneven_config() {
  LlamaConfig c;
  c.vocab_size = 4 * 16 + 1;
  c.dim = 48;
  c.n_layers = 2;
  c.n_heads = 6;
  c.ffn_hidden = 94;
  c.max_seq_len = 16;
  return c;
}

// Next-token prediction on arithmetic sequences modulo the vocabulary: a start and a stride
// per row, both drawn from a fixed seed.
struct Task {
  at::Tensor tokens, targets;  // [B, S] int64
};
Task make_task(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  auto g = tessera::test::generator(seed);
  const auto start = at::randint(0, vocab, {batch, 1}, g, at::kLong);
  const auto stride = at::randint(1, 5, {batch, 1}, g, at::kLong);
  const auto walk =
      at::remainder(start + stride * at::arange(seq + 1, at::kLong).view({1, -1}), vocab);
  return {walk.narrow(1, 0, seq).contiguous(), walk.narrow(1, 1, seq).contiguous()};
}

// The one-device model everything is compared with, made once on the test thread.
Transformer make_reference(const LlamaConfig& c, uint64_t seed) {
  torch::manual_seed(seed);  // on the test thread, before any rank thread exists
  Transformer m(c);
  m->to(at::kDouble);
  return m;
}

// A model with the reference's initial values (double precision: Adam divides by tiny
// second moments, where float rounding of a different summation order would show).
Transformer copy_of(const Transformer& proto) {
  Transformer m(proto->config);
  m->to(at::kDouble);
  torch::NoGradGuard no_grad;
  const auto src = proto->named_parameters();
  for (auto& item : m->named_parameters()) item.value().copy_(src[item.key()]);
  return m;
}

double value(const at::Tensor& t) {
  return is_dtensor(t) ? full_tensor(t).item<double>() : t.item<double>();
}

struct Trained {
  std::vector<double> losses;
  Counts forward, backward, optimizer;  // collectives of step 2 (steady state)
  int64_t bytes = 0;                    // sent by this rank in step 2
};

// kSteps AdamW steps of cross entropy over every position.
Trained train(Transformer model, const at::Tensor& tokens, const at::Tensor& targets) {
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  const int64_t vocab = model->config.vocab_size;
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    const bool count = step == 1;
    opt.zero_grad();
    at::Tensor loss;
    {
      std::optional<CommDebugMode> cdm;
      if (count) cdm.emplace();
      auto logits = model->forward(tokens);
      loss =
          torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), targets.reshape({-1}));
      if (count) out.forward = cdm->get_comm_counts(), out.bytes += cdm->total_bytes_sent();
    }
    {
      std::optional<CommDebugMode> cdm;
      if (count) cdm.emplace();
      loss.backward();
      if (count) out.backward = cdm->get_comm_counts(), out.bytes += cdm->total_bytes_sent();
    }
    {
      std::optional<CommDebugMode> cdm;
      if (count) cdm.emplace();
      opt.step();
      if (count) out.optimizer = cdm->get_comm_counts(), out.bytes += cdm->total_bytes_sent();
    }
    out.losses.push_back(value(loss));
  }
  return out;
}

std::string str(const Counts& c) {
  std::string s;
  for (const auto& [k, v] : c)
    if (v) s += (s.empty() ? "" : ", ") + k + " " + std::to_string(v);
  return s.empty() ? "none" : s;
}

// The collectives proper: shape exchanges ("metadata": a plain Rowwise input whose shard
// sizes no parameter table fixes) are left out, as CommDebugMode's total leaves them out.
Counts collectives(const Counts& c) {
  Counts r;
  for (const auto& [k, v] : c)
    if (v && k != "metadata") r[k] = v;
  return r;
}

// One device's run, made once per configuration.
struct Reference {
  Transformer initial{nullptr};
  Trained trained;
  Transformer model{nullptr};
};
Reference reference_run(const LlamaConfig& c, const Task& task, uint64_t seed) {
  Reference r;
  r.initial = make_reference(c, seed);
  r.model = copy_of(r.initial);
  r.trained = train(r.model, task.tokens, task.targets);
  return r;
}

// Losses and every parameter (gathered: collective) against the one-device run.
void expect_same(const Reference& ref, const Trained& got, Transformer model,
                 const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.trained.losses.size());
  for (size_t s = 0; s < got.losses.size(); ++s)
    ASSERT_NEAR(got.losses[s], ref.trained.losses[s], 1e-9 * (1 + std::abs(ref.trained.losses[s])))
        << what << " step " << s;
  const auto expected = ref.model->named_parameters();
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    const at::Tensor& e = expected[item.key()].detach();
    if (is_dtensor(p)) {
      ASSERT_TRUE(tessera::test::full_matches(p, e, {1e-8, 1e-10}))
          << what << " parameter " << item.key() << " " << spec(p).str();
    } else {
      ASSERT_TRUE(tessera::test::matches(p.detach(), e, {1e-8, 1e-10}))
          << what << " parameter " << item.key();
    }
  }
}

// Collectives of one training step, by the plan's structure (L layers):
//  tensor parallel only, forward: all-reduce after the embedding, wo and w2 of every layer;
//    all-gather of the logits. Backward: all-reduce of the input gradient of each of wq, wk,
//    wv, w1, w3 and the output projection: each Colwise reads its plain (replicated) input
//    by itself, so the gradients of a shared input are summed after their all-reduces (as
//    in PyTorch: 9 for its 2-layer toy Transformer).
//  sequence parallel, forward: reduce-scatter after the embedding, wo and w2; all-gather at
//    the attention's and the feed-forward's input, before the output projection and of the
//    logits. Backward: each of those in reverse (reduce-scatter <-> all-gather), except the
//    logits' (Replicate -> Shard(-1) is a local slice); the PrepareModuleInput conversions
//    are made once per module, so wq/wk/wv (w1/w3) share one reduce-scatter. The replicated
//    norm weights' gradients are partial sums over the sequence shards: one all-reduce per
//    norm.
struct Expected {
  Counts forward, backward, optimizer;
};
Expected analytic(int64_t layers, bool sequence_parallel) {
  const int64_t L = layers;
  if (!sequence_parallel)
    return {{{"all_gather", 1}, {"all_reduce", 2 * L + 1}}, {{"all_reduce", 5 * L + 1}}, {}};
  return {{{"all_gather", 2 * L + 2}, {"reduce_scatter", 2 * L + 1}},
          {{"all_gather", 2 * L + 1}, {"reduce_scatter", 2 * L + 1}, {"all_reduce", 2 * L + 1}},
          {}};
}

void record(const std::string& what, const Trained& t) {
  std::printf("[collectives] %s: forward {%s}; backward {%s}; optimizer {%s}; %lld bytes sent\n",
              what.c_str(), str(t.forward).c_str(), str(t.backward).c_str(),
              str(t.optimizer).c_str(), static_cast<long long>(t.bytes));
}

// fully_shard on each block, then on the root (embedding, final norm, output): returns the
// number of groups.
int64_t shard_llama(Transformer& model, const DeviceMesh& dp) {
  int64_t groups = 0;
  for (const auto& layer : *model->layers) fully_shard(*layer, dp), ++groups;
  fully_shard(*model, dp);
  return groups + 1;
}

void tensor_parallel_case(bool sequence_parallel) {
  register_rmsnorm_member();
  const auto c = uneven_config();
  // An odd sequence length (7) splits unevenly over 2, 3 and 4 ranks.
  const Task task = make_task(/*batch=*/3, /*seq=*/7, c.vocab_size, 5);
  const Reference ref = reference_run(c, task, 17);
  for (int tp : {2, 3, 4}) {
    const std::string what =
        std::string(sequence_parallel ? "tp+sp" : "tp") + " on " + std::to_string(tp) + " ranks";
    std::vector<Trained> per_rank(tp);
    tessera::testing::run_ranks(tp,
                                [&](int rank) {
                                  auto mesh = init_device_mesh("cpu", {tp}, {"tp"});
                                  auto model = copy_of(ref.initial);
                                  llama::PlanOptions o;
                                  o.sequence_parallel = sequence_parallel;
                                  o.head_dim = c.head_dim();
                                  parallelize_module(model, mesh["tp"],
                                                     llama::tensor_parallel_plan(o));
                                  per_rank[rank] = train(model, task.tokens, task.targets);
                                  expect_same(ref, per_rank[rank], model, what);
                                },
                                {std::chrono::seconds(600)});
    record(what, per_rank[0]);
    const auto e = analytic(c.n_layers, sequence_parallel);
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(collectives(per_rank[r].forward), e.forward) << what << " rank " << r << " forward";
      EXPECT_EQ(collectives(per_rank[r].backward), e.backward)
          << what << " rank " << r << " backward";
      EXPECT_EQ(collectives(per_rank[r].optimizer), e.optimizer)
          << what << " rank " << r << " optimizer";
    }
  }
}

}  // namespace

// What every case below relies on: a Linear's style applies when the module is called the
// ordinary way (the holder's operator()), so a ColwiseParallel output is the local block.
TEST(TpLlama, LinearStyleAppliesThroughModuleCall) {
  tessera::testing::run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    torch::nn::Linear lin(torch::nn::LinearOptions(4, 8).bias(false));
    parallelize_module(lin, mesh, ColwiseParallel());
    const auto y = lin(at::ones({2, 4}));
    EXPECT_FALSE(is_dtensor(y)) << "ColwiseParallel's output should be local: " << spec(y).str();
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 4}));
  });
}

TEST(TpLlama, TensorParallelMatchesOneDevice) { tensor_parallel_case(false); }

TEST(TpLlama, SequenceParallelMatchesOneDevice) { tensor_parallel_case(true); }

// The batch is a distributed tensor sharded over "dp" (3 rows: 2 + 1), the plan is applied
// on mesh["tp"] with every activation kept distributed, and the loss is the mean over the
// whole batch; parameters live on the 2x2 mesh, replicated over "dp", so their gradients
// are global sums without a data-parallel wrapper.
TEST(TpLlama, DataAndTensorParallelTwoByTwo) {
  register_rmsnorm_member();
  const auto c = uneven_config();
  const Task task = make_task(/*batch=*/3, /*seq=*/7, c.vocab_size, 6);
  const Reference ref = reference_run(c, task, 23);
  for (bool sequence_parallel : {false, true}) {
    const std::string what =
        std::string("dp x ") + (sequence_parallel ? "tp+sp" : "tp") + " on 2x2";
    std::vector<Trained> per_rank(4), bucketed(4), fsdp(4);
    tessera::testing::run_ranks(
        4,
        [&](int rank) {
          auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
          auto model = copy_of(ref.initial);
          llama::PlanOptions o;
          o.sequence_parallel = sequence_parallel;
          o.local_output = false;
          o.head_dim = c.head_dim();
          parallelize_module(model, mesh["tp"], llama::tensor_parallel_plan(o));
          const Placements batch = {Shard(0), Replicate()};
          const auto tokens = distribute_tensor(task.tokens, mesh, batch, std::nullopt);
          const auto targets = distribute_tensor(task.targets, mesh, batch, std::nullopt);
          per_rank[rank] = train(model, tokens, targets);
          expect_same(ref, per_rank[rank], model, what);
          // The same with replicate() over "dp": every gradient summed in buckets (by the
          // mesh dims it is replicated on: "dp" for tensor-parallel weights, both dims for
          // the norms' under sequence parallelism) instead of one all-reduce per parameter.
          auto again = copy_of(ref.initial);
          parallelize_module(again, mesh["tp"], llama::tensor_parallel_plan(o));
          auto ddp = replicate(again, mesh["dp"]);
          bucketed[rank] = train(again, tokens, targets);
          expect_same(ref, bucketed[rank], again, what + " with replicate");
          // And with fully_shard over "dp" on each block and the root: the tensor-parallel
          // parameters' data-parallel rows nest inside their tensor-parallel shards.
          auto sharded = copy_of(ref.initial);
          parallelize_module(sharded, mesh["tp"], llama::tensor_parallel_plan(o));
          const int64_t groups = shard_llama(sharded, mesh["dp"]);
          fsdp[rank] = train(sharded, tokens, targets);
          expect_same(ref, fsdp[rank], sharded, what + " with fully_shard");
          // One reduce-scatter per group on top of the tensor-parallel ones, and no
          // data-parallel all-reduce of a gradient is left for the optimizer.
          EXPECT_EQ(fsdp[rank].backward["reduce_scatter"],
                    per_rank[rank].backward["reduce_scatter"] + groups)
              << what;
          EXPECT_EQ(fsdp[rank].optimizer["all_reduce"], 0) << what;
          const auto buckets = static_cast<int64_t>(ddp->bucket_parameter_names().size());
          EXPECT_LE(buckets, 2) << what;
          // No gradient is left for the optimizer's reads to reduce, and backward sums fewer.
          EXPECT_EQ(bucketed[rank].optimizer["all_reduce"], 0) << what;
          EXPECT_LT(bucketed[rank].backward["all_reduce"] + bucketed[rank].optimizer["all_reduce"],
                    per_rank[rank].backward["all_reduce"] + per_rank[rank].optimizer["all_reduce"])
              << what;
        },
        {std::chrono::seconds(600)});
    record(what, per_rank[0]);
    record(what + " with replicate", bucketed[0]);
    record(what + " with fully_shard", fsdp[0]);
  }
}

// Data parallel alone, on 2 and 3 ranks with a batch of 3 rows (2 + 1; 1 + 1 + 1): replicate
// (gradients summed in buckets) and fully_shard (each block, then the root; vocabulary 65
// rows in uneven shards) train like one device, with one all-gather per group in forward and
// one reduce-scatter per group in backward.
TEST(TpLlama, ReplicateAndFullyShardMatchOneDevice) {
  register_rmsnorm_member();
  const auto c = uneven_config();
  const Task task = make_task(/*batch=*/3, /*seq=*/7, c.vocab_size, 12);
  const Reference ref = reference_run(c, task, 31);
  for (int world : {2, 3}) {
    const std::string what = "dp " + std::to_string(world);
    std::vector<Trained> ddp(world), fsdp(world);
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          const auto tokens = distribute_tensor(task.tokens, mesh, {Shard(0)}, std::nullopt);
          const auto targets = distribute_tensor(task.targets, mesh, {Shard(0)}, std::nullopt);
          auto replicated = copy_of(ref.initial);
          auto handle = replicate(replicated, mesh);
          ddp[rank] = train(replicated, tokens, targets);
          expect_same(ref, ddp[rank], replicated, what + " replicate");
          EXPECT_EQ(ddp[rank].optimizer["all_reduce"], 0) << what;

          auto sharded = copy_of(ref.initial);
          const int64_t groups = shard_llama(sharded, mesh);
          fsdp[rank] = train(sharded, tokens, targets);
          expect_same(ref, fsdp[rank], sharded, what + " fully_shard");
          EXPECT_EQ(fsdp[rank].forward["all_gather"], groups) << what;
          EXPECT_EQ(fsdp[rank].backward["reduce_scatter"], groups) << what;
          EXPECT_EQ(fsdp[rank].optimizer["all_reduce"] + fsdp[rank].optimizer["all_gather"], 0)
              << what;
        },
        {std::chrono::seconds(600)});
    record(what + " replicate", ddp[0]);
    record(what + " fully_shard", fsdp[0]);
  }
}

// Context parallelism: the tokens split along the sequence (7 positions: uneven) over "cp",
// the model unchanged. On a 1-D mesh of 2 and 3 ranks and on 2x2 meshes with data parallel
// (rows over "dp") and tensor parallel (heads over "tp", with and without sequence parallelism
// splitting the positions over "tp" too between the blocks) beside it, with the attention as
// matmul-softmax-matmul (K and V gathered by the matmul rules) and, where LibTorch has it,
// as scaled_dot_product_attention(is_causal) under the ring and the all-gather.
TEST(TpLlama, ContextParallelMatchesOneDevice) {
  register_rmsnorm_member();
  const Task task = make_task(/*batch=*/3, /*seq=*/7, uneven_config().vocab_size, 14);
  std::vector<bool> forms = {false};
  if (LLAMA_HAS_SDPA && test::has_fused_cpu_attention()) forms.push_back(true);
  for (const bool fused : forms) {
    auto c = uneven_config();
    c.fused_attention = fused;
    const Reference ref = reference_run(c, task, 37);
    std::vector<ContextParallelMethod> methods = {ContextParallelMethod::kAuto};
    if (fused) methods = {ContextParallelMethod::kRing, ContextParallelMethod::kAllGather};
    for (const auto method : methods) {
      const auto before = set_context_parallel_method(method);
      const std::string form = !fused                                   ? "matmul softmax"
                               : method == ContextParallelMethod::kRing ? "sdpa ring"
                                                                        : "sdpa all-gather";
      // kExample: tp_transformer's wrapping (tensor + sequence parallel over "tp", fully_shard
      // over "dp", nothing over "cp").
      enum class Wrap { kReplicate, kFullyShard, kTensorParallel, kSequenceParallel, kExample };
      struct Case {
        std::vector<int64_t> shape;
        std::vector<std::string> names;
        Placements tokens;
        Wrap wrap;
      };
      std::vector<Case> cases = {
          {{2}, {"cp"}, {Shard(1)}, Wrap::kReplicate},
          {{3}, {"cp"}, {Shard(1)}, Wrap::kReplicate},
          {{3}, {"cp"}, {Shard(1)}, Wrap::kFullyShard},
          {{2, 2}, {"dp", "cp"}, {Shard(0), Shard(1)}, Wrap::kReplicate},
          {{2, 2}, {"cp", "tp"}, {Shard(1), Replicate()}, Wrap::kTensorParallel},
          {{2, 2}, {"cp", "tp"}, {Shard(1), Replicate()}, Wrap::kSequenceParallel},
      };
      // The head-tail order from the batch to the loss (the rotary tables laid out alike):
      // its attention is the ring on the stored order whatever the method, so once.
      if (fused && method == ContextParallelMethod::kRing) {
        const std::vector<Case> head_tail = {
            {{2}, {"cp"}, {HeadTailShard(1)}, Wrap::kReplicate},
            {{3}, {"cp"}, {HeadTailShard(1)}, Wrap::kFullyShard},
            {{2, 2}, {"dp", "cp"}, {Shard(0), HeadTailShard(1)}, Wrap::kReplicate},
            {{2, 2}, {"cp", "tp"}, {HeadTailShard(1), Replicate()}, Wrap::kTensorParallel},
            {{2, 2}, {"cp", "tp"}, {HeadTailShard(1), Replicate()}, Wrap::kSequenceParallel},
            // A mesh dim of one member ("tp" = 1): plans change layouts there freely.
            {{2, 2, 1},
             {"dp", "cp", "tp"},
             {Shard(0), HeadTailShard(1), Replicate()},
             Wrap::kExample},
        };
        cases.insert(cases.end(), head_tail.begin(), head_tail.end());
      }
      for (const Case& k : cases) {
        const bool head_tail = std::any_of(k.tokens.begin(), k.tokens.end(),
                                           [](const Placement& p) { return p.is_head_tail(); });
        int world = 1;
        std::string what = form + (head_tail ? " head-tail" : "") + ", mesh";
        for (size_t d = 0; d < k.shape.size(); ++d) {
          world *= static_cast<int>(k.shape[d]);
          what += " " + k.names[d] + "=" + std::to_string(k.shape[d]);
        }
        what += k.wrap == Wrap::kReplicate        ? ", replicate"
                : k.wrap == Wrap::kFullyShard     ? ", fully_shard"
                : k.wrap == Wrap::kTensorParallel ? ", tensor parallel + replicate over cp"
                : k.wrap == Wrap::kExample ? ", tensor + sequence parallel + fully_shard over dp"
                                           : ", tensor + sequence parallel + replicate over cp";
        std::vector<Trained> per_rank(world);
        tessera::testing::run_ranks(
            world,
            [&](int rank) {
              auto mesh = init_device_mesh("cpu", k.shape, k.names);
              auto model = copy_of(ref.initial);
              std::shared_ptr<ReplicatedModule> ddp;
              const bool tp = k.wrap == Wrap::kTensorParallel ||
                              k.wrap == Wrap::kSequenceParallel || k.wrap == Wrap::kExample;
              if (tp) {
                llama::PlanOptions o;
                // Sequence parallelism: between the blocks the positions are split over "cp"
                // and, nested inside that, over "tp".
                o.sequence_parallel = k.wrap != Wrap::kTensorParallel;
                o.local_output = false;  // activations keep their sequence split
                o.head_dim = c.head_dim();
                parallelize_module(model, mesh["tp"], llama::tensor_parallel_plan(o));
                if (k.wrap == Wrap::kExample) {
                  for (const auto& layer : *model->layers) fully_shard(*layer, mesh["dp"]);
                  fully_shard(*model, mesh["dp"]);
                } else {
                  ddp = replicate(model, mesh["cp"]);
                }
              } else if (k.wrap == Wrap::kFullyShard) {
                shard_llama(model, mesh);
              } else {
                ddp = replicate(model, mesh);
              }
              const auto tokens = distribute_tensor(task.tokens, mesh, k.tokens, std::nullopt);
              const auto targets = distribute_tensor(task.targets, mesh, k.tokens, std::nullopt);
              if (head_tail) llama::lay_out_rotary_tables(model, mesh, k.tokens, tokens.size(1));
              per_rank[rank] = train(model, tokens, targets);
              expect_same(ref, per_rank[rank], model, what);
              // No op between the batch and the logits puts the rows in order, and the ring
              // only fetches K/V blocks (per layer and step: one per ring step forward, K/V
              // and dK/dV backward).
              if (head_tail) {
                const size_t m = k.names[0] == "cp" ? 0 : 1;
                const auto logits = model->forward(tokens);
                EXPECT_TRUE(spec(logits).placement(static_cast<int64_t>(m)).is_head_tail()) << what;
                const int64_t cp = k.shape[m], layers = c.n_layers;
                EXPECT_EQ(per_rank[rank].forward["send_recv"], 2 * layers * (cp - 1)) << what;
                EXPECT_EQ(per_rank[rank].backward["send_recv"], 4 * layers * (cp - 1)) << what;
              }
              // Under the ring K and V travel point to point, never gathered.
              if (fused && method == ContextParallelMethod::kRing) {
                EXPECT_GT(per_rank[rank].forward["send_recv"], 0) << what;
              }
              // Sequence parallelism ran: the blocks' outputs reduce-scattered over "tp".
              if (k.wrap == Wrap::kSequenceParallel) {  // (kExample's "tp" is one member)
                EXPECT_GT(per_rank[rank].forward["reduce_scatter"], 0) << what;
              }
            },
            {std::chrono::seconds(600)});
        record(what, per_rank[0]);
      }
      set_context_parallel_method(before);
    }
  }
}

// torchtitan's plan as written makes tok_embeddings', wo's and w2's outputs local and lets
// SequenceParallel's hook re-read them as sequence shards. LibTorch has no hooks and the
// hand-written RMSNorm is not one ATen op, so Tessera cannot see that input: an error that
// names the module and the fix, never a silently replicated reading.
TEST(TpLlama, TorchtitanLiteralPlanAsksForDistributedResiduals) {
  register_rmsnorm_member();
  const auto c = uneven_config();
  const Task task = make_task(2, 8, c.vocab_size, 7);
  const Transformer proto = make_reference(c, 29);
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    auto model = copy_of(proto);
    parallelize_module(model, mesh, llama::torchtitan_literal_plan());
    try {
      model->forward(task.tokens);
      ADD_FAILURE() << "a local sequence shard reached a SequenceParallel RMSNorm unnoticed";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("layers.0.attention_norm"), std::string::npos) << msg;
      EXPECT_NE(msg.find("use_local_output(false)"), std::string::npos) << msg;
    }
  });
}
