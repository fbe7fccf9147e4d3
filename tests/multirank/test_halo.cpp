// Halo exchange against one device: each rank's extended shard equals the padded (or
// wrapped) full tensor's window, and the backward adds every halo row's gradient into its
// owner's rows, for uneven and empty shards and halos wider than a neighbour's shard.
#include "helpers.h"

using namespace tessera;
using comm::HaloBoundary;

namespace {

int64_t wrap(int64_t g, int64_t total) { return ((g % total) + total) % total; }

}  // namespace

TEST(Halo, ExchangeAndAdjointMatchOneDevice) {
  for (int world : {1, 2, 3, 4}) {
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      tessera::test::Rng rng(1000 + world);
      for (int c = 0; c < 40; ++c) {
        const int64_t total = rng.uniform(1, 9);
        auto sizes = tessera::test::random_table(rng, total, world);
        const int64_t before = rng.uniform(0, 4);
        const int64_t after = rng.uniform(0, 4);
        const auto boundary = c % 2 ? HaloBoundary::Periodic : HaloBoundary::Zeros;
        const std::string what = "world " + std::to_string(world) + " case " + std::to_string(c) +
                                 " sizes " + shape_str(sizes) + " halo " + std::to_string(before) +
                                 "/" + std::to_string(after) + (c % 2 ? " periodic" : " zeros");
        const auto full = tessera::test::randn({3, total}, 7 * c + world);
        std::vector<int64_t> offsets(world, 0);
        for (int i = 1; i < world; ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
        const int64_t off = offsets[rank], len = sizes[rank];
        auto local = full.narrow(1, off, len);
        auto ext = comm::halo_exchange(mesh.group(0), local, 1, sizes, before, after, boundary);
        // One device: the window [off - before, off + len + after) of the padded/wrapped tensor.
        auto expected = at::zeros({3, before + len + after});
        for (int64_t k = 0; k < before + len + after; ++k) {
          int64_t g = off - before + k;
          if (boundary == HaloBoundary::Periodic) g = wrap(g, total);
          if (g >= 0 && g < total) expected.select(1, k).copy_(full.select(1, g));
        }
        ASSERT_TRUE(at::equal(ext, expected)) << what;
        // Adjoint: every rank's extended gradient lands on the global rows it came from.
        std::vector<at::Tensor> grads;
        auto total_grad = at::zeros({3, total});
        for (int r = 0; r < world; ++r) {
          grads.push_back(tessera::test::randn({3, before + sizes[r] + after}, 500 + 31 * c + r));
          for (int64_t k = 0; k < before + sizes[r] + after; ++k) {
            int64_t g = offsets[r] - before + k;
            if (boundary == HaloBoundary::Periodic) g = wrap(g, total);
            if (g >= 0 && g < total) total_grad.select(1, g).add_(grads[r].select(1, k));
          }
        }
        auto back = comm::halo_exchange_backward(mesh.group(0), grads[rank], 1, sizes, before,
                                                 after, boundary);
        ASSERT_TRUE(at::allclose(back, total_grad.narrow(1, off, len), 1e-5, 1e-6)) << what;
      }
    });
  }
}

// Halos cost exactly the halo rows: a rank receives before + after rows (those inside the
// domain), and sends what its neighbours need of it.
TEST(Halo, MovesOnlyHaloRows) {
  tessera::testing::run_ranks(3, [](int rank) {
    auto mesh = init_device_mesh("cpu", {3});
    std::vector<int64_t> sizes = {4, 1, 5};  // the middle shard is thinner than the halo
    auto local = at::ones({2, sizes[rank]});
    CommDebugMode comm;
    comm::halo_exchange(mesh.group(0), local, 1, sizes, 2, 2, HaloBoundary::Zeros);
    const int64_t row = 2 * 4;  // 2 floats
    const int64_t expected_recv = rank == 0 ? 2 * row : rank == 1 ? 4 * row : 2 * row;
    EXPECT_EQ(comm.total_bytes_received(), expected_recv) << "rank " << rank;
    const std::vector<comm::Window> windows = {{-2, 6}, {2, 7}, {3, 12}};
    EXPECT_EQ(comm::halo_rows_received(rank, sizes, windows, HaloBoundary::Zeros) * row,
              expected_recv);
  });
}

// An exchange assigned over while still in flight is finished first (its rows arrive, its
// peers are not left waiting); the new one then completes with its own window.
TEST(Halo, AssigningOverAnExchangeInFlightFinishesIt) {
  for (int world : {1, 2, 3, 4}) {
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      std::vector<int64_t> sizes(world, 2);
      sizes[0] = 3;
      const int64_t total = 2 * world + 1;
      const auto full = tessera::test::randn({2, total}, 40 + world);
      const int64_t off = rank == 0 ? 0 : 3 + 2 * (rank - 1);
      const auto local = full.narrow(1, off, sizes[rank]);
      std::vector<comm::Window> first, second;
      for (int r = 0, o = 0; r < world; o += sizes[r], ++r) {
        first.push_back({o - 1, o + sizes[r] + 1});
        second.push_back({o - 2, o + sizes[r]});
      }
      comm::PendingWindow pending = comm::fetch_window_async(
          mesh.group(0), local, 1, sizes, first, HaloBoundary::Periodic, 0.0, /*tag=*/1);
      EXPECT_TRUE(pending.pending());
      pending = comm::fetch_window_async(mesh.group(0), local, 1, sizes, second,
                                         HaloBoundary::Periodic, 0.0, /*tag=*/2);
      const at::Tensor got = pending.wait();
      EXPECT_FALSE(pending.pending());
      auto expected = at::empty({2, second[rank].size()});
      for (int64_t k = 0; k < second[rank].size(); ++k)
        expected.select(1, k).copy_(full.select(1, wrap(second[rank].lo + k, total)));
      EXPECT_TRUE(at::equal(got, expected)) << "world " << world;
      EXPECT_FALSE(pending.wait().defined());  // handed over: the handle keeps nothing
    });
  }
}
