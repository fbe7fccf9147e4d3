// Tessera's side of the peer benchmark (bench/peer/compare.py runs it next to PyTorch's
// DTensor, bench/peer/dtensor_*.py). Same cases, same timing method, same output lines
// (`PEER {json}`), so the driver can put both in one table.
//   ./build/bench/tessera_peer ops                          # 1-rank mesh, per-op cost
//   ./build/tessera-run -n 4 ./build/bench/tessera_peer redistribute [--iters 20]
//   ./build/tessera-run -n 4 ./build/bench/tessera_peer train [--iters 20]
//   ./build/tessera-run -n 2 ./build/bench/tessera_peer tp [--iters 20]   # also -n 4
//   ./build/tessera-run -n 4 ./build/bench/tessera_peer dp [--iters 20]   # also -n 1, -n 2
// Multi-rank cases run one process per rank (as PyTorch's side does), Gloo over loopback.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include "counting_allocator.h"
#include "llama_plan.h"
#include "tessera/tessera.h"

using namespace tessera;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

namespace {

void emit(const std::string& suite, const std::string& name, const std::string& variant, double us,
          json extra = json::object()) {
  json rec = {
      {"suite", suite}, {"case", name}, {"impl", "tessera"}, {"variant", variant}, {"us", us}};
  rec.update(extra);
  std::printf("PEER %s\n", rec.dump().c_str());
  std::fflush(stdout);
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median cost of one call in microseconds: batches calibrated to >= 20 ms (as peer_common.py).
double per_call_us(const std::function<void()>& fn, int batches = 9) {
  auto t0 = Clock::now();
  for (int calls = 0; calls < 20 || seconds_since(t0) < 0.05; ++calls) fn();
  int64_t n = 1;
  for (;;) {
    auto t = Clock::now();
    for (int64_t i = 0; i < n; ++i) fn();
    if (seconds_since(t) >= 0.02) break;
    n *= 2;
  }
  std::vector<double> samples;
  for (int b = 0; b < batches; ++b) {
    auto t = Clock::now();
    for (int64_t i = 0; i < n; ++i) fn();
    samples.push_back(seconds_since(t) / static_cast<double>(n) * 1e6);
  }
  return median(samples);
}

// Median over `iters` of one call started together on every rank (after a barrier).
double step_us(const std::function<void()>& fn, int iters, const comm::Group& pg) {
  auto barrier = [&] { pg->barrier()->wait(); };
  for (int i = 0; i < 2; ++i) {
    barrier();
    fn();
  }
  std::vector<double> samples;
  for (int i = 0; i < iters; ++i) {
    barrier();
    auto t = Clock::now();
    fn();
    samples.push_back(seconds_since(t) * 1e6);
  }
  return median(samples);
}

json comm_summary(const CommDebugMode& cdm) {
  return {{"bytes", cdm.total_bytes_sent()},
          {"calls", cdm.get_total_counts()},
          {"collectives", cdm.get_comm_counts()}};
}

// One training step: a first call outside the timing (optimizer state, first decisions), the
// collectives of the second, then the median time.
std::pair<double, json> time_training_step(const std::function<void()>& step, int iters,
                                           const comm::Group& pg) {
  step();
  json comm;
  {
    CommDebugMode cdm;
    step();
    comm = comm_summary(cdm);
  }
  return {step_us(step, iters, pg), comm};
}

void per_op_costs() {
  at::set_num_threads(1);
  at::manual_seed(0);
  auto mesh = init_device_mesh("cpu", {1});
  at::Tensor a = at::randn({8, 8}), b = at::randn({8, 8}), m = at::randn({8, 8});
  at::Tensor v = at::randn({16}), w = at::randn({16});
  auto da = distribute_tensor(a, mesh, {Shard(0)});
  auto db = distribute_tensor(b, mesh, {Shard(0)});
  auto dm = distribute_tensor(m, mesh, {Replicate()});
  auto dv = distribute_tensor(v, mesh, {Shard(0)});
  auto dw = distribute_tensor(w, mesh, {Shard(0)});
  using Fn = std::function<void()>;
  const std::vector<std::tuple<std::string, Fn, Fn>> cases = {
      {"add 8x8", [&] { at::add(a, b); }, [&] { at::add(da, db); }},
      {"add 16", [&] { at::add(v, w); }, [&] { at::add(dv, dw); }},
      {"mul scalar 8x8", [&] { a * 2.0; }, [&] { da * 2.0; }},
      {"sum 8x8", [&] { a.sum(); }, [&] { da.sum(); }},
      {"mm 8x8", [&] { at::mm(a, m); }, [&] { at::mm(da, dm); }},
      {"view 8x8", [&] { a.view({64}); }, [&] { da.view({64}); }},
      {"detach 8x8", [&] { a.detach(); }, [&] { da.detach(); }},
      {"add_ 8x8", [&] { a.add_(b, 0.0); }, [&] { da.add_(db, 0.0); }},
  };
  for (const auto& [name, plain, distributed] : cases) {
    emit("ops", name, "plain", per_call_us(plain));
    emit("ops", name, "dist", per_call_us(distributed));
  }
  for (bool dist : {false, true}) {
    std::vector<at::Tensor> params;
    for (int i = 0; i < 50; ++i) {
      at::Tensor p = at::randn({16, 16}), g = at::randn({16, 16});
      if (dist) {
        p = distribute_tensor(p, mesh, {Replicate()});
        g = distribute_tensor(g, mesh, {Replicate()});
      }
      p = p.detach().requires_grad_();
      p.mutable_grad() = g;
      params.push_back(p);
    }
    torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-3));
    adam.step();  // state allocation outside the timing
    emit("ops", "adam step 50x16x16", dist ? "dist" : "plain",
         per_call_us([&] { adam.step(); }, 5));
  }
}

void redistribute_cases(int iters) {
  at::set_num_threads(1);
  at::manual_seed(0);
  const int world = get_world_size();
  auto mesh = init_device_mesh("cpu", {world});
  auto pg = mesh.group(0);
  const int64_t cols = 256;  // float32 rows of 1 KiB
  const std::vector<std::pair<std::string, int64_t>> sizes = {{"0.25MiB", 256}, {"4MiB", 4096}};
  for (const auto& [size, rows] : sizes) {
    for (const auto& [layout, global_rows] : std::vector<std::pair<std::string, int64_t>>{
             {"even", rows * world}, {"uneven", rows * world - 3}}) {
      auto full = at::randn({global_rows, cols});
      auto s0 = distribute_tensor(full, mesh, {Shard(0)});
      auto rep = distribute_tensor(full, mesh, {Replicate()});
      auto part = from_local(full / world, mesh, {Partial()});
      const std::vector<std::tuple<std::string, at::Tensor, Placements>> cases = {
          {"S(0)->R", s0, {Replicate()}}, {"S(0)->S(1)", s0, {Shard(1)}},
          {"P->R", part, {Replicate()}},  {"P->S(0)", part, {Shard(0)}},
          {"R->S(0)", rep, {Shard(0)}},
      };
      for (const auto& [name, src, dst] : cases) {
        auto fn = [&, &src = src, &dst = dst] { redistribute(src, dst); };
        json comm;
        {
          CommDebugMode cdm;
          fn();
          comm = comm_summary(cdm);
        }
        const double us = step_us(fn, iters, pg);
        if (get_rank() == 0)
          emit("redistribute", name + " " + size + " " + layout, "dist", us, comm);
      }
    }
  }
}

// The peer MLP (same in dtensor_train.py): 64 -> 256 -> 256 -> 16, global batch 128.
constexpr int64_t kIn = 64, kHidden = 256, kOut = 16, kBatch = 128;

torch::nn::Sequential mlp() {
  namespace nn = torch::nn;
  at::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, kHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kHidden, kOut));
}

void train(int iters) {
  at::set_num_threads(1);
  const int world = get_world_size(), rank = get_rank();
  auto mesh = init_device_mesh("cpu", {world});
  auto pg = mesh.group(0);
  at::manual_seed(1);
  at::Tensor x = at::randn({kBatch, kIn}), y = at::randn({kBatch, kOut});
  auto timed = [&](const std::string& variant, torch::nn::Sequential model, at::Tensor in,
                   at::Tensor target) {
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
    auto step = [&] {
      adam.zero_grad();
      // As in dtensor_train.py (PyTorch's DTensor has no rule for mse_loss).
      auto loss = (model->forward(in) - target).pow(2).mean();
      loss.backward();
      adam.step();
    };
    const auto [us, comm] = time_training_step(step, iters, pg);
    if (rank == 0) emit("train", "MLP step, data parallel", variant, us, comm);
  };
  const int64_t lo = rank * kBatch / world, hi = (rank + 1) * kBatch / world;
  timed("plain", mlp(), x.slice(0, lo, hi), y.slice(0, lo, hi));  // one rank's share
  auto model = mlp();
  distribute_module(*model, mesh);  // parameters replicated
  timed("dist", model, distribute_tensor(x, mesh, {Shard(0)}),
        distribute_tensor(y, mesh, {Shard(0)}));
}

// Live and peak bytes of the CPU allocator, every thread of the process (the dp suite's
// memory column; counted by bench::ProcessCountingAllocator, installed in main).
bench::LiveBytes& g_bytes = bench::process_bytes();

// Data parallelism (same in dtensor_dp.py): one training step of the peer MLP on 1, 2 or 4
// ranks, every rank on its own share of the global batch:
//   replicate        tessera::replicate, distributed inputs (batch Shard(0), summed gradients);
//   replicate local  tessera::replicate with local_batches(true) (plain batches, averaged);
//   fully_shard      tessera::fully_shard on each Linear, then the root, unsharded from
//                    forward to backward (as FSDP2 in dtensor_dp.py), distributed inputs;
//   plain            the model alone on one rank's share, no communication (scale).
// Per variant: step time, the collectives of one step, and the CPU allocator's peak during
// the third step above the live bytes before the variant was built (as peak_step_bytes in
// dtensor_dp.py counts PyTorch's).
void data_parallel(int iters) {
  at::set_num_threads(1);
  const int world = get_world_size(), rank = get_rank();
  auto mesh = init_device_mesh("cpu", {world});
  auto pg = mesh.group(0);
  const int64_t lo = rank * kBatch / world, hi = (rank + 1) * kBatch / world;
  auto local_batch = [&] {
    at::manual_seed(1);
    at::Tensor x = at::randn({kBatch, kIn}), y = at::randn({kBatch, kOut});
    return std::make_pair(x.slice(0, lo, hi).clone(), y.slice(0, lo, hi).clone());
  };
  const std::vector<std::string> variants = {"plain", "replicate", "replicate local",
                                             "fully_shard"};
  for (const auto& variant : variants) {
    // Memory, then time, each on a model of its own (the first is gone before the second).
    auto run = [&](bool count_memory) {
      const int64_t live_before = g_bytes.live.load();
      auto model = mlp();
      std::shared_ptr<ReplicatedModule> ddp;
      if (variant == "replicate" || variant == "replicate local")
        ddp =
            replicate(model, mesh, ReplicateOptions().local_batches(variant == "replicate local"));
      if (variant == "fully_shard") {
        // Bottom-up, as dtensor_dp.py's FSDP2: one group per Linear, the root owns none.
        // Unsharded from forward to backward, as FSDP2_OPTIONS there (which CPU needs), so
        // both sides gather each parameter once per step.
        const auto opts = FullyShardOptions().reshard_after_forward(false);
        for (const auto& child : model->children())
          if (child->as<torch::nn::Linear>()) fully_shard(*child, mesh, opts);
        fully_shard(*model, mesh, opts);
      }
      at::Tensor x, y;
      std::tie(x, y) = local_batch();
      if (variant == "replicate" || variant == "fully_shard") {
        x = from_local(x, mesh, {Shard(0)});
        y = from_local(y, mesh, {Shard(0)});
      }
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
      auto step = [&] {
        adam.zero_grad();  // set_to_none, as PyTorch's
        (model->forward(x) - y).pow(2).mean().backward();
        adam.step();
      };
      if (count_memory) {
        step();
        step();
        const int64_t start = g_bytes.live.load() - live_before;
        g_bytes.reset_peak();
        step();
        return json{{"mem_peak", g_bytes.peak.load() - live_before}, {"mem_start", start}};
      }
      const auto [us, comm] = time_training_step(step, iters, pg);
      json rec = comm;
      rec["us"] = us;
      return rec;
    };
    json rec = run(/*count_memory=*/true);
    rec.update(run(/*count_memory=*/false));
    rec["ranks"] = world;
    const double us = rec["us"];
    if (rank == 0) emit("dp", "MLP step, " + std::to_string(world) + " ranks", variant, us, rec);
  }
}

// The peer Llama (same in dtensor_tp.py; the model is examples/llama_model.h): 2 blocks,
// dim 128, 8 heads of 16, SwiGLU 384, vocabulary 1024, batch 8 x 64 tokens.
llama::LlamaConfig peer_llama() {
  llama::LlamaConfig c;
  c.vocab_size = 1024;
  c.dim = 128;
  c.n_layers = 2;
  c.n_heads = 8;
  c.ffn_hidden = 384;
  c.max_seq_len = 64;
  return c;
}

llama::Transformer llama_model() {
  at::manual_seed(0);
  return llama::Transformer(peer_llama());
}

// One training step with torchtitan's plan, tensor parallel only and with sequence
// parallelism, and the whole model on one rank.
void tensor_parallel(int iters) {
  at::set_num_threads(1);
  const int world = get_world_size(), rank = get_rank();
  register_member_accessor<llama::RMSNormImpl>(
      [](llama::RMSNormImpl& m, const std::string& name) -> at::Tensor* {
        return name == "weight" ? &m.weight : nullptr;
      });
  auto mesh = init_device_mesh("cpu", {world}, {"tp"});
  auto pg = mesh.group(0);
  const auto c = peer_llama();
  const int64_t seq = c.max_seq_len, batch = 8;
  at::manual_seed(1);
  const auto start = at::randint(0, c.vocab_size, {batch, 1}, at::kLong);
  const auto stride = at::randint(1, 8, {batch, 1}, at::kLong);
  const auto walk =
      at::remainder(start + stride * at::arange(seq + 1, at::kLong).view({1, -1}), c.vocab_size);
  const auto tokens = walk.narrow(1, 0, seq).contiguous(),
             targets = walk.narrow(1, 1, seq).contiguous();
  auto timed = [&](const std::string& variant, llama::Transformer model) {
    torch::optim::AdamW opt(model->parameters(),
                            torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
    auto step = [&] {
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(
          model->forward(tokens).reshape({-1, c.vocab_size}), targets.reshape({-1}));
      loss.backward();
      opt.step();
    };
    const auto [us, comm] = time_training_step(step, iters, pg);
    if (rank == 0) emit("tp", "Llama step, " + std::to_string(world) + " ranks", variant, us, comm);
  };
  timed("plain", llama_model());  // the whole model, no communication
  for (bool sp : {false, true}) {
    const std::string variant = sp ? "tp+sp" : "tp";
    // A failing variant is reported in the table, not the end of the run (every rank fails
    // at the same op, so none is left inside a collective).
    try {
      auto model = llama_model();
      llama::PlanOptions o;
      o.sequence_parallel = sp;
      parallelize_module(model, mesh["tp"], llama::tensor_parallel_plan(o));
      timed(variant, model);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "tessera_peer tp %s: %s\n", variant.c_str(), e.what_without_backtrace());
      if (rank == 0)
        emit("tp", "Llama step, " + std::to_string(world) + " ranks", variant, 0,
             {{"us", nullptr}, {"error", e.what_without_backtrace()}});
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera's side of the peer benchmark (PEER json lines)"};
  int iters = 20;
  app.require_subcommand(1);
  auto* ops_cmd = app.add_subcommand("ops", "per-op cost on a 1-rank mesh");
  auto* redist_cmd = app.add_subcommand("redistribute", "redistribute on every rank");
  auto* train_cmd = app.add_subcommand("train", "one data-parallel MLP step");
  auto* tp_cmd = app.add_subcommand("tp", "one tensor-parallel Llama step (torchtitan's plan)");
  auto* dp_cmd = app.add_subcommand(
      "dp", "one data-parallel MLP step: replicate, fully_shard; time and memory");
  for (auto* c : {redist_cmd, train_cmd, tp_cmd, dp_cmd})
    c->add_option("--iters", iters, "timed iterations");
  CLI11_PARSE(app, argc, argv);
  // Before any tensor exists, and only here: the other suites time the default allocator.
  if (*dp_cmd) {
    static bench::ProcessCountingAllocator counting(c10::GetDefaultCPUAllocator());
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  }
  init_process_group();
  if (*ops_cmd) per_op_costs();
  if (*redist_cmd) redistribute_cases(iters);
  if (*train_cmd) train(iters);
  if (*tp_cmd) tensor_parallel(iters);
  if (*dp_cmd) data_parallel(iters);
  destroy_process_group();
  return 0;
}
