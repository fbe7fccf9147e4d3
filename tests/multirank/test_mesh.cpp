// DeviceMesh: shapes, coordinates (row-major), per-dim groups, slicing and subset meshes.
#include "helpers.h"

#include <algorithm>

using namespace tessera;

namespace {

using Shape = std::vector<int64_t>;
using Ranks = std::vector<int>;

// Expects fn to throw a c10::Error whose message contains `needle`.
template <typename Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error (expected one mentioning \"" << needle << "\")";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
}

// The full value the ranks of one group agree on, distinct per group.
at::Tensor group_value(int64_t group_id) {
  return at::arange(35, at::kFloat).reshape({7, 5}) + 100 * group_id;
}

}  // namespace

TEST(MeshInit, OneDim) {
  tessera::testing::run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4}, {"x"});
    EXPECT_TRUE(mesh.defined());
    EXPECT_EQ(mesh.device_type(), "cpu");
    EXPECT_EQ(mesh.device_kind(), c10::DeviceType::CPU);
    EXPECT_EQ(mesh.ndim(), 1);
    EXPECT_EQ(mesh.size(), 4);
    EXPECT_EQ(mesh.size(0), 4);
    EXPECT_EQ(mesh.shape(), (Shape{4}));
    EXPECT_EQ(mesh.ranks(), (Ranks{0, 1, 2, 3}));
    EXPECT_EQ(mesh.dim_names(), (std::vector<std::string>{"x"}));
    EXPECT_EQ(mesh.dim_index("x"), 0);
    EXPECT_TRUE(mesh.contains_this_rank());
    EXPECT_EQ(mesh.coordinate(), (Shape{rank}));
    EXPECT_EQ(mesh.local_rank(0), rank);
    EXPECT_EQ(mesh.group_ranks(0), (Ranks{0, 1, 2, 3}));
    EXPECT_EQ(comm::group_size(mesh.group(0)), 4);
    EXPECT_EQ(comm::group_rank(mesh.group(0)), rank);
    EXPECT_EQ(comm::group_rank(mesh.mesh_group()), rank);
    EXPECT_EQ(mesh.rank_at({2}), 2);
    EXPECT_NE(mesh.str().find("shape=[4]"), std::string::npos) << mesh.str();
    EXPECT_TRUE(mesh == mesh);
    // Unnamed dims.
    auto plain = init_device_mesh("cpu", {4});
    EXPECT_TRUE(plain.dim_names().empty());
    EXPECT_TRUE(plain != mesh);  // a second mesh is a different mesh
    expect_error([&] { plain.dim_index("x"); }, "no dim named \"x\"");
  });
}

TEST(MeshInit, TwoDimRowMajor) {
  tessera::testing::run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    EXPECT_EQ(mesh.ndim(), 2);
    EXPECT_EQ(mesh.size(), 4);
    EXPECT_EQ(mesh.shape(), (Shape{2, 2}));
    const int64_t dp = rank / 2, tp = rank % 2;
    EXPECT_EQ(mesh.coordinate(), (Shape{dp, tp}));
    EXPECT_EQ(mesh.dim_index("tp"), 1);
    // Along dp: same tp coordinate; along tp: same dp row.
    EXPECT_EQ(mesh.group_ranks(0), (Ranks{static_cast<int>(tp), static_cast<int>(2 + tp)}));
    EXPECT_EQ(mesh.group_ranks(1), (Ranks{static_cast<int>(2 * dp), static_cast<int>(2 * dp + 1)}));
    EXPECT_EQ(comm::group_rank(mesh.group(0)), dp);
    EXPECT_EQ(comm::group_rank(mesh.group(1)), tp);
    EXPECT_EQ(comm::group_size(mesh.mesh_group()), 4);
    EXPECT_EQ(mesh.rank_at({1, 0}), 2);
    EXPECT_EQ(mesh.rank_at({0, 1}), 1);
    EXPECT_NE(mesh.str().find("dp, tp"), std::string::npos) << mesh.str();
  });
  tessera::testing::run_ranks(6, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 3}, {"dp", "tp"});
    const int dp = rank / 3, tp = rank % 3;
    EXPECT_EQ(mesh.size(), 6);
    EXPECT_EQ(mesh.size(0), 2);
    EXPECT_EQ(mesh.size(1), 3);
    EXPECT_EQ(mesh.coordinate(), (Shape{dp, tp}));
    EXPECT_EQ(mesh.group_ranks(0), (Ranks{tp, 3 + tp}));
    EXPECT_EQ(mesh.group_ranks(1), (Ranks{3 * dp, 3 * dp + 1, 3 * dp + 2}));
    EXPECT_EQ(mesh.rank_at({1, 2}), 5);
    // Collectives over each dim's group run independently.
    auto full = group_value(0);
    auto dt = distribute_tensor(full, mesh, {Shard(1), Shard(0)});
    EXPECT_TRUE(at::equal(full_tensor(dt), full));
  });
}

TEST(MeshInit, ThreeDim) {
  tessera::testing::run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2, 1}, {"a", "b", "c"});
    EXPECT_EQ(mesh.ndim(), 3);
    EXPECT_EQ(mesh.size(), 4);
    EXPECT_EQ(mesh.coordinate(), (Shape{rank / 2, rank % 2, 0}));
    EXPECT_EQ(mesh.group_ranks(0), (Ranks{rank % 2, 2 + rank % 2}));
    EXPECT_EQ(mesh.group_ranks(1), (Ranks{2 * (rank / 2), 2 * (rank / 2) + 1}));
    EXPECT_EQ(mesh.group_ranks(2), (Ranks{rank}));
    auto full = group_value(0);
    auto dt = distribute_tensor(full, mesh, {Shard(0), Replicate(), Shard(1)});
    EXPECT_TRUE(at::equal(full_tensor(dt), full));

    auto lead = init_device_mesh("cpu", {1, 2, 2}, {"pp", "dp", "tp"});
    EXPECT_EQ(lead.coordinate(), (Shape{0, rank / 2, rank % 2}));
    EXPECT_EQ(lead.group_ranks(0), (Ranks{rank}));
    EXPECT_EQ(lead.group_ranks(2), (Ranks{2 * (rank / 2), 2 * (rank / 2) + 1}));
    auto dt2 = distribute_tensor(full, lead, {Shard(1), Shard(0), Shard(0)});
    EXPECT_TRUE(at::equal(full_tensor(dt2), full));
    // Slicing two of three dims.
    auto sub = lead[std::vector<std::string>{"dp", "tp"}];
    EXPECT_EQ(sub.ndim(), 2);
    EXPECT_EQ(sub.ranks(), (Ranks{0, 1, 2, 3}));
    EXPECT_EQ(sub.coordinate(), (Shape{rank / 2, rank % 2}));
    auto ac = mesh[std::vector<std::string>{"a", "c"}];
    EXPECT_EQ(ac.shape(), (Shape{2, 1}));
    EXPECT_EQ(ac.ranks(), (Ranks{rank % 2, 2 + rank % 2}));
  });
}

TEST(MeshSlice, SubmeshesAreCachedAndShareGroups) {
  tessera::testing::run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const int dp = rank / 2, tp = rank % 2;
    auto tpm = mesh["tp"];
    EXPECT_EQ(tpm.ndim(), 1);
    EXPECT_EQ(tpm.size(), 2);
    EXPECT_EQ(tpm.dim_names(), (std::vector<std::string>{"tp"}));
    EXPECT_EQ(tpm.ranks(), (Ranks{2 * dp, 2 * dp + 1}));
    EXPECT_EQ(tpm.coordinate(), (Shape{tp}));
    EXPECT_EQ(tpm.group_ranks(0), mesh.group_ranks(1));
    EXPECT_TRUE(tpm.group(0) == mesh.group(1));  // no new communicator
    auto dpm = mesh["dp"];
    EXPECT_EQ(dpm.ranks(), (Ranks{tp, 2 + tp}));
    EXPECT_EQ(dpm.coordinate(), (Shape{dp}));
    EXPECT_TRUE(dpm.group(0) == mesh.group(0));

    EXPECT_TRUE((mesh[std::vector<std::string>{"dp", "tp"}] == mesh));
    EXPECT_TRUE(mesh["tp"] == tpm);
    EXPECT_TRUE(mesh[std::vector<std::string>{"tp"}] == tpm);
    EXPECT_TRUE(mesh["dp"] == dpm);
    EXPECT_TRUE(tpm != dpm);
    EXPECT_TRUE(tpm["tp"] == tpm);  // slicing every dim is the mesh itself

    expect_error([&] { mesh["pp"]; }, "dp, tp");
    expect_error([&] { mesh[std::vector<std::string>{"tp", "dp"}]; }, "mesh order");
  });
}

// permute: the same ranks and groups, dims reordered; two mesh dims sharding one tensor dim
// then nest in the permuted order (the inner one splits each piece of the outer one).
TEST(MeshSlice, PermutedMeshReordersDimsAndNesting) {
  tessera::testing::run_ranks(6, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 3}, {"dp", "tp"});
    const int64_t dp = rank / 3, tp = rank % 3;
    auto t = mesh.permute({1, 0});
    EXPECT_EQ(t.shape(), (Shape{3, 2}));
    EXPECT_EQ(t.dim_names(), (std::vector<std::string>{"tp", "dp"}));
    EXPECT_EQ(t.coordinate(), (Shape{tp, dp}));
    EXPECT_EQ(t.ranks(), (Ranks{0, 3, 1, 4, 2, 5}));
    EXPECT_TRUE(t.group(0) == mesh.group(1) && t.group(1) == mesh.group(0));
    EXPECT_TRUE(t.root() == mesh);
    EXPECT_EQ(t.dims_in_root(), (Shape{1, 0}));
    EXPECT_TRUE(mesh.permute({1, 0}) == t);  // cached
    EXPECT_TRUE(mesh.permute({0, 1}) == mesh);
    // Rows 0..10 over (tp, dp): tp's chunks [4, 4, 3], each cut in two over dp.
    const auto full = at::arange(11, at::kDouble).view({11, 1}).repeat({1, 2});
    const auto d = distribute_tensor(full, t, {Shard(0), Shard(0)}, std::nullopt);
    const int64_t tp_rows[] = {4, 4, 3}, tp_off[] = {0, 4, 8};
    const int64_t mine = (tp_rows[tp] + 1 - dp) / 2;  // chunk of the tp piece
    const int64_t off = tp_off[tp] + (dp == 0 ? 0 : (tp_rows[tp] + 1) / 2);
    EXPECT_TRUE(at::equal(to_local(d), full.narrow(0, off, mine))) << rank;
    EXPECT_TRUE(at::equal(full_tensor(d), full));
    const auto back = redistribute(d, {Shard(0), Replicate()});  // gather over dp only
    EXPECT_TRUE(at::equal(to_local(back), full.narrow(0, tp_off[tp], tp_rows[tp])));
    // A mesh without dim names permutes too, and stays unnamed.
    auto unnamed = init_device_mesh("cpu", {2, 3}).permute({1, 0});
    EXPECT_EQ(unnamed.shape(), (Shape{3, 2}));
    EXPECT_TRUE(unnamed.dim_names().empty());
    EXPECT_EQ(unnamed.ranks(), (Ranks{0, 3, 1, 4, 2, 5}));
    expect_error([&] { mesh.permute({0, 0}); }, "every mesh dim exactly once");
    expect_error([&] { mesh.permute({1}); }, "every mesh dim exactly once");
  });
}

TEST(MeshSlice, SubmeshCollectivesStayInTheirGroup) {
  tessera::testing::run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const int dp = rank / 2;
    auto tpm = mesh["tp"];
    // Each tp group distributes its own value; rows never mix.
    auto full = group_value(dp);
    const int src = tpm.ranks().back();
    auto mine = rank == src ? full : full * 0 - 1;
    auto dt = distribute_tensor(mine, tpm, {Shard(0)}, src);
    EXPECT_TRUE(device_mesh(dt) == tpm);
    EXPECT_EQ(to_local(dt).size(0), rank % 2 == 0 ? 4 : 3);
    EXPECT_TRUE(at::equal(full_tensor(dt), full));
    auto split = distribute_tensor(full, tpm, {Shard(1)}, std::nullopt);
    EXPECT_TRUE(at::equal(full_tensor(split), full));
    auto sc = scatter_tensor(rank == src ? full : at::Tensor(), src, tpm, {Shard(0)});
    EXPECT_TRUE(at::equal(full_tensor(sc), full));
    // And along dp.
    auto dpm = mesh["dp"];
    auto col = group_value(10 + rank % 2);
    auto dt2 = distribute_tensor(col, dpm, {Shard(1)}, dpm.ranks()[0]);
    EXPECT_TRUE(at::equal(full_tensor(dt2), col));
  });
}

TEST(MeshSubset, RanksOutsideHaveNoCoordinate) {
  tessera::testing::run_ranks(4, [](int rank) {
    DeviceMesh sub("cpu", {2}, {1, 3}, {"x"});
    const bool member = rank == 1 || rank == 3;
    EXPECT_EQ(sub.contains_this_rank(), member);
    EXPECT_EQ(sub.size(), 2);
    EXPECT_EQ(sub.ndim(), 1);
    EXPECT_EQ(sub.ranks(), (Ranks{1, 3}));
    EXPECT_EQ(sub.rank_at({1}), 3);
    if (member) {
      EXPECT_EQ(sub.coordinate(), (Shape{rank == 1 ? 0 : 1}));
      EXPECT_EQ(sub.group_ranks(0), (Ranks{1, 3}));
      auto full = group_value(3);
      auto dt = distribute_tensor(rank == 3 ? full : full + 1, sub, {Shard(0)}, 3);
      EXPECT_TRUE(at::equal(full_tensor(dt), full));
      auto infer =
          from_local(at::ones({rank == 1 ? 2 : 5, 3}), sub, {Shard(0)}, {ShardSizes::Infer()});
      EXPECT_EQ(infer.sizes().vec(), (Shape{7, 3}));
    } else {
      EXPECT_TRUE(sub.coordinate().empty());
      expect_error([&] { sub.group(0); }, "not part of");
      expect_error([&] { sub.group_ranks(0); }, "not part of");
    }
    // A full-world mesh created afterwards still lines up on every rank.
    auto all = init_device_mesh("cpu", {4});
    auto full = group_value(4);
    EXPECT_TRUE(at::equal(full_tensor(distribute_tensor(full, all, {Shard(0)})), full));
  });
}

TEST(MeshSubset, TwoDimOverPermutedRanks) {
  tessera::testing::run_ranks(4, [](int rank) {
    // Ranks in an order other than 0..n-1: coordinates follow the given row-major order.
    const Ranks order = {3, 1, 0, 2};
    DeviceMesh mesh("cpu", {2, 2}, order, {"a", "b"});
    const int64_t flat = std::find(order.begin(), order.end(), rank) - order.begin();
    EXPECT_EQ(mesh.coordinate(), (Shape{flat / 2, flat % 2}));
    EXPECT_EQ(mesh.rank_at({0, 0}), 3);
    EXPECT_EQ(mesh.group_ranks(1), (Ranks{order[2 * (flat / 2)], order[2 * (flat / 2) + 1]}));
    auto full = group_value(0);
    auto dt = distribute_tensor(full, mesh, {Shard(0), Shard(1)}, 0);
    EXPECT_TRUE(at::equal(full_tensor(dt), full));
  });
}

TEST(MeshWorld, SingleRank) {
  tessera::testing::run_ranks(1, [](int rank) {
    EXPECT_EQ(rank, 0);
    auto mesh = init_device_mesh("cpu", {1}, {"x"});
    EXPECT_EQ(mesh.size(), 1);
    EXPECT_EQ(mesh.coordinate(), (Shape{0}));
    EXPECT_EQ(mesh.group_ranks(0), (Ranks{0}));
    auto full = group_value(1);
    auto dt = distribute_tensor(full, mesh, {Shard(0)});
    EXPECT_TRUE(at::equal(to_local(dt), full));
    EXPECT_TRUE(at::equal(full_tensor(dt), full));
    auto mesh2 = init_device_mesh("cpu", {1, 1}, {"dp", "tp"});
    EXPECT_EQ(mesh2.coordinate(), (Shape{0, 0}));
    EXPECT_EQ(mesh2["tp"].size(), 1);
    auto dt2 = distribute_tensor(full, mesh2, {Shard(1), Shard(0)});
    EXPECT_TRUE(at::equal(full_tensor(dt2), full));
  });
}
