// from_local with default options on uneven local batches (the DTensor-tutorial habit):
// the layout is exchanged, so every rank sees the true global shape and every global value
// (a mean, a full tensor, a gradient) equals one device's. Sweeps 1-4 ranks, 1-D and 2-D
// meshes, empty local batches, and forward + backward.
#include "helpers.h"

#include <cmath>
#include <numeric>

using namespace tessera;

namespace {

// Rows per rank: uneven, some empty, a fixed function of (rank count, case).
std::vector<int64_t> batch_rows(int n, int which) {
  std::vector<int64_t> rows(n);
  for (int r = 0; r < n; ++r) rows[r] = (3 * r + which) % 4 + (which == 2 && r == 0 ? 0 : 1);
  if (which == 1) rows[0] = 0;  // an empty local batch
  return rows;
}

}  // namespace

TEST(FromLocalDefault, UnevenLocalBatchesGiveTheGlobalValue) {
  for (int n : {1, 2, 3, 4}) {
    for (int which : {0, 1, 2}) {
      const auto rows = batch_rows(n, which);
      const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
      const auto full = tessera::test::randn({total, 3}, 40 + n + which, at::kDouble);
      // One device: the mean and the gradient of the mean over the whole batch.
      auto ref_in = full.clone().requires_grad_();
      auto ref = (ref_in * ref_in).mean();
      ref.backward();
      tessera::testing::run_ranks(n, [&](int rank) {
        auto mesh = init_device_mesh("cpu", {n});
        const int64_t off = std::accumulate(rows.begin(), rows.begin() + rank, int64_t{0});
        auto local = full.narrow(0, off, rows[rank]).clone().requires_grad_();
        auto x = from_local(local, mesh, {Shard(0)});  // default options
        ASSERT_EQ(x.sizes().vec(), (std::vector<int64_t>{total, 3})) << "rank " << rank;
        auto loss = (x * x).mean();
        const double got = full_tensor(loss).item<double>(), want = ref.item<double>();
        if (total == 0) {
          EXPECT_TRUE(std::isnan(got) && std::isnan(want));  // an empty mean
        } else
          EXPECT_NEAR(got, want, 1e-12);
        loss.backward();
        ASSERT_TRUE(local.grad().defined());
        EXPECT_TRUE(at::allclose(local.grad(), ref_in.grad().narrow(0, off, rows[rank])))
            << n << " ranks, case " << which << ", rank " << rank;
        EXPECT_TRUE(full_tensor(x).equal(full));
      });
    }
  }
}

// On a 2x2 (dp, tp) mesh the batch is sharded over dp and replicated over tp: the exchange
// covers both mesh dims and the tp replicas agree.
TEST(FromLocalDefault, TwoDimMeshShardAndReplicate) {
  const std::vector<int64_t> rows = {3, 1};
  const auto full = tessera::test::randn({4, 5}, 7, at::kDouble);
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const int64_t dp = mesh.coordinate()[0];
    auto local = full.narrow(0, dp == 0 ? 0 : 3, rows[dp]).clone();
    auto x = from_local(local, mesh, {Shard(0), Replicate()});
    EXPECT_EQ(x.sizes().vec(), (std::vector<int64_t>{4, 5}));
    EXPECT_NEAR(full_tensor(x.sum()).item<double>(), full.sum().item<double>(), 1e-12);
  });
}

// Replicate and Partial only: nothing to infer, nothing exchanged (PyTorch's cost).
TEST(FromLocalDefault, NoExchangeWithoutShards) {
  tessera::testing::run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    CommDebugMode debug;
    from_local(at::ones({2, 2}), mesh, {Replicate()});
    from_local(at::ones({2, 2}), mesh, {Partial()});
    EXPECT_EQ(debug.get_total_counts(), 0);
    EXPECT_EQ(debug.stats(comm::CollectiveKind::Metadata).calls, 0);
    // A shard: one metadata exchange, nothing else; ShardSizes::Chunk() skips it.
    debug.reset();
    from_local(at::ones({2, 2}), mesh, {Shard(0)});
    EXPECT_EQ(debug.stats(comm::CollectiveKind::Metadata).calls, 1);
    EXPECT_EQ(debug.get_total_counts(), 0);
    debug.reset();
    FromLocalOptions chunk;
    chunk.sizes = ShardSizes::Chunk();
    from_local(at::ones({2, 2}), mesh, {Shard(0)}, chunk);
    EXPECT_EQ(debug.stats(comm::CollectiveKind::Metadata).calls, 0);
  });
}

// Ranks that disagree on the rows' width fail on every rank, naming the ranks.
TEST(FromLocalDefault, MismatchedLocalShapesFailEverywhere) {
  tessera::testing::run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    try {
      from_local(at::ones({2, rank == 0 ? 3 : 4}), mesh, {Shard(0)});
      ADD_FAILURE() << "no error on rank " << rank;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("from_local"), std::string::npos) << msg;
    }
  });
}
