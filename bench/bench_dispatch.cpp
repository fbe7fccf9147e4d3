// Per-op dispatch overhead: a small op on a distributed tensor on a 1-rank mesh (all the
// wrapper, fallback and rule work, no communication) vs the same plain ATen op.
//   ./build/bench/bench_dispatch --benchmark_min_time=0.5
#include <benchmark/benchmark.h>
#include <torch/optim/adam.h>

#include <ATen/ATen.h>

#include "tessera/tessera.h"

using namespace tessera;

namespace {

struct Fixture {
  DeviceMesh mesh;
  at::Tensor a, b, da, db, m, dm;
  Fixture() {
    init_process_group();  // no launcher variables: a world of one rank
    mesh = init_device_mesh("cpu", {1});
    a = at::randn({8, 8});
    b = at::randn({8, 8});
    m = at::randn({8, 8});
    da = distribute_tensor(a, mesh, {Shard(0)});
    db = distribute_tensor(b, mesh, {Shard(0)});
    dm = distribute_tensor(m, mesh, {Replicate()});
  }
};
Fixture& fx() {
  static Fixture f;
  return f;
}

void BM_plain_add(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(at::add(f.a, f.b));
}
void BM_dtensor_add(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(at::add(f.da, f.db));
}
void BM_plain_mul_scalar(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.a * 2.0);
}
void BM_dtensor_mul_scalar(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.da * 2.0);
}
void BM_plain_sum(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.a.sum());
}
void BM_dtensor_sum(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.da.sum());
}
void BM_plain_detach(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.a.detach());
}
void BM_dtensor_detach(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.da.detach());
}
void BM_plain_add_(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) f.a.add_(f.b, 0.0);
}
void BM_dtensor_add_(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) f.da.add_(f.db, 0.0);
}

void BM_plain_mm(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(at::mm(f.a, f.m));
}
void BM_dtensor_mm(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(at::mm(f.da, f.dm));
}
void BM_plain_view(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.a.view({64}));
}
void BM_dtensor_view(benchmark::State& s) {
  auto& f = fx();
  for (auto _ : s) benchmark::DoNotOptimize(f.da.view({64}));
}

// One Adam step over 50 small parameters with gradients, plain vs distributed (replicated
// on a 1-rank mesh: all of the wrapper's work, none of the communication).
void adam_step(benchmark::State& s, bool distributed) {
  auto& f = fx();
  std::vector<at::Tensor> params;
  for (int i = 0; i < 50; ++i) {
    auto p = at::randn({16, 16});
    if (distributed) p = distribute_tensor(p, f.mesh, {Replicate()}, std::nullopt);
    p = p.detach().requires_grad_();
    p.mutable_grad() = distributed ? distribute_tensor(at::randn({16, 16}), f.mesh, {Replicate()},
                                                       std::nullopt)
                                   : at::randn({16, 16});
    params.push_back(p);
  }
  torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-3));
  adam.step();  // state allocation happens once, outside the timing
  for (auto _ : s) adam.step();
}
void BM_plain_adam_step_50(benchmark::State& s) { adam_step(s, false); }
void BM_dtensor_adam_step_50(benchmark::State& s) { adam_step(s, true); }

}  // namespace

BENCHMARK(BM_plain_mm);
BENCHMARK(BM_dtensor_mm);
BENCHMARK(BM_plain_view);
BENCHMARK(BM_dtensor_view);
BENCHMARK(BM_plain_adam_step_50);
BENCHMARK(BM_dtensor_adam_step_50);
BENCHMARK(BM_plain_add);
BENCHMARK(BM_dtensor_add);
BENCHMARK(BM_plain_mul_scalar);
BENCHMARK(BM_dtensor_mul_scalar);
BENCHMARK(BM_plain_sum);
BENCHMARK(BM_dtensor_sum);
BENCHMARK(BM_plain_detach);
BENCHMARK(BM_dtensor_detach);
BENCHMARK(BM_plain_add_);
BENCHMARK(BM_dtensor_add_);
BENCHMARK_MAIN();
