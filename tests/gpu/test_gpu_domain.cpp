// Domain parallelism on the GPU: convolutions, pooling and interpolation with halos, and
// neighbourhood attention (na1d / na2d / na3d), on inputs cut over both dims of a 2x2 mesh
// into uneven shards (some thinner than the halo, some empty); forward and every gradient
// against the same op on the full tensors on one GPU. Also the raw halo exchange.
#include <torch/nn/functional/upsampling.h>

#include "gpu_helpers.h"
#include "tessera/nn/neighborhood_attention.h"

using namespace tessera;
using gpu_test::GpuMesh;
using gpu_test::Operand;
using Shape = std::vector<int64_t>;
namespace F = torch::nn::functional;
namespace NA = tessera::nn::functional;

namespace {

// 2-D inputs [N, C, 13, 11]: H cut 10 / 3, W cut 1 / 10 (a one-column shard under 3- and
// 5-wide kernels). 3-D inputs [N, C, 7, 6, 5]: D cut 5 / 2, H cut 0 / 6 (an empty shard).
const Shape kImage = {2, 3, 13, 11};
const Shape kVolume = {1, 2, 7, 6, 5};

std::vector<ShardTable> image_tables(const DeviceMesh& mesh) {
  if (mesh.size() == 1) return {};
  return {{}, {}, {10, 3}, {1, 10}};
}
std::vector<ShardTable> volume_tables(const DeviceMesh& mesh) {
  if (mesh.size() == 1) return {};
  return {{}, {}, {5, 2}, {0, 6}, {}};
}
// Spatial dims 2 and 3 over the mesh's two dims (both over the single dim of a 1-rank mesh
// would nest; one is enough there).
Placements spatial(const DeviceMesh& mesh) {
  if (mesh.ndim() == 1) return {Shard(2)};
  return {Shard(2), Shard(3)};
}

struct WindowCase {
  std::string name;
  bool volume;
  std::vector<Shape> params;  // replicated parameters
  std::function<at::Tensor(const std::vector<at::Tensor>&)> fn;
};

// at::convolution (one signature on every LibTorch); t = {input, weight[, bias]}.
gpu_test::Fn conv(Shape stride, Shape pad, Shape dil, bool transposed = false, Shape outpad = {},
                  int64_t groups = 1) {
  if (outpad.empty()) outpad.assign(stride.size(), 0);
  return [=](const std::vector<at::Tensor>& t) {
    return at::convolution(t[0], t[1], t.size() > 2 ? t[2] : at::Tensor(), stride, pad, dil,
                           transposed, outpad, groups);
  };
}

std::vector<WindowCase> window_cases() {
  using V = std::vector<at::Tensor>;
  return {
      {"conv2d k3 pad1 bias", false, {{4, 3, 3, 3}, {4}}, conv({1, 1}, {1, 1}, {1, 1})},
      {"conv2d k5x3 stride2x1 dil1x2", false, {{4, 3, 5, 3}}, conv({2, 1}, {2, 1}, {1, 2})},
      {"conv2d groups3 no pad",
       false,
       {{3, 1, 3, 3}},
       conv({1, 1}, {0, 0}, {1, 1}, false, {0, 0}, 3)},
      {"conv_transpose2d stride2 bias",
       false,
       {{3, 2, 3, 3}, {2}},
       conv({2, 2}, {1, 1}, {1, 1}, true, {1, 0})},
      {"conv3d k3 pad1", true, {{2, 2, 3, 3, 3}}, conv({1, 1, 1}, {1, 1, 1}, {1, 1, 1})},
      {"max_pool2d k3 s2 p1",
       false,
       {},
       [](const V& t) {
         return at::max_pool2d(t[0], {3, 3}, {2, 2}, {1, 1});
       }},
      {"avg_pool2d k3 s1 p1 exclude_pad",
       false,
       {},
       [](const V& t) {
         return at::avg_pool2d(t[0], {3, 3}, {1, 1}, {1, 1}, false, false);
       }},
      {"max_pool3d k2 s2 ceil",
       true,
       {},
       [](const V& t) {
         return at::max_pool3d(t[0], {2, 2, 2}, {2, 2, 2}, {0, 0, 0}, {1, 1, 1}, true);
       }},
      {"bilinear x2",
       false,
       {},
       [](const V& t) {
         return F::interpolate(t[0], F::InterpolateFuncOptions()
                                         .scale_factor(std::vector<double>{2, 2})
                                         .mode(torch::kBilinear)
                                         .align_corners(false));
       }},
      {"nearest to 20x17",
       false,
       {},
       [](const V& t) {
         return F::interpolate(
             t[0],
             F::InterpolateFuncOptions().size(std::vector<int64_t>{20, 17}).mode(torch::kNearest));
       }},
      {"trilinear align_corners to 9x5x6",
       true,
       {},
       [](const V& t) {
         return F::interpolate(t[0], F::InterpolateFuncOptions()
                                         .size(std::vector<int64_t>{9, 5, 6})
                                         .mode(torch::kTrilinear)
                                         .align_corners(true));
       }},
  };
}

// Neighbourhood attention: q [B, *S, H, D], k / v [B, *S, H_kv, D]; `cut` names the q dims
// sharded over the mesh dims, with their tables.
struct NACase {
  std::string name;
  Shape spatial;
  int64_t heads, kv_heads, dim;
  std::vector<int64_t> kernel;
  NA::NeighborhoodAttentionFuncOptions options;
  bool rpb;
  std::vector<int64_t> cut;            // per mesh dim: the sharded q dim
  std::vector<ShardTable> cut_tables;  // per mesh dim: its table
};

std::vector<NACase> na_cases() {
  return {
      // na1d: X 9 / 4 with a dilated 5-wide window (reach 4 rows), heads split 3 / 1.
      {"na1d k5 dil2 heads cut",
       {13},
       4,
       4,
       8,
       {5},
       NA::NeighborhoodAttentionFuncOptions().dilation({2}),
       false,
       {1, 2},
       {{9, 4}, {3, 1}}},
      // na2d: X 3 / 8, Y 6 / 3; relative positional bias; grouped query (2 heads, 1 kv).
      {"na2d k5x3 rpb gqa",
       {11, 9},
       2,
       1,
       4,
       {5, 3},
       NA::NeighborhoodAttentionFuncOptions(),
       true,
       {1, 2},
       {{3, 8}, {6, 3}}},
      // na3d: X 2 / 4, Y 1 / 4; causal along Z, circular along Y, stride 2 along X.
      {"na3d k3 causal-z circular-y stride-x",
       {6, 5, 7},
       2,
       2,
       4,
       {3},
       NA::NeighborhoodAttentionFuncOptions()
           .is_causal({false, false, true})
           .circular({false, true, false})
           .stride({2, 1, 1}),
       false,
       {1, 2},
       {{2, 4}, {1, 4}}},
  };
}

Shape with(Shape spatial, int64_t b, int64_t h, int64_t d) {
  spatial.insert(spatial.begin(), b);
  spatial.push_back(h);
  spatial.push_back(d);
  return spatial;
}

void run_na(const DeviceMesh& mesh, const NACase& c) {
  const int64_t nd = static_cast<int64_t>(c.spatial.size());
  Placements p;
  std::vector<ShardTable> qt(nd + 3), kvt(nd + 3);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    p.push_back(Shard(c.cut[m]));
    if (mesh.size() == 1) continue;
    qt[c.cut[m]] = c.cut_tables[m];
    kvt[c.cut[m]] = c.cut_tables[m];
    if (c.cut[m] == nd + 1)  // heads: key/value heads split in proportion
      for (auto& n : kvt[c.cut[m]]) n = n * c.kv_heads / c.heads;
  }
  std::vector<Operand> ops = {{with(c.spatial, 2, c.heads, c.dim), p, qt},
                              {with(c.spatial, 2, c.kv_heads, c.dim), p, kvt},
                              {with(c.spatial, 2, c.kv_heads, c.dim), p, kvt}};
  if (c.rpb) {
    Shape rs = {c.heads};
    for (auto k : c.kernel) rs.push_back(2 * k - 1);
    ops.push_back({rs});
  }
  const auto options = c.options;
  const auto kernel = c.kernel;
  gpu_test::differential(
      mesh, ops,
      [&](const std::vector<at::Tensor>& t) {
        auto o = options;
        if (t.size() > 3) o.rpb(t[3]);
        switch (nd) {
          case 1: return NA::na1d(t[0], t[1], t[2], kernel, o);
          case 2: return NA::na2d(t[0], t[1], t[2], kernel, o);
          default: return NA::na3d(t[0], t[1], t[2], kernel, o);
        }
      },
      mesh.str() + " " + c.name, 31);
}

const auto kDomainMeshes =
    ::testing::Values(GpuMesh{"cuda:gloo", {2, 2}}, GpuMesh{"cuda", {1}}, GpuMesh{"cuda", {2, 2}});

}  // namespace

class GpuDomain : public ::testing::TestWithParam<GpuMesh> {};

TEST_P(GpuDomain, HaloWindowOpsMatchOneDevice) {
  TESSERA_REQUIRE_GPU_MESH(GetParam());
  const auto cases = window_cases();
  gpu_test::on_gpu_mesh(GetParam(), [&](const DeviceMesh& mesh) {
    uint64_t seed = 100;
    for (const auto& c : cases) {
      std::vector<Operand> ops = {{c.volume ? kVolume : kImage, spatial(mesh),
                                   c.volume ? volume_tables(mesh) : image_tables(mesh)}};
      for (const auto& s : c.params) ops.push_back({s});
      gpu_test::differential(mesh, ops, c.fn, mesh.str() + " " + c.name, seed += 10);
    }
  });
}

TEST_P(GpuDomain, NeighborhoodAttentionMatchesOneDevice) {
  TESSERA_REQUIRE_GPU_MESH(GetParam());
  const auto cases = na_cases();
  gpu_test::on_gpu_mesh(GetParam(), [&](const DeviceMesh& mesh) {
    for (const auto& c : cases) run_na(mesh, c);
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuDomain, kDomainMeshes, gpu_test::mesh_param_name);

// The halo exchange itself on CUDA shards (1-D meshes, uneven, a shard thinner than the
// halo, zero and periodic boundaries): each rank's extended block is the padded / wrapped
// full tensor's window, and the adjoint sums every halo row back into its owner.
class GpuHalo : public ::testing::TestWithParam<GpuMesh> {};

TEST_P(GpuHalo, ExchangeAndAdjointMatchOneDevice) {
  TESSERA_REQUIRE_GPU_MESH(GetParam());
  gpu_test::on_gpu_mesh(GetParam(), [&](const DeviceMesh& mesh) {
    const int64_t n = mesh.size(0), me = mesh.coordinate()[0];
    const ShardTable sizes = n == 1   ? ShardTable{7}
                             : n == 2 ? ShardTable{6, 1}
                                      : ShardTable{4, 1, 2};
    const int64_t total = 7, before = 2, after = 3;
    std::vector<int64_t> offsets(n, 0);
    for (int64_t i = 1; i < n; ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
    const at::Tensor full = gpu_test::randn({3, total}, 11, mesh.device());
    for (auto boundary : {comm::HaloBoundary::Zeros, comm::HaloBoundary::Periodic}) {
      const bool wrap = boundary == comm::HaloBoundary::Periodic;
      const std::string what = mesh.str() + (wrap ? " periodic" : " zeros");
      const at::Tensor local = full.narrow(1, offsets[me], sizes[me]).contiguous();
      const at::Tensor ext =
          comm::halo_exchange(mesh.group(0), local, 1, sizes, before, after, boundary);
      ASSERT_TRUE(gpu_test::on_mesh_device(ext, mesh)) << what;
      // One device: the full tensor padded (zeros) or wrapped, then windowed.
      const at::Tensor padded =
          wrap
              ? at::cat({full.narrow(1, total - before, before), full, full.narrow(1, 0, after)}, 1)
              : at::constant_pad_nd(full, {before, after});
      ASSERT_TRUE(test::matches(ext, padded.narrow(1, offsets[me], before + sizes[me] + after)))
          << what;
      // Adjoint: a gradient on every rank's extended block, summed back onto the owners.
      at::Tensor total_grad = at::zeros_like(padded);
      at::Tensor mine;
      for (int64_t r = 0; r < n; ++r) {
        const at::Tensor g = gpu_test::randn({3, before + sizes[r] + after}, 50 + r, mesh.device());
        total_grad.narrow(1, offsets[r], g.size(1)).add_(g);
        if (r == me) mine = g;
      }
      at::Tensor folded = total_grad.narrow(1, before, total).clone();
      if (wrap) {
        folded.narrow(1, total - before, before).add_(total_grad.narrow(1, 0, before));
        folded.narrow(1, 0, after).add_(total_grad.narrow(1, before + total, after));
      }
      const at::Tensor back =
          comm::halo_exchange_backward(mesh.group(0), mine, 1, sizes, before, after, boundary);
      ASSERT_TRUE(gpu_test::on_mesh_device(back, mesh)) << what;
      ASSERT_TRUE(test::matches(back, folded.narrow(1, offsets[me], sizes[me]), gpu_test::kTol))
          << what;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuHalo,
                         ::testing::Values(GpuMesh{"cuda:gloo", {2}}, GpuMesh{"cuda:gloo", {3}},
                                           GpuMesh{"cuda", {1}}),
                         gpu_test::mesh_param_name);
