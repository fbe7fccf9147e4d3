// Tessera on one CUDA device: what a distributed tensor costs per op next to the plain CUDA
// tensor, neighbourhood attention's local kernel, one training step of fully_shard and of
// tensor parallelism, and attention's block kernels on distributed tensors, all on a 1-rank
// "cuda" mesh (NCCL, a world of one). PyTorch's side of the same cases is
// bench/peer/gpu_peer.py; bench/gpu_compare.sh runs both and merges them.
//
//   ./build/bench/bench_gpu [--out tessera_gpu.json] [--format table|json]
//                           [--only ops,na2d,steps,attn]
//
// Timing (LibTorch API only: torch::cuda::synchronize, no CUDA events):
//   * per-op cost: warm-up, then batches of back-to-back calls, each batch closed by a
//     synchronize, calibrated to >= --batch-ms; the median over --batches of the batch time
//     divided by its calls. Small ops therefore measure the host side (dispatch, launch);
//     1024x1024 matmul measures the kernel.
//   * na2d and training steps: --warmup untimed calls, then each timed call between two
//     synchronizes; the median of --iters (fewer when one case passes --case-budget-s).
// Suites run in the order ops, steps, na2d, attn (PyTorch's side: the same, its compiles
// last; attn is Tessera's alone: its rows compare kernels within this run).
// Without a CUDA device it prints "no CUDA device: skipped" and exits 0.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/version.h>

#include "ops/attention_ring.h"
#include "tessera/nn/neighborhood_attention.h"
#include "tessera/tessera.h"

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
namespace naf = tessera::nn::functional;

namespace {

struct Config {
  int batches = 7;           // per-op: timed batches (median)
  double batch_ms = 10;      // per-op: a batch lasts at least this long
  int64_t max_batch = 4096;  // per-op: at most this many calls in a batch
  int warmup = 3;            // na2d, steps: untimed calls
  int iters = 10;            // na2d, steps: timed calls (median)
  double case_budget_s = 3;  // na2d, steps: stop timing a case after this long (>= 3 samples)
  std::vector<int64_t> na_sizes = {64, 128, 256};
  int64_t na_kernel = 7, na_heads = 4, na_head_dim = 32;
  int64_t mlp_in = 1024, mlp_hidden = 4096, mlp_out = 1024, mlp_batch = 256;
  std::vector<int64_t> attn_lengths = {1024, 4096};
  int64_t attn_heads = 16, attn_head_dim = 64;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Where the cases run: CUDA, or CPU for checking the program on a machine without a GPU
// (--device cpu: a Gloo mesh, no synchronize; its numbers are not the benchmark).
at::DeviceType g_device = at::kCUDA;

void cuda_sync() {
  if (g_device == at::kCUDA) torch::cuda::synchronize();
}

// Median cost of one call in microseconds, the GPU work included (see the header).
double per_call_us(const std::function<void()>& fn, const Config& c) {
  cuda_sync();
  const auto w0 = Clock::now();
  for (int calls = 0; calls < 20 || seconds_since(w0) < 0.02; ++calls) fn();
  cuda_sync();
  int64_t n = 1;
  for (;;) {
    const auto t = Clock::now();
    for (int64_t i = 0; i < n; ++i) fn();
    cuda_sync();
    if (seconds_since(t) * 1e3 >= c.batch_ms || n >= c.max_batch) break;
    n *= 2;
  }
  std::vector<double> samples;
  for (int b = 0; b < c.batches; ++b) {
    const auto t = Clock::now();
    for (int64_t i = 0; i < n; ++i) fn();
    cuda_sync();
    samples.push_back(seconds_since(t) / static_cast<double>(n) * 1e6);
  }
  return median(samples);
}

// Median milliseconds of one call, each timed between two synchronizes.
double per_step_ms(const std::function<void()>& fn, const Config& c) {
  for (int i = 0; i < c.warmup; ++i) fn();
  cuda_sync();
  std::vector<double> samples;
  const auto start = Clock::now();
  for (int i = 0; i < c.iters; ++i) {
    const auto t = Clock::now();
    fn();
    cuda_sync();
    samples.push_back(seconds_since(t) * 1e3);
    if (samples.size() >= 3 && seconds_since(start) > c.case_budget_s) break;
  }
  return median(samples);
}

// One result row. value < 0: none (see error).
struct Record {
  Record(std::string suite_, std::string name_, std::string variant_, std::string dtype_,
         std::string unit_)
      : suite(std::move(suite_)),
        name(std::move(name_)),
        variant(std::move(variant_)),
        dtype(std::move(dtype_)),
        unit(std::move(unit_)) {}
  std::string suite, name, variant, dtype, unit;
  double value = -1;
  std::string method;  // na2d rows: "na2d" (PyTorch's side names flex_attention, dense SDPA)
  std::string error;
};

class Results {
 public:
  // With a file, every row rewrites it (a run cut short by a time limit leaves what it
  // measured); cases that start after budget_s seconds are reported as skipped.
  Results(std::string out_file = {}, json meta = json::object(), double budget_s = 1e9)
      : out_file_(std::move(out_file)), meta_(std::move(meta)), budget_s_(budget_s) {}
  json& meta() { return meta_; }
  void save() const {
    if (!out_file_.empty()) std::ofstream(out_file_) << to_json().dump(2) << "\n";
  }

  void add(Record r) {
    if (r.error.empty())
      std::fprintf(stderr, "bench_gpu: %-6s %-34s %-12s %-9s %12.3f %s\n", r.suite.c_str(),
                   r.name.c_str(), r.variant.c_str(), r.dtype.c_str(), r.value, r.unit.c_str());
    else
      std::fprintf(stderr, "bench_gpu: %-6s %-34s %-12s %-9s %s\n", r.suite.c_str(), r.name.c_str(),
                   r.variant.c_str(), r.dtype.c_str(), r.error.c_str());
    rows_.push_back(std::move(r));
    save();
  }
  // Runs `timed`, recording its value or the error it raised (a failing case is a row of the
  // table, not the end of the run).
  void run(Record r, const std::function<double()>& timed) {
    if (seconds_since(started_) > budget_s_) {
      r.error =
          "skipped: past the run's budget of " + std::to_string(static_cast<int>(budget_s_)) + " s";
      add(std::move(r));
      return;
    }
    try {
      r.value = timed();
    } catch (const c10::Error& e) {
      r.error = first_line(e.what_without_backtrace());
    } catch (const std::exception& e) {
      r.error = first_line(e.what());
    }
    add(std::move(r));
  }
  const std::vector<Record>& rows() const { return rows_; }

  json to_json() const {
    json records = json::array();
    for (const auto& r : rows_) {
      json j = {{"suite", r.suite},     {"case", r.name},   {"impl", "tessera"},
                {"variant", r.variant}, {"dtype", r.dtype}, {"unit", r.unit}};
      j["value"] = r.error.empty() ? json(r.value) : json(nullptr);
      if (!r.method.empty()) j["method"] = r.method;
      if (!r.error.empty()) j["error"] = r.error;
      records.push_back(j);
    }
    json meta = meta_;
    meta["seconds"] = seconds_since(started_);
    return {{"impl", "tessera"}, {"meta", meta}, {"records", records}};
  }

  // The value of the "plain" row of the same suite, case and dtype (< 0: none).
  double plain_of(const Record& r) const {
    for (const auto& p : rows_)
      if (p.suite == r.suite && p.name == r.name && p.dtype == r.dtype && p.variant == "plain" &&
          p.error.empty())
        return p.value;
    return -1;
  }

  void print_table(std::FILE* f) const {
    std::fprintf(f, "%-6s %-34s %-12s %-9s %14s %10s\n", "suite", "case", "variant", "dtype",
                 "value", "vs plain");
    for (const auto& r : rows_) {
      if (!r.error.empty()) {
        std::fprintf(f, "%-6s %-34s %-12s %-9s %14s  (%s)\n", r.suite.c_str(), r.name.c_str(),
                     r.variant.c_str(), r.dtype.c_str(), "-", r.error.c_str());
        continue;
      }
      const double p = plain_of(r);
      char ratio[32] = "";
      if (p > 0 && r.variant != "plain") std::snprintf(ratio, sizeof ratio, "%.2fx", r.value / p);
      std::fprintf(f, "%-6s %-34s %-12s %-9s %11.3f %-2s %10s\n", r.suite.c_str(), r.name.c_str(),
                   r.variant.c_str(), r.dtype.c_str(), r.value, r.unit.c_str(), ratio);
    }
  }

 private:
  static std::string first_line(const std::string& s) {
    const auto nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }
  std::vector<Record> rows_;
  std::string out_file_;
  json meta_;
  double budget_s_;
  Clock::time_point started_ = Clock::now();
};

at::TensorOptions cuda_f32() { return at::TensorOptions().device(g_device).dtype(at::kFloat); }

// ---------------------------------------------------------------------------------------
// Per-op cost: the plain CUDA tensor, and distributed tensors Replicate and Shard(0) on the
// 1-rank mesh (no communication: what remains is the wrapper, the sharding propagation and
// the local op).

using Fn = std::function<void()>;

struct OpCase {
  std::string name;
  // Given (a, b) as plain or distributed operands: the call to time.
  std::function<Fn(const at::Tensor&, const at::Tensor&)> make;
  int64_t rows, cols;
  // Shard(0) variant: the second operand's placement (mm's right-hand side is Replicate).
  bool second_replicated = false;
};

void per_op_costs(const tessera::DeviceMesh* mesh, const Config& c, Results& out) {
  at::manual_seed(0);
  const std::vector<OpCase> cases = {
      {"add 64x64",
       [](const at::Tensor& a, const at::Tensor& b) -> Fn { return [=] { at::add(a, b); }; }, 64,
       64},
      {"add 1024x1024",
       [](const at::Tensor& a, const at::Tensor& b) -> Fn { return [=] { at::add(a, b); }; }, 1024,
       1024},
      {"mul 64x64",
       [](const at::Tensor& a, const at::Tensor& b) -> Fn { return [=] { at::mul(a, b); }; }, 64,
       64},
      {"matmul 64x64",
       [](const at::Tensor& a, const at::Tensor& b) -> Fn { return [=] { at::matmul(a, b); }; }, 64,
       64, true},
      {"matmul 1024x1024",
       [](const at::Tensor& a, const at::Tensor& b) -> Fn { return [=] { at::matmul(a, b); }; },
       1024, 1024, true},
      {"view 64x64 -> 4096",
       [](const at::Tensor& a, const at::Tensor&) -> Fn { return [=] { a.view({4096}); }; }, 64,
       64},
      {"reshape 64x64 -> 32x128",
       [](const at::Tensor& a, const at::Tensor&) -> Fn { return [=] {
                                                            a.reshape({32, 128});
                                                          }; },
       64, 64},
      {"sum 64x64", [](const at::Tensor& a, const at::Tensor&) -> Fn { return [=] { a.sum(); }; },
       64, 64},
      {"sum 1024x1024",
       [](const at::Tensor& a, const at::Tensor&) -> Fn { return [=] { a.sum(); }; }, 1024, 1024},
  };
  for (const auto& oc : cases) {
    const at::Tensor a = at::randn({oc.rows, oc.cols}, cuda_f32());
    const at::Tensor b = at::randn({oc.rows, oc.cols}, cuda_f32());
    Record r{"ops", oc.name, "plain", "float32", "us"};
    out.run(r, [&] { return per_call_us(oc.make(a, b), c); });
    for (const std::string variant : {"R", "S(0)"}) {
      r.variant = variant;
      if (!mesh) {
        r.error = "no 1-rank mesh";
        out.add(r);
        continue;
      }
      out.run(r, [&] {
        const tessera::Placements pa = {variant == "R" ? tessera::Placement(tessera::Replicate())
                                                       : tessera::Placement(tessera::Shard(0))};
        const tessera::Placements pb =
            oc.second_replicated ? tessera::Placements{tessera::Replicate()} : pa;
        const auto da = tessera::distribute_tensor(a, *mesh, pa);
        const auto db = tessera::distribute_tensor(b, *mesh, pb);
        return per_call_us(oc.make(da, db), c);
      });
    }
  }

  // Linear 1024 -> 1024 on a batch of 64: forward, then backward of the output with a given
  // gradient (parameter gradients accumulate, the same on every variant).
  for (const std::string variant : {"plain", "R", "S(0)"}) {
    Record r{"ops", "Linear 1024 fwd+bwd, batch 64", variant, "float32", "us"};
    if (variant != "plain" && !mesh) {
      r.error = "no 1-rank mesh";
      out.add(r);
      continue;
    }
    out.run(r, [&] {
      at::manual_seed(1);
      torch::nn::Linear lin(1024, 1024);
      lin->to(g_device);
      at::Tensor x = at::randn({64, 1024}, cuda_f32()), g = at::randn({64, 1024}, cuda_f32());
      if (variant != "plain") {
        tessera::distribute_module(*lin, *mesh);  // parameters Replicate
        const tessera::Placements p = {variant == "R" ? tessera::Placement(tessera::Replicate())
                                                      : tessera::Placement(tessera::Shard(0))};
        x = tessera::distribute_tensor(x, *mesh, p);
        g = tessera::distribute_tensor(g, *mesh, p);
      }
      return per_call_us([&] { lin->forward(x).backward(g); }, c);
    });
  }

  // Adam over 16 parameters of 256x256 (LibTorch's Adam: one parameter at a time).
  for (const std::string variant : {"plain", "R", "S(0)"}) {
    Record r{"ops", "Adam step, 16 x 256x256", variant, "float32", "us"};
    if (variant != "plain" && !mesh) {
      r.error = "no 1-rank mesh";
      out.add(r);
      continue;
    }
    out.run(r, [&] {
      at::manual_seed(2);
      std::vector<at::Tensor> params;
      for (int i = 0; i < 16; ++i) {
        at::Tensor p = at::randn({256, 256}, cuda_f32()), g = at::randn({256, 256}, cuda_f32());
        if (variant != "plain") {
          const tessera::Placements pl = {variant == "R" ? tessera::Placement(tessera::Replicate())
                                                         : tessera::Placement(tessera::Shard(0))};
          p = tessera::distribute_tensor(p, *mesh, pl);
          g = tessera::distribute_tensor(g, *mesh, pl);
        }
        p = p.detach().requires_grad_();
        p.mutable_grad() = g;
        params.push_back(p);
      }
      torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-3));
      adam.step();  // state allocation outside the timing
      return per_call_us([&] { adam.step(); }, c);
    });
  }
}

// ---------------------------------------------------------------------------------------
// Neighbourhood attention: tessera::nn::functional::na2d on plain CUDA tensors (the local
// kernel), heads-last [1, S, S, heads, head_dim], k x k window, dilation 1, stride 1.

void na2d_cases(const Config& c, Results& out) {
  for (const int64_t size : c.na_sizes) {
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const std::string dname = dtype == at::kFloat ? "float32" : "bfloat16";
      const std::string name = "na2d " + std::to_string(size) + "x" + std::to_string(size) + " k" +
                               std::to_string(c.na_kernel) + " h" + std::to_string(c.na_heads) +
                               " d" + std::to_string(c.na_head_dim);
      at::manual_seed(3);
      const std::vector<int64_t> shape = {1, size, size, c.na_heads, c.na_head_dim};
      const auto opts = cuda_f32();
      const at::Tensor q = at::randn(shape, opts).to(dtype), k = at::randn(shape, opts).to(dtype),
                       v = at::randn(shape, opts).to(dtype), g = at::randn(shape, opts).to(dtype);
      const std::vector<int64_t> kernel = {c.na_kernel};
      Record fwd{"na2d", name, "fwd", dname, "ms"};
      fwd.method = "na2d";
      out.run(fwd, [&] {
        at::NoGradGuard no_grad;
        return per_step_ms([&] { naf::na2d(q, k, v, kernel); }, c);
      });
      Record both{"na2d", name, "fwd+bwd", dname, "ms"};
      both.method = "na2d";
      out.run(both, [&] {
        const at::Tensor ql = q.detach().requires_grad_(), kl = k.detach().requires_grad_(),
                         vl = v.detach().requires_grad_();
        return per_step_ms(
            [&] {
              for (const at::Tensor* t : {&ql, &kl, &vl}) t->mutable_grad() = at::Tensor();
              naf::na2d(ql, kl, vl, kernel).backward(g);
            },
            c);
      });
    }
  }
}

// ---------------------------------------------------------------------------------------
// Attention on distributed tensors: scaled_dot_product_attention, causal, forward + backward,
// on the plain CUDA tensors (LibTorch's own choice of fused kernel) and with the heads split
// on the 1-rank mesh, where the call runs the sharded rule's block kernel (NOTE: [Block
// kernels] in src/ops/attention_ring.h): the matrix products (the default off the CPU) and
// LibTorch's memory-efficient pair (TESSERA_ATTENTION_BLOCKS=fused).

void attention_cases(const tessera::DeviceMesh* mesh, const Config& c, Results& out) {
#if TORCH_VERSION_MAJOR < 2
  Record r{"attn", "sdpa", "plain", "float32", "ms"};
  r.error = "LibTorch 1.13 has no scaled_dot_product_attention";
  out.add(r);
#else
  namespace attention = tessera::ops::attention;
  for (const int64_t L : c.attn_lengths) {
    for (const auto dtype : {at::kBFloat16, at::kFloat}) {
      const std::string dname = dtype == at::kFloat ? "float32" : "bfloat16";
      const std::string name = "sdpa causal L" + std::to_string(L) + " h" +
                               std::to_string(c.attn_heads) + " d" +
                               std::to_string(c.attn_head_dim) + " fwd+bwd";
      at::manual_seed(6);
      const std::vector<int64_t> shape = {1, c.attn_heads, L, c.attn_head_dim};
      const auto opts = cuda_f32().dtype(dtype);
      const at::Tensor q = at::randn(shape, opts), k = at::randn(shape, opts),
                       v = at::randn(shape, opts), g = at::randn(shape, opts);
      const auto step = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& d,
                            const at::Tensor& grad) {
        const at::Tensor ql = a.detach().requires_grad_(), kl = b.detach().requires_grad_(),
                         vl = d.detach().requires_grad_();
        return per_step_ms(
            [&] {
              for (const at::Tensor* t : {&ql, &kl, &vl}) t->mutable_grad() = at::Tensor();
              at::scaled_dot_product_attention(ql, kl, vl, {}, 0.0, true).backward(grad);
            },
            c);
      };
      out.run(Record("attn", name, "plain", dname, "ms"), [&] { return step(q, k, v, g); });
      for (const auto& [variant, kernel] :
           {std::pair{std::string("S(1) products"), attention::BlockKernel::kProducts},
            std::pair{std::string("S(1) fused"), attention::BlockKernel::kFused}}) {
        Record r{"attn", name, variant, dname, "ms"};
        if (!mesh) {
          r.error = "no 1-rank mesh";
          out.add(r);
          continue;
        }
        out.run(r, [&] {
          const auto before = attention::set_block_kernel(kernel);
          const tessera::Placements heads = {tessera::Shard(1)};
          const auto lay = [&](const at::Tensor& t) {
            return tessera::distribute_tensor(t, *mesh, heads);
          };
          const int64_t calls = attention::efficient_calls();
          const double ms = step(lay(q), lay(k), lay(v), lay(g));
          attention::set_block_kernel(before);
          // (On CUDA the fused row must have run the fused pair: a fallback would misreport.)
          TORCH_CHECK(g_device != at::kCUDA || kernel != attention::BlockKernel::kFused ||
                          attention::efficient_calls() > calls,
                      "bench_gpu: the memory-efficient pair did not run");
          return ms;
        });
      }
    }
  }
#endif
}

// ---------------------------------------------------------------------------------------
// One training step (zero_grad, forward, MSE spelled (out - y)^2 mean, backward, Adam) of an
// MLP in -> hidden -> ReLU -> out: plain, fully_shard (each Linear, then the root), and
// tensor parallel (Colwise on the first Linear, Rowwise on the second), on the 1-rank mesh.

torch::nn::Sequential make_mlp(const Config& c) {
  at::manual_seed(4);
  torch::nn::Sequential m(torch::nn::Linear(c.mlp_in, c.mlp_hidden), torch::nn::ReLU(),
                          torch::nn::Linear(c.mlp_hidden, c.mlp_out));
  m->to(g_device);
  return m;
}

void step_cases(const tessera::DeviceMesh* mesh, const Config& c, Results& out) {
  const std::string name = "MLP " + std::to_string(c.mlp_in) + "-" + std::to_string(c.mlp_hidden) +
                           "-" + std::to_string(c.mlp_out) + " step, batch " +
                           std::to_string(c.mlp_batch);
  at::manual_seed(5);
  const at::Tensor x = at::randn({c.mlp_batch, c.mlp_in}, cuda_f32());
  const at::Tensor y = at::randn({c.mlp_batch, c.mlp_out}, cuda_f32());
  auto timed = [&](torch::nn::Sequential model, const at::Tensor& in, const at::Tensor& target) {
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
    return per_step_ms(
        [&] {
          adam.zero_grad();
          (model->forward(in) - target).pow(2).mean().backward();
          adam.step();
        },
        c);
  };
  out.run(Record("step", name, "plain", "float32", "ms"), [&] { return timed(make_mlp(c), x, y); });
  for (const std::string variant : {"fully_shard", "tp"}) {
    Record r{"step", name, variant, "float32", "ms"};
    if (!mesh) {
      r.error = "no 1-rank mesh";
      out.add(r);
      continue;
    }
    out.run(r, [&] {
      auto model = make_mlp(c);
      if (variant == "fully_shard") {
        // Bottom-up, as FSDP2 is used: one group per Linear, the root owns none. Inputs
        // distributed over the batch (the local batch is the whole batch on one rank).
        for (const auto& child : model->children())
          if (child->as<torch::nn::Linear>()) tessera::fully_shard(*child, *mesh);
        tessera::fully_shard(*model, *mesh);
        return timed(model, tessera::from_local(x, *mesh, {tessera::Shard(0)}),
                     tessera::from_local(y, *mesh, {tessera::Shard(0)}));
      }
      const tessera::ParallelizePlan plan = {{"0", tessera::ColwiseParallel()},
                                             {"2", tessera::RowwiseParallel()}};
      tessera::parallelize_module(model, *mesh, plan);
      return timed(model, x, y);  // plain in (read as Replicate), plain out (use_local_output)
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera on one CUDA device: per-op cost, na2d, fully_shard and TP steps"};
  Config c;
  std::string out_file, format = "table", only = "ops,na2d,steps,attn";
  app.add_option("--out", out_file, "also write the results as JSON to this file");
  app.add_option("--format", format, "stdout: table or json")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
  app.add_option("--only", only, "suites, comma-separated: ops, na2d, steps, attn")
      ->capture_default_str();
  app.add_option("--batches", c.batches, "per-op: timed batches (median)")->capture_default_str();
  app.add_option("--batch-ms", c.batch_ms, "per-op: minimum batch length, ms")
      ->capture_default_str();
  app.add_option("--max-batch", c.max_batch, "per-op: most calls in one batch")
      ->capture_default_str();
  app.add_option("--warmup", c.warmup, "na2d, steps: untimed calls")->capture_default_str();
  app.add_option("--iters", c.iters, "na2d, steps: timed calls (median)")->capture_default_str();
  app.add_option("--case-budget-s", c.case_budget_s,
                 "na2d, steps: seconds of timing per case (at least 3 calls)")
      ->capture_default_str();
  double budget_s = 45;
  app.add_option("--budget-s", budget_s,
                 "cases that start after this many seconds are reported as skipped")
      ->capture_default_str();
  app.add_option("--na-sizes", c.na_sizes, "na2d: field sizes (height = width)")
      ->capture_default_str();
  app.add_option("--na-kernel", c.na_kernel, "na2d: kernel")->capture_default_str();
  app.add_option("--na-heads", c.na_heads, "na2d: heads")->capture_default_str();
  app.add_option("--na-head-dim", c.na_head_dim, "na2d: head dim")->capture_default_str();
  app.add_option("--mlp-hidden", c.mlp_hidden, "steps: MLP hidden width")->capture_default_str();
  app.add_option("--mlp-batch", c.mlp_batch, "steps: batch")->capture_default_str();
  app.add_option("--attn-lengths", c.attn_lengths, "attn: sequence lengths")->capture_default_str();
  app.add_option("--attn-heads", c.attn_heads, "attn: heads")->capture_default_str();
  app.add_option("--attn-head-dim", c.attn_head_dim, "attn: head dim")->capture_default_str();
  std::string device = "cuda";
  app.add_option(
         "--device", device,
         "cuda; cpu only checks the program where there is no GPU (Gloo mesh, not a benchmark)")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::set<std::string> suites;
  {
    std::stringstream ss(only);
    for (std::string s; std::getline(ss, s, ',');) suites.insert(s);
  }

  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  json meta = {{"command", command}, {"libtorch", TORCH_VERSION}};
  if (device == "cpu") g_device = at::kCPU;
  if (device == "cuda" && !torch::cuda::is_available()) {
    std::printf("bench_gpu: no CUDA device: skipped\n");
    if (!out_file.empty()) {
      meta["skipped"] = "no CUDA device";
      Results(out_file, meta).save();
    }
    return 0;
  }
  meta["device"] = device;
  meta["cuda_devices"] = torch::cuda::device_count();
#ifdef TESSERA_WITH_NCCL
  meta["nccl"] = true;
#else
  meta["nccl"] = false;
#endif
  meta["timing"] = {
      {"per_op", {{"batches", c.batches}, {"batch_ms", c.batch_ms}, {"max_batch", c.max_batch}}},
      {"per_step", {{"warmup", c.warmup}, {"iters", c.iters}, {"case_budget_s", c.case_budget_s}}}};

  meta["budget_s"] = budget_s;
  Results results(out_file, meta, budget_s);
  tessera::init_process_group();  // no launcher variables: a world of one
  tessera::DeviceMesh mesh;
  std::string mesh_error;
  try {
    mesh = tessera::init_device_mesh(device, {1});
  } catch (const c10::Error& e) {
    mesh_error = e.what_without_backtrace();
    std::fprintf(stderr, "bench_gpu: no 1-rank mesh: %s\n", mesh_error.c_str());
    results.meta()["mesh_error"] = mesh_error;
  }
  const tessera::DeviceMesh* m = mesh.defined() ? &mesh : nullptr;
  if (suites.count("ops")) per_op_costs(m, c, results);
  if (suites.count("steps")) step_cases(m, c, results);
  if (suites.count("na2d")) na2d_cases(c, results);
  if (suites.count("attn")) attention_cases(m, c, results);
  cuda_sync();
  results.save();
  if (format == "json")
    std::printf("%s\n", results.to_json().dump(2).c_str());
  else
    results.print_table(stdout);
  std::fflush(stdout);
  tessera::destroy_process_group();
  return 0;
}
