// redistribute(t, mesh, placements) between a mesh and its slices: the values equal one
// device's, forward and backward, on uneven shards and several 2-D mesh shapes; adding a
// dim as a shard joins per-group tensors into one; unrelated meshes raise on every rank.
#include "helpers.h"

using namespace tessera;

namespace {

const test::Tolerance kTol{1e-12, 1e-12};
const std::vector<std::vector<int64_t>> kShapes = {{2, 2}, {2, 3}, {3, 2}, {1, 2}};

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming \"" << needle << "\"";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

// Root (S(0), S(1)) -> mesh["tp"] {S(1)} -> root (R, S(0)): one device's values and gradient
// (a tensor on a slice is the same in every group, so its gradient is not summed over "dp").
TEST(MeshMove, RootToSliceAndBack) {
  const at::Tensor full = test::randn({7, 5}, 61, at::kDouble);
  const at::Tensor w = test::randn({7, 5}, 62, at::kDouble);
  for (const auto& shape : kShapes) {
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int) {
      auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
      const at::Tensor x = full.clone().requires_grad_();
      const at::Tensor d = distribute_tensor(x, mesh, {Shard(0), Shard(1)}, std::nullopt);
      const at::Tensor on_tp = redistribute(d, mesh["tp"], {Shard(1)});
      EXPECT_EQ(device_mesh(on_tp), mesh["tp"]);
      EXPECT_TRUE(test::full_matches(on_tp, full, kTol)) << mesh.str();
      const at::Tensor back = redistribute(on_tp * w, mesh, {Replicate(), Shard(0)});
      EXPECT_EQ(device_mesh(back), mesh);
      EXPECT_TRUE(test::full_matches(back, full * w, kTol)) << mesh.str();
      (back * back).sum().backward();
      EXPECT_TRUE(test::matches(x.grad(), 2 * full * w * w, kTol)) << mesh.str();
    });
  }
}

// Each dp group's own tensor on mesh["tp"] (uneven rows per group) joined as a batch split
// over "dp": the root tensor is their concatenation; its gradient goes back to each group.
TEST(MeshMove, PerGroupTensorsJoinAsAShardOverDp) {
  for (const auto& shape : kShapes) {
    std::vector<at::Tensor> groups;
    for (int64_t g = 0; g < shape[0]; ++g)
      groups.push_back(test::randn({g + 2, 3}, 70 + g, at::kDouble));
    const at::Tensor joined = at::cat(groups);
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int) {
      auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
      const int64_t g = mesh.coordinate()[0];
      const at::Tensor mine = groups[static_cast<size_t>(g)].clone().requires_grad_();
      const at::Tensor on_tp = distribute_tensor(mine, mesh["tp"], {Shard(1)}, std::nullopt);
      const at::Tensor on_root = redistribute(on_tp, mesh, {Shard(0), Shard(1)});
      EXPECT_TRUE(test::full_matches(on_root, joined, kTol)) << mesh.str();
      (on_root * on_root).sum().backward();
      EXPECT_TRUE(test::matches(mine.grad(), 2 * groups[static_cast<size_t>(g)], kTol))
          << mesh.str();
    });
  }
}

// The target must share the tensor's root; a Partial added dim is refused. Every rank raises.
TEST(MeshMove, UnrelatedMeshOrPartialRaises) {
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto other = init_device_mesh("cpu", {4}, {"all"});
    const at::Tensor d =
        distribute_tensor(test::randn({4, 4}, 80), mesh, {Shard(0), Replicate()}, std::nullopt);
    expect_error([&] { (void)redistribute(d, other, {Shard(0)}); }, "not a slice");
    const at::Tensor on_tp = redistribute(d, mesh["tp"], {Replicate()});
    expect_error(
        [&] {
          (void)redistribute(on_tp, mesh, {Partial(), Replicate()});
        },
        "cannot become Partial");
    expect_error([&] { (void)redistribute(on_tp, mesh, {Replicate()}); }, "one placement per dim");
  });
}
