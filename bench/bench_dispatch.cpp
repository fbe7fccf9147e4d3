// Per-op dispatch overhead: a small op on a distributed tensor on a 1-rank mesh (all the
// wrapper, fallback and rule work, no communication) vs the same plain ATen op.
//   ./build/bench/bench_dispatch --benchmark_min_time=0.5
// Instructions per op (repeatable on a noisy machine), see bench/count_instructions.sh:
//   valgrind --tool=callgrind --toggle-collect='*measured_loop*'
//       ./build/bench/bench_dispatch --count dtensor_add 2000        (one command line)
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

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

// One Adam step over 50 small parameters with gradients, plain vs distributed (replicated
// on a 1-rank mesh: all of the wrapper's work, none of the communication).
struct AdamCase {
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Adam> adam;
  explicit AdamCase(bool distributed) {
    auto& f = fx();
    for (int i = 0; i < 50; ++i) {
      auto p = at::randn({16, 16});
      if (distributed) p = distribute_tensor(p, f.mesh, {Replicate()}, std::nullopt);
      p = p.detach().requires_grad_();
      p.mutable_grad() =
          distributed ? distribute_tensor(at::randn({16, 16}), f.mesh, {Replicate()}, std::nullopt)
                      : at::randn({16, 16});
      params.push_back(p);
    }
    adam = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
    adam->step();  // state allocation happens once, outside the timing
  }
};
AdamCase& adam_case(bool distributed) {
  static AdamCase plain(false), dist(true);
  return distributed ? dist : plain;
}

// Each case once per iteration; plain and distributed variants side by side.
struct Case {
  std::string name;
  std::function<void()> plain, dtensor;
};
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"mm", [] { benchmark::DoNotOptimize(at::mm(fx().a, fx().m)); },
       [] { benchmark::DoNotOptimize(at::mm(fx().da, fx().dm)); }},
      {"view", [] { benchmark::DoNotOptimize(fx().a.view({64})); },
       [] { benchmark::DoNotOptimize(fx().da.view({64})); }},
      {"adam_step_50", [] { adam_case(false).adam->step(); }, [] { adam_case(true).adam->step(); }},
      {"add", [] { benchmark::DoNotOptimize(at::add(fx().a, fx().b)); },
       [] { benchmark::DoNotOptimize(at::add(fx().da, fx().db)); }},
      {"mul_scalar", [] { benchmark::DoNotOptimize(fx().a * 2.0); },
       [] { benchmark::DoNotOptimize(fx().da * 2.0); }},
      {"sum", [] { benchmark::DoNotOptimize(fx().a.sum()); },
       [] { benchmark::DoNotOptimize(fx().da.sum()); }},
      {"detach", [] { benchmark::DoNotOptimize(fx().a.detach()); },
       [] { benchmark::DoNotOptimize(fx().da.detach()); }},
      {"add_", [] { fx().a.add_(fx().b, 0.0); }, [] { fx().da.add_(fx().db, 0.0); }},
  };
  return all;
}

// The loop callgrind counts (--toggle-collect='*measured_loop*'): kept out of line.
__attribute__((noinline)) void measured_loop(const std::function<void()>& fn, int64_t n) {
  for (int64_t i = 0; i < n; ++i) fn();
}

int count_mode(const std::string& which, int64_t n) {
  for (const auto& c : cases()) {
    for (bool dist : {false, true}) {
      if (which != (dist ? "dtensor_" : "plain_") + c.name) continue;
      const auto& fn = dist ? c.dtensor : c.plain;
      for (int i = 0; i < 20; ++i) fn();  // warm caches: the decision, the allocator
      measured_loop(fn, n);
      return 0;
    }
  }
  std::cerr << "unknown case " << which << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "--count") == 0)
    return count_mode(argv[2], std::stoll(argv[3]));
  for (const auto& c : cases()) {
    for (bool dist : {false, true}) {
      const auto fn = dist ? c.dtensor : c.plain;
      benchmark::RegisterBenchmark(((dist ? "BM_dtensor_" : "BM_plain_") + c.name).c_str(),
                                   [fn](benchmark::State& s) {
                                     for (auto _ : s) fn();
                                   });
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
