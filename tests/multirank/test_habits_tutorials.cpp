// PyTorch's own distributed tutorials, translated line by line into Tessera: "Getting Started
// with Distributed Data Parallel", "Getting Started with Fully Sharded Data Parallel (FSDP2)",
// "Large Scale Transformer model training with Tensor Parallel" and the torch.distributed.tensor
// examples, with the wrong-but-common variants users write. Each case trains (forward,
// backward, an optimizer step) and compares with the same program on one device in float64,
// or expects a clear error on every rank (docs/design.md, "Never silently wrong").
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <numeric>

#include "fully_shard_helpers.h"

using namespace tessera;
using tessera::fsdp_test::clone_of;
using tessera::test::fresh_dir;

namespace {

namespace fs = std::filesystem;

const test::Tolerance kTight{1e-9, 1e-10};
const tessera::testing::RunOptions kRun{std::chrono::seconds(120)};

// ---------------------------------------------------------------------------------------------
// Shared setup

// float64 data for (step, rank, which), the same on every thread that asks.
at::Tensor data(std::vector<int64_t> shape, int step, int rank, int which) {
  return test::randn(shape, 7000 + 100 * step + 10 * rank + which, at::kDouble);
}
at::Tensor tokens(std::vector<int64_t> shape, int64_t vocab, uint64_t seed) {
  auto g = test::generator(seed);
  return at::randint(vocab, shape, g, at::kLong);
}

at::Tensor value_of(const at::Tensor& t) {
  return is_dtensor(t) ? full_tensor(t.detach()) : t.detach();
}

// Every parameter of `model` (plain or distributed: collective) equals the reference's.
void expect_parameters(torch::nn::Module& model, torch::nn::Module& ref, const std::string& ctx,
                       test::Tolerance tol = kTight) {
  const auto got = model.named_parameters();
  ASSERT_EQ(got.size(), ref.named_parameters().size()) << ctx;
  for (const auto& item : ref.named_parameters()) {
    const at::Tensor* p = got.find(item.key());
    ASSERT_TRUE(p != nullptr) << ctx << ": no parameter " << item.key();
    ASSERT_TRUE(test::matches(value_of(*p), item.value().detach(), tol))
        << ctx << " " << item.key();
  }
}

// The call raises a c10::Error naming every needle (called on every rank: each checks its own).
void expect_error(const std::function<void()>& call, const std::vector<std::string>& needles,
                  const std::string& ctx) {
  try {
    call();
    ADD_FAILURE() << ctx << ": no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << ctx << ": '" << n << "' missing from: " << msg;
  }
}

// dist.barrier(): a tiny all-reduce over the mesh.
void barrier(const DeviceMesh& mesh) {
  comm::all_reduce(mesh.mesh_group(), at::zeros({1}), PartialOp::Sum);
}

// Rank `me`'s rows of a global batch split over the ranks as `table`.
at::Tensor rows_of(const at::Tensor& global, const ShardTable& table, int64_t me) {
  const int64_t off = std::accumulate(table.begin(), table.begin() + me, int64_t{0});
  return global.narrow(0, off, table[me]).clone();
}

// ---------------------------------------------------------------------------------------------
// The DDP tutorial's ToyModel: Linear(10, 10), ReLU, Linear(10, 5).
struct ToyModelImpl : torch::nn::Cloneable<ToyModelImpl> {
  torch::nn::Linear net1{nullptr}, net2{nullptr};
  ToyModelImpl() { reset(); }
  void reset() override {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return net2(at::relu(net1(x))); }
};

// Each process of the tutorial builds its own ToyModel: its own random initial values.
std::shared_ptr<ToyModelImpl> make_toy(uint64_t seed) {
  torch::manual_seed(seed);  // on the test thread (rank threads must not use the global one)
  auto m = std::make_shared<ToyModelImpl>();
  m->to(at::kDouble);
  return m;
}

// DDP's step on one device: every rank's loss on its own batch, the gradients averaged.
at::Tensor ddp_loss(ToyModelImpl& ref, const std::vector<int64_t>& rows, int step, int which = 0) {
  const int n = static_cast<int>(rows.size());
  at::Tensor total = at::zeros({}, at::kDouble);
  for (int r = 0; r < n; ++r)
    if (rows[r] > 0)
      total = total + at::mse_loss(ref.forward(data({rows[r], 10}, step, r, which)),
                                   data({rows[r], 5}, step, r, which + 1));
  return total / n;
}
// The same batches read as one global batch (what a distributed input means).
at::Tensor global_loss(ToyModelImpl& ref, const std::vector<int64_t>& rows, int step,
                       int which = 0) {
  std::vector<at::Tensor> xs, ys;
  for (size_t r = 0; r < rows.size(); ++r) {
    xs.push_back(data({rows[r], 10}, step, static_cast<int>(r), which));
    ys.push_back(data({rows[r], 5}, step, static_cast<int>(r), which + 1));
  }
  return at::mse_loss(ref.forward(at::cat(xs)), at::cat(ys));
}

// Each process's own ToyModel (seeds 40, 41, ...).
std::vector<std::shared_ptr<ToyModelImpl>> toy_inits(int world) {
  std::vector<std::shared_ptr<ToyModelImpl>> inits;
  for (int r = 0; r < world; ++r) inits.push_back(make_toy(40 + r));
  return inits;
}
// One device trained `steps` DDP steps (SGD 0.05) from `init` on plain per-rank batches.
std::shared_ptr<ToyModelImpl> ddp_reference(const std::shared_ptr<ToyModelImpl>& init,
                                            const std::vector<int64_t>& rows, int steps) {
  auto ref = clone_of(init);
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.05));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    ddp_loss(*ref, rows, s).backward();
    opt.step();
  }
  return ref;
}
// Python's model.load_state_dict(sd): a copy_ of each saved value into the parameter.
void load_state_dict(torch::nn::Module& model, torch::nn::Module& saved) {
  at::NoGradGuard no_grad;
  const auto values = saved.named_parameters();
  for (auto& item : model.named_parameters()) item.value().copy_(*values.find(item.key()));
}
// One step of the tutorial's loop on this rank's own plain batch.
void ddp_step(ToyModelImpl& model, torch::optim::Optimizer& opt, const std::vector<int64_t>& rows,
              int rank, int s) {
  opt.zero_grad();
  at::mse_loss(model.forward(data({rows[rank], 10}, s, rank, 0)), data({rows[rank], 5}, s, rank, 1))
      .backward();
  opt.step();
}

enum class Feed { Plain, FromLocal };
const char* name(Feed f) { return f == Feed::Plain ? "plain batches" : "from_local batches"; }

// This rank's batch as the tutorial feeds it (plain) or as Tessera's docs do (from_local).
at::Tensor feed(Feed f, const at::Tensor& local, const DeviceMesh& mesh) {
  return f == Feed::Plain ? local : from_local(local, mesh, {Shard(0)});
}

// ---------------------------------------------------------------------------------------------
// The FSDP2 tutorial's shape of model: an input projection, a list of residual blocks (the
// unit fully_shard is applied to) and an output head. Sizes that do not divide: 10 features
// over 3 and 4 ranks, a head of 3 rows (an empty shard on 4 ranks), a hidden width of 13.
struct BlockImpl : torch::nn::Cloneable<BlockImpl> {
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  BlockImpl() { reset(); }
  void reset() override {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({10})));
    fc1 = register_module("fc1", torch::nn::Linear(10, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2(at::gelu(fc1(norm(x)))); }
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Cloneable<StackImpl> {
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList layers{nullptr};
  StackImpl() { reset(); }
  void reset() override {
    embed = register_module("embed", torch::nn::Linear(7, 10));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) layers->push_back(Block());
    head = register_module("head", torch::nn::Linear(10, 3));
  }
  at::Tensor forward(at::Tensor x) {
    x = embed(x);
    for (const auto& layer : *layers) x = layer->as<BlockImpl>()->forward(x);
    return head(x);
  }
};

std::shared_ptr<StackImpl> make_stack(uint64_t seed = 21) {
  torch::manual_seed(seed);
  auto m = std::make_shared<StackImpl>();
  m->to(at::kDouble);
  return m;
}

// The tutorial's loop: zero, forward, loss, backward, step. Losses as every rank sees them.
template <class Model>
std::vector<double> train_stack(Model& model, torch::optim::Optimizer& opt, const at::Tensor& x,
                                const at::Tensor& y, int steps) {
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    at::Tensor loss = at::mse_loss(model.forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// Per-rank rows of a 9-row global batch: uneven, one rank empty on 3 and 4 ranks.
ShardTable batch_rows(int world) {
  switch (world) {
    case 1: return {9};
    case 2: return {5, 4};
    case 3: return {2, 0, 7};
    default: return {3, 1, 5, 0};
  }
}

// fully_shard as the FSDP2 tutorial applies it: every block, then the root.
void shard_stack(StackImpl& model, const DeviceMesh& mesh, FullyShardOptions options = {}) {
  for (const auto& layer : *model.layers) fully_shard(*layer, mesh, options);
  fully_shard(model, mesh, options);
}

// ---------------------------------------------------------------------------------------------
// The tensor-parallel tutorial's FeedForward: w2(silu(w1(x)) * w3(x)), no biases.
struct FeedForwardImpl : torch::nn::Cloneable<FeedForwardImpl> {
  int64_t dim, hidden;
  bool bias;
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
  FeedForwardImpl(int64_t d, int64_t h, bool b = false) : dim(d), hidden(h), bias(b) { reset(); }
  void reset() override {
    w1 = register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(dim, hidden).bias(bias)));
    w2 = register_module("w2", torch::nn::Linear(torch::nn::LinearOptions(hidden, dim).bias(bias)));
    w3 = register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(dim, hidden).bias(bias)));
  }
  at::Tensor forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }
};
TORCH_MODULE(FeedForward);

// A transformer of feed-forward blocks with the tutorial's names: tok_embeddings, layers.*
// (ffn_norm, feed_forward), norm, output. Vocabulary 11, width 6, hidden 7: all uneven.
struct TinyBlockImpl : torch::nn::Cloneable<TinyBlockImpl> {
  torch::nn::LayerNorm ffn_norm{nullptr};
  FeedForward feed_forward{nullptr};
  TinyBlockImpl() { reset(); }
  void reset() override {
    ffn_norm = register_module("ffn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
    feed_forward = register_module("feed_forward", FeedForward(6, 7));
  }
  at::Tensor forward(const at::Tensor& x) { return x + feed_forward(ffn_norm(x)); }
};
TORCH_MODULE(TinyBlock);

constexpr int64_t kVocab = 11;

struct TinyTransformerImpl : torch::nn::Cloneable<TinyTransformerImpl> {
  torch::nn::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear output{nullptr};
  TinyTransformerImpl() { reset(); }
  void reset() override {
    tok_embeddings = register_module("tok_embeddings", torch::nn::Embedding(kVocab, 6));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) layers->push_back(TinyBlock());
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
    output = register_module("output",
                             torch::nn::Linear(torch::nn::LinearOptions(6, kVocab).bias(false)));
  }
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor h = tok_embeddings(ids);
    for (const auto& layer : *layers) h = layer->as<TinyBlockImpl>()->forward(h);
    return output(norm(h));
  }
};

std::shared_ptr<TinyTransformerImpl> make_tiny(uint64_t seed = 31) {
  torch::manual_seed(seed);
  auto m = std::make_shared<TinyTransformerImpl>();
  m->to(at::kDouble);
  return m;
}

// The tutorial's plan with sequence parallelism (its attention left out). keep_distributed:
// the styles whose outputs the tutorial makes local keep them distributed instead
// (use_local_output(false)), as docs/tensor_parallel.md asks on a slice of a 2-D mesh.
ParallelizePlan sequence_parallel_plan(bool keep_distributed = false) {
  return {
      {"tok_embeddings", RowwiseParallel()
                             .input_layouts(Replicate())
                             .output_layouts(Shard(1))
                             .use_local_output(!keep_distributed)},
      {"layers.*.ffn_norm", SequenceParallel()},
      {"layers.*.feed_forward",
       PrepareModuleInput().input_layouts({Shard(1)}).desired_input_layouts({Replicate()})},
      {"layers.*.feed_forward.w1", ColwiseParallel().use_local_output(!keep_distributed)},
      {"layers.*.feed_forward.w2",
       RowwiseParallel().output_layouts(Shard(1)).use_local_output(!keep_distributed)},
      {"layers.*.feed_forward.w3", ColwiseParallel().use_local_output(!keep_distributed)},
      {"norm", SequenceParallel()},
      {"output",
       ColwiseParallel().input_layouts(Shard(1)).output_layouts(Shard(-1)).use_local_output(false)},
  };
}

// The tutorial's loss: cross entropy over the flattened batch and sequence.
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1));
}

}  // namespace

// =============================================================================================
// Getting Started with Distributed Data Parallel

// demo_basic: each process builds its own ToyModel (its own random values), wraps it for data
// parallelism, builds SGD(lr=0.001) on it and steps once per batch of 20 random rows of its
// own with MSELoss. DDP starts every rank from rank 0's values and averages the gradients:
// one device from rank 0's model, stepping on the mean of the ranks' losses.
TEST(HabitsTutorial, DdpBasicLoopEachRankItsOwnInitAndBatch) {
  for (int world : {1, 2, 3}) {
    std::vector<std::shared_ptr<ToyModelImpl>> inits;
    for (int r = 0; r < world; ++r) inits.push_back(make_toy(100 + r));
    const std::vector<int64_t> rows(world, 20);
    auto ref = clone_of(inits[0]);
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.001));
    for (int s = 0; s < 3; ++s) {
      ref_opt.zero_grad();
      ddp_loss(*ref, rows, s).backward();
      ref_opt.step();
    }
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          auto model = clone_of(inits[rank]);
          auto ddp = replicate(*model, mesh);
          torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.001));
          for (int s = 0; s < 3; ++s) {
            opt.zero_grad();
            at::mse_loss(model->forward(data({20, 10}, s, rank, 0)), data({20, 5}, s, rank, 1))
                .backward();
            opt.step();
          }
          expect_parameters(*model, *ref,
                            std::to_string(world) + " ranks, rank " + std::to_string(rank));
        },
        kRun);
  }
}

// The same loop when the ranks' batches differ in size and one rank has none (the last,
// short batch of an epoch). Fed plain, as the tutorial does, it trains as torch DDP (the mean
// of the ranks' local gradients, an empty rank contributing zeros); fed through from_local
// (docs/data_parallel.md), the loss is the exact mean over the global batch: one device on
// the concatenated batch.
TEST(HabitsTutorial, DdpUnevenBatchesWithAnEmptyRank) {
  const std::vector<std::vector<int64_t>> cases = {{3, 0, 5}, {0, 4}, {2, 5, 0, 1}};
  const auto init = make_toy(7);
  for (Feed f : {Feed::Plain, Feed::FromLocal}) {
    for (const auto& rows : cases) {
      const int world = static_cast<int>(rows.size());
      auto ref = clone_of(init);
      torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      for (int s = 0; s < 3; ++s) {
        ref_opt.zero_grad();
        (f == Feed::Plain ? ddp_loss(*ref, rows, s) : global_loss(*ref, rows, s)).backward();
        ref_opt.step();
      }
      const std::string ctx = std::string(name(f)) + ", rows " + shape_str(rows);
      tessera::testing::run_ranks(
          world,
          [&](int rank) {
            at::set_num_threads(1);
            auto mesh = init_device_mesh("cpu", {world}, {"dp"});
            auto model = clone_of(init);
            auto ddp = replicate(*model, mesh);
            torch::optim::SGD opt(model->parameters(),
                                  torch::optim::SGDOptions(0.05).momentum(0.9));
            for (int s = 0; s < 3; ++s) {
              opt.zero_grad();
              const auto x = feed(f, data({rows[rank], 10}, s, rank, 0), mesh);
              const auto y = feed(f, data({rows[rank], 5}, s, rank, 1), mesh);
              at::mse_loss(model->forward(x), y).backward();
              opt.step();
            }
            expect_parameters(*model, *ref, ctx + ", rank " + std::to_string(rank));
          },
          kRun);
    }
  }
}

// Gradient accumulation (DDP's no_sync, which its docs pair with the tutorial's loop): the
// first micro-batch's backward runs inside no_sync and communicates nothing, the second one
// reduces the accumulated sum; one step per two micro-batches.
TEST(HabitsTutorial, DdpNoSyncAccumulatesMicroBatches) {
  const std::vector<int64_t> rows = {4, 2, 3};
  const int world = 3;
  const auto init = make_toy(8);
  for (Feed f : {Feed::Plain, Feed::FromLocal}) {
    auto ref = clone_of(init);
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < 2; ++s) {
      ref_opt.zero_grad();
      for (int micro : {0, 2})
        (f == Feed::Plain ? ddp_loss(*ref, rows, s, micro) : global_loss(*ref, rows, s, micro))
            .backward();
      ref_opt.step();
    }
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          auto model = clone_of(init);
          auto ddp = replicate(*model, mesh);
          torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
          auto micro_loss = [&](int s, int micro) {
            const auto x = feed(f, data({rows[rank], 10}, s, rank, micro), mesh);
            const auto y = feed(f, data({rows[rank], 5}, s, rank, micro + 1), mesh);
            return at::mse_loss(model->forward(x), y);
          };
          for (int s = 0; s < 2; ++s) {
            opt.zero_grad();
            {
              auto guard = ddp->no_sync();
              micro_loss(s, 0).backward();
            }
            micro_loss(s, 2).backward();
            opt.step();
          }
          expect_parameters(*model, *ref, std::string(name(f)) + ", rank " + std::to_string(rank));
        },
        kRun);
  }
}

// demo_checkpoint: train, then rank 0 alone saves the model with torch.save, a barrier, every
// rank reads the file and training goes on: one device trained as long. With torch DDP's own
// feeding (ReplicateOptions::local_batches: plain parameters); the file is read the way
// Python's load_state_dict writes it, a copy_ into each parameter (LibTorch's
// torch::load(model) does set_ instead: see DISABLED_DdpTorchLoadIntoTheWrappedModel).
TEST(HabitsTutorial, DdpCheckpointSavedByRankZeroLoadedByEveryRank) {
  const std::vector<int64_t> rows = {6, 3};
  const auto inits = toy_inits(2);
  const auto ref = ddp_reference(inits[0], rows, 4);
  const auto blank = make_toy(99);
  const std::string path = fresh_dir("ddp") + "/model.checkpoint";
  tessera::testing::run_ranks(
      2,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2}, {"dp"});
        auto model = clone_of(inits[rank]);
        auto ddp = replicate(*model, mesh, ReplicateOptions().local_batches(true));
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
        ddp_step(*model, opt, rows, rank, 0);
        ddp_step(*model, opt, rows, rank, 1);
        if (rank == 0) torch::save(model, path);
        barrier(mesh);
        auto loaded = clone_of(blank);
        torch::load(loaded, path);
        load_state_dict(*model, *loaded);
        ddp_step(*model, opt, rows, rank, 2);
        ddp_step(*model, opt, rows, rank, 3);
        expect_parameters(*model, *ref, "rank " + std::to_string(rank));
      },
      kRun);
}

// The same habit with replicate's default options (replicated distributed parameters):
// torch.save on rank 0 cannot read them and says what to use instead; Tessera's way is the
// collective export_module (rank 0 writes LibTorch's own file), then import_module.
TEST(HabitsTutorial, DdpRankZeroTorchSaveOfDistributedParametersNamesTheWayOut) {
  const std::vector<int64_t> rows = {6, 3};
  const auto inits = toy_inits(2);
  const auto ref = ddp_reference(inits[0], rows, 4);
  const std::string path = fresh_dir("ddp") + "/model.checkpoint";
  tessera::testing::run_ranks(
      2,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2}, {"dp"});
        auto model = clone_of(inits[rank]);
        auto ddp = replicate(*model, mesh);
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
        ddp_step(*model, opt, rows, rank, 0);
        ddp_step(*model, opt, rows, rank, 1);
        if (rank == 0)
          expect_error([&] { torch::save(model, path); }, {"distributed tensor", "full_tensor"},
                       "torch::save on rank 0");
        checkpoint::export_module(*model, path);
        barrier(mesh);
        checkpoint::import_module(*model, path);
        ddp_step(*model, opt, rows, rank, 2);
        ddp_step(*model, opt, rows, rank, 3);
        expect_parameters(*model, *ref, "rank " + std::to_string(rank));
      },
      kRun);
}

// Disabled: SILENTLY WRONG today. The tutorial's load line in LibTorch, torch::load(model,
// path), into a model under replicate (local batches or the default options) loads the right
// values, but the next backward communicates nothing: InputArchive::read calls set_ on each
// parameter, autograd then drops the parameter's gradient accumulator, and with it the
// post-hook replicate registered on it. Every rank steps on its own gradient and the
// replicas drift apart.
TEST(HabitsTutorial, DISABLED_DdpTorchLoadIntoTheWrappedModel) {
  const std::vector<int64_t> rows = {6, 3};
  const auto inits = toy_inits(2);
  const auto ref = ddp_reference(inits[0], rows, 4);
  for (bool local_batches : {true, false}) {
    const std::string path = fresh_dir("ddp") + "/model.checkpoint";
    tessera::testing::run_ranks(
        2,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {2}, {"dp"});
          auto model = clone_of(inits[rank]);
          auto ddp = replicate(*model, mesh, ReplicateOptions().local_batches(local_batches));
          torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
          ddp_step(*model, opt, rows, rank, 0);
          ddp_step(*model, opt, rows, rank, 1);
          checkpoint::export_module(*model, path);  // (torch::save on rank 0 for local batches)
          barrier(mesh);
          torch::load(model, path);
          ddp_step(*model, opt, rows, rank, 2);
          ddp_step(*model, opt, rows, rank, 3);
          expect_parameters(*model, *ref,
                            std::string(local_batches ? "local batches" : "default") + ", rank " +
                                std::to_string(rank));
        },
        kRun);
  }
}

// =============================================================================================
// Getting Started with Fully Sharded Data Parallel (FSDP2)

// fully_shard on every block of model.layers, then on the root; the optimizer (Adam) built
// afterwards on model.parameters(); each rank's own rows of the batch. 1 to 4 ranks, uneven
// parameter rows and batch rows (an empty rank included).
TEST(HabitsTutorial, FsdpEveryLayerThenRootOptimizerAfter) {
  const auto proto = make_stack();
  const auto x = data({9, 7}, 0, 0, 0), y = data({9, 3}, 0, 0, 1);
  auto ref = clone_of(proto);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01));
  const auto expected = train_stack(*ref, ref_opt, x, y, 3);
  for (int world : {1, 2, 3, 4}) {
    const ShardTable rows = batch_rows(world);
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          auto model = clone_of(proto);
          shard_stack(*model, mesh);
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          const auto dx = from_local(rows_of(x, rows, rank), mesh, {Shard(0)});
          const auto dy = from_local(rows_of(y, rows, rank), mesh, {Shard(0)});
          const std::string ctx = std::to_string(world) + " ranks, rank " + std::to_string(rank);
          fsdp_test::expect_losses(train_stack(*model, opt, dx, dy, 3), expected, ctx);
          expect_parameters(*model, *ref, ctx);
        },
        kRun);
  }
}

// Disabled: SILENTLY WRONG today. The FSDP2 tutorial feeds each rank its own plain batch
// (torch.randn on every rank) to the fully_shard'ed model; FSDP2 then averages the ranks'
// gradients (DDP's semantics, one device on the mean of the ranks' losses). Tessera raises
// nothing, but fully_shard's reduce takes a gradient that is Replicate over the shard dim (a
// plain batch reads as replicated) as this rank's rows without averaging: each rank's rows
// step on its own batch's gradient.
TEST(HabitsTutorial, FsdpPlainPerRankBatchesTrainAsFsdp2) {
  const auto proto = make_stack();
  for (int world : {2, 3}) {
    auto ref = clone_of(proto);
    {
      torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(0.01));
      for (int s = 0; s < 3; ++s) {
        opt.zero_grad();
        at::Tensor total = at::zeros({}, at::kDouble);
        for (int r = 0; r < world; ++r)
          total = total + at::mse_loss(ref->forward(data({3, 7}, s, r, 0)), data({3, 3}, s, r, 1));
        (total / world).backward();
        opt.step();
      }
    }
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          auto model = clone_of(proto);
          shard_stack(*model, mesh);
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          for (int s = 0; s < 3; ++s) {
            opt.zero_grad();
            at::mse_loss(model->forward(data({3, 7}, s, rank, 0)), data({3, 3}, s, rank, 1))
                .backward();
            opt.step();
          }
          expect_parameters(*model, *ref,
                            std::to_string(world) + " ranks, rank " + std::to_string(rank));
        },
        kRun);
  }
}

// The tutorial's mixed precision: MixedPrecisionPolicy(param_dtype, reduce_dtype) passed to
// every fully_shard call; here float32 compute and float64 reduction over float64 master
// weights (bfloat16 / float32 in the tutorial). One device applying the same casts: compute
// on a float32 copy, step the float64 master. Inputs in the master dtype (float64), as the
// tutorial's float32 inputs next to bfloat16 parameters, are cast to param_dtype as FSDP2's
// cast_forward_inputs does: training equals the float32-input run.
TEST(HabitsTutorial, FsdpMixedPrecisionPolicy) {
  const auto proto = make_stack();
  const auto x = data({9, 7}, 1, 0, 0).to(at::kFloat), y = data({9, 3}, 1, 0, 1).to(at::kFloat);
  auto ref = clone_of(proto);
  std::vector<double> expected;
  {
    torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(0.01));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      auto work = clone_of(ref);
      work->to(at::kFloat);
      auto loss = at::mse_loss(work->forward(x), y);
      loss.backward();
      auto master = ref->parameters(), compute = work->parameters();
      for (size_t i = 0; i < master.size(); ++i)
        master[i].mutable_grad() = compute[i].grad().to(at::kDouble);
      opt.step();
      expected.push_back(loss.item<double>());
    }
  }
  const int world = 3;
  const ShardTable rows = batch_rows(world);
  tessera::testing::run_ranks(
      world,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {world}, {"dp"});
        auto model = clone_of(proto);
        MixedPrecisionPolicy mp;
        mp.param_dtype = at::kFloat;
        mp.reduce_dtype = at::kDouble;
        shard_stack(*model, mesh, FullyShardOptions().mp_policy(mp));
        torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
        const auto dx = from_local(rows_of(x, rows, rank).to(at::kDouble), mesh, {Shard(0)});
        const auto dy = from_local(rows_of(y, rows, rank), mesh, {Shard(0)});
        const std::string ctx = "mixed precision, rank " + std::to_string(rank);
        EXPECT_EQ(model->forward(dx).scalar_type(), at::kFloat) << ctx;
        fsdp_test::expect_losses(train_stack(*model, opt, dx, dy, 3), expected, ctx, 1e-5);
        expect_parameters(*model, *ref, ctx, {1e-4, 1e-6});
        for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), at::kDouble);
      },
      kRun);
}

// reshard_after_forward=False (the tutorial's ZeRO-2-like option): the gathered parameters stay
// from forward to backward; training is unchanged.
TEST(HabitsTutorial, FsdpReshardAfterForwardFalse) {
  const auto proto = make_stack();
  const auto x = data({9, 7}, 2, 0, 0), y = data({9, 3}, 2, 0, 1);
  auto ref = clone_of(proto);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01));
  const auto expected = train_stack(*ref, ref_opt, x, y, 3);
  for (int world : {2, 3}) {
    const ShardTable rows = batch_rows(world);
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          auto model = clone_of(proto);
          shard_stack(*model, mesh, FullyShardOptions().reshard_after_forward(false));
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          const auto dx = from_local(rows_of(x, rows, rank), mesh, {Shard(0)});
          const auto dy = from_local(rows_of(y, rows, rank), mesh, {Shard(0)});
          const std::string ctx = std::to_string(world) + " ranks, rank " + std::to_string(rank);
          fsdp_test::expect_losses(train_stack(*model, opt, dx, dy, 3), expected, ctx);
          expect_parameters(*model, *ref, ctx);
          model->forward(dx);
          for (const auto& layer : *model->layers)
            EXPECT_TRUE(fsdp_module_of(*layer)->is_unsharded())
                << ctx << ": a block resharded after forward";
        },
        kRun);
  }
}

// The tutorial's state dicts: save by gathering every sharded parameter with full_tensor()
// and writing the full tensors on rank 0; load into a freshly sharded model by
// distribute_tensor of each full tensor with the sharded parameter's mesh and placements
// (load_state_dict(assign=True) in Python: here copy_ under no_grad). The habit of copying
// the full tensor straight into the sharded parameter (a plain load_state_dict) loads the
// same values. Training then goes on as on one device.
TEST(HabitsTutorial, FsdpFullStateDictSavedOnRankZeroAndLoadedWithDistributeTensor) {
  const auto proto = make_stack();
  const auto x = data({9, 7}, 3, 0, 0), y = data({9, 3}, 3, 0, 1);
  auto ref = clone_of(proto);
  std::vector<double> expected;
  for (int phase = 0; phase < 2; ++phase) {  // a new optimizer after loading
    torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(0.01));
    for (double l : train_stack(*ref, opt, x, y, 2)) expected.push_back(l);
  }
  const auto fresh = make_stack(22);  // the model the checkpoint is loaded into
  const int world = 3;
  const ShardTable rows = batch_rows(world);
  for (bool distribute_on_load : {true, false}) {
    const std::string file = fresh_dir("fsdp") + "/full.pt";
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          const auto dx = from_local(rows_of(x, rows, rank), mesh, {Shard(0)});
          const auto dy = from_local(rows_of(y, rows, rank), mesh, {Shard(0)});
          std::vector<double> losses;
          {
            auto model = clone_of(proto);
            shard_stack(*model, mesh);
            torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
            losses = train_stack(*model, opt, dx, dy, 2);
            std::vector<at::Tensor> full;
            for (const auto& p : model->parameters()) full.push_back(full_tensor(p.detach()));
            if (rank == 0) torch::save(full, file);
          }
          barrier(mesh);
          auto model = clone_of(fresh);
          shard_stack(*model, mesh);
          std::vector<at::Tensor> full;
          torch::load(full, file);
          {
            at::NoGradGuard no_grad;
            auto params = model->parameters();
            ASSERT_EQ(params.size(), full.size());
            for (size_t i = 0; i < params.size(); ++i)
              params[i].copy_(
                  distribute_on_load
                      ? distribute_tensor(full[i], device_mesh(params[i]), placements(params[i]))
                      : full[i]);
          }
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
          for (double l : train_stack(*model, opt, dx, dy, 2)) losses.push_back(l);
          const std::string ctx =
              std::string(distribute_on_load ? "distribute_tensor" : "copy_ of the full tensor") +
              ", rank " + std::to_string(rank);
          fsdp_test::expect_losses(losses, expected, ctx);
          expect_parameters(*model, *ref, ctx);
        },
        kRun);
  }
}

// The tutorial's gradient clipping: clip_grad_norm_ over model.parameters() between backward
// and step, on sharded gradients. The total norm and the clipped step equal one device's.
TEST(HabitsTutorial, FsdpClipGradNormOnShardedGradients) {
  const auto proto = make_stack();
  const auto x = data({9, 7}, 4, 0, 0), y = data({9, 3}, 4, 0, 1);
  auto ref = clone_of(proto);
  std::vector<double> ref_norms;
  {
    torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      at::mse_loss(ref->forward(x), y).backward();
      ref_norms.push_back(torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05));
      opt.step();
    }
  }
  for (int world : {2, 4}) {
    const ShardTable rows = batch_rows(world);
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"dp"});
          auto model = clone_of(proto);
          shard_stack(*model, mesh);
          torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
          const auto dx = from_local(rows_of(x, rows, rank), mesh, {Shard(0)});
          const auto dy = from_local(rows_of(y, rows, rank), mesh, {Shard(0)});
          const std::string ctx = std::to_string(world) + " ranks, rank " + std::to_string(rank);
          for (int s = 0; s < 3; ++s) {
            opt.zero_grad();
            at::mse_loss(model->forward(dx), dy).backward();
            const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 0.05);
            EXPECT_NEAR(norm, ref_norms[s], 1e-10 * (1 + ref_norms[s])) << ctx << " step " << s;
            opt.step();
          }
          expect_parameters(*model, *ref, ctx);
        },
        kRun);
  }
}

// =============================================================================================
// Large Scale Transformer model training with Tensor Parallel

// The tutorial's first plan: w1 and w3 ColwiseParallel, w2 RowwiseParallel, on the Llama
// FeedForward (no biases), with a hidden width that does not divide (11 over 2, 3, 4 ranks).
// Each rank builds its own model (its own random values): parallelize_module takes rank 0's,
// as PyTorch's src_data_rank=0 does. AdamW, 3 steps, a replicated batch [3, 4, 6].
// The variant with biases (nn.Linear's default) on the same 3-D input is an error on every
// rank naming use_local_output (the output must stay distributed for the bias).
TEST(HabitsTutorial, TpFeedForwardColwiseRowwiseUnevenHidden) {
  const auto x = data({3, 4, 6}, 5, 0, 0), y = data({3, 4, 6}, 5, 0, 1);
  for (int world : {1, 2, 3, 4}) {
    std::vector<FeedForward> inits;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(50 + r);
      inits.emplace_back(6, 11);
      inits.back()->to(at::kDouble);
    }
    auto ref = clone_of(inits[0].ptr());
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.01));
    const auto expected = train_stack(*ref, ref_opt, x, y, 3);
    torch::manual_seed(60);
    FeedForward biased(6, 11, true);
    biased->to(at::kDouble);
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world}, {"tp"});
          auto model = clone_of(inits[rank].ptr());
          const ParallelizePlan plan = {
              {"w1", ColwiseParallel()}, {"w2", RowwiseParallel()}, {"w3", ColwiseParallel()}};
          parallelize_module(*model, mesh, plan);
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01));
          const std::string ctx = std::to_string(world) + " ranks, rank " + std::to_string(rank);
          fsdp_test::expect_losses(train_stack(*model, opt, x, y, 3), expected, ctx);
          expect_parameters(*model, *ref, ctx);
          auto with_bias = clone_of(biased.ptr());
          parallelize_module(*with_bias, mesh, plan);
          if (world > 1)
            expect_error([&] { with_bias->forward(x); }, {"use_local_output"}, ctx + ", biases");
        },
        kRun);
  }
}

// The tutorial's sequence-parallel plan: tok_embeddings RowwiseParallel to Shard(1), every
// norm SequenceParallel, feed_forward's input gathered by PrepareModuleInput, w2 back to
// sequence shards, output ColwiseParallel to vocabulary shards kept distributed, and the loss
// under loss_parallel (cross entropy on the flattened batch and sequence). Also the habit of
// forgetting loss_parallel: the usual decomposition runs on the sharded logits, same values.
// A sequence of 5 and a vocabulary of 11 over 1 to 4 ranks.
TEST(HabitsTutorial, TpSequenceParallelNormsAndLossParallel) {
  const auto proto = make_tiny();
  const auto ids = tokens({3, 5}, kVocab, 70), labels = tokens({3, 5}, kVocab, 71);
  auto ref = clone_of(proto);
  std::vector<double> expected;
  {
    torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(0.01));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      auto loss = lm_loss(ref->forward(ids), labels);
      loss.backward();
      opt.step();
      expected.push_back(loss.item<double>());
    }
  }
  for (int world : {1, 2, 3, 4}) {
    for (bool scope : {true, false}) {
      tessera::testing::run_ranks(
          world,
          [&](int rank) {
            at::set_num_threads(1);
            auto mesh = init_device_mesh("cpu", {world}, {"tp"});
            auto model = clone_of(proto);
            parallelize_module(*model, mesh, sequence_parallel_plan());
            torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01));
            std::vector<double> losses;
            for (int s = 0; s < 3; ++s) {
              opt.zero_grad();
              at::Tensor logits = model->forward(ids);
              EXPECT_EQ(placements(logits), (Placements{Shard(2)}));
              at::Tensor loss;
              if (scope) {
                LossParallel guard;
                loss = lm_loss(logits, labels);
                loss.backward();
              } else {
                loss = lm_loss(logits, labels);
                loss.backward();
              }
              opt.step();
              losses.push_back(loss.item<double>());
            }
            const std::string ctx = std::to_string(world) + " ranks" +
                                    (scope ? ", loss_parallel" : ", no scope") + ", rank " +
                                    std::to_string(rank);
            fsdp_test::expect_losses(losses, expected, ctx);
            expect_parameters(*model, *ref, ctx);
          },
          kRun);
    }
  }
}

namespace {

// One device trained 3 AdamW steps on the whole batch with the tutorial's loss.
std::vector<double> train_tiny_reference(TinyTransformerImpl& ref, const at::Tensor& ids,
                                         const at::Tensor& labels) {
  std::vector<double> expected;
  torch::optim::AdamW opt(ref.parameters(), torch::optim::AdamWOptions(0.01));
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    auto loss = lm_loss(ref.forward(ids), labels);
    loss.backward();
    opt.step();
    expected.push_back(loss.item<double>());
  }
  return expected;
}

// On a (dp, tp) mesh: the plan on mesh["tp"], fully_shard on mesh["dp"] for every layer and
// the root, then 3 AdamW steps under loss_parallel on this dp group's rows of the batch.
void train_two_dim(const std::shared_ptr<TinyTransformerImpl>& proto, const ParallelizePlan& plan,
                   const std::function<at::Tensor(const at::Tensor&, const DeviceMesh&)>& batch,
                   const at::Tensor& ids, const at::Tensor& labels, TinyTransformerImpl& ref,
                   const std::vector<double>& expected, const std::string& what) {
  tessera::testing::run_ranks(
      4,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
        auto model = clone_of(proto);
        parallelize_module(*model, mesh["tp"], plan);
        for (const auto& layer : *model->layers) fully_shard(*layer, mesh["dp"]);
        fully_shard(*model, mesh["dp"]);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01));
        const auto my_ids = batch(ids, mesh), my_labels = batch(labels, mesh);
        std::vector<double> losses;
        for (int s = 0; s < 3; ++s) {
          opt.zero_grad();
          LossParallel guard;
          auto loss = lm_loss(model->forward(my_ids), my_labels);
          loss.backward();
          opt.step();
          losses.push_back(loss.item<double>());
        }
        const std::string ctx = "2x2 dp x tp, " + what + ", rank " + std::to_string(rank);
        // (plain batches: each dp group's loss is its own rows' mean, as in PyTorch)
        if (!is_dtensor(my_ids))
          losses[0] = comm::all_reduce(mesh.group(0), at::full({1}, losses[0] / 2, at::kDouble),
                                       PartialOp::Sum)
                          .item<double>();
        EXPECT_NEAR(losses[0], expected[0], 1e-9) << ctx << ": first loss";
        if (is_dtensor(my_ids)) fsdp_test::expect_losses(losses, expected, ctx);
        expect_parameters(*model, ref, ctx);
      },
      kRun);
}

}  // namespace

// The tutorial's 2-D parallelism: init_device_mesh((dp, tp)), the plan on mesh["tp"], then
// fully_shard on mesh["dp"] for every layer and the root; each dp group's own rows of the
// batch (uneven: 3 and 1) declared with from_local, the same rows on both tp ranks;
// loss_parallel. The two local outputs of the 1-D plan stay distributed here (the batch's
// dp sharding must survive between modules).
TEST(HabitsTutorial, TpTwoDimDataTimesTensorParallelWithFullyShard) {
  const auto proto = make_tiny();
  const auto ids = tokens({4, 5}, kVocab, 80), labels = tokens({4, 5}, kVocab, 81);
  auto ref = clone_of(proto);
  const auto expected = train_tiny_reference(*ref, ids, labels);
  const ShardTable rows = {3, 1};
  train_two_dim(
      proto, sequence_parallel_plan(true),
      [&](const at::Tensor& t, const DeviceMesh& mesh) {
        return from_local(rows_of(t, rows, mesh.coordinate()[0]), mesh, {Shard(0), Replicate()});
      },
      ids, labels, *ref, expected, "from_local batches");
}

// The tutorial's 2-D recipe verbatim: its 1-D plan (local outputs), fully_shard over "dp",
// and each dp group's own plain rows. The plain ids reach the embedding on mesh["tp"] as one
// value over "dp" (NOTE: [Plain inputs on a slice]); they differ, so every rank raises naming
// from_local, where this trained silently wrong before (the tensor-parallel rules split work
// over a "replicated" dp dim). The working form of the recipe is
// TpTwoDimDataTimesTensorParallelWithFullyShard (distributed batches and outputs).
TEST(HabitsTutorial, TpTwoDimTutorialVerbatimWithPlainBatches) {
  const auto proto = make_tiny();
  const auto ids = tokens({4, 5}, kVocab, 80), labels = tokens({4, 5}, kVocab, 81);
  auto ref = clone_of(proto);
  const auto expected = train_tiny_reference(*ref, ids, labels);
  const ShardTable rows = {2, 2};
  try {
    train_two_dim(
        proto, sequence_parallel_plan(),
        [&](const at::Tensor& t, const DeviceMesh& mesh) {
          return rows_of(t, rows, mesh.coordinate()[0]);
        },
        ids, labels, *ref, expected, "plain batches");
    ADD_FAILURE() << "per-group plain batches on mesh[\"tp\"] did not raise";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    for (const char* needle : {"differs across mesh dim(s) 'dp'", "from_local", "failed after it"})
      EXPECT_NE(msg.find(needle), std::string::npos) << needle << " missing from: " << msg;
  }
}

// =============================================================================================
// torch.distributed.tensor (DTensor) examples

// distribute_tensor(big_tensor, mesh, placements) then full_tensor(): the round trip gives the
// tensor back on every rank, for 1-D meshes of 1 to 4 ranks and 2-D meshes, uneven shapes.
// The source's values come from rank 0 (src_data_rank=0) even when each rank's differ (each
// process drew its own torch.randn). A leaf made from it trains: its gradient is one device's.
TEST(HabitsTutorial, DTensorDistributeThenFullTensorRoundTrip) {
  struct Case {
    std::vector<int64_t> mesh;
    Placements placements;
  };
  const std::vector<Case> cases = {
      {{1}, {Shard(0)}},
      {{2}, {Shard(0)}},
      {{3}, {Shard(1)}},
      {{4}, {Shard(0)}},
      {{3}, {Replicate()}},
      {{2, 2}, {Shard(0), Shard(1)}},
      {{2, 2}, {Shard(0), Shard(0)}},
      {{2, 2}, {Replicate(), Shard(1)}},
      {{3, 2}, {Shard(1), Replicate()}},
  };
  const auto weight = test::randn({7, 5}, 91, at::kDouble);
  for (const auto& c : cases) {
    const int world = static_cast<int>(
        std::accumulate(c.mesh.begin(), c.mesh.end(), int64_t{1}, std::multiplies<int64_t>()));
    const auto big0 = test::randn({7, 5}, 90, at::kDouble);
    const std::string ctx = "mesh " + shape_str(c.mesh) + " " + to_string(c.placements);
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", c.mesh);
          const auto big = rank == 0 ? big0 : test::randn({7, 5}, 900 + rank, at::kDouble);
          auto dt = distribute_tensor(big, mesh, c.placements);
          ASSERT_TRUE(at::equal(full_tensor(dt), big0)) << ctx << ", rank " << rank;
          dt.requires_grad_(true);
          (full_tensor(dt) * weight).pow(2).sum().backward();
          ASSERT_TRUE(dt.grad().defined()) << ctx;
          ASSERT_TRUE(test::full_matches(dt.grad(), 2 * big0 * weight * weight, kTight))
              << ctx << ", rank " << rank;
        },
        kRun);
  }
}

// The DTensor README's redistribute walk on 2-D meshes: from a Partial layout (from_local of
// per-rank partial sums), P->R, R->S, S->S on the other dim, S->R, checked at each step, then
// backward through the whole chain. Asking redistribute for a Partial target, which torch
// users try for R->P, is refused on every rank.
TEST(HabitsTutorial, DTensorRedistributeSequencesOnTwoDimMeshes) {
  const auto full = test::randn({7, 6}, 95, at::kDouble);
  const auto weight = test::randn({7, 6}, 96, at::kDouble);
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{2, 2}, std::vector<int64_t>{3, 2}}) {
    const int world = static_cast<int>(shape[0] * shape[1]);
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
          auto leaf = test::make_dtensor_from_full(full, mesh, {Partial(), Shard(0)})
                          .detach()
                          .requires_grad_();
          const std::vector<Placements> walk = {{Replicate(), Shard(0)},
                                                {Shard(1), Shard(0)},
                                                {Shard(1), Shard(1)},
                                                {Shard(0), Replicate()},
                                                {Replicate(), Replicate()}};
          at::Tensor t = leaf;
          for (const auto& target : walk) {
            t = redistribute(t, target);
            ASSERT_EQ(placements(t), target);
            ASSERT_TRUE(test::full_matches(t, full, kTight))
                << "mesh " << shape_str(shape) << " to " << to_string(target);
          }
          (t * weight).sum().backward();
          ASSERT_TRUE(test::full_matches(leaf.grad(), weight, kTight))
              << "mesh " << shape_str(shape) << ", rank " << rank;
          const auto replicated = redistribute(leaf.detach(), {Replicate(), Replicate()});
          expect_error(
              [&] {
                redistribute(replicated, {Partial(), Replicate()});
              },
              {"redistribute", "Partial"}, "a Partial target");
        },
        kRun);
  }
}

// DTensor.from_local on local shards of different sizes on a 2x2 mesh: rows split 4/1 over
// "dp", columns 3/0 over "tp" (an empty shard). With the default options the global shape
// and every value and gradient are one device's. PyTorch's from_local(run_check=True) with its
// equal-chunks assumption (ShardSizes::Chunk()) on the same uneven shards is an error on
// every rank naming the fix.
TEST(HabitsTutorial, DTensorFromLocalUnevenLocalShapesOnTwoDimMesh) {
  const auto full = test::randn({5, 3}, 97, at::kDouble);
  const ShardTable rows = {4, 1}, cols = {3, 0};
  auto ref_in = full.clone().requires_grad_();
  auto ref = (ref_in.sum(1).pow(2) + ref_in.exp().sum(1)).mean();
  ref.backward();
  tessera::testing::run_ranks(
      4,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
        const int64_t dp = mesh.coordinate()[0], tp = mesh.coordinate()[1];
        auto block = [&](const at::Tensor& t) {
          return rows_of(rows_of(t, rows, dp).t(), cols, tp).t().contiguous();
        };
        auto local = block(full).requires_grad_();
        auto x = from_local(local, mesh, {Shard(0), Shard(1)});
        ASSERT_EQ(x.sizes().vec(), full.sizes().vec()) << "rank " << rank;
        auto loss = (x.sum(1).pow(2) + x.exp().sum(1)).mean();
        EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-12);
        loss.backward();
        ASSERT_TRUE(test::matches(local.grad(), block(ref_in.grad()), kTight)) << "rank " << rank;
        FromLocalOptions chunk;
        chunk.sizes = ShardSizes::Chunk();
        chunk.run_check = true;
        expect_error(
            [&] {
              from_local(block(full), mesh, {Shard(0), Shard(1)}, chunk);
            },
            {"from_local", "ShardSizes::Infer()"},
            "equal chunks assumed, rank " + std::to_string(rank));
      },
      kRun);
}

// Ops mixing a distributed tensor and a plain one (a weight or bias every rank holds): the
// plain tensor reads as the same value on every rank, so x @ w + b on row shards is one
// device's, and so are the gradients of all three, the plain ones included.
TEST(HabitsTutorial, DTensorMixedWithPlainTensors) {
  const auto x_full = test::randn({7, 4}, 98, at::kDouble);
  const auto w_full = test::randn({4, 3}, 99, at::kDouble),
             b_full = test::randn({3}, 100, at::kDouble);
  auto rx = x_full.clone().requires_grad_(), rw = w_full.clone().requires_grad_(),
       rb = b_full.clone().requires_grad_();
  auto ref = (at::matmul(rx, rw) + rb).tanh().pow(2).mean();
  ref.backward();
  for (int world : {1, 2, 3, 4}) {
    tessera::testing::run_ranks(
        world,
        [&](int rank) {
          at::set_num_threads(1);
          auto mesh = init_device_mesh("cpu", {world});
          auto x = distribute_tensor(x_full, mesh, {Shard(0)});
          x.requires_grad_(true);
          auto w = w_full.clone().requires_grad_(), b = b_full.clone().requires_grad_();
          auto loss = (at::matmul(x, w) + b).tanh().pow(2).mean();
          const std::string ctx = std::to_string(world) + " ranks, rank " + std::to_string(rank);
          EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-12) << ctx;
          loss.backward();
          ASSERT_TRUE(test::full_matches(x.grad(), rx.grad(), kTight)) << ctx;
          ASSERT_TRUE(w.grad().defined() && b.grad().defined()) << ctx;
          EXPECT_TRUE(test::matches(value_of(w.grad()), rw.grad(), kTight))
              << ctx << ": plain weight's gradient";
          EXPECT_TRUE(test::matches(value_of(b.grad()), rb.grad(), kTight))
              << ctx << ": plain bias's gradient";
        },
        kRun);
  }
}
