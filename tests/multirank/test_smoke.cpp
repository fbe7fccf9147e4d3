#include "helpers.h"

using namespace tessera;

TEST(Smoke, DistributeAndBack) {
  tessera::testing::run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto full = at::arange(10, at::kFloat).reshape({5, 2});
    auto dt = distribute_tensor(full, mesh, {Shard(0)});
    EXPECT_EQ(dt.sizes().vec(), (std::vector<int64_t>{5, 2}));
    EXPECT_TRUE(at::equal(full_tensor(dt), full));
    auto y = dt * 2 + 1;
    EXPECT_TRUE(at::equal(full_tensor(y), full * 2 + 1));
    auto s = dt.sum();
    EXPECT_FLOAT_EQ(s.item<float>(), full.sum().item<float>());
    auto m = dt.mean();
    EXPECT_FLOAT_EQ(m.item<float>(), full.mean().item<float>());
    auto x = distribute_tensor(full, mesh, {Shard(0)}).detach().requires_grad_();
    auto loss = (x * x).sum();
    loss.backward();
    EXPECT_TRUE(tessera::test::full_matches(x.grad(), 2 * full, {1e-5, 1e-8}));
  });
}
