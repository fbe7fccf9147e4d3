// Matrix products on every layout combination (cost-based strategy choice), forward and
// backward, against one device; torch::nn::Linear-shaped code (matmul, linear) included.
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
