// Matrix products on every layout combination (cost-based strategy choice), forward and
// backward, against one device; torch::nn::Linear-shaped code (matmul, linear) included.
#include <torch/nn/modules/linear.h>

#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::on_meshes;
using tessera::test::Operand;

namespace {

std::vector<Placements> layouts(int64_t mesh_ndim) {
  std::vector<Placement> one = {Shard(0), Shard(1), Replicate(), Partial()};
  std::vector<Placements> out = {{}};
  for (int64_t d = 0; d < mesh_ndim; ++d) {
    std::vector<Placements> next;
    for (auto& p : out)
      for (auto& c : one) {
        auto q = p;
        q.push_back(c);
        next.push_back(q);
      }
    out = next;
  }
  return out;
}

}  // namespace

TEST(Matrix, MmEveryLayoutPair) {
  on_meshes([](const DeviceMesh& mesh) {
    for (auto& a : layouts(mesh.ndim()))
      for (auto& b : layouts(mesh.ndim()))
        differential(
            mesh, {{{5, 7}, a}, {{7, 3}, b}}, [](auto& v) { return at::mm(v[0], v[1]); },
            "mm " + to_string(a) + " x " + to_string(b));
  });
}

TEST(Matrix, AddmmBmmMatmulLinear) {
  on_meshes([](const DeviceMesh& mesh) {
    Placements r(mesh.ndim(), Replicate()), s0 = r, s1 = r;
    s0[0] = Shard(0);
    s1[mesh.ndim() - 1] = Shard(1);
    differential(
        mesh, {{{3}, r}, {{4, 5}, s0}, {{5, 3}, s1}},
        [](auto& v) { return at::addmm(v[0], v[1], v[2], 0.5, 2.0); }, "addmm bias");
    differential(
        mesh, {{{4, 3}, s0}, {{4, 5}, s1}, {{5, 3}, s0}},
        [](auto& v) { return at::addmm(v[0], v[1], v[2]); }, "addmm full self");
    differential(
        mesh, {{{3, 4, 5}, s0}, {{3, 5, 2}, s0}}, [](auto& v) { return at::bmm(v[0], v[1]); },
        "bmm batch-sharded");
    differential(
        mesh, {{{3, 4, 5}, s1}, {{3, 5, 2}, r}}, [](auto& v) { return at::bmm(v[0], v[1]); },
        "bmm row-sharded");
    differential(
        mesh, {{{6, 4}, s0}, {{3, 4}, r}, {{3}, r}},
        [](auto& v) { return at::linear(v[0], v[1], v[2]); }, "linear (data parallel)");
    differential(
        mesh, {{{6, 4}, r}, {{3, 4}, s0}, {{3}, s0}},
        [](auto& v) { return at::linear(v[0], v[1], v[2]); }, "linear (colwise)");
    differential(
        mesh, {{{6, 4}, s1}, {{3, 4}, s1}, {{3}, r}},
        [](auto& v) { return at::linear(v[0], v[1], v[2]); }, "linear (rowwise)");
    differential(
        mesh, {{{2, 6, 4}, s0}, {{4, 3}, r}}, [](auto& v) { return at::matmul(v[0], v[1]); },
        "matmul 3-d x 2-d");
    differential(
        mesh, {{{5, 4}, s0}, {{4}, r}}, [](auto& v) { return at::mv(v[0], v[1]); }, "mv");
    differential(
        mesh, {{{6}, s0}, {{6}, s0}}, [](auto& v) { return at::dot(v[0], v[1]); }, "dot");
    differential(
        mesh, {{{4, 6}, s1}}, [](auto& v) { return v[0].t().mm(v[0]); }, "t");
    differential(
        mesh, {{{2, 3, 4}, s0}},
        [](auto& v) {
          return v[0].permute({2, 0, 1}).transpose(0, 1) * 2;
        },
        "permute");
  });
}

// A Megatron-style MLP (colwise then rowwise) costs one all-reduce, and only where the
// partial sums are first needed whole.
TEST(Matrix, ColwiseRowwiseMlpCommunicatesOnce) {
  tessera::testing::run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto x = distribute_tensor(tessera::test::randn({4, 6}, 1), mesh, {Replicate()});
    auto w1 = distribute_tensor(tessera::test::randn({8, 6}, 2), mesh, {Shard(0)});
    auto w2 = distribute_tensor(tessera::test::randn({6, 8}, 3), mesh, {Shard(1)});
    CommDebugMode comm;
    auto h = at::linear(x, w1).relu();
    auto y = at::linear(h, w2);
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    EXPECT_EQ(placements(y), (Placements{Partial()}));
    auto yr = redistribute(y, {Replicate()});
    EXPECT_EQ(comm.get_comm_counts()["all_reduce"], 1);
  });
}

// NOTE: [Row splits through a linear layer]: torch::nn::Linear on [B, L, in] (and [A, B, L, in])
// with L split (evenly, unevenly, with empty shards, L = 0) keeps the split and equals one
// device, output and every gradient (input, weight, bias); with the batch split as well on a
// 2x2 mesh.
TEST(Matrix, LinearKeepsARowSplit) {
  const test::Tolerance tol{1e-10, 1e-11};
  test::Sweep sweep;
  sweep.cases(10).run([&](test::Rng& rng, int64_t c) {
    const bool grid = c % 5 == 4, four_d = c % 3 == 2;
    const int world = grid ? 4 : static_cast<int>(rng.uniform(1, 3));
    const int64_t L = c == 0 ? 0 : rng.uniform(1, 9);
    std::vector<int64_t> shape =
        four_d ? std::vector<int64_t>{2, 2, L, 5} : std::vector<int64_t>{3, L, 5};
    const int64_t row_dim = static_cast<int64_t>(shape.size()) - 2;
    torch::manual_seed(40 + c);
    torch::nn::Linear proto(torch::nn::LinearOptions(5, 4).bias(rng.coin()));
    proto->to(at::kDouble);
    auto x = test::randn(shape, 50 + c, at::kDouble).requires_grad_();
    auto expected = proto->forward(x);
    auto g = test::randn(expected.sizes(), 60 + c, at::kDouble);
    expected.backward(g);
    std::vector<ShardTable> tables(shape.size());
    tables[row_dim] = test::random_table(rng, L, grid ? 2 : world);
    const Placements p = grid ? Placements{Shard(0), Shard(row_dim)} : Placements{Shard(row_dim)};
    if (grid) tables[0] = {};
    const std::string desc = sweep.label(c) + ": " + std::to_string(world) + " ranks, x " +
                             shape_str(shape) + (grid ? ", batch x rows" : "");
    tessera::testing::run_ranks(world, [&](int) {
      at::set_num_threads(1);
      auto mesh = grid ? init_device_mesh("cpu", {2, 2}) : init_device_mesh("cpu", {world});
      torch::nn::Linear layer(proto->options);
      layer->to(at::kDouble);
      {
        torch::NoGradGuard no_grad;
        layer->weight.copy_(proto->weight);
        if (proto->bias.defined()) layer->bias.copy_(proto->bias);
      }
      auto ddp = replicate(layer, mesh);
      auto dx = test::make_dtensor_from_full(x.detach(), mesh, p, tables).requires_grad_();
      auto got = layer->forward(dx);
      EXPECT_EQ(spec(got).placements(), p) << desc;
      EXPECT_TRUE(test::full_matches(got, expected, tol)) << desc << ": output";
      got.backward(test::make_dtensor_from_full(g, mesh, p, tables));
      EXPECT_TRUE(test::full_matches(dx.grad(), x.grad(), tol)) << desc << ": input grad";
      EXPECT_TRUE(test::full_matches(layer->weight.grad(), proto->weight.grad(), tol))
          << desc << ": weight grad";
      if (proto->bias.defined())
        EXPECT_TRUE(test::full_matches(layer->bias.grad(), proto->bias.grad(), tol))
            << desc << ": bias grad";
    });
  });
}
