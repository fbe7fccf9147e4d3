// One training step (forward, MSE loss, backward, Adam) of a torch::nn MLP, plain vs with
// distributed parameters and inputs on a 1-rank mesh (all wrapper work, no communication),
// and the op-decision cache hit rate over the timed steps.
//   ./build/bench/bench_training_step --benchmark_min_time=1
#include <benchmark/benchmark.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "tessera/tessera.h"

using namespace tessera;
namespace nn = torch::nn;

namespace {

DeviceMesh& mesh() {
  static DeviceMesh m = [] {
    init_process_group();
    return init_device_mesh("cpu", {1});
  }();
  return m;
}

void step(benchmark::State& state, bool distributed) {
  auto model =
      torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                            torch::nn::ReLU(), torch::nn::Linear(64, 8));
  at::Tensor x = at::randn({16, 32}), y = at::randn({16, 8});
  if (distributed) {
    distribute_module(*model, mesh());
    x = distribute_tensor(x, mesh(), {Shard(0)}, std::nullopt);
    y = distribute_tensor(y, mesh(), {Shard(0)}, std::nullopt);
  }
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  auto one_step = [&] {
    adam.zero_grad();
    auto loss = at::mse_loss(model->forward(x), y);
    loss.backward();
    adam.step();
  };
  one_step();  // optimizer state and first decisions outside the timing
  const auto before = dispatch_cache_stats();
  for (auto _ : state) one_step();
  const auto after = dispatch_cache_stats();
  if (distributed) {
    const double hits = static_cast<double>(after.hits - before.hits);
    const double misses = static_cast<double>(after.misses - before.misses);
    state.counters["cache_hit_rate"] = hits / std::max(1.0, hits + misses);
    state.counters["ops_per_step"] = (hits + misses) / static_cast<double>(state.iterations());
  }
}

void BM_plain_training_step(benchmark::State& s) { step(s, false); }
void BM_dtensor_training_step(benchmark::State& s) { step(s, true); }

}  // namespace

BENCHMARK(BM_plain_training_step);
BENCHMARK(BM_dtensor_training_step);
BENCHMARK_MAIN();
