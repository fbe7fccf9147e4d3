// Redistribute vs a direct c10d collective moving the same bytes, 4 ranks as threads
// (Gloo over loopback). Reports the median of repeated runs per transition and size.
//   ./build/bench/bench_redistribute [--ranks 4] [--iters 20]
// The last row per size times from_local's default shape exchange against ShardSizes::Chunk().
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

#include <CLI/CLI.hpp>
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "tessera/tessera.h"
#include "tessera/testing/run_ranks.h"

using namespace tessera;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double time_ms(const compat::BackendPtr& pg, int iters, F&& f) {
  std::vector<double> t;
  std::vector<at::Tensor> bar{at::zeros({1})};
  for (int i = 0; i < iters + 2; ++i) {
    pg->allreduce(bar)->wait();  // line the ranks up
    auto t0 = Clock::now();
    f();
    auto t1 = Clock::now();
    if (i >= 2) t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera redistribute vs direct c10d collectives"};
  int ranks = 4, iters = 20;
  app.add_option("--ranks", ranks, "ranks (threads)");
  app.add_option("--iters", iters, "timed iterations per case");
  CLI11_PARSE(app, argc, argv);

  std::mutex out;
  std::printf("%-24s %10s %14s %14s %8s\n", "transition", "MiB/rank", "tessera ms", "c10d ms",
              "ratio");
  tessera::testing::run_ranks(ranks, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {ranks});
    auto pg = mesh.group(0);
    for (int64_t rows : {256, 4096}) {
      const int64_t cols = 256;  // float rows of 1 KiB
      auto full = at::randn({rows * ranks, cols});
      auto s0 = distribute_tensor(full, mesh, {Shard(0)}, std::nullopt);
      auto r = distribute_tensor(full, mesh, {Replicate()}, std::nullopt);
      auto local = to_local(s0);
      const double mib = local.numel() * 4.0 / (1 << 20);
      auto report = [&](const char* name, double ours, double direct) {
        if (rank != 0) return;
        std::lock_guard<std::mutex> lock(out);
        std::printf("%-24s %10.2f %14.3f %14.3f %8.2f\n", name, mib, ours, direct, ours / direct);
      };
      // S(0) -> R vs all-gather of the same shards.
      double ours = time_ms(pg, iters, [&] { redistribute(s0, {Replicate()}); });
      double direct = time_ms(pg, iters, [&] {
        std::vector<at::Tensor> in{local};
        std::vector<std::vector<at::Tensor>> o(1);
        for (int i = 0; i < ranks; ++i) o[0].push_back(at::empty_like(local));
        pg->allgather(o, in)->wait();
        at::cat(o[0]);
      });
      report("S(0)->R  all_gather", ours, direct);
      // S(0) -> S(1) vs one all-to-all of the same bytes.
      ours = time_ms(pg, iters, [&] { redistribute(s0, {Shard(1)}); });
      direct = time_ms(pg, iters, [&] {
        auto in = local.reshape({rows, ranks, cols / ranks}).transpose(0, 1).contiguous();
        auto o = at::empty_like(in);
        std::vector<int64_t> sp;
        pg->alltoall_base(o, in, sp, sp)->wait();
        o.reshape({ranks * rows, cols / ranks});
      });
      report("S(0)->S(1) all_to_all", ours, direct);
      // P -> R vs all-reduce.
      auto p = from_local(local, mesh, {Partial()});
      ours = time_ms(pg, iters, [&] { redistribute(p, {Replicate()}); });
      direct = time_ms(pg, iters, [&] {
        std::vector<at::Tensor> buf{local.clone()};
        pg->allreduce(buf)->wait();
      });
      report("P->R     all_reduce", ours, direct);
      // R -> S(0): local slice, no communication, vs a plain narrow + clone.
      ours = time_ms(pg, iters, [&] { redistribute(r, {Shard(0)}); });
      direct = time_ms(pg, iters, [&] { full.narrow(0, rank * rows, rows).clone(); });
      report("R->S(0)  local slice", ours, direct);
      // from_local(S(0)) with default options exchanges the local shapes once (uneven local
      // batches read right); ShardSizes::Chunk() trusts them (PyTorch's cost: nothing moves).
      FromLocalOptions chunk;
      chunk.sizes = ShardSizes::Chunk();
      ours = time_ms(pg, iters, [&] { from_local(local, mesh, {Shard(0)}); });
      direct = time_ms(pg, iters, [&] { from_local(local, mesh, {Shard(0)}, chunk); });
      report("from_local S(0) vs Chunk", ours, direct);
    }
    // What the argument agreement costs a consistent loop (NOTE: [Agreed signatures]): 1,000
    // calls of the cheapest redistribute (R -> S(0) of 256 bytes per rank, a local slice)
    // after the first, taken on trust, vs the same with TESSERA_CHECK_ARGUMENTS=0 and =1.
    {
      auto tiny = distribute_tensor(at::randn({ranks * 4, 16}), mesh, {Replicate()}, std::nullopt);
      std::vector<at::Tensor> bar{at::zeros({1})};
      auto with_env = [&](const char* value, int calls) {
        pg->allreduce(bar)->wait();  // no rank reads the environment while rank 0 writes it
        if (rank == 0) {
          if (value)
            ::setenv("TESSERA_CHECK_ARGUMENTS", value, 1);
          else
            ::unsetenv("TESSERA_CHECK_ARGUMENTS");
        }
        pg->allreduce(bar)->wait();
        const double ms = time_ms(pg, iters, [&] {
          for (int i = 0; i < calls; ++i) redistribute(tiny, {Shard(0)});
        });
        return ms * 1000.0 / calls;  // us per call
      };
      const double off = with_env("0", 1000), trusted = with_env(nullptr, 1000);
      const double every = with_env("1", 20);
      (void)with_env(nullptr, 1);
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(out);
        std::printf(
            "\nR->S(0) of 256 B per rank, us per call: agreed once, then trusted %.2f; "
            "agreement off %.2f (ratio %.3f); exchanged on every call %.1f\n",
            trusted, off, trusted / off, every);
      }
    }
  });
  return 0;
}
