// Domain parallelism: spatially sharded activations with halo exchange.
//  1. Halo conv2d forward+backward on a large field: 1 rank vs 2 ranks (rows split in two),
//     one thread per rank, with the machine's ceiling (plain convs side by side) and where
//     the time goes (self time per op).
//  2. Halo bytes per step against the analytic minimum: the single conv on 2 ranks, and the
//     domain_demo U-Net on a 2x2 mesh with uneven shards; other collectives listed apart.
//  3. Peak memory per rank of the U-Net's forward+backward, 1 rank vs a 2x2 mesh, counted by
//     a wrapper around the CPU allocator.
//  4. An alpha-beta model of weak scaling to 1,024 ranks from the measured compute time,
//     halo bytes and messages, and all-reduces of one step (a 3x3 mesh gives a corner and
//     an interior rank), and from the measured local work of the halo path.
//
//   ./build-bench/tessera-run -n 2 --no-prefix ./build-bench/bench/bench_domain
//
// Under the launcher the 2-rank timings run ranks as processes (rank 1 waits idle while
// rank 0 times one rank); without it, as two threads of one process. Byte and memory counts
// are exact either way and run ranks as threads (on rank 0 under the launcher).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <time.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <CLI/CLI.hpp>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "heat_net.h"
#include "bench_main.h"
#include "counting_allocator.h"
#include "tessera/tessera.h"
#include "tessera/testing/run_ranks.h"

using namespace tessera;
namespace nn = torch::nn;
using Clock = std::chrono::steady_clock;

namespace {

// ---------------------------------------------------------------------------------------
// Counting CPU allocator. Every allocation is charged to the counter of the thread that
// makes it (ranks may be threads) and remembers that counter in a header in front of the
// data, so a free on any thread credits the right one. The header also gives a working
// raw_deleter: oneDNN allocates through raw_allocate / raw_deleter of the CPU allocator.

// The ops running on this thread, outermost first, while an OpStackTracking lives. Copies:
// a name may live only as long as its RecordFunction.
thread_local std::vector<std::string> t_ops;

struct MemCounter {
  explicit MemCounter(bool owned = true) : owned(owned) {}
  const bool owned;  // one thread raises its peak: it may record where (peak_ops)
  std::atomic<int64_t> live{0}, peak{0};
  std::vector<std::string> peak_ops;  // t_ops when the peak was last raised
  void add(int64_t n) {
    const int64_t now = live.fetch_add(n) + n;
    int64_t p = peak.load();
    while (now > p) {
      if (peak.compare_exchange_weak(p, now)) {
        if (owned) peak_ops = t_ops;
        break;
      }
    }
  }
  void sub(int64_t n) { live.fetch_sub(n); }
  void reset_peak() { peak.store(live.load()); }
};

MemCounter g_untracked{/*owned=*/false};  // threads that set no counter (main, Gloo workers)
thread_local MemCounter* t_counter = nullptr;

// Records the op stack of the calling thread (RecordFunction callbacks) while it lives.
class OpStackTracking {
 public:
  OpStackTracking()
      : handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end))) {}
  ~OpStackTracking() {
    at::removeCallback(handle_);
    t_ops.clear();
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    t_ops.emplace_back(fn.name() ? fn.name() : "?");
    return nullptr;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext*) {
    if (!t_ops.empty()) t_ops.pop_back();
  }
  at::CallbackHandle handle_;
};

// Self time per op name on the calling thread while it lives (RecordFunction callbacks): where
// a step's time goes. Time between ops inside an op (Tessera's own kernel code, waits for
// peers) counts as that op's self time.
class OpProfile {
 public:
  OpProfile()
      : handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end))) {
    t_profile = this;
  }
  ~OpProfile() {
    at::removeCallback(handle_);
    t_profile = nullptr;
  }
  std::map<std::string, double> self;  // seconds

 private:
  struct Frame {
    std::string name;
    Clock::time_point t0;
    double children = 0;
  };
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (t_profile) t_profile->stack_.push_back({fn.name() ? fn.name() : "?", Clock::now(), 0.0});
    return nullptr;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext*) {
    if (!t_profile || t_profile->stack_.empty()) return;
    auto& st = t_profile->stack_;
    const Frame f = st.back();
    st.pop_back();
    const double dur = std::chrono::duration<double>(Clock::now() - f.t0).count();
    t_profile->self[f.name] += dur - f.children;
    if (!st.empty()) st.back().children += dur;
  }
  static inline thread_local OpProfile* t_profile = nullptr;
  std::vector<Frame> stack_;
  at::CallbackHandle handle_;
};

// "outer > ... > inner" without the autograd engine's wrapper names.
std::string op_path(const std::vector<std::string>& ops) {
  std::string out;
  for (const auto& name : ops) {
    if (name.rfind("autograd::engine::evaluate_function: ", 0) == 0) continue;
    out += (out.empty() ? "" : " > ") + name;
  }
  return out.empty() ? "(no op)" : out;
}

// Charges each allocation to the allocating thread's counter (the rank's, in the P=4 runs).
MemCounter* charged_counter() { return t_counter ? t_counter : &g_untracked; }
using CountingAllocator = bench::CountingAllocator<MemCounter, &charged_counter>;

// ---------------------------------------------------------------------------------------
// Every collective record of one thread, in order (CommDebugMode keeps totals per kind;
// the model needs each all-reduce's size and group, and which exchanges carried rows).
struct Recorder : comm::CommObserver {
  std::vector<comm::CommRecord> records;
  Recorder() { comm::push_observer(this); }
  ~Recorder() override { comm::pop_observer(this); }
  void on_collective(const comm::CommRecord& r) override { records.push_back(r); }
};

// ---------------------------------------------------------------------------------------
// The U-Net of examples/domain_demo.cpp.
using heat::HeatNet;

// The 3x3 convolutions of the U-Net: channels in and out, and the resolution they run at
// (1: full, 2: after pooling). Pooling 2x2 / upsampling x2 on even cuts and the 1x1 head
// read only their own rows.
struct ConvLayer {
  const char* name;
  int64_t c_in, c_out, level;
};
const std::vector<ConvLayer> kUnetConvs = {
    {"encode", 1, 8, 1}, {"coarse", 8, 16, 2}, {"decode", 24, 8, 1}};

at::Tensor seeded_randn(const std::vector<int64_t>& shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad() = at::Tensor();
}

// A training step needs every replicated parameter's gradient summed over the ranks.
// distribute_module's parameters get theirs reduced during backward, as they arrive; this
// reduces any that still arrive Partial (none at the time of writing), so a step always
// includes the reduction. Returns how many it had to reduce.
int reduce_grads(torch::nn::Module& m, const DeviceMesh& mesh) {
  const Placements replicate(mesh.ndim(), Replicate());
  int reduced = 0;
  for (auto& p : m.parameters()) {
    if (!p.grad().defined() || placements(p.grad()) == replicate) continue;
    p.mutable_grad() = redistribute(p.grad(), replicate);
    ++reduced;
  }
  return reduced;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the calling thread: a rank's own work, without the time it waits blocked for
// peers (Gloo waits on condition variables) or for a core.
double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// A rank-wide barrier on a group (not counted by any observer: direct c10d call).
void barrier(const compat::BackendPtr& pg) {
  std::vector<at::Tensor> t{at::zeros({1})};
  pg->allreduce(t)->wait();
}

// Elementwise sum of a small double vector over a group (for gathering per-rank figures).
std::vector<double> sum_over(const compat::BackendPtr& pg, std::vector<double> v) {
  std::vector<at::Tensor> t{at::tensor(v, at::kDouble)};
  pg->allreduce(t)->wait();
  auto c = t[0].contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

double max_over(const compat::BackendPtr& pg, double x) {
  std::vector<at::Tensor> t{at::tensor({x}, at::kDouble)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  pg->allreduce(t, o)->wait();
  return t[0].item<double>();
}

// ---------------------------------------------------------------------------------------
// Analytic halo minimum. A 3x3 'same' convolution needs, for each output cell of a block,
// the inputs within one cell of it; those inside the domain but owned by another rank are
// the minimum the rank must receive (corners included: a diagonal neighbour's cell is read).
// Forward: that many input cells x c_in; backward: the same count of output-gradient cells
// x c_out (the gradient of every output that reads one of the rank's inputs).
struct Block {
  int64_t h0, h1, w0, w1;  // rows [h0, h1) x cols [w0, w1)
};

// Cells of the halo-1 window of `b` inside an H x W domain, not counting b itself.
int64_t halo_cells_in_domain(const Block& b, int64_t H, int64_t W) {
  const int64_t rows = std::min(b.h1 + 1, H) - std::max<int64_t>(b.h0 - 1, 0);
  const int64_t cols = std::min(b.w1 + 1, W) - std::max<int64_t>(b.w0 - 1, 0);
  return rows * cols - (b.h1 - b.h0) * (b.w1 - b.w0);
}

// The same window as the library moves it: dims one after the other (rows, then columns of
// the row-extended block). The forward window keeps rows beyond the domain edge as fill
// rows, so its column exchange also carries the fill cells next to a cut; the backward
// window is clamped to the domain.
int64_t halo_cells_dim_by_dim(const Block& b, int64_t H, int64_t W, bool forward) {
  const bool cut_top = b.h0 > 0, cut_bottom = b.h1 < H;
  const bool cut_left = b.w0 > 0, cut_right = b.w1 < W;
  const int64_t rows_from_others = (cut_top ? 1 : 0) + (cut_bottom ? 1 : 0);
  const int64_t extended_rows =
      forward ? (b.h1 - b.h0) + 2 : std::min(b.h1 + 1, H) - std::max<int64_t>(b.h0 - 1, 0);
  const int64_t cols_from_others = (cut_left ? 1 : 0) + (cut_right ? 1 : 0);
  return rows_from_others * (b.w1 - b.w0) + cols_from_others * extended_rows;
}

struct HaloBytes {
  int64_t fwd_min = 0, bwd_min = 0, fwd_dims = 0, bwd_dims = 0;
};

// The U-Net's analytic halo bytes received per step by the rank holding `b` (full
// resolution) of an H x W field, batch B, float32.
HaloBytes unet_halo_bytes(const Block& b, int64_t H, int64_t W, int64_t B) {
  HaloBytes r;
  for (const auto& c : kUnetConvs) {
    const int64_t s = c.level;
    const Block bl{b.h0 / s, b.h1 / s, b.w0 / s, b.w1 / s};
    const int64_t cells_min = halo_cells_in_domain(bl, H / s, W / s);
    r.fwd_min += cells_min * B * c.c_in * 4;
    r.bwd_min += cells_min * B * c.c_out * 4;
    r.fwd_dims += halo_cells_dim_by_dim(bl, H / s, W / s, true) * B * c.c_in * 4;
    r.bwd_dims += halo_cells_dim_by_dim(bl, H / s, W / s, false) * B * c.c_out * 4;
  }
  return r;
}

struct PhaseComm {
  int64_t halo_calls = 0, halo_exchanges = 0;  // send_recv calls; those that moved rows
  int64_t halo_sent = 0, halo_received = 0;
  int64_t ar_calls = 0, ar_sent = 0;        // all_reduce (ring bytes as recorded)
  int64_t other_calls = 0, other_sent = 0;  // anything else (metadata excluded)
};

// Runs f with a CommDebugMode (the byte and call totals) and a Recorder (which exchanges moved
// rows, each all-reduce's group and size) on this thread.
struct Phase {
  PhaseComm c;
  std::vector<comm::CommRecord> records;
};

template <class F>
Phase record_phase(F&& f) {
  Phase p;
  CommDebugMode cdm;
  Recorder rec;
  f();
  using K = comm::CollectiveKind;
  const auto halo = cdm.stats(K::SendRecv), ar = cdm.stats(K::AllReduce);
  p.c.halo_calls = halo.calls;
  p.c.halo_sent = halo.bytes_sent;
  p.c.halo_received = halo.bytes_received;
  p.c.ar_calls = ar.calls;
  p.c.ar_sent = ar.bytes_sent;
  p.c.other_calls = cdm.get_total_counts() - halo.calls - ar.calls;
  p.c.other_sent = cdm.total_bytes_sent() - halo.bytes_sent - ar.bytes_sent;
  for (const auto& r : rec.records)
    if (r.kind == K::SendRecv && (r.bytes_sent > 0 || r.bytes_received > 0)) ++p.c.halo_exchanges;
  p.records = std::move(rec.records);
  return p;
}

PhaseComm add(const PhaseComm& a, const PhaseComm& b) {
  PhaseComm r;
  r.halo_calls = a.halo_calls + b.halo_calls;
  r.halo_exchanges = a.halo_exchanges + b.halo_exchanges;
  r.halo_sent = a.halo_sent + b.halo_sent;
  r.halo_received = a.halo_received + b.halo_received;
  r.ar_calls = a.ar_calls + b.ar_calls;
  r.ar_sent = a.ar_sent + b.ar_sent;
  r.other_calls = a.other_calls + b.other_calls;
  r.other_sent = a.other_sent + b.other_sent;
  return r;
}

// ---------------------------------------------------------------------------------------
// (1) + (2a): the halo convolution.

struct ConvConfig {
  int64_t batch, channels, height, width, first_rows;
  int warmup, iters;
};

// One forward+backward of `conv` on x with output gradient g; grads cleared first.
void conv_step(torch::nn::Conv2d& conv, at::Tensor& x, const at::Tensor& g) {
  clear_grads(*conv);
  x.mutable_grad() = at::Tensor();
  conv->forward(x).backward(g);
}

struct SingleConvResult {
  std::vector<double> times;
  std::map<std::string, double> profile;  // one more step, self time per op
};

SingleConvResult time_single_conv(const ConvConfig& c) {
  torch::manual_seed(0);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(c.channels, c.channels, 3).padding(1));
  auto x = seeded_randn({c.batch, c.channels, c.height, c.width}, 1).requires_grad_();
  const auto g = seeded_randn({c.batch, c.channels, c.height, c.width}, 2);
  SingleConvResult r;
  for (int i = 0; i < c.warmup + c.iters; ++i) {
    const auto t0 = Clock::now();
    conv_step(conv, x, g);
    if (i >= c.warmup) r.times.push_back(seconds_since(t0));
  }
  OpProfile prof;
  conv_step(conv, x, g);
  r.profile = prof.self;
  return r;
}

struct DistConvResult {
  std::vector<double> times;  // per step, the slower rank's
  std::vector<double> alone;  // both ranks convolve their own rows with plain ATen, no halo
  std::vector<double> cpu;    // per step, the larger rank's thread CPU time (Tessera step)
  std::map<std::string, double> profile;  // one more step on this rank, self time per op
  // per rank: halo fwd recv, halo bwd recv, halo calls, all_reduce calls, all_reduce bytes, other
  // calls
  std::vector<std::vector<double>> per_rank;
};

// Runs on every rank of a 2-member world (processes or threads). A step is forward, backward
// and the weight-gradient all-reduce.
DistConvResult time_distributed_conv(const ConvConfig& c) {
  auto mesh = init_device_mesh("cpu", {2});
  auto pg = mesh.group(0);
  const int me = static_cast<int>(mesh.coordinate()[0]);
  torch::manual_seed(0);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(c.channels, c.channels, 3).padding(1));
  distribute_module(*conv, mesh);
  const auto rows = ShardSizes::Given(2, {c.first_rows, c.height - c.first_rows});
  const Placements split = {Shard(2)};
  auto x = distribute_tensor(seeded_randn({c.batch, c.channels, c.height, c.width}, 1), mesh, split,
                             std::nullopt, rows)
               .detach()
               .requires_grad_();
  const auto g = distribute_tensor(seeded_randn({c.batch, c.channels, c.height, c.width}, 2), mesh,
                                   split, std::nullopt, rows);
  DistConvResult r;
  {
    // The ceiling on this machine: the same work per rank, both ranks at once, no halo and no
    // Tessera (what sharing the cores' memory bandwidth and caches leaves of 2x).
    torch::manual_seed(0);
    torch::nn::Conv2d plain(torch::nn::Conv2dOptions(c.channels, c.channels, 3).padding(1));
    auto xl = to_local(x).detach().clone().requires_grad_();
    const auto gl = to_local(g).clone();
    for (int i = 0; i < c.warmup + c.iters; ++i) {
      barrier(pg);
      const auto t0 = Clock::now();
      conv_step(plain, xl, gl);
      const double t = max_over(pg, seconds_since(t0));
      if (i >= c.warmup) r.alone.push_back(t);
    }
  }
  for (int i = 0; i < c.warmup + c.iters; ++i) {
    barrier(pg);
    const auto t0 = Clock::now();
    const double c0 = thread_cpu_seconds();
    conv_step(conv, x, g);
    reduce_grads(*conv, mesh);
    const double cpu = thread_cpu_seconds() - c0;
    const double t = max_over(pg, seconds_since(t0));
    const double cmax = max_over(pg, cpu);
    if (i >= c.warmup) {
      r.times.push_back(t);
      r.cpu.push_back(cmax);
    }
  }
  {
    barrier(pg);
    OpProfile prof;
    conv_step(conv, x, g);
    reduce_grads(*conv, mesh);
    r.profile = prof.self;
  }
  // One more step, recorded: forward and backward apart.
  clear_grads(*conv);
  x.mutable_grad() = at::Tensor();
  at::Tensor out;
  const auto f = record_phase([&] { out = conv->forward(x); });
  const auto b = record_phase([&] { out.backward(g); });
  const auto w = record_phase([&] { reduce_grads(*conv, mesh); });
  std::vector<double> mine(2 * 6, 0.0);
  const std::vector<double> v = {double(f.c.halo_received),
                                 double(b.c.halo_received),
                                 double(f.c.halo_calls + b.c.halo_calls),
                                 double(f.c.ar_calls + b.c.ar_calls + w.c.ar_calls),
                                 double(f.c.ar_sent + b.c.ar_sent + w.c.ar_sent),
                                 double(f.c.other_calls + b.c.other_calls + w.c.other_calls)};
  std::copy(v.begin(), v.end(), mine.begin() + 6 * me);
  const auto all = sum_over(pg, mine);
  for (int k = 0; k < 2; ++k)
    r.per_rank.emplace_back(all.begin() + 6 * k, all.begin() + 6 * (k + 1));
  return r;
}

// Two op profiles side by side, the `top` ops by self time in the second first.
void print_profiles(const std::map<std::string, double>& a, const std::map<std::string, double>& b,
                    const char* name_a, const char* name_b, size_t top) {
  std::vector<std::pair<double, std::string>> ops;
  for (const auto& [name, t] : b) ops.emplace_back(t, name);
  for (const auto& [name, t] : a)
    if (!b.count(name)) ops.emplace_back(0.0, name);
  std::sort(ops.rbegin(), ops.rend());
  std::printf(
      "  self time per op in one profiled step, ms (Tessera's kernel code and waits for peers"
      " count in the enclosing op):\n  %-44s %10s %10s\n",
      "op", name_a, name_b);
  double rest_a = 0, rest_b = 0;
  for (const auto& [name, t] : a) rest_a += t;
  for (const auto& [name, t] : b) rest_b += t;
  for (size_t i = 0; i < ops.size() && i < top; ++i) {
    const auto it = a.find(ops[i].second);
    const double ta = it == a.end() ? 0.0 : it->second;
    rest_a -= ta;
    rest_b -= ops[i].first;
    std::printf("  %-44s %10.1f %10.1f\n", ops[i].second.c_str(), 1e3 * ta, 1e3 * ops[i].first);
  }
  std::printf("  %-44s %10.1f %10.1f\n", "(all other ops)", 1e3 * rest_a, 1e3 * rest_b);
}

void report_conv(const ConvConfig& c, const SingleConvResult& single, const DistConvResult& d,
                 const char* mode) {
  const auto& t1 = single.times;
  const double m1 = median(t1), m2 = median(d.times), ma = median(d.alone);
  std::printf("\n== 1. Halo conv2d forward+backward: 1 rank vs 2 ranks (%s, 1 thread each) ==\n",
              mode);
  std::printf(
      "input [%lld, %lld, %lld, %lld], Conv2d %lld->%lld 3x3 padding 1, step = forward +"
      " out.backward(g) (+ weight-gradient all-reduce on 2 ranks); rows split %lld + %lld\n",
      (long long)c.batch, (long long)c.channels, (long long)c.height, (long long)c.width,
      (long long)c.channels, (long long)c.channels, (long long)c.first_rows,
      (long long)(c.height - c.first_rows));
  std::printf(
      "median of %d steps after %d warm-up (2 ranks: the slower rank's time per step);"
      " %u cores here: the 2-rank runs use %s\n",
      c.iters, c.warmup, std::thread::hardware_concurrency(),
      std::thread::hardware_concurrency() <= 2 ? "all of them" : "two of them");
  std::printf("  1 rank : %8.1f ms/step  (min %.1f, max %.1f)\n", 1e3 * m1,
              1e3 * *std::min_element(t1.begin(), t1.end()),
              1e3 * *std::max_element(t1.begin(), t1.end()));
  std::printf(
      "  2 ranks, plain conv of own rows only, at once: %8.1f ms/step -> ceiling %.2fx on this "
      "machine\n",
      1e3 * ma, m1 / ma);
  std::printf("  2 ranks: %8.1f ms/step  (min %.1f, max %.1f)\n", 1e3 * m2,
              1e3 * *std::min_element(d.times.begin(), d.times.end()),
              1e3 * *std::max_element(d.times.begin(), d.times.end()));
  std::printf("  speed-up T(1)/T(2) = %.2fx  (goal >= 1.85x; ideal 2x); %.0f%% of the ceiling\n",
              m1 / m2, 100 * ma / m2);
  std::printf(
      "  2 ranks, thread CPU time of the slower rank: %.1f ms/step (%.2fx of half the 1-rank"
      " time: local work the halo path adds)\n",
      1e3 * median(d.cpu), median(d.cpu) / (m1 / 2));
  print_profiles(single.profile, d.profile, "1 rank", "2 ranks/r0", 10);

  std::printf("\n== 2a. Halo bytes of one step, single conv on 2 ranks ==\n");
  const int64_t row_in = c.batch * c.channels * c.width * 4;  // one input row, all channels
  const int64_t row_grad = row_in;                            // c_out == c_in here
  std::printf("%4s %14s %14s %14s %14s %8s %9s %13s\n", "rank", "halo fwd recv", "min fwd",
              "halo bwd recv", "min bwd", "ratio", "ar calls", "ar bytes sent");
  for (int k = 0; k < 2; ++k) {
    const auto& v = d.per_rank[k];
    const int64_t cut_sides = 1;  // one cut between the two blocks
    const int64_t fmin = cut_sides * row_in, bmin = cut_sides * row_grad;
    std::printf("%4d %14.0f %14lld %14.0f %14lld %8.3f %9.0f %13.0f\n", k, v[0], (long long)fmin,
                v[1], (long long)bmin, (v[0] + v[1]) / double(fmin + bmin), v[3], v[4]);
  }
  std::printf(
      "  minimum: 1 input row (%lld ch x %lld cols x 4 B) forward and 1 output-gradient row"
      " backward per cut side\n",
      (long long)c.channels, (long long)c.width);
  std::printf(
      "  all_reduce: the weight and bias gradients (%lld floats), ring bytes 2(n-1)/n x size;"
      " send_recv calls per step: %.0f\n",
      (long long)(c.channels * c.channels * 9 + c.channels), d.per_rank[0][2]);
}

// ---------------------------------------------------------------------------------------
// (2b): U-Net bytes on a 2x2 mesh with uneven shards.

ShardTable even_cut(int64_t size, int64_t first) { return {first, size - first}; }

struct UnetStepComm {
  PhaseComm fwd, bwd, grads;
  PhaseComm bwd_frozen;  // backward with frozen parameters: no weight-gradient all-reduces
  std::vector<comm::CommRecord> records;  // the whole step, in order
  Block block{};
};

// One recorded training step without the optimizer (forward + mse_loss, backward, gradient
// all-reduce; after one warm-up step) of the U-Net on `mesh`, the field split by the given row
// and column tables (rows over mesh dim 0, columns over mesh dim 1).
UnetStepComm unet_step_comm(const DeviceMesh& mesh, int64_t B, int64_t H, int64_t W,
                            const ShardTable& rows, const ShardTable& cols) {
  torch::manual_seed(0);
  HeatNet model;
  // Weight gradients summed in replicate()'s bucket: one all-reduce over the whole mesh.
  const auto data_parallel = replicate(*model, mesh);
  const auto tables = ShardSizes::Given({{}, {}, rows, cols});
  const Placements hw = {Shard(2), Shard(3)};
  const auto x = distribute_tensor(seeded_randn({B, 1, H, W}, 3), mesh, hw, std::nullopt, tables);
  const auto y = distribute_tensor(seeded_randn({B, 1, H, W}, 4), mesh, hw, std::nullopt, tables);
  auto forward_backward = [&] {
    clear_grads(*model);
    at::mse_loss(model->forward(x), y).backward();
  };
  forward_backward();  // decisions cached, lazy state built
  reduce_grads(*model, mesh);
  clear_grads(*model);
  UnetStepComm r;
  at::Tensor loss;
  const auto f = record_phase([&] { loss = at::mse_loss(model->forward(x), y); });
  const auto b = record_phase([&] { loss.backward(); });
  const auto g = record_phase([&] { reduce_grads(*model, mesh); });
  r.fwd = f.c, r.bwd = b.c, r.grads = g.c;
  for (const auto* ph : {&f, &b, &g})
    r.records.insert(r.records.end(), ph->records.begin(), ph->records.end());
  // The same backward with the parameters frozen (the input takes their place as the leaf
  // that needs a gradient, so every conv still sends its gradient halo): what is left are
  // the normalisation statistics; the difference is the weight gradients.
  clear_grads(*model);
  for (auto& prm : model->parameters()) prm.requires_grad_(false);
  const auto xl = x.detach().requires_grad_();
  loss = at::mse_loss(model->forward(xl), y);
  r.bwd_frozen = record_phase([&] { loss.backward(); }).c;
  for (auto& prm : model->parameters()) prm.requires_grad_(true);
  const auto off = spec(x).local_offsets();
  const auto ext = spec(x).local_sizes();
  r.block = {off[2], off[2] + ext[2], off[3], off[3] + ext[3]};
  return r;
}

// Payloads of the all-reduces in `records` (the records hold ring bytes, 2(n-1)/n x payload).
struct AllReduceCall {
  int64_t payload, group;
};
std::vector<AllReduceCall> all_reduces(const std::vector<comm::CommRecord>& records) {
  std::vector<AllReduceCall> out;
  for (const auto& r : records) {
    if (r.kind != comm::CollectiveKind::AllReduce || r.group_size <= 1) continue;
    const double payload = double(r.bytes_sent) * r.group_size / (2.0 * (r.group_size - 1));
    out.push_back({4 * std::llround(payload / 4), r.group_size});  // float32 payloads
  }
  return out;
}

void unet_bytes_2x2(int64_t B, int64_t size) {
  // Uneven, even-sized blocks as in the demo: 64 -> rows 24 + 40, cols 36 + 28.
  const int64_t r0 = std::max<int64_t>(2, 2 * (6 * size / 32));
  const int64_t c0 = std::max<int64_t>(2, 2 * (9 * size / 32));
  const ShardTable rows = even_cut(size, r0), cols = even_cut(size, c0);
  std::vector<UnetStepComm> per(4);
  tessera::testing::run_ranks(4, [&](int rank) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {2, 2}, {"h", "w"});
    per[rank] = unet_step_comm(mesh, B, size, size, rows, cols);
  });
  std::printf(
      "\n== 2b. Halo bytes of one step, domain_demo U-Net on a 2x2 mesh (uneven shards) ==\n");
  std::printf(
      "field [%lld, 1, %lld, %lld], rows %lld + %lld, cols %lld + %lld, float32; step = forward +"
      " mse_loss + backward + gradient all-reduce; halo bytes received by each rank\n",
      (long long)B, (long long)size, (long long)size, (long long)rows[0], (long long)rows[1],
      (long long)cols[0], (long long)cols[1]);
  std::printf("%4s %-16s %10s %10s %10s %10s %8s %11s %8s\n", "rank", "block (rows x cols)",
              "halo fwd", "min fwd", "halo bwd", "min bwd", "ratio", "dim-by-dim", "ratio");
  int64_t tot_meas = 0, tot_min = 0, tot_dims = 0;
  for (int k = 0; k < 4; ++k) {
    const auto& p = per[k];
    const auto a = unet_halo_bytes(p.block, size, size, B);
    const int64_t meas = p.fwd.halo_received + p.bwd.halo_received + p.grads.halo_received;
    const int64_t mn = a.fwd_min + a.bwd_min, dims = a.fwd_dims + a.bwd_dims;
    tot_meas += meas;
    tot_min += mn;
    tot_dims += dims;
    char blk[64];
    std::snprintf(blk, sizeof blk, "[%lld,%lld)x[%lld,%lld)", (long long)p.block.h0,
                  (long long)p.block.h1, (long long)p.block.w0, (long long)p.block.w1);
    std::printf("%4d %-16s %10lld %10lld %10lld %10lld %8.4f %11lld %8.4f\n", k, blk,
                (long long)p.fwd.halo_received, (long long)a.fwd_min,
                (long long)p.bwd.halo_received, (long long)a.bwd_min, double(meas) / mn,
                (long long)dims, double(meas) / dims);
  }
  std::printf("%4s %-16s %10s %10s %10s %10s %8.4f %11lld %8.4f\n", "all", "", "", "", "", "",
              double(tot_meas) / tot_min, (long long)tot_dims, double(tot_meas) / tot_dims);
  std::printf(
      "  min = in-domain cells of each 3x3 conv's halo-1 window owned by other ranks (corners"
      " included) x c_in (fwd) / x c_out (bwd), x batch x 4 B\n"
      "  dim-by-dim = the same plus the fill cells beyond the domain edge that the column"
      " exchange of the row-extended forward window carries\n");
  const auto& p = per[0];
  std::printf(
      "collectives of the same step on rank 0 (bytes sent; all_reduce: ring bytes 2(n-1)/n x "
      "payload):\n");
  std::printf("  %-34s %6s %10s\n", "", "calls", "bytes");
  std::printf("  %-34s %6lld %10lld  (%lld moved rows)\n", "send_recv, forward (halo)",
              (long long)p.fwd.halo_calls, (long long)p.fwd.halo_sent,
              (long long)p.fwd.halo_exchanges);
  std::printf("  %-34s %6lld %10lld  (%lld moved rows)\n", "send_recv, backward (gradient halo)",
              (long long)p.bwd.halo_calls, (long long)p.bwd.halo_sent,
              (long long)p.bwd.halo_exchanges);
  // Group norm's forward statistics travel as all-gathers (one per sharded dim), the only
  // collectives of forward besides the halos.
  std::printf("  %-34s %6lld %10lld\n", "all_gather, forward (norm stats)",
              (long long)(p.fwd.ar_calls + p.fwd.other_calls),
              (long long)(p.fwd.ar_sent + p.fwd.other_sent));
  const auto& fz = p.bwd_frozen;
  std::printf("  %-34s %6lld %10lld\n", "all_reduce, backward (norm stats)", (long long)fz.ar_calls,
              (long long)fz.ar_sent);
  std::printf("  %-34s %6lld %10lld  (%lld in backward, %lld after it)\n",
              "all_reduce, weight gradients",
              (long long)(p.bwd.ar_calls - fz.ar_calls + p.grads.ar_calls),
              (long long)(p.bwd.ar_sent - fz.ar_sent + p.grads.ar_sent),
              (long long)(p.bwd.ar_calls - fz.ar_calls), (long long)p.grads.ar_calls);
  std::printf("  %-34s %6lld %10lld\n", "other",
              (long long)(p.bwd.other_calls + p.grads.other_calls),
              (long long)(p.bwd.other_sent + p.grads.other_sent));
  std::map<std::pair<int64_t, int64_t>, int> sizes;
  for (const auto& a : all_reduces(p.records)) ++sizes[{a.group, a.payload}];
  std::printf("  all_reduce payloads (group size:bytes x calls):");
  for (const auto& [k, n] : sizes)
    std::printf(" %lld:%lldx%d", (long long)k.first, (long long)k.second, n);
  std::printf("\n");
}

// ---------------------------------------------------------------------------------------
// (3): peak memory.

struct MemResult {
  int64_t base = 0;                   // live bytes before the step (parameters, input, target)
  int64_t peak_fwd = 0;               // highest live bytes up to the end of forward + loss
  int64_t peak = 0;                   // highest live bytes during the whole step
  std::vector<std::string> peak_ops;  // ops on the stack at the peak
};

// Forward+backward of the U-Net, counted on the calling thread's counter.
MemResult measure_step_memory(HeatNet& model, const at::Tensor& x, const at::Tensor& y,
                              MemCounter& counter) {
  auto step = [&] {
    clear_grads(*model);
    at::mse_loss(model->forward(x), y).backward();
  };
  step();  // warm-up: decision caches and other lazy state are not part of a step
  clear_grads(*model);
  MemResult r;
  r.base = counter.live.load();
  counter.reset_peak();
  OpStackTracking track;
  {
    auto loss = at::mse_loss(model->forward(x), y);
    r.peak_fwd = counter.peak.load();
    loss.backward();
  }
  r.peak = counter.peak.load();
  r.peak_ops = counter.peak_ops;
  clear_grads(*model);
  return r;
}

// The plain module on [B, 1, rows, cols] on a fresh thread with its own counter.
MemResult plain_memory(int64_t B, int64_t rows, int64_t cols) {
  MemResult r;
  tessera::testing::run_ranks(1, [&](int) {
    at::set_num_threads(1);
    MemCounter counter;
    t_counter = &counter;
    {
      torch::manual_seed(0);
      HeatNet model;
      const auto x = seeded_randn({B, 1, rows, cols}, 3);
      const auto y = seeded_randn({B, 1, rows, cols}, 4);
      r = measure_step_memory(model, x, y, counter);
    }
    t_counter = nullptr;
  });
  return r;
}

void memory_report(const std::vector<std::pair<int64_t, int64_t>>& fields) {
  std::vector<std::string> last_sites;
  std::printf(
      "\n== 3. Peak memory per rank, U-Net forward+backward: 1 rank vs 2x2 mesh (even shards) "
      "==\n");
  std::printf(
      "bytes from the CPU allocator, counted per rank thread; peak = highest live bytes during the"
      " step, the parameters, input and target allocated before it included; P=4: the largest"
      " rank; 'tile' = the plain module alone on one rank's quarter\n");
  std::printf("%-12s %9s %9s %9s %9s %9s %9s %8s %7s %11s\n", "field", "P=1 MiB", "P=4 MiB",
              "tile MiB", "P=1 fwd", "P=4 fwd", "tile fwd", "P4/P1", "goal", "P4/tile");
  for (const auto& [size, B] : fields) {
    const MemResult single = plain_memory(B, size, size);
    const MemResult tile = plain_memory(B, size / 2, size / 2);
    std::vector<MemResult> per(4);
    std::vector<MemCounter> counters(4);
    tessera::testing::run_ranks(4, [&](int rank) {
      at::set_num_threads(1);
      t_counter = &counters[rank];
      {
        auto mesh = init_device_mesh("cpu", {2, 2}, {"h", "w"});
        torch::manual_seed(0);
        HeatNet model;
        distribute_module(*model, mesh);
        const Placements hw = {Shard(2), Shard(3)};
        // Each rank slices its block from a full copy; cloning the block lets the copy die.
        at::Tensor x =
            distribute_tensor(seeded_randn({B, 1, size, size}, 3), mesh, hw, std::nullopt);
        at::Tensor y =
            distribute_tensor(seeded_randn({B, 1, size, size}, 4), mesh, hw, std::nullopt);
        x = from_local(to_local(x).clone(), mesh, hw);
        y = from_local(to_local(y).clone(), mesh, hw);
        per[rank] = measure_step_memory(model, x, y, counters[rank]);
      }
      t_counter = nullptr;
    });
    MemResult worst;
    for (const auto& m : per) {
      if (m.peak > worst.peak) worst.peak_ops = m.peak_ops;
      worst.peak = std::max(worst.peak, m.peak);
      worst.peak_fwd = std::max(worst.peak_fwd, m.peak_fwd);
    }
    last_sites = {op_path(single.peak_ops), op_path(worst.peak_ops), op_path(tile.peak_ops)};
    const double mib = 1.0 / (1 << 20);
    char name[32];
    std::snprintf(name, sizeof name, "%lldx%lld b%lld", (long long)size, (long long)size,
                  (long long)B);
    std::printf("%-12s %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %8.3f %7.3f %11.3f\n", name,
                single.peak * mib, worst.peak * mib, tile.peak * mib, single.peak_fwd * mib,
                worst.peak_fwd * mib, tile.peak_fwd * mib, double(worst.peak) / single.peak,
                0.25 + 0.05, double(worst.peak) / tile.peak);
  }
  if (!fields.empty()) {
    // The window path's largest extra buffer: a halo-extended copy of the decode conv's input.
    const auto [size, B] = fields.back();
    const double window = double(B) * 24 * (size / 2 + 2) * (size / 2 + 2) * 4 / (1 << 20);
    std::printf(
        "  one halo-extended copy of the decode conv's input (%lld x 24 x %lld x %lld floats) on a"
        " rank of the last field: %.2f MiB\n",
        (long long)B, (long long)(size / 2 + 2), (long long)(size / 2 + 2), window);
  }
  if (!last_sites.empty())
    std::printf("  where the last field peaks: P=1 in %s; P=4 in %s; tile in %s\n",
                last_sites[0].c_str(), last_sites[1].c_str(), last_sites[2].c_str());
}

// ---------------------------------------------------------------------------------------
// (4): alpha-beta model of weak scaling.

// Two ranks, one tile each (rows cut once), at the same time: the plain module on each tile,
// and the Tessera step on the 2-tile field. Their ratio is the local work the halo path adds
// (window copies, index and statistics handling, dispatch), on cores shared the same way.
struct UnetPairTimes {
  double alone = 0, dist = 0;          // wall, the slower rank (dist: gradients in buckets)
  double unbucketed = 0;               // wall, gradients reduced one parameter at a time
  double alone_cpu = 0, dist_cpu = 0;  // thread CPU time, the larger rank's
  std::map<std::string, double> alone_profile, dist_profile;  // one more step each, rank's own
  double local_factor() const { return alone > 0 ? dist / alone : 0.0; }
};

UnetPairTimes time_unet_pair(int64_t tile, int64_t B, int warmup, int iters) {
  auto mesh = init_device_mesh("cpu", {2});
  auto pg = mesh.group(0);
  UnetPairTimes r;
  std::vector<double> alone, dist, alone_cpu, dist_cpu;
  {
    torch::manual_seed(0);
    HeatNet model;
    const auto x = seeded_randn({B, 1, tile, tile}, 3), y = seeded_randn({B, 1, tile, tile}, 4);
    for (int i = 0; i < warmup + iters; ++i) {
      clear_grads(*model);
      barrier(pg);
      const auto t0 = Clock::now();
      const double c0 = thread_cpu_seconds();
      at::mse_loss(model->forward(x), y).backward();
      const double c = thread_cpu_seconds() - c0;
      const double t = max_over(pg, seconds_since(t0));
      if (i >= warmup) {
        alone.push_back(t);
        alone_cpu.push_back(max_over(pg, c));
      } else {
        max_over(pg, c);
      }
    }
    clear_grads(*model);
    barrier(pg);
    OpProfile prof;
    at::mse_loss(model->forward(x), y).backward();
    r.alone_profile = prof.self;
  }
  // The Tessera step, its weight gradients reduced one by one as they arrive
  // (distribute_module alone) or in replicate()'s buckets.
  auto time_dist = [&](bool bucketed, std::vector<double>& wall, std::vector<double>& cpu,
                       std::map<std::string, double>& profile) {
    torch::manual_seed(0);
    HeatNet model;
    std::shared_ptr<ReplicatedModule> ddp;
    if (bucketed)
      ddp = replicate(*model, mesh);
    else
      distribute_module(*model, mesh);
    const Placements rows = {Shard(2)};
    const auto x =
        distribute_tensor(seeded_randn({B, 1, 2 * tile, tile}, 3), mesh, rows, std::nullopt);
    const auto y =
        distribute_tensor(seeded_randn({B, 1, 2 * tile, tile}, 4), mesh, rows, std::nullopt);
    for (int i = 0; i < warmup + iters; ++i) {
      clear_grads(*model);
      barrier(pg);
      const auto t0 = Clock::now();
      const double c0 = thread_cpu_seconds();
      at::mse_loss(model->forward(x), y).backward();
      reduce_grads(*model, mesh);
      const double c = thread_cpu_seconds() - c0;
      const double t = max_over(pg, seconds_since(t0));
      if (i >= warmup) {
        wall.push_back(t);
        cpu.push_back(max_over(pg, c));
      } else {
        max_over(pg, c);
      }
    }
    clear_grads(*model);
    barrier(pg);
    OpProfile prof;
    at::mse_loss(model->forward(x), y).backward();
    reduce_grads(*model, mesh);
    profile = prof.self;
  };
  std::vector<double> per_param, per_param_cpu;
  std::map<std::string, double> per_param_profile;
  time_dist(false, per_param, per_param_cpu, per_param_profile);
  time_dist(true, dist, dist_cpu, r.dist_profile);
  r.unbucketed = median(per_param);
  r.alone = median(alone);
  r.dist = median(dist);
  r.alone_cpu = median(alone_cpu);
  r.dist_cpu = median(dist_cpu);
  return r;
}

struct ScalingInputs {
  double t_compute = 0;  // s, one rank, one tile, forward+backward (plain module)
  UnetPairTimes pair;    // the local work of the halo path, from two ranks at once
  const char* pair_mode = "";
  // From a 3x3 mesh: rank 0 (corner: one neighbour per mesh dim, as every rank of 2x2) and
  // rank 4 (interior: two per mesh dim, as the worst rank of any larger square mesh).
  PhaseComm corner, interior;
  std::vector<comm::CommRecord> records;  // interior rank, whole step
  Block corner_block{}, interior_block{};
};

// Point-to-point messages a rank sends in one step: one per neighbour with rows, in each
// exchange that moved rows (the p2p transport sends only to members that need rows).
int64_t messages(const PhaseComm& fwd_bwd, int neighbours_per_dim) {
  return fwd_bwd.halo_exchanges * neighbours_per_dim;
}

void scaling_model(const ScalingInputs& in, int64_t tile, int64_t B, double alpha, double beta) {
  std::printf(
      "\n== 4. Weak scaling model: fixed %lldx%lld tile (batch %lld) per rank, 2-D decomposition "
      "==\n",
      (long long)tile, (long long)tile, (long long)B);
  // The all-reduces of one step: payload and which group (one mesh dim of the 3x3 = 3
  // members -> sqrt(P) at scale; the whole mesh = 9 -> P).
  const auto ars = all_reduces(in.records);
  double ar_payload = 0;
  int whole = 0;
  for (const auto& a : ars) {
    ar_payload += double(a.payload);
    whole += a.group > 3;
  }
  const auto c = in.corner, i = in.interior;
  const int64_t msg_corner = messages(c, 1), msg_interior = messages(i, 2);
  const double bytes_corner = double(std::max(c.halo_sent, c.halo_received));
  const double bytes_interior = double(std::max(i.halo_sent, i.halo_received));
  std::printf("measured inputs (one run):\n");
  std::printf("  T_compute = %.2f ms  (one rank, plain module on one tile, one thread, median)\n",
              1e3 * in.t_compute);
  const double local = in.pair.local_factor();
  if (local > 0)
    std::printf(
        "  local work of the halo path: 2 ranks (%s), one %lldx%lld tile each, rows cut: Tessera"
        " step %.2f ms vs the plain module on each tile at once %.2f ms: x%.2f (thread CPU time"
        " %.2f vs %.2f ms: x%.2f)\n",
        in.pair_mode, (long long)tile, (long long)tile, 1e3 * in.pair.dist, 1e3 * in.pair.alone,
        local, 1e3 * in.pair.dist_cpu, 1e3 * in.pair.alone_cpu,
        in.pair.dist_cpu / in.pair.alone_cpu);
  if (local > 0)
    std::printf(
        "  (weight gradients in replicate()'s buckets; reduced one parameter at a time as they"
        " arrive instead: %.2f ms, x%.2f)\n",
        1e3 * in.pair.unbucketed, in.pair.unbucketed / in.pair.alone);
  if (local > 0)
    print_profiles(in.pair.alone_profile, in.pair.dist_profile, "plain tile", "Tessera/r0", 12);
  std::printf(
      "  halo per step, 3x3 mesh of %lldx%lld tiles: corner rank %lld B in %lld messages,"
      " interior rank %lld B in %lld messages (%lld exchanges with rows of %lld calls)\n",
      (long long)tile, (long long)tile, (long long)bytes_corner, (long long)msg_corner,
      (long long)bytes_interior, (long long)msg_interior, (long long)i.halo_exchanges,
      (long long)i.halo_calls);
  {
    const auto mc = unet_halo_bytes(in.corner_block, 3 * tile, 3 * tile, B);
    const auto mi = unet_halo_bytes(in.interior_block, 3 * tile, 3 * tile, B);
    std::printf(
        "  received vs the analytic minimum: corner %lld / %lld B (%.4f), interior %lld / %lld B "
        "(%.4f)\n",
        (long long)c.halo_received, (long long)(mc.fwd_min + mc.bwd_min),
        double(c.halo_received) / double(mc.fwd_min + mc.bwd_min), (long long)i.halo_received,
        (long long)(mi.fwd_min + mi.bwd_min),
        double(i.halo_received) / double(mi.fwd_min + mi.bwd_min));
  }
  std::printf(
      "  all_reduce per step: %zu calls (%d over the whole mesh, %zu over one mesh dim),"
      " %.0f B of payload in all\n",
      ars.size(), whole, ars.size() - whole, ar_payload);
  std::printf(
      "network: alpha = %.1f us per message, beta = %.1f GB/s per link (InfiniBand HDR"
      " 200 Gb/s class); collectives blocking, nothing overlapped\n",
      alpha * 1e6, beta / 1e9);
  std::printf(
      "  T_halo = messages x alpha + bytes / beta (interior rank for P >= 16; neighbour"
      " exchanges do not grow with P)\n");
  std::printf(
      "  all_reduce of b bytes over n ranks: tree = 2 ceil(log2 n) (alpha + b/beta)"
      " (binomial reduce + broadcast);\n"
      "                                       ring = 2(n-1) alpha + 2(n-1)/n b/beta\n");
  auto allreduce_time = [&](int64_t P, bool tree) {
    double t = 0;
    const int64_t side = static_cast<int64_t>(std::lround(std::sqrt(double(P))));
    for (const auto& a : ars) {
      const int64_t n = a.group > 3 ? P : side;
      if (n <= 1) continue;
      if (tree)
        t += 2 * std::ceil(std::log2(double(n))) * (alpha + a.payload / beta);
      else
        t += 2 * (n - 1) * alpha + 2.0 * (n - 1) / n * a.payload / beta;
    }
    return t;
  };
  std::printf("\n%6s %7s %10s %12s %12s %10s %9s %9s %10s\n", "P", "mesh", "T_halo us",
              "T_ar tree us", "T_ar ring us", "T(P) ms", "eff tree", "eff ring", "eff x loc");
  for (int64_t P : {1, 4, 16, 64, 256, 1024}) {
    const int64_t side = static_cast<int64_t>(std::lround(std::sqrt(double(P))));
    double halo = 0;
    if (P == 4) halo = msg_corner * alpha + bytes_corner / beta;
    if (P >= 16) halo = msg_interior * alpha + bytes_interior / beta;
    const double tree = P > 1 ? allreduce_time(P, true) : 0,
                 ring = P > 1 ? allreduce_time(P, false) : 0;
    const double tp = in.t_compute + halo + tree;
    const double tp_ring = in.t_compute + halo + ring;
    const double tp_local = in.t_compute * (P == 1 || local <= 0 ? 1.0 : local) + halo + tree;
    char mesh[16];
    std::snprintf(mesh, sizeof mesh, "%lldx%lld", (long long)side, (long long)side);
    std::printf("%6lld %7s %10.1f %12.1f %12.1f %10.2f %8.1f%% %8.1f%% %9.1f%%\n", (long long)P,
                mesh, halo * 1e6, tree * 1e6, ring * 1e6, tp * 1e3, 100 * in.t_compute / tp,
                100 * in.t_compute / tp_ring, 100 * in.t_compute / tp_local);
  }
  std::printf(
      "  T(P) = T_compute + T_halo + T_ar (tree); efficiency = T(1) / T(P); goal >= 90%% at 1024\n"
      "  eff ring: the same with ring all-reduces; eff x loc: tree, with T_compute multiplied by "
      "the"
      " measured local work factor of the halo path (P > 1)\n");
}

ScalingInputs measure_scaling_comm(int64_t tile, int64_t B) {
  ScalingInputs s;
  std::vector<UnetStepComm> per(9);
  tessera::testing::RunOptions opts;
  opts.timeout = std::chrono::minutes(5);
  tessera::testing::run_ranks(
      9,
      [&](int rank) {
        at::set_num_threads(1);
        auto mesh = init_device_mesh("cpu", {3, 3}, {"h", "w"});
        per[rank] =
            unet_step_comm(mesh, B, 3 * tile, 3 * tile, {tile, tile, tile}, {tile, tile, tile});
      },
      opts);
  s.corner = add(add(per[0].fwd, per[0].bwd), per[0].grads);
  s.interior = add(add(per[4].fwd, per[4].bwd), per[4].grads);
  s.records = per[4].records;
  s.corner_block = per[0].block;
  s.interior_block = per[4].block;
  return s;
}

void time_single_unet(ScalingInputs& s, int64_t tile, int64_t B, int warmup, int iters) {
  torch::manual_seed(0);
  HeatNet model;
  const auto x = seeded_randn({B, 1, tile, tile}, 3), y = seeded_randn({B, 1, tile, tile}, 4);
  std::vector<double> t;
  for (int i = 0; i < warmup + iters; ++i) {
    clear_grads(*model);
    const auto t0 = Clock::now();
    at::mse_loss(model->forward(x), y).backward();
    if (i >= warmup) t.push_back(seconds_since(t0));
  }
  s.t_compute = median(t);
}

std::vector<std::pair<int64_t, int64_t>> parse_fields(const std::vector<std::string>& specs) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& s : specs) {
    const auto x = s.find('x');
    TORCH_CHECK(x != std::string::npos, "--mem-fields: expected SIZExBATCH, got ", s);
    out.emplace_back(std::stoll(s.substr(0, x)), std::stoll(s.substr(x + 1)));
    TORCH_CHECK(out.back().first % 4 == 0, "--mem-fields: size must be a multiple of 4, got ", s);
  }
  return out;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{
      "Tessera domain parallelism: halo conv speed-up, halo bytes, peak memory, scaling model"};
  ConvConfig conv{1, 16, 1024, 1024, -1, 2, 7};
  int64_t unet_size = 64, unet_batch = 4, tile = 256, tile_batch = 1;
  int tile_iters = 15;
  std::vector<std::string> mem_fields = {"64x4", "256x2", "512x1"};
  double alpha_us = 5.0, beta_gbs = 25.0;
  bool skip_timing = false;
  app.add_option("--conv-size", conv.height, "conv field height = width")->capture_default_str();
  app.add_option("--conv-channels", conv.channels, "conv channels in = out")->capture_default_str();
  app.add_option("--conv-batch", conv.batch, "conv batch")->capture_default_str();
  app.add_option("--first-rows", conv.first_rows, "rows on rank 0 (default: half)");
  app.add_option("--warmup", conv.warmup, "untimed steps")->capture_default_str();
  app.add_option("--iters", conv.iters, "timed steps (median reported)")->capture_default_str();
  app.add_option("--unet-size", unet_size, "U-Net field size for the 2x2 byte count")
      ->capture_default_str();
  app.add_option("--unet-batch", unet_batch, "U-Net batch for the 2x2 byte count")
      ->capture_default_str();
  app.add_option("--mem-fields", mem_fields, "U-Net fields for peak memory, SIZExBATCH")
      ->capture_default_str();
  app.add_option("--tile", tile, "per-rank tile of the scaling model (even)")
      ->capture_default_str();
  app.add_option("--tile-batch", tile_batch, "batch of the scaling model")->capture_default_str();
  app.add_option("--tile-iters", tile_iters, "timed steps of the scaling model's tile timings")
      ->capture_default_str();
  app.add_option("--alpha-us", alpha_us, "model: latency per message, us")->capture_default_str();
  app.add_option("--beta-gbs", beta_gbs, "model: bandwidth per link, GB/s")->capture_default_str();
  app.add_flag("--skip-timing", skip_timing,
               "skip the 2-rank timings (sections 1 and 2a, and the local-work factor of 4)");
  CLI11_PARSE(app, argc, argv);
  conv.width = conv.height;
  if (conv.first_rows < 0) conv.first_rows = conv.height / 2;
  const auto fields = parse_fields(mem_fields);

  at::set_num_threads(1);
  init_process_group();
  const int world = get_world_size(), rank = get_rank();
  TORCH_CHECK(world == 1 || world == 2, "bench_domain runs on 1 process or under tessera-run -n 2");
  const auto started = Clock::now();

  // A process world of two: rank 1 takes part in the 2-rank timing and otherwise waits.
  DeviceMesh pair;
  if (world == 2) pair = init_device_mesh("cpu", {2});

  // Runs f on both ranks of a 2-member world: the two processes, or two threads of this one.
  // Returns rank 0's result.
  auto on_two_ranks = [&](auto f) {
    decltype(f()) result{};
    if (world == 2) {
      barrier(pair.group(0));
      result = f();
    } else {
      std::mutex mu;
      tessera::testing::run_ranks(2, [&](int r) {
        at::set_num_threads(1);  // per thread: OpenMP's thread count is a per-thread setting
        auto res = f();
        std::lock_guard<std::mutex> lock(mu);
        if (r == 0) result = std::move(res);
      });
    }
    return result;
  };
  const char* mode = world == 2 ? "ranks as processes" : "ranks as threads";

  UnetPairTimes unet_pair;
  if (!skip_timing) {
    SingleConvResult t1;
    if (rank == 0) t1 = time_single_conv(conv);  // rank 1 (if any) idles in a barrier
    const DistConvResult d = on_two_ranks([&] { return time_distributed_conv(conv); });
    if (rank == 0) report_conv(conv, t1, d, mode);
    std::fflush(stdout);
    unet_pair =
        on_two_ranks([&] { return time_unet_pair(tile, tile_batch, conv.warmup, tile_iters); });
  }

  if (rank == 0) {
    unet_bytes_2x2(unet_batch, unet_size);
    std::fflush(stdout);
    memory_report(fields);
    std::fflush(stdout);
    ScalingInputs s = measure_scaling_comm(tile, tile_batch);
    s.pair = unet_pair;
    s.pair_mode = mode;
    time_single_unet(s, tile, tile_batch, conv.warmup, tile_iters);
    scaling_model(s, tile, tile_batch, alpha_us * 1e-6, beta_gbs * 1e9);
    std::printf("\ntotal %.1f s\n", seconds_since(started));
    std::fflush(stdout);
  }
  if (world == 2) barrier(pair.group(0));
  return 0;
}

int main(int argc, char** argv) {
  return counting_bench_main<CountingAllocator>("bench_domain", run, argc, argv);
}
