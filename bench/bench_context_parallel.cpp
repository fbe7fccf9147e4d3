// Context parallelism: at::scaled_dot_product_attention, forward + backward, on queries, keys
// and values whose sequence is sharded over P ranks (threads of this process, one CPU thread
// each), with the K/V ring and with the K/V all-gather (NOTE: [Ring attention]), against the
// same step on one rank holding the whole sequence. Per sequence length: step time (median
// of --reps) and peak memory per rank above its inputs (a counting CPU allocator charges
// each allocation to the rank thread that makes it). Causal calls also run the ring without
// its load balancing ("natural": each rank keeps its contiguous rows; NOTE: [Load-balanced
// causal ring]), and on inputs stored in the head-tail order ("stored": HeadTailShard(2), the
// ring's balanced layout, so nothing is dealt per call; NOTE: [Attention on the head-tail
// order]). --kernel products runs every sharded block as matrix products, the kernel
// of non-CPU devices (NOTE: [Block kernels]), in tiles of at most --tile scores.
//
//   ./build/bench/bench_context_parallel --ranks 1,2,4 --lengths 1024,2048,4096
//
// LibTorch 2.x (the fused CPU attention); on 1.13 it prints a skip.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include "bench_main.h"
#include "counting_allocator.h"
#include "ops/attention_ring.h"
#include "tessera/tessera.h"
#include "tessera/testing/run_ranks.h"

namespace {

using Clock = std::chrono::steady_clock;
using KVMethod = tessera::ContextParallelMethod;

bench::LiveBytes g_untracked;
thread_local bench::LiveBytes* t_counter = nullptr;
bench::LiveBytes* charged() { return t_counter ? t_counter : &g_untracked; }
using Allocator = bench::CountingAllocator<bench::LiveBytes, &charged>;

double mib(int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

// Grouped-query heads (enable_gqa) where K/V have fewer heads than the query.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal, c10::nullopt,
                                          q.size(1) != k.size(1));
#elif TORCH_VERSION_MAJOR >= 2
  TORCH_CHECK(q.size(1) == k.size(1), "bench_context_parallel: --kv-heads needs LibTorch 2.5");
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
#else
  (void)q, (void)k, (void)v, (void)causal;
  TORCH_CHECK(false, "bench_context_parallel: this LibTorch has no scaled_dot_product_attention");
#endif
}

struct Shape {
  int64_t batch = 1, heads = 8, kv_heads = 8, head_dim = 64;
  bool causal = true;
};

struct Result {
  double ms = 0;
  int64_t peak = 0;  // bytes above the inputs, the largest over ranks
};

// Forward + backward `reps` times on this thread's tensors; the median time and the peak
// above what was live before.
template <class Step>
Result measure(bench::LiveBytes& mine, int reps, Step step) {
  step();  // warm-up
  const int64_t base = mine.live.load();
  mine.reset_peak();
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    step();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], mine.peak.load() - base};
}

Result one_device(const Shape& s, int64_t L, int reps) {
  bench::LiveBytes mine;
  t_counter = &mine;
  const std::vector<int64_t> dims = {s.batch, s.heads, L, s.head_dim};
  const std::vector<int64_t> kv_dims = {s.batch, s.kv_heads, L, s.head_dim};
  auto q = at::randn(dims).requires_grad_(), k = at::randn(kv_dims).requires_grad_();
  auto v = at::randn(kv_dims).requires_grad_();
  const auto g = at::randn(dims);
  Result r = measure(mine, reps, [&] {
    q.mutable_grad() = at::Tensor(), k.mutable_grad() = at::Tensor(),
    v.mutable_grad() = at::Tensor();
    attention(q, k, v, s.causal).backward(g);
  });
  t_counter = nullptr;
  return r;
}

Result sharded(const Shape& s, int64_t L, int ranks, KVMethod method, int reps, bool balance = true,
               bool stored = false) {
  const KVMethod before = tessera::set_context_parallel_method(method);
  const bool balance_before = tessera::set_context_parallel_load_balance(balance);
  std::vector<Result> per_rank(static_cast<size_t>(ranks));
  tessera::testing::run_ranks(ranks, [&](int rank) {
    at::set_num_threads(1);
    bench::LiveBytes mine;
    t_counter = &mine;
    auto mesh = tessera::init_device_mesh("cpu", {ranks});
    const std::vector<int64_t> dims = {s.batch, s.heads, L, s.head_dim};
    const std::vector<int64_t> kv_dims = {s.batch, s.kv_heads, L, s.head_dim};
    auto lay = [&](uint64_t seed, const std::vector<int64_t>& d) {
      at::manual_seed(seed);
      return tessera::distribute_tensor(at::randn(d), mesh,
                                        {stored ? tessera::HeadTailShard(2) : tessera::Shard(2)});
    };
    auto q = lay(1, dims).requires_grad_(), k = lay(2, kv_dims).requires_grad_();
    auto v = lay(3, kv_dims).requires_grad_();
    const auto g = lay(4, dims);
    per_rank[static_cast<size_t>(rank)] = measure(mine, reps, [&] {
      q.mutable_grad() = at::Tensor(), k.mutable_grad() = at::Tensor(),
      v.mutable_grad() = at::Tensor();
      attention(q, k, v, s.causal).backward(g);
    });
    t_counter = nullptr;
  });
  tessera::set_context_parallel_method(before);
  tessera::set_context_parallel_load_balance(balance_before);
  Result r;
  for (const auto& x : per_rank) r.ms = std::max(r.ms, x.ms), r.peak = std::max(r.peak, x.peak);
  return r;
}

int run(int argc, char** argv) {
  CLI::App app{"Tessera context parallelism: sequence-sharded SDPA, ring vs all-gather"};
  Shape s;
  std::vector<int> ranks = {1, 2, 4};
  std::vector<int64_t> lengths = {1024, 2048, 4096};
  int reps = 3;
  app.add_option("--ranks", ranks, "rank counts (threads)")->delimiter(',');
  app.add_option("--lengths", lengths, "sequence lengths")->delimiter(',');
  app.add_option("--heads", s.heads)->capture_default_str();
  int64_t kv_heads = 0;
  app.add_option("--kv-heads", kv_heads, "K/V heads, grouped-query (default: --heads)");
  app.add_option("--head-dim", s.head_dim)->capture_default_str();
  app.add_option("--batch", s.batch)->capture_default_str();
  app.add_option("--reps", reps, "timed steps (median)")->capture_default_str();
  bool full = false;
  app.add_flag("--full", full, "non-causal attention (default: causal)");
  std::string kernel = "fused";
  app.add_option("--kernel", kernel, "the sharded blocks' kernel")
      ->capture_default_str()
      ->check(CLI::IsMember({"fused", "products"}));
  int64_t tile = int64_t{1} << 24;
  app.add_option("--tile", tile, "with --kernel products: scores per tile over batch and heads")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  s.causal = !full;
  s.kv_heads = kv_heads > 0 ? kv_heads : s.heads;
  namespace attention = tessera::ops::attention;
  attention::set_block_kernel(kernel == "products" ? attention::BlockKernel::kProducts
                                                   : attention::BlockKernel::kFusedOnCpu);
  attention::set_products_tile(tile);
  if (!c10::Dispatcher::singleton().findOp(
          {"aten::_scaled_dot_product_flash_attention_for_cpu", ""})) {
    std::printf("bench_context_parallel: skipped (this LibTorch has no fused CPU attention)\n");
    return 0;
  }
  at::set_num_threads(1);
  std::printf(
      "q, k, v [%ld, %ld heads (K/V %ld), L, %ld], float32, %s; step = forward + backward; "
      "median of %d after 1 warm-up; peak = bytes allocated above the inputs, the "
      "largest rank; sharded blocks by %s\n\n",
      static_cast<long>(s.batch), static_cast<long>(s.heads), static_cast<long>(s.kv_heads),
      static_cast<long>(s.head_dim), s.causal ? "causal" : "not causal", reps,
      kernel == "products"
          ? ("matrix products, tiles of " + std::to_string(tile) + " scores").c_str()
          : "LibTorch's fused CPU kernel");
  std::printf("%8s %6s | %10s %10s %10s %10s %10s | %10s %10s %10s %10s %10s\n", "L", "ranks",
              "1 rank ms", "gather ms", "ring ms", "natural ms", "stored ms", "1 rank MiB",
              "gather MiB", "ring MiB", "natural MiB", "stored MiB");
  for (const int64_t L : lengths) {
    const Result one = one_device(s, L, reps);
    for (const int p : ranks) {
      const Result g = sharded(s, L, p, KVMethod::kAllGather, reps);
      const Result r = sharded(s, L, p, KVMethod::kRing, reps);
      const Result n = s.causal ? sharded(s, L, p, KVMethod::kRing, reps, false) : r;
      const Result h = sharded(s, L, p, KVMethod::kRing, reps, true, /*stored=*/true);
      std::printf(
          "%8ld %6d | %10.1f %10.1f %10.1f %10.1f %10.1f | %10.1f %10.1f %10.1f %10.1f %10.1f\n",
          static_cast<long>(L), p, one.ms, g.ms, r.ms, n.ms, h.ms, mib(one.peak), mib(g.peak),
          mib(r.peak), mib(n.peak), mib(h.peak));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return counting_bench_main<Allocator>("bench_context_parallel", run, argc, argv);
}
