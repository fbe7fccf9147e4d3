// The distributed tensor as an at::Tensor: unchanged ATen code runs on it through the
// fallback and the issue-2 rule families (pointwise, sum/mean, layout-preserving ops), and
// results and gradients equal the same code on full tensors in one process.
#include <functional>

#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::full_matches;
using tessera::test::make_dtensor_from_full;
using tessera::test::on_meshes;
using tessera::test::Operand;

namespace {

std::vector<ShardTable> uneven_rows(const DeviceMesh& mesh, int64_t rows) {
  if (mesh.ndim() != 1) return {};
  ShardTable t(mesh.size(), 0);
  t[0] = rows;  // all rows on the first rank, the others empty...
  if (mesh.size() > 1) t[0] = rows - 1, t[mesh.size() - 1] = 1;  // ...but one
  return {t};
}

}  // namespace

TEST(Dispatch, PointwiseSameLayout) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    auto tab = uneven_rows(mesh, 7);
    std::vector<Operand> two = {{{7, 5}, p, tab}, {{7, 5}, p, tab}};
    differential(
        mesh, two, [](auto& v) { return v[0] + v[1] * 2; }, "add/mul");
    differential(
        mesh, two, [](auto& v) { return (v[0] - v[1]).exp().relu(); }, "sub/exp/relu");
    differential(
        mesh, two, [](auto& v) { return at::where(v[0] > v[1], v[0], v[1] * 3); }, "where");
    differential(
        mesh, two, [](auto& v) { return at::maximum(v[0].tanh(), v[1].sigmoid()); }, "maximum");
    differential(
        mesh, {{{7, 5}, p, tab}}, [](auto& v) { return v[0].clamp(-0.5, 0.5) / 3 + 1; }, "scalars");
  });
}

TEST(Dispatch, PointwiseMixedLayoutsAndBroadcast) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements s0(mesh.ndim(), Replicate()), r(mesh.ndim(), Replicate()), s1 = r;
    s0[0] = Shard(0);
    s1[mesh.ndim() - 1] = Shard(1);
    // Different layouts: the second operand moves to the first's.
    differential(
        mesh, {{{6, 4}, s0}, {{6, 4}, s1}}, [](auto& v) { return v[0] * v[1]; }, "S0*S1");
    // Bias broadcast over a sharded batch dim.
    differential(
        mesh, {{{6, 4}, s0, uneven_rows(mesh, 6)}, {{4}, r}}, [](auto& v) { return v[0] + v[1]; },
        "broadcast bias");
    // A plain tensor next to a distributed one is taken as a replicated value.
    differential(
        mesh, {{{6, 4}, s0}},
        [](auto& v) {
          return v[0] * at::linspace(0, 1, 4).reshape({1, 4});
        },
        "plain operand");
  });
}

TEST(Dispatch, PartialRules) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements p(mesh.ndim(), Partial());
    differential(
        mesh, {{{5, 3}, p}, {{5, 3}, p}}, [](auto& v) { return v[0] + v[1]; }, "P+P");
    differential(
        mesh, {{{5, 3}, p}}, [](auto& v) { return v[0] * 3 - v[0] / 2; }, "P*scalar");
    differential(
        mesh, {{{5, 3}, p}}, [](auto& v) { return v[0] + 1; }, "P+scalar");
    differential(
        mesh, {{{5, 3}, p}}, [](auto& v) { return v[0].exp(); }, "exp(P)");
    Placements r(mesh.ndim(), Replicate());
    differential(
        mesh, {{{5, 3}, p}, {{5, 3}, r}}, [](auto& v) { return v[0] + v[1]; }, "P+R");
    differential(
        mesh, {{{5, 3}, p}, {{5, 3}, r}}, [](auto& v) { return v[0] * v[1]; }, "P*R");
  });
}

TEST(Dispatch, SumMeanExactOnUnevenShards) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    if (mesh.ndim() > 1) p[1] = Shard(1);
    auto tab = uneven_rows(mesh, 7);
    std::vector<Operand> x = {{{7, 5}, p, tab}};
    differential(
        mesh, x, [](auto& v) { return v[0].sum(); }, "sum()");
    differential(
        mesh, x, [](auto& v) { return v[0].mean(); }, "mean()");
    differential(
        mesh, x, [](auto& v) { return v[0].sum(0); }, "sum(0)");
    differential(
        mesh, x, [](auto& v) { return v[0].mean(1); }, "mean(1)");
    differential(
        mesh, x, [](auto& v) { return v[0].mean(0, /*keepdim=*/true); }, "mean(0, keepdim)");
    differential(
        mesh, x,
        [](auto& v) {
          return (v[0] * v[0]).mean(at::IntArrayRef{0, 1});
        },
        "mean({0,1})");
  });
}

TEST(Dispatch, LayoutPreservingOps) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    std::vector<Operand> x = {{{6, 3}, p, uneven_rows(mesh, 6)}};
    differential(
        mesh, x, [](auto& v) { return v[0].clone() * at::ones_like(v[0]); }, "clone/ones_like");
    differential(
        mesh, x, [](auto& v) { return v[0] + at::zeros_like(v[0]); }, "zeros_like");
    differential(
        mesh, x, [](auto& v) { return v[0].to(at::kDouble) * 2; }, "to(double)");
    differential(
        mesh, x, [](auto& v) { return v[0] * v[0].detach(); }, "detach");
  });
}

TEST(Dispatch, InPlaceAndItem) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    auto full = tessera::test::randn({5, 4}, 3);
    auto d = make_dtensor_from_full(full, mesh, p);
    auto e = make_dtensor_from_full(full * 2, mesh, p);
    d.add_(e, 0.5).mul_(2);
    EXPECT_TRUE(full_matches(d, (full + full) * 2));
    d.zero_();
    EXPECT_EQ(full_tensor(d).abs().sum().item<float>(), 0.f);
    d.fill_(1.5);
    EXPECT_FLOAT_EQ(d.sum().item<float>(), 1.5f * 20);
    // copy_ between layouts and from a plain tensor.
    auto r = make_dtensor_from_full(full, mesh, Placements(mesh.ndim(), Replicate()));
    d.copy_(r);
    EXPECT_TRUE(full_matches(d, full));
    EXPECT_EQ(placements(d), p);
    d.copy_(full * 3);
    EXPECT_TRUE(full_matches(d, full * 3));
    EXPECT_FLOAT_EQ(d.mean().item<float>(), (full * 3).mean().item<float>());
  });
}

// Ops without a rule on replicated inputs: data-dependent shapes and Tensor?[] indices.
TEST(Dispatch, ReplicatedOpsWithoutRules) {
  tessera::testing::run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = tessera::test::randn({6, 5}, 71);
    auto dx = distribute_tensor(x, mesh, {Replicate()}, std::nullopt);
    // Same input spec, different data: the output shape must come from the data.
    for (double t : {0.0, 1.0, -1.0}) {
      auto nz = (dx > t).nonzero();
      EXPECT_TRUE(at::equal(full_tensor(nz), (x > t).nonzero())) << "threshold " << t;
    }
    auto rows = at::tensor({4, 0, 4}, at::kLong);
    auto cols = at::tensor({1, 2, 3}, at::kLong);
    EXPECT_TRUE(at::equal(full_tensor(dx.index({rows})), x.index({rows})));
    EXPECT_TRUE(at::equal(full_tensor(dx.index({rows, cols})), x.index({rows, cols})));
    // Distributed (replicated) indices work too.
    auto drows = distribute_tensor(rows, mesh, {Replicate()}, std::nullopt);
    EXPECT_TRUE(at::equal(full_tensor(dx.index({drows})), x.index({rows})));
  });
}
