// Losses and softmax against one device, forward and backward, on uneven shards.
#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::on_meshes;

namespace {

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
        differential(
            mesh, {{{7, 5}, p, tabs}, {{7, 5}, p, tabs}},
            [red](auto& v) { return at::mse_loss(v[0], v[1], red); }, "mse " + what);
        differential(
            mesh, {{{7, 5}, p, tabs}, {{7, 5}, p, tabs}},
            [red](auto& v) { return at::smooth_l1_loss(v[0], v[1], red, 0.5); },
            "smooth_l1 " + what);
        differential(
            mesh, {{{7, 5}, p, tabs}, {{7, 5}, with(mesh, Replicate())}},
            [red](auto& v) { return at::huber_loss(v[0], v[1], red, 0.7); },
            "huber (target replicated) " + what);
        differential(
            mesh, {{{7, 5}, p, tabs}, {{7, 5}, p, tabs}},
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
        differential(
            mesh, {{{6, 5}, p}}, [dim](auto& v) { return at::softmax(v[0], dim); },
            "softmax " + what);
        differential(
            mesh, {{{6, 5}, p}}, [dim](auto& v) { return at::log_softmax(v[0], dim) * 1.5; },
            "log_softmax " + what);
      }
    }
  });
}

TEST(Loss, CrossEntropyBatchShardedWithIgnoreIndexAndWeights) {
  const auto logits = tessera::test::randn({9, 5}, 31);
  auto target = at::randint(0, 5, {9}, tessera::test::generator(32), at::kLong);
  target[2] = -100;  // ignored
  target[7] = -100;
  const auto weight = at::rand({5}, tessera::test::generator(33)) + 0.5;
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      ShardTable rows(world, 0);
      rows[0] = world > 1 ? 2 : 9;
      if (world > 1) rows.back() = 7;
      for (int64_t red : {0, 1, 2}) {
        for (bool weighted : {false, true}) {
          auto ref_x = logits.clone().requires_grad_();
          auto w = weighted ? weight : at::Tensor();
          auto ref = at::cross_entropy_loss(ref_x, target, w, red);
          auto dx =
              distribute_tensor(logits, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows))
                  .detach()
                  .requires_grad_();
          auto dt =
              distribute_tensor(target, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
          auto dw = weighted ? distribute_tensor(weight, mesh, {Replicate()}, std::nullopt)
                             : at::Tensor();
          auto got = at::cross_entropy_loss(dx, dt, dw, red);
          const std::string what =
              "reduction " + std::to_string(red) + (weighted ? " weighted" : "");
          ASSERT_TRUE(tessera::test::full_matches(got, ref, {1e-5, 1e-6})) << what;
          auto g = red == 0 ? tessera::test::randn({9}, 34) : at::ones({});
          ref.backward(g);
          got.backward(red == 0 ? distribute_tensor(g, mesh, placements(got), std::nullopt,
                                                    ShardSizes::Given(spec(got).shard_tables()))
                                : distribute_tensor(g, mesh, {Replicate()}, std::nullopt));
          ASSERT_TRUE(tessera::test::full_matches(dx.grad(), ref_x.grad(), {1e-5, 1e-6}))
              << what << " grad";
        }
      }
    });
  }
}

TEST(Loss, NllLoss2dSpatiallySharded) {
  const auto logits = tessera::test::randn({2, 4, 6, 5}, 41);
  const auto target = at::randint(0, 4, {2, 6, 5}, tessera::test::generator(42), at::kLong);
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    auto ref_x = logits.clone().requires_grad_();
    auto ref = at::cross_entropy_loss(ref_x, target);
    auto dx = distribute_tensor(logits, mesh, {Shard(2), Shard(3)}, std::nullopt,
                                ShardSizes::Given({{}, {}, {5, 1}, {2, 3}}))
                  .detach()
                  .requires_grad_();
    auto dt = distribute_tensor(target, mesh, {Shard(1), Shard(2)}, std::nullopt,
                                ShardSizes::Given({{}, {5, 1}, {2, 3}}));
    auto got = at::cross_entropy_loss(dx, dt);
    ASSERT_TRUE(tessera::test::full_matches(got, ref, {1e-5, 1e-6}));
    ref.backward();
    got.backward();
    ASSERT_TRUE(tessera::test::full_matches(dx.grad(), ref_x.grad(), {1e-5, 1e-6}));
    EXPECT_EQ(placements(dx.grad()), (Placements{Shard(2), Shard(3)}));
  });
}

TEST(Loss, LayerNorm) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements r(mesh.ndim(), Replicate());
    for (auto p : {with(mesh, Shard(0)), with(mesh, Shard(1)), with(mesh, Shard(2)),
                   with(mesh, Shard(0), Shard(1))}) {
      differential(
          mesh, {{{4, 6, 8}, p}, {{8}, r}, {{8}, r}},
          [](auto& v) { return at::layer_norm(v[0], {8}, v[1], v[2], 1e-5); },
          "layer_norm [8] " + to_string(p));
      differential(
          mesh, {{{4, 6, 8}, p}},
          [](auto& v) {
            return at::layer_norm(v[0], {6, 8}) * 2;
          },
          "layer_norm [6, 8] no affine " + to_string(p));
    }
  });
}

TEST(Loss, DropoutAndRandomFillsDrawWhatOneDeviceDraws) {
  const auto x = tessera::test::randn({7, 6}, 51);
  at::manual_seed(1234);  // on the test thread, before the rank threads exist
  const auto ref_drop = at::dropout(x, 0.3, /*train=*/true);
  const auto ref_uniform = at::empty({7, 6}).uniform_(-2, 3);
  const auto ref_normal = at::empty({7, 6}).normal_(1, 2);
  const auto ref_rand = at::rand_like(x);
  const auto ref_randn = at::randn_like(x, at::kDouble);
  const auto ref_randint = at::randint_like(x, 3, 9);
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      ShardTable rows(world, 0);
      rows[0] = world > 1 ? 5 : 7;
      if (world > 1) rows.back() += 2;
      tessera::manual_seed(1234);
      auto dx = distribute_tensor(x, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
      auto drop = at::dropout(dx, 0.3, true);
      EXPECT_TRUE(at::equal(full_tensor(drop), ref_drop)) << "dropout, world " << world;
      auto u = at::empty_like(dx).uniform_(-2, 3);
      EXPECT_TRUE(at::equal(full_tensor(u), ref_uniform)) << "uniform_, world " << world;
      auto n = distribute_tensor(at::zeros({7, 6}), mesh, {Shard(1)}, std::nullopt).normal_(1, 2);
      EXPECT_TRUE(at::equal(full_tensor(n), ref_normal)) << "normal_ on S(1), world " << world;
      // The *_like factories too (each rank once drew the same first values locally).
      auto r = at::rand_like(dx);
      EXPECT_TRUE(at::equal(full_tensor(r), ref_rand)) << "rand_like, world " << world;
      auto rn = at::randn_like(dx, at::kDouble);
      EXPECT_EQ(rn.scalar_type(), at::kDouble);
      EXPECT_TRUE(at::equal(full_tensor(rn), ref_randn)) << "randn_like, world " << world;
      auto ri = at::randint_like(distribute_tensor(x, mesh, {Shard(1)}, std::nullopt), 3, 9);
      EXPECT_TRUE(at::equal(full_tensor(ri), ref_randint))
          << "randint_like on S(1), world " << world;
      tessera::clear_manual_seed();
    });
  }
}
