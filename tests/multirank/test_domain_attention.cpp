// Neighbourhood attention on q, k, v sharded along their spatial dims (and batch and heads):
// forward and every gradient (q, k, v, rpb, extra keys/values) against the same op on the full
// tensors in one process. The reference's eleven shard tables (thin, empty, dilated, causal,
// strided shards) with their exact halos in bytes; randomized cases on 1-D and 2-D meshes of
// 1 to 4 ranks; argument errors raised on every rank.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include "helpers.h"
#include "tessera/nn/neighborhood_attention.h"

using namespace tessera;

namespace {

namespace F = tessera::nn::functional;
using Shape = std::vector<int64_t>;
using test::Rng;

// One case: shapes, the op's arguments, and where q, k, v live.
struct NACase {
  int64_t batch = 1, heads = 2, kv_heads = 2, dim = 3, vdim = 3;
  Shape spatial, kernel, dilation, stride;
  std::vector<bool> causal, circular;
  bool rpb = false;
  int64_t extra = 0;  // additional keys/values
  // Per mesh dim: the tensor dim of q it shards (-1: Replicate).
  std::vector<int64_t> shard_dim;
  std::vector<ShardTable> tables;  // per q dim (heads: q's table); empty: torch.chunk
  bool check_bytes = false;        // one cut spatial dim: halo bytes = the union of windows

  int64_t nd() const { return static_cast<int64_t>(spatial.size()); }
  std::string str() const {
    std::string s = "na" + std::to_string(nd()) + "d B" + std::to_string(batch) + " S" +
                    shape_str(spatial) + " H" + std::to_string(heads) + "/" +
                    std::to_string(kv_heads) + " D" + std::to_string(dim) + "/" +
                    std::to_string(vdim) + " k" + shape_str(kernel) + " d" + shape_str(dilation) +
                    " s" + shape_str(stride) + " causal";
    for (bool c : causal) s += c ? "1" : "0";
    s += " circular";
    for (bool c : circular) s += c ? "1" : "0";
    if (rpb) s += " rpb";
    if (extra) s += " extra" + std::to_string(extra);
    s += " shards";
    for (auto d : shard_dim) s += " " + std::to_string(d);
    for (size_t t = 0; t < tables.size(); ++t)
      if (!tables[t].empty()) s += " t" + std::to_string(t) + "=" + shape_str(tables[t]);
    return s;
  }
};

F::NeighborhoodAttentionFuncOptions options(const NACase& c, const at::Tensor& rpb,
                                            const at::Tensor& ek, const at::Tensor& ev) {
  auto o = F::NeighborhoodAttentionFuncOptions()
               .dilation(c.dilation)
               .stride(c.stride)
               .is_causal(c.causal)
               .circular(c.circular);
  if (rpb.defined()) o.rpb(rpb);
  if (ek.defined()) o.additional_keys(ek).additional_values(ev);
  return o;
}

Shape with(Shape spatial, int64_t b, int64_t h, int64_t d) {
  spatial.insert(spatial.begin(), b);
  spatial.push_back(h);
  spatial.push_back(d);
  return spatial;
}

const test::Tolerance kTol{1e-10, 1e-11};

// Bytes this rank moved: received in the forward op, sent in its backward.
struct NABytes {
  int64_t forward_received = 0, backward_sent = 0;
};

// The op sharded and on full tensors; out and every gradient compared.
NABytes check(const DeviceMesh& mesh, const NACase& c, uint64_t seed, const std::string& desc) {
  const int64_t nd = c.nd(), heads_dim = nd + 1;
  const Shape qs = with(c.spatial, c.batch, c.heads, c.dim),
              ks = with(c.spatial, c.batch, c.kv_heads, c.dim),
              vs = with(c.spatial, c.batch, c.kv_heads, c.vdim);
  auto q = test::randn(qs, seed, at::kDouble).requires_grad_();
  auto k = test::randn(ks, seed + 1, at::kDouble).requires_grad_();
  auto v = test::randn(vs, seed + 2, at::kDouble).requires_grad_();
  at::Tensor rpb, ek, ev;
  if (c.rpb) {
    Shape rs = {c.heads};
    for (auto kk : c.kernel) rs.push_back(2 * kk - 1);
    rpb = test::randn(rs, seed + 3, at::kDouble).requires_grad_();
  }
  if (c.extra) {
    ek = test::randn({c.batch, c.extra, c.kv_heads, c.dim}, seed + 4, at::kDouble).requires_grad_();
    ev =
        test::randn({c.batch, c.extra, c.kv_heads, c.vdim}, seed + 5, at::kDouble).requires_grad_();
  }
  at::Tensor expected = F::neighborhood_attention(q, k, v, c.kernel, options(c, rpb, ek, ev));

  Placements p;
  for (auto d : c.shard_dim) p.push_back(d >= 0 ? Placement::shard(d) : Placement::replicate());
  auto kv_tables = c.tables;
  if (kv_tables.size() > static_cast<size_t>(heads_dim) && !kv_tables[heads_dim].empty())
    for (auto& n : kv_tables[heads_dim]) n = n * c.kv_heads / c.heads;
  auto dq = test::make_dtensor_from_full(q.detach(), mesh, p, c.tables).requires_grad_();
  auto dk = test::make_dtensor_from_full(k.detach(), mesh, p, kv_tables).requires_grad_();
  auto dv = test::make_dtensor_from_full(v.detach(), mesh, p, kv_tables).requires_grad_();
  const Placements rep(mesh.ndim(), Placement::replicate());
  at::Tensor drpb, dek, dev;
  if (rpb.defined())
    drpb = distribute_tensor(rpb.detach(), mesh, rep, std::nullopt).requires_grad_();
  if (ek.defined()) {
    dek = distribute_tensor(ek.detach(), mesh, rep, std::nullopt).requires_grad_();
    dev = distribute_tensor(ev.detach(), mesh, rep, std::nullopt).requires_grad_();
  }
  CommDebugMode comm;
  at::Tensor got = F::neighborhood_attention(dq, dk, dv, c.kernel, options(c, drpb, dek, dev));
  const int64_t received = comm.total_bytes_received();
  EXPECT_TRUE(is_dtensor(got)) << desc;
  // The output keeps q's layout where the op can (a spatial dim sharded over two mesh dims
  // keeps its outer one).
  bool nested = false;
  for (size_t m = 0; m < c.shard_dim.size(); ++m)
    for (size_t n = 0; n < m; ++n)
      nested = nested || (c.shard_dim[m] >= 0 && c.shard_dim[m] == c.shard_dim[n]);
  if (!nested) {
    EXPECT_EQ(spec(got).placements(), p) << desc << ": the output keeps q's layout";
  }
  EXPECT_TRUE(test::full_matches(got, expected, kTol)) << desc << ": output";

  at::Tensor g = test::randn(expected.sizes(), seed + 9, at::kDouble);
  expected.backward(g);
  const at::Tensor dg =
      distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(), std::nullopt,
                        ShardSizes::Given(spec(got).shard_tables()));
  CommDebugMode backward_comm;
  got.backward(dg);
  const int64_t backward_sent = backward_comm.total_bytes_sent();
  auto grad_ok = [&](const at::Tensor& d, const at::Tensor& full, const char* what) {
    if (!d.defined()) return;
    EXPECT_TRUE(d.grad().defined()) << desc << ": no gradient for " << what;
    if (d.grad().defined()) {
      EXPECT_TRUE(test::full_matches(d.grad(), full.grad(), kTol)) << desc << ": " << what;
    }
  };
  grad_ok(dq, q, "query");
  grad_ok(dk, k, "key");
  grad_ok(dv, v, "value");
  grad_ok(drpb, rpb, "rpb");
  grad_ok(dek, ek, "additional_keys");
  grad_ok(dev, ev, "additional_values");
  return {received, backward_sent};
}

// ---- the reference's shard tables ------------------------------------------------------------

// One row of the reference's halo table: a 1-D axis, its shard table and every shard's
// (left, right) halo in rows.
struct TableRow {
  int64_t length, kernel, dilation = 1, stride = 1;
  bool causal = false;
  ShardTable table;
  std::vector<std::pair<int64_t, int64_t>> halos;
};

const std::vector<TableRow>& reference_rows() {
  static const std::vector<TableRow> rows = {
      {32, 5, 1, 1, false, {8, 8, 8, 8}, {{0, 2}, {2, 2}, {2, 2}, {2, 0}}},
      {32, 5, 1, 1, false, {14, 14, 3, 1}, {{0, 2}, {2, 2}, {2, 1}, {4, 0}}},
      {32, 5, 1, 1, false, {2, 14, 14, 2}, {{0, 3}, {2, 2}, {2, 2}, {3, 0}}},
      {32, 5, 1, 1, false, {1, 1, 1, 1, 28}, {{0, 4}, {1, 3}, {2, 2}, {2, 2}, {2, 0}}},
      {32, 5, 1, 1, false, {2, 14, 0, 14, 2}, {{0, 3}, {2, 2}, {0, 0}, {2, 2}, {3, 0}}},
      {32, 4, 1, 1, false, {8, 8, 8, 8}, {{0, 1}, {2, 1}, {2, 1}, {2, 0}}},
      {33, 5, 3, 1, false, {10, 1, 17, 5}, {{0, 6}, {6, 6}, {6, 5}, {10, 0}}},
      {32, 5, 2, 1, true, {3, 20, 1, 8}, {{0, 0}, {3, 0}, {8, 0}, {8, 0}}},
      {32, 5, 1, 2, false, {7, 9, 11, 5}, {{0, 3}, {2, 2}, {1, 3}, {2, 0}}},
      {32, 5, 1, 5, false, {8, 8, 8, 8}, {{0, 2}, {3, 4}, {1, 1}, {4, 0}}},
      {64, 7, 1, 1, false, {24, 40}, {{0, 3}, {3, 0}}},
  };
  return rows;
}

// The row as an na1d case (cut along X), or an na2d case cut along X or Y.
NACase row_case(const TableRow& r, int64_t nd, int64_t cut_axis) {
  NACase c;
  c.batch = 2, c.heads = 2, c.kv_heads = 1, c.dim = 3, c.vdim = 2;
  for (int64_t i = 0; i < nd; ++i) {
    const bool cut = i == cut_axis;
    c.spatial.push_back(cut ? r.length : 5);
    c.kernel.push_back(cut ? r.kernel : 3);
    c.dilation.push_back(cut ? r.dilation : 1);
    c.stride.push_back(cut ? r.stride : 1);
    c.causal.push_back(cut && r.causal);
    c.circular.push_back(false);
  }
  c.shard_dim = {1 + cut_axis};
  c.tables.resize(nd + 3);
  c.tables[1 + cut_axis] = r.table;
  c.check_bytes = true;
  return c;
}

TEST(DomainAttention, ReferenceShardTablesMatchOneDeviceWithExactHalos) {
  for (const auto& r : reference_rows()) {
    const int world = static_cast<int>(r.table.size());
    for (int64_t nd : {1, 2}) {
      for (int64_t cut = 0; cut < nd; ++cut) {
        const NACase c = row_case(r, nd, cut);
        const std::string desc = c.str();
        tessera::testing::run_ranks(world, [&](int rank) {
          auto mesh = init_device_mesh("cpu", {world});
          const NABytes got = check(mesh, c, 11, desc);
          // K and V rows: (left + right) rows of the cut axis, times the rest of a row.
          const auto [left, right] = r.halos[rank];
          int64_t row = c.batch * c.kv_heads * (c.dim + c.vdim) * 8;
          for (int64_t i = 0; i < nd; ++i)
            if (i != cut) row *= c.spatial[i];
          EXPECT_EQ(got.forward_received, (left + right) * row) << desc << " rank " << rank;
          // Backward sends the same rows' K and V gradients home and fetches nothing: it
          // reuses the forward's windows.
          EXPECT_EQ(got.backward_sent, (left + right) * row)
              << desc << " rank " << rank << ": backward moved more than the window gradients";
        });
      }
    }
  }
}

// The demo's 2x2 mesh (rows 24/40, cols 36/28): k = 7; k = (3, 5) with d = (2, 1);
// causal = (T, F); and one 3-D case.
TEST(DomainAttention, TwoByTwoMeshMatchesOneDevice) {
  std::vector<NACase> cases;
  NACase base;
  base.batch = 1, base.heads = 2, base.kv_heads = 2, base.dim = 2, base.vdim = 2;
  base.spatial = {64, 64};
  base.shard_dim = {1, 2};
  base.tables = {{}, {24, 40}, {36, 28}};
  base.circular = {false, false};
  NACase a = base;
  a.kernel = {7, 7}, a.dilation = {1, 1}, a.stride = {1, 1}, a.causal = {false, false};
  a.rpb = true;
  cases.push_back(a);
  NACase b = base;
  b.kernel = {3, 5}, b.dilation = {2, 1}, b.stride = {1, 1}, b.causal = {false, false};
  b.extra = 3;
  cases.push_back(b);
  NACase d = base;
  d.kernel = {3, 5}, d.dilation = {2, 1}, d.stride = {1, 2}, d.causal = {true, false};
  cases.push_back(d);
  NACase e = base;
  e.kernel = {5, 3}, e.dilation = {1, 1}, e.stride = {1, 1}, e.causal = {false, false};
  e.circular = {true, false};
  cases.push_back(e);
  NACase three;
  three.spatial = {6, 7, 5};
  three.kernel = {3, 3, 3}, three.dilation = {1, 2, 1}, three.stride = {1, 1, 1};
  three.causal = {false, false, false}, three.circular = {false, false, false};
  three.shard_dim = {1, 3};
  three.tables = {{}, {1, 5}, {}, {4, 1}};
  cases.push_back(three);
  for (const auto& c : cases) {
    const std::string desc = c.str();
    test::on_mesh({2, 2}, [&](const DeviceMesh& mesh) {
      const NABytes b = check(mesh, c, 5, desc);
      // Backward sends each fetched row's gradient home once and fetches nothing again.
      EXPECT_EQ(b.backward_sent, b.forward_received) << desc;
    });
  }
}

// ---- randomized ------------------------------------------------------------------------------

NACase random_case(Rng& rng, const DeviceMesh& mesh) {
  NACase c;
  const int64_t nd = rng.coin(0.15) ? 3 : rng.uniform(1, 2);
  c.batch = rng.uniform(1, 2);
  c.kv_heads = rng.uniform(1, 2);
  c.heads = c.kv_heads * rng.uniform(1, 2);
  c.dim = rng.uniform(1, 4);
  c.vdim = rng.coin() ? c.dim : rng.uniform(1, 4);
  bool any_causal = false;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t k = rng.uniform(2, nd == 3 ? 3 : 5), d = rng.uniform(1, nd == 3 ? 1 : 3);
    c.kernel.push_back(k);
    c.dilation.push_back(d);
    c.stride.push_back(rng.uniform(1, k));
    c.spatial.push_back(rng.uniform(k * d, k * d + (nd == 3 ? 3 : 12)));
    const bool causal = rng.coin(0.25);
    c.causal.push_back(causal);
    c.circular.push_back(!causal && rng.coin(0.2));
    any_causal = any_causal || causal;
  }
  c.rpb = !any_causal && rng.coin(0.4);
  c.extra = rng.coin(0.25) ? rng.uniform(1, 3) : 0;
  // Mostly spatial shards; batch and heads too.
  const Shape qs = with(c.spatial, c.batch, c.heads, c.dim);
  Placements p;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const int64_t choice = rng.uniform(0, 9);
    int64_t dim = -1;
    if (choice < 7)
      dim = 1 + rng.uniform(0, nd - 1);
    else if (choice < 8)
      dim = 0;
    else if (choice < 9)
      dim = nd + 1;
    c.shard_dim.push_back(dim);
    p.push_back(dim >= 0 ? Placement::shard(dim) : Placement::replicate());
  }
  c.tables = test::random_tables(rng, mesh, p, qs);
  // Heads shards hold whole GQA groups.
  auto& ht = c.tables[nd + 1];
  if (!ht.empty()) {
    const int64_t group = c.heads / c.kv_heads;
    ht = test::random_table(rng, c.kv_heads, static_cast<int64_t>(ht.size()));
    for (auto& n : ht) n *= group;
  }
  return c;
}

void run_random(const Shape& mesh_shape, test::Sweep& sweep, int64_t count) {
  const auto cases = sweep.cases(count);
  if (!cases.any()) return;
  test::on_mesh(mesh_shape, [&](const DeviceMesh& mesh) {
    cases.run([&](Rng& rng, int64_t i) {
      const NACase c = random_case(rng, mesh);
      const std::string desc = sweep.label(i) + " mesh " + shape_str(mesh.shape()) + ": " + c.str();
      check(mesh, c, rng.bits() % 100000, desc);
    });
  });
}

class DomainAttentionRandom : public ::testing::TestWithParam<Shape> {};
TEST_P(DomainAttentionRandom, MatchesOneDevice) {
  test::Sweep sweep;
  run_random(GetParam(), sweep, 220);
}
INSTANTIATE_TEST_SUITE_P(Meshes, DomainAttentionRandom,
                         ::testing::Values(Shape{1}, Shape{2}, Shape{3}, Shape{4}, Shape{2, 2},
                                           Shape{1, 3}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return test::mesh_name(info.param);
                         });

// ---- training ---------------------------------------------------------------------------------

// A neighbourhood-attention transformer block on a 2-D field [B, H, W, C]: pre-norm NA
// (k = 5 along rows, k = 3 with dilation 2 along columns, a relative positional bias), an MLP,
// residuals.
struct NABlockImpl : torch::nn::Cloneable<NABlockImpl> {
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  tessera::nn::NeighborhoodAttention2d attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  NABlockImpl() { reset(); }
  void reset() override {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    attn = register_module("attn", tessera::nn::NeighborhoodAttention2d(
                                       tessera::nn::NeighborhoodAttentionOptions(8, 2, {5, 3})
                                           .dilation({1, 2})
                                           .rpb(true)
                                           // A key bias shifts every logit of a query
                                           // equally: its gradient is rounding noise, which
                                           // AdamW scales up to full steps.
                                           .qkv_bias(false)));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 8));
  }
  at::Tensor forward(at::Tensor x) {
    x = x + attn->forward(norm1->forward(x));
    return x + fc2->forward(at::gelu(fc1->forward(norm2->forward(x))));
  }
};
TORCH_MODULE(NABlock);

std::vector<double> train_block(NABlockImpl& model, const at::Tensor& x, const at::Tensor& y) {
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(0.01));
  std::vector<double> losses;
  for (int s = 0; s < 10; ++s) {
    opt.zero_grad();
    at::Tensor loss = at::mse_loss(model.forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// Ten AdamW steps on a field split 2x2 with uneven shards (a thin one included) equal the
// same training on one device: every loss and every parameter.
TEST(DomainAttention, TransformerBlockTrainsLikeOneDevice) {
  torch::manual_seed(4);  // on the test thread, before any rank thread exists
  NABlock proto;
  const at::Tensor x = test::randn({2, 12, 10, 8}, 5), y = test::randn({2, 12, 10, 8}, 6);
  auto ref = std::dynamic_pointer_cast<NABlockImpl>(proto->clone());
  const auto expected = train_block(*ref, x, y);
  const std::vector<ShardTable> tables = {{}, {2, 10}, {7, 3}};
  tessera::testing::run_ranks(4, [&](int) {
    at::set_num_threads(1);
    auto mesh = init_device_mesh("cpu", {2, 2}, {"h", "w"});
    auto model = std::dynamic_pointer_cast<NABlockImpl>(proto->clone());
    distribute_module(*model, mesh);
    const Placements hw = {Placement::shard(1), Placement::shard(2)};
    auto dx = distribute_tensor(x, mesh, hw, std::nullopt, ShardSizes::Given(tables));
    auto dy = distribute_tensor(y, mesh, hw, std::nullopt, ShardSizes::Given(tables));
    {
      // The attention layer never gathers the field: K/V halos, and the all-reduces of the
      // parameter gradients. (A torch::nn::Linear on [B, H, W, C] itself still gathers: its
      // flatten of uneven spatial shards has no sharded form; see docs.)
      CommDebugMode comm;
      model->attn->forward(dx).sum().backward();
      model->zero_grad();
      const auto counts = comm.get_comm_counts();
      EXPECT_EQ(counts.count("all_gather"), 0u) << comm.table();
      EXPECT_EQ(counts.count("all_to_all"), 0u) << comm.table();
    }
    const auto got = train_block(*model, dx, dy);
    for (size_t s = 0; s < got.size(); ++s)
      ASSERT_NEAR(got[s], expected[s], 1e-4 * (1 + std::abs(expected[s]))) << "step " << s;
    const auto mine = model->named_parameters();
    for (const auto& p : ref->named_parameters()) {
      at::Tensor m = *mine.find(p.key());
      ASSERT_TRUE(is_dtensor(m)) << p.key();
      ASSERT_TRUE(test::full_matches(m, p.value().detach(), {1e-4, 1e-5}))
          << "parameter " << p.key() << " after 10 steps";
    }
  });
}

// ---- errors ----------------------------------------------------------------------------------

// Every rank raises the same clear error (checked on global sizes), none waits for a peer.
TEST(DomainAttention, BadArgumentsFailOnEveryRank) {
  struct Bad {
    Shape kernel, dilation, stride;
    std::vector<bool> causal;
    bool rpb;
    const char* says;
  };
  const std::vector<Bad> bad = {
      {{9}, {2}, {1}, {false}, false, "dilation"},  // k*d = 18 > 16
      {{3}, {1}, {4}, {false}, false, "stride"},    // stride > kernel
      {{3}, {1}, {1}, {true}, true, "rpb"},         // rpb with causal
  };
  for (const auto& b : bad) {
    std::atomic<int> failed{0};
    tessera::testing::run_ranks(3, [&](int) {
      auto mesh = init_device_mesh("cpu", {3});
      const Placements p = {Placement::shard(1)};
      auto q = distribute_tensor(test::randn({1, 16, 2, 4}, 1, at::kDouble), mesh, p, std::nullopt);
      auto opts = F::NeighborhoodAttentionFuncOptions()
                      .dilation(b.dilation)
                      .stride(b.stride)
                      .is_causal(b.causal);
      if (b.rpb) opts.rpb(at::zeros({2, 2 * b.kernel[0] - 1}, at::kDouble));
      try {
        F::neighborhood_attention(q, q, q, b.kernel, opts);
      } catch (const c10::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(b.says), std::string::npos) << msg;
        ++failed;
      }
    });
    EXPECT_EQ(failed.load(), 3) << b.says;
  }
}

}  // namespace
