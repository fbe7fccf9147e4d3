#pragma once
// The GPU tier's shared pieces: which meshes a test runs on ("cuda:gloo" with 2-4 ranks
// sharing one GPU, "cuda" = NCCL with one rank per GPU), the skip rules, CUDA inputs made
// from the seeded CPU generators (every rank draws the same values), and checks that the
// shards really live on the GPU. The oracle is always plain LibTorch on the full tensor.
#include <chrono>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/cuda.h>

#include "helpers.h"

namespace tessera::gpu_test {

// TESSERA_GPU_TIER_ON_CPU=1 runs the tier on host meshes ("cpu", Gloo) with host oracles:
// it checks the tests themselves where there is no GPU, and proves nothing about CUDA.
inline bool on_cpu_instead() {
  static const bool on = [] {
    const char* e = std::getenv("TESSERA_GPU_TIER_ON_CPU");
    return e != nullptr && std::string(e) == "1";
  }();
  return on;
}

// A mesh to run on: "cuda:gloo" (CUDA tensors, Gloo collectives staged through host memory)
// or "cuda" (NCCL), and its shape.
struct GpuMesh {
  std::string type;
  std::vector<int64_t> shape;
  std::vector<std::string> names = {};

  bool nccl() const { return type == "cuda"; }
  // What init_device_mesh is given, and what the mesh must then report.
  std::string mesh_type() const { return on_cpu_instead() ? "cpu" : type; }
  std::string backend() const { return nccl() && !on_cpu_instead() ? "nccl" : "gloo"; }
  std::string device_type() const { return on_cpu_instead() ? "cpu" : "cuda"; }
  int world() const { return test::mesh_world(shape); }
  std::string name() const { return (nccl() ? "nccl_" : "gloo_") + test::mesh_name(shape); }
};

inline std::ostream& operator<<(std::ostream& os, const GpuMesh& m) { return os << m.name(); }

// Why this machine cannot run `m` (nullopt: it can). NCCL refuses two ranks on one GPU, so a
// NCCL mesh needs one GPU per rank; several ranks sharing one GPU go over "cuda:gloo".
inline std::optional<std::string> skip_reason(const GpuMesh& m) {
  if (on_cpu_instead()) return std::nullopt;
  if (!torch::cuda::is_available())
    return std::string(
        "no CUDA device: the GPU tier needs one (torch::cuda::is_available() is false)");
  if (!m.nccl()) return std::nullopt;
#ifndef TESSERA_WITH_NCCL
  return std::string("this build of Tessera has no NCCL (LibTorch without CUDA)");
#else
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus < m.world())
    return "NCCL needs one GPU per rank: " + std::to_string(m.world()) + " ranks, " +
           std::to_string(gpus) + " GPU(s); several ranks on one GPU are tested over cuda:gloo";
  return std::nullopt;
#endif
}

}  // namespace tessera::gpu_test

// GTEST_SKIP returns from the test body, so this is a macro.
#define TESSERA_REQUIRE_GPU_MESH(m)                        \
  do {                                                     \
    if (auto why_ = ::tessera::gpu_test::skip_reason(m)) { \
      GTEST_SKIP() << *why_;                               \
    }                                                      \
  } while (0)

namespace tessera::gpu_test {

// Ranks share one process, so a hung collective must end the test, not the tier.
inline const tessera::testing::RunOptions kRunOptions{std::chrono::seconds(240),
                                                      std::chrono::seconds(60)};

// body(mesh) on every rank of `m`, with the timeout above.
inline void on_gpu_mesh(const GpuMesh& m, const std::function<void(const DeviceMesh&)>& body) {
  tessera::testing::run_ranks(
      m.world(), [&](int) { body(init_device_mesh(m.mesh_type(), m.shape, m.names)); },
      kRunOptions);
}

// The meshes most tests sweep: Gloo-staged meshes of 2, 3 and 2x2 ranks on one GPU, and
// NCCL on one rank (and on 2 and 2x2 ranks where there are that many GPUs).
inline std::vector<GpuMesh> standard_gpu_meshes() {
  return {{"cuda:gloo", {2}}, {"cuda:gloo", {3}}, {"cuda:gloo", {2, 2}},
          {"cuda", {1}},      {"cuda", {2}},      {"cuda", {2, 2}}};
}

inline std::string mesh_param_name(const ::testing::TestParamInfo<GpuMesh>& info) {
  return info.param.name();
}

// The device the oracle runs on (the test thread's current CUDA device).
inline at::Device cuda() { return at::Device(on_cpu_instead() ? at::kCPU : at::kCUDA); }

// Seeded values (the CPU generator, so every rank and the oracle agree), on `device`.
inline at::Tensor randn(at::IntArrayRef shape, uint64_t seed, at::Device device,
                        at::ScalarType dtype = at::kDouble) {
  return test::randn(shape, seed, dtype).to(device);
}

// A distributed tensor's shard and its advertised device are on the mesh's device; never
// let a test pass on a silent copy to the host.
inline ::testing::AssertionResult on_mesh_device(const at::Tensor& t, const DeviceMesh& mesh) {
  if (!t.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  const at::Tensor local = is_dtensor(t) ? to_local(t.detach()) : t;
  if (local.device() != mesh.device() || t.device().type() != mesh.device().type())
    return ::testing::AssertionFailure()
           << "lives on " << t.device() << " (local shard on " << local.device()
           << "), the mesh's device is " << mesh.device();
  return ::testing::AssertionSuccess();
}

// Every parameter of `module` (and its gradient, when defined) on the mesh's device.
inline ::testing::AssertionResult parameters_on_mesh_device(const torch::nn::Module& module,
                                                            const DeviceMesh& mesh) {
  for (const auto& p : module.named_parameters()) {
    auto r = on_mesh_device(p.value(), mesh);
    if (!r) return ::testing::AssertionFailure() << "parameter " << p.key() << ": " << r.message();
    if (p.value().grad().defined()) {
      r = on_mesh_device(p.value().grad(), mesh);
      if (!r)
        return ::testing::AssertionFailure() << "gradient of " << p.key() << ": " << r.message();
    }
  }
  return ::testing::AssertionSuccess();
}

// The same global gradient in `out`'s layout (partial placements read as replicated).
inline at::Tensor grad_like(const at::Tensor& g, const at::Tensor& out) {
  return distribute_tensor(g, device_mesh(out), spec(out).partial_as_replicate().placements(),
                           std::nullopt, ShardSizes::Given(spec(out).shard_tables()));
}

// One op on distributed operands and on the full tensors (float64 on the mesh's device):
// the value and every operand's gradient must agree, and stay on the GPU. An operand with
// no placements is replicated (a parameter).
struct Operand {
  std::vector<int64_t> shape;
  Placements placements = {};
  std::vector<ShardTable> tables = {};
};
using Fn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
inline const test::Tolerance kTol{1e-9, 1e-10};

inline void differential(const DeviceMesh& mesh, const std::vector<Operand>& ops, const Fn& fn,
                         const std::string& what, uint64_t seed = 7) {
  std::vector<at::Tensor> full, dist;
  for (size_t i = 0; i < ops.size(); ++i) {
    full.push_back(randn(ops[i].shape, seed + i, mesh.device()).requires_grad_());
    const Placements p =
        ops[i].placements.empty() ? Placements(mesh.ndim(), Replicate()) : ops[i].placements;
    dist.push_back(test::make_dtensor_from_full(full.back().detach(), mesh, p, ops[i].tables)
                       .detach()
                       .requires_grad_());
  }
  const at::Tensor expected = fn(full);
  const at::Tensor got = fn(dist);
  ASSERT_TRUE(is_dtensor(got)) << what << ": the result is not distributed";
  ASSERT_TRUE(on_mesh_device(got, mesh)) << what << " (output)";
  ASSERT_TRUE(test::full_matches(got, expected, kTol)) << what << " (forward)";
  const at::Tensor g = randn(expected.sizes(), seed + 100, mesh.device());
  expected.backward(g);
  got.backward(grad_like(g, got));
  for (size_t i = 0; i < ops.size(); ++i) {
    ASSERT_TRUE(dist[i].grad().defined()) << what << ": operand " << i << " has no gradient";
    ASSERT_TRUE(on_mesh_device(dist[i].grad(), mesh)) << what << " (gradient " << i << ")";
    ASSERT_TRUE(test::full_matches(dist[i].grad(), full[i].grad(), kTol))
        << what << " (gradient of operand " << i << ")";
  }
}

}  // namespace tessera::gpu_test
