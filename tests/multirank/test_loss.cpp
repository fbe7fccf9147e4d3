// Losses and softmax against one device, forward and backward, on uneven shards.
#include "helpers.h"

using namespace tessera;
using tessera::test::differential;

namespace {

void on_meshes(const std::function<void(const DeviceMesh&)>& body) {
  for (int world : {1, 2, 3})
    tessera::testing::run_ranks(world, [&](int) { body(init_device_mesh("cpu", {world})); });
  tessera::testing::run_ranks(4, [&](int) { body(init_device_mesh("cpu", {2, 2})); });
}

Placements with(const DeviceMesh& mesh, Placement first, Placement rest = Replicate()) {
  Placements p(mesh.ndim(), rest);
  p[0] = first;
  return p;
}

std::vector<ShardTable> uneven(const DeviceMesh& mesh, int64_t dim, int64_t size) {
  if (mesh.ndim() != 1 || mesh.size() == 1) return {};
  ShardTable t(mesh.size(), 0);
  t[0] = size - 1;
  t.back() += 1;
  std::vector<ShardTable> out(dim + 1);
  out[dim] = t;
  return out;
}

}  // namespace

TEST(Loss, ElementwiseLossesEveryReduction) {
  on_meshes([](const DeviceMesh& mesh) {
    for (auto p : {with(mesh, Shard(0)), with(mesh, Shard(1)), with(mesh, Replicate()),
                   with(mesh, Shard(0), Shard(1))}) {
      auto tabs = p[0].is_shard(0) ? uneven(mesh, 0, 7) : std::vector<ShardTable>{};
      for (int64_t red : {0, 1, 2}) {
        const std::string what = to_string(p) + " reduction " + std::to_string(red);
        differential(mesh, {{{7, 5}, p, tabs}, {{7, 5}, p, tabs}},
                     [red](auto& v) { return at::mse_loss(v[0], v[1], red); }, "mse " + what);
        differential(mesh, {{{7, 5}, p, tabs}, {{7, 5}, p, tabs}},
                     [red](auto& v) { return at::smooth_l1_loss(v[0], v[1], red, 0.5); },
                     "smooth_l1 " + what);
        differential(mesh, {{{7, 5}, p, tabs}, {{7, 5}, with(mesh, Replicate())}},
                     [red](auto& v) { return at::huber_loss(v[0], v[1], red, 0.7); },
                     "huber (target replicated) " + what);
        differential(mesh, {{{7, 5}, p, tabs}, {{7, 5}, p, tabs}},
                     [red](auto& v) { return at::l1_loss(v[0], v[1], red); }, "l1 " + what);
      }
    }
  });
}

TEST(Loss, SoftmaxShardedAndUnshardedDims) {
  on_meshes([](const DeviceMesh& mesh) {
    for (auto p : {with(mesh, Shard(0)), with(mesh, Shard(1)), with(mesh, Partial())}) {
      for (int64_t dim : {0, 1, -1}) {
        const std::string what = to_string(p) + " dim " + std::to_string(dim);
        differential(mesh, {{{6, 5}, p}}, [dim](auto& v) { return at::softmax(v[0], dim); },
                     "softmax " + what);
        differential(mesh, {{{6, 5}, p}},
                     [dim](auto& v) { return at::log_softmax(v[0], dim) * 1.5; },
                     "log_softmax " + what);
      }
    }
  });
}
