// Neighbourhood attention (tessera::nn::functional::na2d), forward+backward, one thread per rank.
//  a. Local: NA against dense masked attention on the same input (softmax(QK^T * scale + M) V
//     with M = 0 inside each query's neighbourhood and -inf outside, autograd backward): time
//     (median of --reps) and peak memory (a wrapper around the CPU allocator counts the bytes
//     allocated during the step). Dense holds the N x N scores per head, so it runs on a
//     smaller field (--dense-size); NA runs on both fields.
//  b. Domain parallel: 1 rank (the plain op on the whole field) vs 2 ranks (q, k, v cut along
//     rows), the speed-up, the machine's ceiling (the plain op on each rank's rows, both at
//     once, and on rank 0's alone), and the halo bytes a rank receives against the exact
//     minimum (the K and V rows of the other rank that its queries' windows reach).
// glibc's allocator as it is: the kernels allocate per chunk, not per tap, so its mmap
// threshold no longer shapes the timings (BENCHMARKS.md). TESSERA_NA_KERNEL=taps|blocked picks
// the local kernel.
//
//   ./build/tessera-run -n 2 --no-prefix ./build/bench/bench_neighborhood_attention
//
// Under the launcher the 2-rank timings run the ranks as processes (rank 1 waits idle in a
// barrier while rank 0 times one rank and part a); without it, as two threads of one process.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "tessera/nn/neighborhood_attention.h"
#include "bench_main.h"
#include "counting_allocator.h"
#include "tessera/tessera.h"
#include "tessera/testing/run_ranks.h"

using Clock = std::chrono::steady_clock;
namespace naf = tessera::nn::functional;

namespace {

// Peak bytes through the CPU allocator, process-wide (bench::ProcessCountingAllocator; part
// a runs on one thread, the Gloo threads allocate nothing then).
bench::LiveBytes& g_bytes = bench::process_bytes();

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double mib(int64_t bytes) { return double(bytes) / (1024.0 * 1024.0); }

at::Tensor seeded_randn(const std::vector<int64_t>& shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

struct Shape {
  int64_t size = 128, heads = 4, head_dim = 32, kernel = 7;
  std::vector<int64_t> dims() const { return {1, size, size, heads, head_dim}; }
};

struct Inputs {
  at::Tensor q, k, v, g;  // q, k, v leaves with requires_grad; g the output gradient
};

Inputs make_inputs(const Shape& s) {
  return {seeded_randn(s.dims(), 1).requires_grad_(), seeded_randn(s.dims(), 2).requires_grad_(),
          seeded_randn(s.dims(), 3).requires_grad_(), seeded_randn(s.dims(), 4)};
}

void clear_grads(Inputs& in) {
  for (auto* t : {&in.q, &in.k, &in.v}) t->mutable_grad() = at::Tensor();
}

// ---------------------------------------------------------------------------------------
// a. Local NA vs dense masked attention.

// The neighbourhood along one axis, computed here from NATTEN's rule (dilation 1, stride 1,
// not causal): query i sees keys [a, a + k) with a = clamp(i - k/2, 0, L - k). [L, L] bool.
at::Tensor axis_mask(int64_t L, int64_t k) {
  const auto i = at::arange(L, at::kLong).view({L, 1});
  const auto j = at::arange(L, at::kLong).view({1, L});
  const auto start = at::clamp(i - k / 2, 0, L - k);
  return (j >= start) & (j < start + k);
}

// 0 inside the 2-D neighbourhood (the product of the axes' windows), -inf outside: [N, N]
// with N = size^2, row-major positions.
at::Tensor dense_bias(int64_t size, int64_t k) {
  const auto m = axis_mask(size, k);
  const int64_t n = size * size;
  const auto allowed = (m.view({size, 1, size, 1}) & m.view({1, size, 1, size})).reshape({n, n});
  return at::zeros({n, n}).masked_fill_(allowed.logical_not(),
                                        -std::numeric_limits<float>::infinity());
}

// softmax(Q K^T * scale + bias) V per head; q, k, v [1, S, S, H, D] -> [1, S, S, H, D].
at::Tensor dense_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& bias) {
  const auto sizes = q.sizes().vec();
  const int64_t n = sizes[1] * sizes[2], h = sizes[3], d = sizes[4];
  auto heads_first = [&](const at::Tensor& t) { return t.reshape({n, h, d}).permute({1, 0, 2}); };
  const auto scores =
      at::matmul(heads_first(q), heads_first(k).transpose(1, 2)) * (1.0 / std::sqrt(double(d))) +
      bias;
  const auto out = at::matmul(at::softmax(scores, -1), heads_first(v));  // [H, N, D]
  return out.permute({1, 0, 2}).reshape(sizes);
}

at::Tensor na_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        int64_t kernel) {
  return naf::na2d(q, k, v, {kernel});
}

struct LocalResult {
  double seconds = 0;          // median of the reps, forward + backward
  double forward_seconds = 0;  // median of the reps, forward alone (autograd recording)
  int64_t peak = 0;            // bytes allocated above the inputs during one step, at its peak
  at::Tensor out, dq, dk, dv;
};

template <class F>
LocalResult time_local(Inputs& in, F&& attention, int warmup, int reps) {
  LocalResult r;
  std::vector<double> t;
  for (int i = 0; i < warmup + reps; ++i) {
    clear_grads(in);
    const auto t0 = Clock::now();
    attention(in.q, in.k, in.v).backward(in.g);
    if (i >= warmup) t.push_back(seconds_since(t0));
  }
  r.seconds = median(t);
  t.clear();
  for (int i = 0; i < warmup + reps; ++i) {
    const auto t0 = Clock::now();
    (void)attention(in.q, in.k, in.v);
    if (i >= warmup) t.push_back(seconds_since(t0));
  }
  r.forward_seconds = median(t);
  clear_grads(in);
  const int64_t base = g_bytes.live.load();
  g_bytes.reset_peak();
  {
    auto out = attention(in.q, in.k, in.v);
    out.backward(in.g);
    r.out = out.detach();
  }
  r.peak = g_bytes.peak.load() - base;
  r.dq = in.q.grad();
  r.dk = in.k.grad();
  r.dv = in.v.grad();
  return r;
}

double max_diff(const LocalResult& a, const LocalResult& b) {
  double m = 0;
  const std::vector<std::pair<at::Tensor, at::Tensor>> pairs = {
      {a.out, b.out}, {a.dq, b.dq}, {a.dk, b.dk}, {a.dv, b.dv}};
  for (const auto& [x, y] : pairs) m = std::max(m, (x - y).abs().max().item<double>());
  return m;
}

void local_part(Shape na_shape, int64_t dense_size, int warmup, int reps) {
  std::printf("\n== a. Local na2d forward+backward vs dense masked attention (1 thread) ==\n");
  std::printf(
      "q, k, v [1, S, S, %lld heads, %lld], float32, k=%lld (dilation 1, stride 1, not causal);"
      " step = forward + out.backward(g); median of %d after %d warm-up;\n"
      "peak = bytes allocated above q, k, v and g during one step\n",
      (long long)na_shape.heads, (long long)na_shape.head_dim, (long long)na_shape.kernel, reps,
      warmup);
  std::printf("%-34s %10s %12s %12s %14s %10s\n", "variant", "field", "fwd ms", "ms / step",
              "peak MiB", "max |Δ|");
  std::vector<int64_t> sizes = {dense_size};
  if (na_shape.size != dense_size) sizes.push_back(na_shape.size);
  LocalResult dense;
  for (int64_t size : sizes) {
    Shape s = na_shape;
    s.size = size;
    Inputs in = make_inputs(s);
    const auto na = time_local(
        in, [&](auto& q, auto& k, auto& v) { return na_attention(q, k, v, s.kernel); }, warmup,
        reps);
    if (size == dense_size) {
      const auto bias = dense_bias(size, s.kernel);  // a constant of the layer: not in the step
      dense = time_local(
          in, [&](auto& q, auto& k, auto& v) { return dense_attention(q, k, v, bias); }, warmup,
          reps);
      std::printf("%-34s %4lldx%-5lld %12.1f %12.1f %14.2f %10s\n",
                  "dense masked (matmul, softmax)", (long long)size, (long long)size,
                  1e3 * dense.forward_seconds, 1e3 * dense.seconds, mib(dense.peak), "");
      std::printf("%-34s %4lldx%-5lld %12.1f %12.1f %14.2f %10.1e\n", "na2d", (long long)size,
                  (long long)size, 1e3 * na.forward_seconds, 1e3 * na.seconds, mib(na.peak),
                  max_diff(na, dense));
      std::printf("%-34s %10s %11.1fx %11.1fx %13.1fx\n", "  dense / na2d", "",
                  dense.forward_seconds / na.forward_seconds, dense.seconds / na.seconds,
                  double(dense.peak) / double(na.peak));
    } else {
      std::printf("%-34s %4lldx%-5lld %12.1f %12.1f %14.2f %10s\n", "na2d", (long long)size,
                  (long long)size, 1e3 * na.forward_seconds, 1e3 * na.seconds, mib(na.peak), "");
      const double scale = std::pow(double(size) / double(dense_size), 4);  // N^2
      std::printf(
          "%-34s %4lldx%-5lld %12.0f %12.0f %14.0f %10s   (dense x (N/N_dense)^2, not run)\n",
          "dense masked, extrapolated", (long long)size, (long long)size,
          1e3 * dense.forward_seconds * scale, 1e3 * dense.seconds * scale, mib(dense.peak) * scale,
          "");
      std::printf("%-34s %10s %11.0fx %11.0fx %13.0fx\n", "  dense (extrapolated) / na2d", "",
                  dense.forward_seconds * scale / na.forward_seconds,
                  dense.seconds * scale / na.seconds, mib(dense.peak) * scale / mib(na.peak));
    }
    std::fflush(stdout);
  }
  std::printf("max |Δ|: out, dq, dk, dv of na2d against dense on the same input\n");
}

// ---------------------------------------------------------------------------------------
// b. 1 rank vs 2 ranks.

void barrier(const tessera::compat::BackendPtr& pg) {
  std::vector<at::Tensor> t{at::zeros({1})};
  pg->allreduce(t)->wait();
}

double max_over(const tessera::compat::BackendPtr& pg, double x) {
  std::vector<at::Tensor> t{at::tensor({x}, at::kDouble)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  pg->allreduce(t, o)->wait();
  return t[0].item<double>();
}

std::vector<double> sum_over(const tessera::compat::BackendPtr& pg, std::vector<double> v) {
  std::vector<at::Tensor> t{at::tensor(v, at::kDouble)};
  pg->allreduce(t)->wait();
  auto c = t[0].contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

// The exact K/V rows [lo, hi) the queries [a, e) read along an axis of length L (dilation 1,
// stride 1, not causal; from the window rule, written out here).
std::pair<int64_t, int64_t> reads(int64_t a, int64_t e, int64_t L, int64_t k) {
  const int64_t left = k / 2;
  return {std::clamp<int64_t>(a - left, 0, L - k), std::clamp<int64_t>(e - 1 - left, 0, L - k) + k};
}

struct DistResult {
  std::vector<double> times, alone, solo;  // solo: rank 0's own rows, rank 1 idle
  // per rank: fwd bytes received, bwd bytes received, fwd calls, bwd calls, fwd rows min, bwd rows
  // min
  std::vector<std::vector<double>> per_rank;
  double max_diff = -1;  // against the 1-rank result (rank 0 only)
};

DistResult time_distributed(const Shape& s, int64_t first_rows, int warmup, int reps,
                            const LocalResult* single) {
  auto mesh = tessera::init_device_mesh("cpu", {2});
  auto pg = mesh.group(0);
  const int me = static_cast<int>(mesh.coordinate()[0]);
  const auto rows = tessera::ShardSizes::Given(1, {first_rows, s.size - first_rows});
  const tessera::Placements split = {tessera::Shard(1)};
  auto dist = [&](uint64_t seed) {
    return tessera::distribute_tensor(seeded_randn(s.dims(), seed), mesh, split, std::nullopt,
                                      rows);
  };
  Inputs in{dist(1).detach().requires_grad_(), dist(2).detach().requires_grad_(),
            dist(3).detach().requires_grad_(), dist(4)};
  DistResult r;
  {
    // The machine's ceiling: the plain op on each rank's own rows, both ranks at once (no halo,
    // no Tessera).
    Inputs local{tessera::to_local(in.q).detach().clone().requires_grad_(),
                 tessera::to_local(in.k).detach().clone().requires_grad_(),
                 tessera::to_local(in.v).detach().clone().requires_grad_(),
                 tessera::to_local(in.g).clone()};
    for (int i = 0; i < warmup + reps; ++i) {
      clear_grads(local);
      barrier(pg);
      const auto t0 = Clock::now();
      na_attention(local.q, local.k, local.v, s.kernel).backward(local.g);
      const double t = max_over(pg, seconds_since(t0));
      if (i >= warmup) r.alone.push_back(t);
    }
    // The same work on rank 0 with rank 1 idle: what running both at once costs each.
    if (me == 0)
      for (int i = 0; i < warmup + reps; ++i) {
        clear_grads(local);
        const auto t0 = Clock::now();
        na_attention(local.q, local.k, local.v, s.kernel).backward(local.g);
        if (i >= warmup) r.solo.push_back(seconds_since(t0));
      }
    barrier(pg);
  }
  for (int i = 0; i < warmup + reps; ++i) {
    clear_grads(in);
    barrier(pg);
    const auto t0 = Clock::now();
    na_attention(in.q, in.k, in.v, s.kernel).backward(in.g);
    const double t = max_over(pg, seconds_since(t0));
    if (i >= warmup) r.times.push_back(t);
  }
  // One more step, its forward and backward communication counted apart.
  clear_grads(in);
  at::Tensor out;
  int64_t fwd_recv = 0, bwd_recv = 0, fwd_calls = 0, bwd_calls = 0;
  {
    tessera::CommDebugMode comm;
    out = na_attention(in.q, in.k, in.v, s.kernel);
    fwd_recv = comm.total_bytes_received();
    fwd_calls = comm.get_total_counts();
  }
  {
    tessera::CommDebugMode comm;
    out.backward(in.g);
    bwd_recv = comm.total_bytes_received();
    bwd_calls = comm.get_total_counts();
  }
  // The minimum: forward, the K and V rows of the other rank that this rank's queries read;
  // backward, the dK and dV rows of this rank's keys that the other rank's queries read.
  const int64_t a = me == 0 ? 0 : first_rows, e = me == 0 ? first_rows : s.size;
  const int64_t oa = me == 0 ? first_rows : 0, oe = me == 0 ? s.size : first_rows;
  auto overlap = [](std::pair<int64_t, int64_t> w, int64_t lo, int64_t hi) {
    return std::max<int64_t>(0, std::min(w.second, hi) - std::max(w.first, lo));
  };
  const int64_t fwd_rows = e > a ? overlap(reads(a, e, s.size, s.kernel), oa, oe) : 0;
  const int64_t bwd_rows = oe > oa ? overlap(reads(oa, oe, s.size, s.kernel), a, e) : 0;
  std::vector<double> mine(2 * 6, 0.0);
  const std::vector<double> v = {double(fwd_recv),  double(bwd_recv), double(fwd_calls),
                                 double(bwd_calls), double(fwd_rows), double(bwd_rows)};
  std::copy(v.begin(), v.end(), mine.begin() + 6 * me);
  const auto all = sum_over(pg, mine);
  for (int k = 0; k < 2; ++k)
    r.per_rank.emplace_back(all.begin() + 6 * k, all.begin() + 6 * (k + 1));
  // The same values as one rank (collective: both ranks).
  LocalResult mine_full;
  mine_full.out = tessera::full_tensor(out.detach());
  mine_full.dq = tessera::full_tensor(in.q.grad());
  mine_full.dk = tessera::full_tensor(in.k.grad());
  mine_full.dv = tessera::full_tensor(in.v.grad());
  if (single) r.max_diff = max_diff(mine_full, *single);
  return r;
}

void report_distributed(const Shape& s, int64_t first_rows, double t1, const DistResult& d,
                        const char* mode, int warmup, int reps) {
  const double t2 = median(d.times), ta = median(d.alone);
  std::printf("\n== b. Domain parallel: 1 rank vs 2 ranks (%s, 1 thread each) ==\n", mode);
  std::printf(
      "q, k, v [1, %lld, %lld, %lld, %lld] float32, k=%lld, rows split %lld + %lld; step = forward "
      "+"
      " out.backward(g); median of %d after %d warm-up (2 ranks: the slower rank's time);"
      " %u cores here\n",
      (long long)s.size, (long long)s.size, (long long)s.heads, (long long)s.head_dim,
      (long long)s.kernel, (long long)first_rows, (long long)(s.size - first_rows), reps, warmup,
      std::thread::hardware_concurrency());
  std::printf("  %-62s %10s %10s\n", "", "ms / step", "speed-up");
  std::printf("  %-62s %10.1f %10s\n", "1 rank, plain na2d on the whole field", 1e3 * t1, "");
  const double ts = median(d.solo);
  std::printf("  %-62s %10.1f %9.2fx\n", "1 rank, plain na2d on rank 0's rows only (rank 1 idle)",
              1e3 * ts, t1 / ts);
  std::printf(
      "  %-62s %10.1f %9.2fx  (%.2fx slower than alone: the cores' shared memory bandwidth)\n",
      "2 ranks, plain na2d on each rank's own rows, at once (ceiling)", 1e3 * ta, t1 / ta, ta / ts);
  std::printf("  %-62s %10.1f %9.2fx  (goal >= 1.8x; %.0f%% of the ceiling)\n",
              "2 ranks, distributed na2d", 1e3 * t2, t1 / t2, 100 * ta / t2);
  if (d.max_diff >= 0)
    std::printf("  2 ranks vs 1 rank: max |Δ| of out, dq, dk, dv = %.1e\n", d.max_diff);
  const int64_t row_bytes =
      s.size * s.heads * (s.head_dim + s.head_dim) * 4;  // one K row + one V row
  std::printf(
      "  halo bytes received by each rank (CommDebugMode), against the exact minimum: the other "
      "rank's"
      " K and V rows its windows reach\n  (rows x W %lld x H_kv %lld x (D + Dv) %lld x 4 B)\n",
      (long long)s.size, (long long)s.heads, (long long)(2 * s.head_dim));
  std::printf(
      "  forward: K and V rows read; backward: the dK and dV rows sent home (its minimum when the"
      " forward's K/V windows are kept; a backward that fetches them again receives 2x)\n");
  std::printf("  %4s %14s %14s %8s %14s %14s %8s %6s\n", "rank", "fwd received", "fwd minimum",
              "ratio", "bwd received", "bwd minimum", "ratio", "calls");
  for (int k = 0; k < 2; ++k) {
    const auto& v = d.per_rank[k];
    const double fmin = v[4] * double(row_bytes), bmin = v[5] * double(row_bytes);
    std::printf("  %4d %14.0f %14.0f %8.3f %14.0f %14.0f %8.3f %6.0f\n", k, v[0], fmin, v[0] / fmin,
                v[1], bmin, v[1] / bmin, v[2] + v[3]);
  }
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{
      "Tessera neighbourhood attention: local NA vs dense masked attention, 1 rank vs 2 ranks"};
  Shape local_shape, dist_shape;
  dist_shape.size = 256;
  int64_t dense_size = 64, first_rows = -1;
  int warmup = 1, reps = 3, dist_reps = 5;
  bool skip_local = false, skip_dist = false;
  app.add_option("--size", local_shape.size, "part a: NA field height = width")
      ->capture_default_str();
  app.add_option("--dense-size", dense_size,
                 "part a: field of the dense comparison (NA runs there too)")
      ->capture_default_str();
  app.add_option("--heads", local_shape.heads, "heads (both parts)")->capture_default_str();
  app.add_option("--head-dim", local_shape.head_dim, "head dim D = Dv (both parts)")
      ->capture_default_str();
  app.add_option("--kernel", local_shape.kernel, "kernel size k (both parts)")
      ->capture_default_str();
  app.add_option("--dist-size", dist_shape.size, "part b: field height = width")
      ->capture_default_str();
  app.add_option("--first-rows", first_rows, "part b: rows on rank 0 (default: half)");
  app.add_option("--warmup", warmup, "untimed steps")->capture_default_str();
  app.add_option("--reps", reps, "part a: timed steps (median)")->capture_default_str();
  app.add_option("--dist-reps", dist_reps, "part b: timed steps (median)")->capture_default_str();
  app.add_flag("--skip-local", skip_local, "skip part a");
  app.add_flag("--skip-dist", skip_dist, "skip part b");
  CLI11_PARSE(app, argc, argv);
  dist_shape.heads = local_shape.heads;
  dist_shape.head_dim = local_shape.head_dim;
  dist_shape.kernel = local_shape.kernel;
  if (first_rows < 0) first_rows = dist_shape.size / 2;

  at::set_num_threads(1);
  tessera::init_process_group();
  const int world = tessera::get_world_size(), rank = tessera::get_rank();
  TORCH_CHECK(world == 1 || world == 2,
              "bench_neighborhood_attention runs on 1 process or under tessera-run -n 2");
  const auto started = Clock::now();
  tessera::DeviceMesh pair;
  if (world == 2) pair = tessera::init_device_mesh("cpu", {2});
  const char* mode = world == 2 ? "ranks as processes" : "ranks as threads";

  if (!skip_dist) {
    // 1 rank: the plain op on the whole field (rank 1, if any, waits in the barrier below).
    LocalResult single;
    if (rank == 0) {
      Inputs in = make_inputs(dist_shape);
      single = time_local(
          in, [&](auto& q, auto& k, auto& v) { return na_attention(q, k, v, dist_shape.kernel); },
          warmup, dist_reps);
    }
    DistResult d;
    if (world == 2) {
      barrier(pair.group(0));
      d = time_distributed(dist_shape, first_rows, warmup, dist_reps,
                           rank == 0 ? &single : nullptr);
    } else {
      std::mutex mu;
      tessera::testing::RunOptions opts;
      opts.timeout = std::chrono::minutes(10);
      opts.collective_timeout = std::chrono::minutes(5);
      tessera::testing::run_ranks(
          2,
          [&](int r) {
            at::set_num_threads(1);  // per thread
            auto res = time_distributed(dist_shape, first_rows, warmup, dist_reps,
                                        r == 0 ? &single : nullptr);
            std::lock_guard<std::mutex> lock(mu);
            if (r == 0) d = std::move(res);
          },
          opts);
    }
    if (rank == 0)
      report_distributed(dist_shape, first_rows, single.seconds, d, mode, warmup, dist_reps);
    std::fflush(stdout);
  }
  if (rank == 0 && !skip_local) local_part(local_shape, dense_size, warmup, reps);
  if (rank == 0)
    std::printf(
        "\nlocal kernel: TESSERA_NA_KERNEL=%s\ntotal %.1f s\n",
        std::getenv("TESSERA_NA_KERNEL") ? std::getenv("TESSERA_NA_KERNEL") : "auto (unset)",
        seconds_since(started));
  std::fflush(stdout);
  if (world == 2) barrier(pair.group(0));
  return 0;
}

int main(int argc, char** argv) {
  return counting_bench_main<bench::ProcessCountingAllocator>("bench_neighborhood_attention", run,
                                                              argc, argv);
}
