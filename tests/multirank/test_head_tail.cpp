// HeadTailShard(d): the balanced causal order as a placement (NOTE: [Head-tail order] in
// spec.h). One device is the oracle: redistribute into and out of it from every layout, ops
// on head-tail operands (position-reading ones included), views, in-place writes, attention.
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/padding.h>

#include "helpers.h"
#include "support/placements.h"

using namespace tessera;
using tessera::test::full_matches;
using tessera::test::local_block;
using tessera::test::make_dtensor_from_full;
using tessera::test::shard_matches;

namespace {

// Placements of one tensor over a mesh that a spec accepts: a head-tail split is its dim's
// outermost, and its only head-tail one.
bool valid(const Placements& p) {
  for (size_t a = 0; a < p.size(); ++a)
    for (size_t b = 0; b < p.size(); ++b)
      if (a != b && p[a].is_head_tail() && p[b].is_shard(p[a].dim()) &&
          (b < a || p[b].is_head_tail()))
        return false;
  return true;
}

// The combinations a spec accepts.
std::vector<Placements> every(int64_t mesh_ndim, const std::vector<Placement>& choices) {
  std::vector<Placements> out;
  for (auto& p : tessera::test::placement_combinations(mesh_ndim, choices))
    if (valid(p)) out.push_back(std::move(p));
  return out;
}

// Random tables for the natural shards (a head-tail split's level is fixed; splits nested
// inside it cut each member's run at random).
std::vector<ShardTable> natural_tables(tessera::test::Rng& rng, const DeviceMesh& mesh,
                                       const Placements& p, const std::vector<int64_t>& sizes) {
  std::vector<ShardTable> tables(sizes.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    int64_t parts = 1, members = 0;
    bool plain = false;
    for (size_t m = 0; m < p.size(); ++m) {
      if (!p[m].is_shard(static_cast<int64_t>(t))) continue;
      parts *= mesh.size(m);
      if (p[m].is_head_tail())
        members = mesh.size(m);
      else
        plain = true;
    }
    if (!plain || !rng.coin()) continue;
    if (members == 0) {
      tables[t] = tessera::test::random_table(rng, sizes[t], parts);
      continue;
    }
    for (auto run : tessera::detail::head_tail_windows(sizes[t], members).table())
      for (auto s : tessera::test::random_table(rng, run, parts / members)) tables[t].push_back(s);
  }
  return tables;
}

// The positions a rank holds along t, from the definition: each head-tail member's run is
// its head chunk's positions then its tail chunk's, and the inner splits cut that run as the
// table says (entries row-major over the splitting mesh dims, outermost first).
std::vector<int64_t> positions_held(const DTensorSpec& s, int64_t t,
                                    const std::vector<int64_t>& coord) {
  const auto dims = s.mesh_dims_sharding(t);
  const int64_t n = s.mesh().size(dims[0]);
  const auto w = tessera::detail::head_tail_windows(s.sizes()[t], n);
  const int64_t k = coord[dims[0]];
  std::vector<int64_t> run;
  for (auto [lo, hi] : {w.head[k], w.tail[k]})
    for (int64_t i = lo; i < hi; ++i) run.push_back(i);
  int64_t inner = 0;  // this rank's index among the splits inside member k
  for (size_t i = 1; i < dims.size(); ++i) inner = inner * s.mesh().size(dims[i]) + coord[dims[i]];
  const auto& table = s.shard_table(t);
  const int64_t per_member = static_cast<int64_t>(table.size()) / n;
  int64_t from = 0;
  for (int64_t j = 0; j < inner; ++j) from += table[k * per_member + j];
  return {run.begin() + from, run.begin() + from + table[k * per_member + inner]};
}

}  // namespace

// The chunks: a partition of [0, L), sizes within one, and on a length that 2n divides every
// member scores the same number of causal (query, key) pairs; from an even Shard every member
// keeps one of its two chunks.
TEST(HeadTail, ChunksPartitionAndBalanceTheCausalWork) {
  for (int64_t n = 1; n <= 6; ++n) {
    for (int64_t length : std::vector<int64_t>{0, 1, 5, 2 * n, 2 * n + 3, 12 * n, 12 * n + 7}) {
      const auto w = tessera::detail::head_tail_windows(length, n);
      std::vector<int> seen(length, 0);
      int64_t smallest = length, largest = 0;
      std::vector<int64_t> work(n, 0);
      for (int64_t k = 0; k < n; ++k) {
        ASSERT_LE(w.head[k].second, w.tail[k].first) << "low chunk first, n " << n;
        for (auto r : {w.head[k], w.tail[k]}) {
          smallest = std::min(smallest, r.second - r.first);
          largest = std::max(largest, r.second - r.first);
          for (int64_t i = r.first; i < r.second; ++i) {
            ++seen[i];
            work[k] += i + 1;  // row i sees keys 0..i
          }
        }
      }
      for (int64_t i = 0; i < length; ++i) ASSERT_EQ(seen[i], 1) << "row " << i << " n " << n;
      EXPECT_LE(largest - smallest, 1) << "n " << n << " length " << length;
      if (length % (2 * n) == 0) {
        for (int64_t k = 1; k < n; ++k) EXPECT_EQ(work[k], work[0]) << "n " << n;
      }
      if (length % (2 * n) == 0 && length > 0) {
        const auto even = chunk_sizes(length, n);
        int64_t lo = 0;
        for (int64_t k = 0; k < n; ++k) {
          const int64_t hi = lo + even[k];
          const bool keeps = (w.head[k].first >= lo && w.head[k].second <= hi) ||
                             (w.tail[k].first >= lo && w.tail[k].second <= hi);
          EXPECT_TRUE(keeps) << "member " << k << " of " << n << " keeps neither chunk";
          lo = hi;
        }
      }
    }
  }
}

TEST(HeadTail, SpecChecks) {
  tessera::testing::run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    DTensorSpec s(mesh, {HeadTailShard(1), Replicate()}, {3, 11}, at::kFloat);
    EXPECT_TRUE(s.has_head_tail());
    EXPECT_EQ(s.placement(0).str(), "HT(1)");
    EXPECT_EQ(s.shard_table(1), tessera::detail::head_tail_windows(11, 2).table());
    EXPECT_FALSE(s.natural_spec().has_head_tail());
    EXPECT_EQ(s.natural_spec().shard_table(1), s.shard_table(1));
    EXPECT_NE(s.hash(), s.natural_spec().hash());
    EXPECT_FALSE(s == s.natural_spec());
    const int64_t k = mesh.coordinate()[0];
    const auto w = tessera::detail::head_tail_windows(11, 2);
    const std::vector<std::pair<int64_t, int64_t>> mine = {w.head[k], w.tail[k]};
    EXPECT_EQ(s.local_ranges(1, mesh.coordinate()), mine);
    EXPECT_THROW(s.local_offsets(), c10::Error);  // two ranges, on every rank
    // Inside another split of the same dim, two head-tail splits of it, or a table other
    // than the fixed one (at the head-tail level, when nested).
    EXPECT_THROW(DTensorSpec(mesh, {Shard(1), HeadTailShard(1)}, {3, 11}, at::kFloat), c10::Error);
    EXPECT_THROW(DTensorSpec(mesh, {HeadTailShard(1), HeadTailShard(1)}, {3, 11}, at::kFloat),
                 c10::Error);
    EXPECT_THROW(
        DTensorSpec(mesh, {HeadTailShard(1), Replicate()}, {3, 11}, at::kFloat, {{}, {6, 5}}),
        c10::Error);
    EXPECT_THROW(
        DTensorSpec(mesh, {HeadTailShard(1), Shard(1)}, {3, 11}, at::kFloat, {{}, {3, 3, 2, 3}}),
        c10::Error);
    // Nested: Shard(1) inside cuts each member's run (head chunk, then tail chunk); every
    // table of the inner level, empty pieces included. (11 over 2: runs of 5 and 6.)
    ASSERT_EQ(s.shard_table(1), (ShardTable{5, 6}));
    for (const ShardTable& table : std::vector<ShardTable>{
             {}, {3, 2, 3, 3}, {0, 5, 6, 0}, {5, 0, 1, 5}, {2, 3, 4, 2}, {4, 1, 0, 6}}) {
      DTensorSpec n(mesh, {HeadTailShard(1), Shard(1)}, {3, 11}, at::kFloat, {{}, table});
      EXPECT_TRUE(n.has_head_tail());
      EXPECT_EQ(n.local_sizes()[1],
                n.shard_table(1)[mesh.coordinate()[0] * 2 + mesh.coordinate()[1]]);
      std::vector<int64_t> got;
      for (auto [lo, hi] : n.local_ranges(1, mesh.coordinate()))
        for (int64_t i = lo; i < hi; ++i) got.push_back(i);
      EXPECT_EQ(got, positions_held(n, 1, mesh.coordinate())) << shape_str(n.shard_table(1));
      EXPECT_EQ(n.natural_spec().shard_table(1), n.shard_table(1));
      EXPECT_THROW(n.local_offsets(), c10::Error);
    }
    EXPECT_NO_THROW(DTensorSpec(mesh, {HeadTailShard(1), Shard(0)}, {3, 11}, at::kFloat));
  });
}

// Every source layout to every target, head-tail on either side or both, on 1-5 ranks and
// 2-D meshes; random tables for the natural shards; lengths with empty chunks and not a
// multiple of 2n. The shards equal the full tensor's blocks and the gradient of the layout
// change equals the identity's.
TEST(HeadTail, RedistributeIntoAndOutOfEveryLayout) {
  const std::vector<std::vector<int64_t>> meshes = {{1},    {2},    {3},    {4},      {5},
                                                    {2, 2}, {3, 2}, {2, 3}, {2, 1, 2}};
  for (const auto& shape : meshes) {
    tessera::test::on_mesh(shape, [&](const DeviceMesh& mesh) {
      const std::vector<Placement> from_choices = {Shard(0),  Shard(1),         Replicate(),
                                                   Partial(), HeadTailShard(0), HeadTailShard(1)};
      const std::vector<Placement> to_choices = {Shard(0), Shard(1), Replicate(), HeadTailShard(0),
                                                 HeadTailShard(1)};
      const auto sources = every(mesh.ndim(), from_choices);
      const auto targets = every(mesh.ndim(), to_choices);
      tessera::test::Rng rng(17 + mesh.size());
      int checked = 0;
      for (int64_t length : std::vector<int64_t>{0, 3, 7, 16, 21}) {
        const std::vector<int64_t> sizes = {length, 5};
        const auto full = tessera::test::randn(sizes, 100 + length, at::kDouble);
        const auto grad = tessera::test::randn(sizes, 200 + length, at::kDouble);
        for (const auto& from : sources) {
          for (const auto& to : targets) {
            const bool head_tail =
                std::any_of(from.begin(), from.end(),
                            [](const Placement& p) { return p.is_head_tail(); }) ||
                std::any_of(to.begin(), to.end(),
                            [](const Placement& p) { return p.is_head_tail(); });
            // 2-D and 3-D meshes: a draw of the pairs (every pair on 1-D ones).
            if (!head_tail || (mesh.ndim() > 1 && !rng.coin(mesh.ndim() == 2 ? 0.25 : 0.02)))
              continue;
            const std::string ctx = "mesh " + shape_str(mesh.shape()) + " length " +
                                    std::to_string(length) + " " + to_string(from) + " -> " +
                                    to_string(to);
            auto x =
                make_dtensor_from_full(full, mesh, from, natural_tables(rng, mesh, from, sizes))
                    .detach()
                    .requires_grad_();
            auto target = std::make_shared<DTensorSpec>(mesh, to, sizes, at::kDouble,
                                                        natural_tables(rng, mesh, to, sizes));
            auto y = redistribute(x, target);
            ASSERT_TRUE(spec(y) == *target) << ctx << ": got " << spec(y).str();
            ASSERT_TRUE(shard_matches(y, full)) << ctx;
            to_local(y).backward(local_block(grad, *target));
            ASSERT_TRUE(full_matches(x.grad(), grad)) << ctx << " (backward)";
            ++checked;
          }
        }
      }
      EXPECT_GT(checked, 10);
    });
  }
}

// Rows this rank holds under `after` that it did not under `before` (along dim 0).
int64_t rows_gained(const DTensorSpec& before, const DTensorSpec& after) {
  const auto& coord = before.mesh().coordinate();
  int64_t gained = 0;
  for (auto [lo, hi] : after.local_ranges(0, coord))
    for (int64_t i = lo; i < hi; ++i) {
      bool held = false;
      for (auto [a, b] : before.local_ranges(0, coord)) held = held || (i >= a && i < b);
      gained += !held;
    }
  return gained;
}

// Into and out of head-tail: each row moves once, point to point, to the one member that
// needs it (no all-gather); from a replicated tensor nothing moves; to a replicated one, one
// all-gather of the stored shards (no relayout first).
TEST(HeadTail, RelayoutMovesEachRowOnce) {
  for (int world : {2, 3, 4, 5}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const int64_t length = 4 * world + 3, row = 6 * sizeof(float);
      const auto full = tessera::test::randn({length, 6}, 5);
      auto x = distribute_tensor(full, mesh, {Shard(0)});
      CommDebugMode into;
      auto y = redistribute(x, {HeadTailShard(0)});
      EXPECT_EQ(into.total_bytes_received(), rows_gained(spec(x), spec(y)) * row);
      EXPECT_EQ(into.total_bytes_sent(), rows_gained(spec(y), spec(x)) * row);
      EXPECT_EQ(into.get_comm_counts().count("all_gather"), 0u);
      ASSERT_TRUE(shard_matches(y, full));
      // Back to an even split (the table given), and to the natural order of its own table.
      for (const auto& sizes :
           {ShardSizes::Chunk(), ShardSizes::Given(0, spec(y).shard_table(0))}) {
        CommDebugMode back;
        auto z = redistribute(y, {Shard(0)}, sizes);
        EXPECT_EQ(back.total_bytes_received(), rows_gained(spec(y), spec(z)) * row);
        EXPECT_EQ(back.get_comm_counts().count("all_to_all"), 0u) << "one relayout, no re-cut";
        ASSERT_TRUE(shard_matches(z, full));
      }
      // (as gathering the same table in position order: padded where uneven, as that is)
      const auto natural =
          redistribute(y, {Shard(0)}, ShardSizes::Given(0, spec(y).shard_table(0)));
      int64_t natural_bytes = 0;
      {
        CommDebugMode natural_gather;
        redistribute(natural, {Replicate()});
        natural_bytes = natural_gather.total_bytes_received();
      }
      CommDebugMode gather;
      auto r = redistribute(y, {Replicate()});
      EXPECT_EQ(gather.get_comm_counts().count("send_recv"), 0u) << gather.table();
      EXPECT_EQ(gather.get_comm_counts().count("all_gather"), 1u) << gather.table();
      EXPECT_EQ(gather.total_bytes_received(), natural_bytes);
      ASSERT_TRUE(full_matches(r, full));
      const auto whole = distribute_tensor(full, mesh, {Replicate()});
      CommDebugMode cut;
      auto h = redistribute(whole, {HeadTailShard(0)});
      EXPECT_EQ(cut.total_bytes_sent(), 0) << "a replicated tensor is cut locally";
      ASSERT_TRUE(shard_matches(h, full));
    });
  }
}

// Ops on head-tail operands equal one device, forward and backward: element-wise, ops that
// read positions along the head-tail dim (scans, flips, slices, reductions, softmax over it),
// matrix products over it, and head-tail next to natural operands.
TEST(HeadTail, OpsEqualOneDevice) {
  using tessera::test::differential;
  using tessera::test::Operand;
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const Placements ht = {HeadTailShard(1)}, s1 = {Shard(1)};
      const std::vector<int64_t> shape = {2, 13, 4};
      auto one = [&](const std::string& what, const tessera::test::Fn& fn,
                     std::vector<Operand> ops) { differential(mesh, ops, fn, what); };
      one("mul+tanh", [](auto& a) { return (a[0] * a[1]).tanh(); }, {{shape, ht}, {shape, ht}});
      one("head-tail * natural", [](auto& a) { return a[0] * a[1] + a[0]; },
          {{shape, ht}, {shape, s1}});
      one("cumsum over it", [](auto& a) { return a[0].cumsum(1); }, {{shape, ht}});
      one("flip", [](auto& a) { return a[0].flip({1}) * 2; }, {{shape, ht}});
      // Views that cut it are taken of the natural order (the head-tail ones raise below).
      auto natural = [](const at::Tensor& t) {
        return is_dtensor(t) ? redistribute(t, {Shard(1)}) : t;
      };
      one("narrow it", [&](auto& a) { return natural(a[0]).narrow(1, 3, 7) * 1; }, {{shape, ht}});
      one("select rows of it",
          [&](auto& a) { return natural(a[0]).select(1, 11) + natural(a[0]).select(1, 2); },
          {{shape, ht}});
      one("circular padding along it",
          [](auto& a) {
            namespace F = torch::nn::functional;
            return F::pad(a[0].transpose(1, 2), F::PadFuncOptions({2, 3}).mode(torch::kCircular));
          },
          {{shape, ht}});
      one("softmax over it", [](auto& a) { return a[0].softmax(1); }, {{shape, ht}});
      one("sum over it", [](auto& a) { return a[0].sum(1); }, {{shape, ht}});
      one("matmul over it", [](auto& a) { return at::matmul(a[0].transpose(1, 2), a[1]); },
          {{shape, ht}, {shape, ht}});
      one("transpose keeps it", [](auto& a) { return a[0].transpose(0, 1) + 1; }, {{shape, ht}});
      one("index along it",
          [](auto& a) { return a[0].index_select(1, at::arange(12, -1, -3, at::kLong)); },
          {{shape, ht}});
      // A rule's error on head-tail arguments (it saw natural stand-ins) says so, on every
      // rank.
      const auto x = distribute_tensor(at::zeros({13, 6}), mesh, {HeadTailShard(0)});
      const auto w = distribute_tensor(at::zeros({5, 4}), mesh, {Replicate()});
      try {
        at::mm(x, w);
        ADD_FAILURE() << "mm of [13, 6] and [5, 4] ran";
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        EXPECT_NE(msg.find("aten::mm"), std::string::npos) << msg;
        EXPECT_NE(msg.find("head-tail arguments appear as Shard"), std::string::npos) << msg;
      }
    });
  }
}

// A view that keeps the head-tail dim whole shares the shard: it is head-tail itself and
// writes through it reach the base. A view that cuts the dim would read a relayed copy (stale
// after later writes, its own writes lost): it raises on every rank, naming the fix.
TEST(HeadTail, ViewsAliasOrRaise) {
  tessera::testing::run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    const auto full = tessera::test::randn({2, 14, 3}, 9, at::kDouble);
    auto x = distribute_tensor(full, mesh, {HeadTailShard(1)});
    auto t = x.transpose(0, 1);
    EXPECT_TRUE(spec(t).placement(0).is_head_tail()) << spec(t).str();
    EXPECT_TRUE(to_local(t).is_alias_of(to_local(x)));
    auto expected = full.clone();
    x.select(2, 1).fill_(7.0);  // a view of another dim, written in place
    expected.select(2, 1).fill_(7.0);
    t.mul_(2.0);
    expected.mul_(2.0);
    auto u = x.unsqueeze(0).view({1, 2, 14, 3});
    EXPECT_TRUE(spec(u).placement(0).is_head_tail());
    u.add_(1.0);
    expected.add_(1.0);
    EXPECT_TRUE(spec(x).placement(0).is_head_tail());
    ASSERT_TRUE(full_matches(x, expected));
    // A reshape that folds the dim into the batch moves it in the natural order too (a copy
    // there as well): taken alike, values in position order (the loss's flatten).
    const auto flat = x.reshape({-1, 3});
    ASSERT_TRUE(full_matches(flat, expected.reshape({-1, 3})));
  });
  // ... and writes through that copy raise, as they do for a Shard(1) tensor.
  tessera::test::expect_error_everywhere(
      3,
      [](int) {
        auto mesh = init_device_mesh("cpu", {3});
        auto x = distribute_tensor(tessera::test::randn({2, 14}, 9), mesh, {HeadTailShard(1)});
        x.view({-1}).fill_(1.0);
      },
      {"base would not see the write"});
  tessera::test::expect_error_everywhere(
      3,
      [](int) {
        auto mesh = init_device_mesh("cpu", {3});
        auto x = distribute_tensor(tessera::test::randn({2, 14}, 9), mesh, {HeadTailShard(1)});
        auto v = x.narrow(1, 0, 5);
      },
      {"HT(1)", "cuts or reorders its head-tail dim", "natural order first"});
  // Writes through a view made contiguous (any layout) raise, through the fast path's add_
  // too, on every rank: 4 ranks, so one shard is a single row (whose transpose is contiguous).
  for (bool fast : {false, true}) {
    tessera::test::expect_error_everywhere(
        4,
        [&](int) {
          auto mesh = init_device_mesh("cpu", {4});
          auto x = distribute_tensor(tessera::test::randn({4, 5}, 9), mesh, {Shard(1)});
          auto flat = x.transpose(0, 1).view({-1});
          if (!fast) flat.fill_(1.0);
          // The fast path has an entry for add_ at this layout from a tensor of its own.
          auto own = distribute_tensor(at::zeros({20}), mesh, {Shard(0)}, std::nullopt,
                                       ShardSizes::Given(0, spec(flat).shard_table(0)));
          own.add_(1.0);
          own.add_(1.0);
          flat.add_(1.0);
        },
        {"base would not see the write"});
  }
}

// In-place and out= writes on a head-tail tensor keep its layout and reach its aliases.
TEST(HeadTail, WritesKeepTheLayout) {
  for (int world : {1, 2, 4}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const auto full = tessera::test::randn({9, 3}, 3, at::kDouble);
      const auto other = tessera::test::randn({9, 3}, 4, at::kDouble);
      auto x = distribute_tensor(full, mesh, {HeadTailShard(0)});
      auto alias = x.detach();
      x.mul_(3.0).add_(distribute_tensor(other, mesh, {Shard(0)}));  // natural other operand
      x.copy_(x.cumsum(0));                                          // reads positions
      const auto expected = (full * 3.0 + other).cumsum(0);
      EXPECT_TRUE(spec(x).placement(0).is_head_tail());
      ASSERT_TRUE(full_matches(x, expected));
      ASSERT_TRUE(full_matches(alias, expected)) << "the alias missed the write";
      auto out = distribute_tensor(at::zeros({9, 3}, at::kDouble), mesh, {HeadTailShard(0)});
      at::cumsum_out(out, x, 0);
      EXPECT_TRUE(spec(out).placement(0).is_head_tail());
      ASSERT_TRUE(full_matches(out, expected.cumsum(0)));
      // out= into a tensor in another layout, and an in-place op that changes the layout.
      auto whole = distribute_tensor(at::zeros({9, 3}, at::kDouble), mesh, {Replicate()});
      at::add_out(whole, x, x);
      ASSERT_TRUE(full_matches(whole, expected * 2));
      auto plain = at::zeros({9, 3}, at::kDouble);  // a plain out= tensor gets the whole result
      at::mul_out(plain, x, x);
      ASSERT_FALSE(is_dtensor(plain));
      ASSERT_TRUE(tessera::test::same_values(plain, expected * expected));
      auto turned = distribute_tensor(full, mesh, {HeadTailShard(0)});
      turned.t_();
      ASSERT_TRUE(full_matches(turned, full.t()));
    });
  }
}

#if TORCH_VERSION_MAJOR >= 2  // LibTorch 1.13 has no scaled_dot_product_attention
// Attention on head-tail q, k, v equals one device (causal and not), forward and backward.
TEST(HeadTail, AttentionEqualsOneDevice) {
  if (!tessera::test::has_fused_cpu_attention()) GTEST_SKIP() << "LibTorch 1.13: no SDPA";
  for (int world : {1, 2, 3}) {
    for (bool causal : {true, false}) {
      tessera::testing::run_ranks(world, [&](int) {
        auto mesh = init_device_mesh("cpu", {world});
        const std::vector<int64_t> shape = {1, 2, 11, 4};
        std::vector<at::Tensor> full, dist;
        for (int i = 0; i < 3; ++i) {
          full.push_back(tessera::test::randn(shape, 30 + i, at::kDouble).requires_grad_());
          dist.push_back(
              distribute_tensor(full.back().detach(), mesh, {HeadTailShard(2)}).requires_grad_());
        }
        auto expected =
            at::scaled_dot_product_attention(full[0], full[1], full[2], {}, 0.0, causal);
        auto got = at::scaled_dot_product_attention(dist[0], dist[1], dist[2], {}, 0.0, causal);
        ASSERT_TRUE(full_matches(got, expected)) << "world " << world << " causal " << causal;
        EXPECT_TRUE(spec(got).placement(0).is_head_tail())
            << "taken as stored: " << spec(got).str();
        const auto g = tessera::test::randn(shape, 40, at::kDouble);
        expected.backward(g);
        got.backward(distribute_tensor(g, mesh, spec(got).placements(), 0,
                                       ShardSizes::Given(spec(got).shard_tables())));
        for (int i = 0; i < 3; ++i) {
          ASSERT_TRUE(full_matches(dist[i].grad(), full[i].grad())) << "gradient " << i;
          EXPECT_TRUE(spec(dist[i].grad()).placement(0).is_head_tail());
        }
      });
    }
  }
}

// Taken as stored, causal attention deals nothing per call: it moves fewer bytes than the
// same call on contiguous rows, which the balanced ring deals in and out (forced here).
TEST(HeadTail, StoredAttentionMovesLess) {
  if (!tessera::test::has_fused_cpu_attention()) GTEST_SKIP() << "LibTorch 1.13: no SDPA";
  const auto before = set_context_parallel_method(ContextParallelMethod::kRing);
  for (int world : {2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const std::vector<int64_t> shape = {1, 2, 24, 8};
      auto bytes = [&](const Placement& p) {
        std::vector<at::Tensor> qkv;
        for (int i = 0; i < 3; ++i)
          qkv.push_back(
              distribute_tensor(tessera::test::randn(shape, 50 + i), mesh, {p}).requires_grad_());
        CommDebugMode comm;
        auto out = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, 0.0, true);
        out.backward(at::ones_like(out));
        return comm.total_bytes_received();
      };
      const int64_t stored = bytes(HeadTailShard(2)), natural = bytes(Shard(2));
      // (the middle member of an odd count holds its pair already: equal there)
      EXPECT_LE(stored, natural) << "world " << world;
      if (mesh.coordinate()[0] == 0) {
        EXPECT_LT(stored, natural) << "world " << world;
      }
    });
  }
  set_context_parallel_method(before);
}

#endif

// Position-free ops keep the order on the stored shards with no communication (products
// with a replicated weight, element-wise ops, a concatenation and a norm over other dims);
// the values and gradients equal one device; an op that reads positions returns the natural
// order.
TEST(HeadTail, PositionFreeOpsKeepTheOrder) {
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      auto fx = tessera::test::randn({2, 13, 6}, 60, at::kDouble).requires_grad_();
      auto fw = tessera::test::randn({6, 5}, 61, at::kDouble).requires_grad_();
      auto x = distribute_tensor(fx.detach(), mesh, {HeadTailShard(1)}).requires_grad_();
      auto w = distribute_tensor(fw.detach(), mesh, {Replicate()}).requires_grad_();
      auto block = [](const at::Tensor& a, const at::Tensor& b) {
        auto y = at::matmul(a, b).relu() * 2 + 1;
        auto z = at::cat({y, y.sin()}, -1);
        return z * at::rsqrt(z.pow(2).mean(-1, true) + 1e-5);
      };
      CommDebugMode comm;
      auto got = block(x, w);
      EXPECT_EQ(comm.get_total_counts(), 0) << "moved: " << comm.total_bytes_sent() << " bytes";
      EXPECT_TRUE(spec(got).placement(0).is_head_tail()) << spec(got).str();
      auto expected = block(fx, fw);
      ASSERT_TRUE(full_matches(got, expected));
      const auto g = tessera::test::randn({2, 13, 10}, 62, at::kDouble);
      expected.backward(g);
      got.backward(distribute_tensor(g, mesh, {HeadTailShard(1)}));
      ASSERT_TRUE(full_matches(x.grad(), fx.grad()));
      ASSERT_TRUE(full_matches(w.grad(), fw.grad()));
      auto scanned = x.cumsum(1);
      EXPECT_FALSE(spec(scanned).has_head_tail());
      ASSERT_TRUE(full_matches(scanned, fx.detach().cumsum(1)));
      // A replicated operand that the op cuts along the dim is cut head-tail, locally (a
      // gradient arriving replicated next to head-tail activations): nothing moves.
      const auto fr = tessera::test::randn({2, 13, 6}, 65, at::kDouble);
      const auto r = distribute_tensor(fr, mesh, {Replicate()});
      CommDebugMode cut_comm;
      const auto mixed = at::addcmul(x.detach(), r, x.detach()) * r;
      EXPECT_EQ(cut_comm.get_total_counts(), 0);
      if (world > 1) {  // (on one rank the plan may as well gather x: it costs nothing)
        EXPECT_TRUE(spec(mixed).placement(0).is_head_tail()) << spec(mixed).str();
      }
      ASSERT_TRUE(full_matches(mixed, at::addcmul(fx.detach(), fr, fx.detach()) * fr));
    });
  }
}

// A mesh dim of one member next to the head-tail one ("tp" = 1 in a cp x tp mesh): plans
// change layouts there freely (a column-wise weight's split, a row-wise product's sum, a
// nested sequence split), which moves nothing, so the order stays and no rows are relayed.
TEST(HeadTail, MeshDimsOfOneMemberKeepTheOrder) {
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world, 1}, {"cp", "tp"});
      auto fx = tessera::test::randn({2, 13, 6}, 80, at::kDouble).requires_grad_();
      auto fa = tessera::test::randn({6, 5}, 81, at::kDouble).requires_grad_();
      auto fb = tessera::test::randn({5, 6}, 82, at::kDouble).requires_grad_();
      auto x = distribute_tensor(fx.detach(), mesh, {HeadTailShard(1), Shard(1)}).requires_grad_();
      auto a = distribute_tensor(fa.detach(), mesh, {Replicate(), Shard(1)}).requires_grad_();
      auto b = distribute_tensor(fb.detach(), mesh, {Replicate(), Shard(0)}).requires_grad_();
      auto block = [](const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
        auto h = at::matmul(at::matmul(x, a).relu(), b);  // column-, then row-wise
        return h + x;
      };
      CommDebugMode comm;
      auto got = block(x, a, b);
      EXPECT_EQ(comm.get_comm_counts()["send_recv"], 0) << "world " << world;
      if (world > 1) {  // (on one rank a plan may as well relay: it costs nothing)
        EXPECT_TRUE(spec(got).placement(0).is_head_tail()) << spec(got).str();
      }
      auto expected = block(fx, fa, fb);
      ASSERT_TRUE(full_matches(got, expected));
      const auto g = tessera::test::randn({2, 13, 6}, 83, at::kDouble);
      expected.backward(g);
      CommDebugMode backward;
      got.backward(distribute_tensor(g, mesh, {HeadTailShard(1), Replicate()}));
      EXPECT_EQ(backward.get_comm_counts()["send_recv"], 0) << "world " << world;
      ASSERT_TRUE(full_matches(x.grad(), fx.grad()));
      ASSERT_TRUE(full_matches(a.grad(), fa.grad()));
      ASSERT_TRUE(full_matches(b.grad(), fb.grad()));
    });
  }
}

// Sequence parallelism inside a head-tail context split: HeadTailShard(1) on the outer mesh
// dim, Shard(1) on the inner one cutting each member's run (uneven and empty pieces). The
// inner gather and cut move over the inner dim only (one all-gather; none), position-free
// ops keep the nested order with no communication, a whole-dim slice keeps it, and values
// and gradients equal one device. On 2x2, 2x3 and 3x2 meshes.
TEST(HeadTail, NestedSequenceSplitKeepsTheOrder) {
  for (const std::vector<int64_t> shape : {std::vector<int64_t>{2, 2}, {2, 3}, {3, 2}}) {
    tessera::test::on_mesh(shape, [&](const DeviceMesh& mesh) {
      tessera::test::Rng rng(70 + mesh.size());
      for (int64_t length : std::vector<int64_t>{0, 5, 13}) {
        const std::string ctx = "mesh " + shape_str(shape) + " length " + std::to_string(length);
        const Placements nested = {HeadTailShard(1), Shard(1)},
                         outer = {HeadTailShard(1), Replicate()};
        const std::vector<int64_t> sizes = {2, length, 6};
        auto fx = tessera::test::randn(sizes, 71 + length, at::kDouble).requires_grad_();
        auto fw = tessera::test::randn({6, 5}, 72, at::kDouble).requires_grad_();
        const auto tables = natural_tables(rng, mesh, nested, sizes);
        auto x = make_dtensor_from_full(fx.detach(), mesh, nested, tables).requires_grad_();
        auto w = distribute_tensor(fw.detach(), mesh, {Replicate(), Replicate()}).requires_grad_();
        ASSERT_TRUE(shard_matches(x, fx.detach())) << ctx;
        CommDebugMode comm;
        auto y = (at::matmul(x, w).relu() * 2 + 1).narrow(1, 0, length);
        EXPECT_EQ(comm.get_total_counts(), 0) << ctx;
        EXPECT_EQ(spec(y).placements(), nested) << ctx << ": " << spec(y).str();
        EXPECT_EQ(spec(y).shard_table(1), spec(x).shard_table(1)) << ctx;
        // The inner split gathered: one all-gather over the inner dim, no relayout.
        CommDebugMode gather;
        auto gathered = redistribute(y, mesh, outer);
        EXPECT_EQ(gather.get_comm_counts()["all_gather"], 1) << ctx;
        EXPECT_EQ(gather.get_comm_counts()["send_recv"], 0) << ctx;
        EXPECT_TRUE(spec(gathered).placement(0).is_head_tail()) << ctx;
        auto expected = at::matmul(fx, fw).relu() * 2 + 1;
        ASSERT_TRUE(shard_matches(gathered, expected.detach())) << ctx;
        // ... and cut again locally.
        CommDebugMode cut;
        auto again = redistribute(gathered, mesh, nested);
        EXPECT_EQ(cut.get_total_counts(), 0) << ctx;
        ASSERT_TRUE(shard_matches(again, expected.detach())) << ctx;
        const auto g = tessera::test::randn({2, length, 5}, 73 + length, at::kDouble);
        expected.backward(g);
        again.backward(distribute_tensor(g, mesh, nested));
        ASSERT_TRUE(full_matches(x.grad(), fx.grad())) << ctx;
        ASSERT_TRUE(full_matches(w.grad(), fw.grad())) << ctx;
        ASSERT_TRUE(full_matches(again, expected.detach())) << ctx;
        // The batch split over the other mesh dim instead (uneven, 3 rows): a weight expanded
        // over the batch is cut along it by the plan, a local slice that the order does not
        // touch. Nothing moves and the result stays head-tail. (On an empty dim moving costs
        // nothing, and the plan may as well gather it.)
        if (length == 0) continue;
        const auto fb = tessera::test::randn({3, length, 6}, 74 + length, at::kDouble);
        const auto b = distribute_tensor(fb, mesh, {Shard(0), HeadTailShard(1)});
        CommDebugMode batch_comm;
        const auto yb = at::bmm(b, w.detach().unsqueeze(0).expand({3, 6, 5}));
        EXPECT_EQ(batch_comm.get_total_counts(), 0) << ctx;
        EXPECT_TRUE(spec(yb).placement(1).is_head_tail()) << ctx << ": " << spec(yb).str();
        ASSERT_TRUE(full_matches(yb, at::bmm(fb, fw.detach().unsqueeze(0).expand({3, 6, 5}))))
            << ctx;
      }
    });
  }
}

// An embedding table stored head-tail along its rows (a positional table laid out like the
// tokens) under the vocabulary-parallel kernel, which reads its shard's offset: the rows a
// lookup returns are the indexed ones, as on one device, for head-tail and replicated
// indices.
TEST(HeadTail, HeadTailEmbeddingTableLooksUpItsRows) {
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const auto table = tessera::test::randn({11, 4}, 66, at::kDouble);
      const auto fidx = at::arange(10, -1, -1, at::kLong).remainder(11).view({1, 11});
      const auto w = distribute_tensor(table, mesh, {HeadTailShard(0)});
      for (const auto& p : {Placements{Replicate()}, Placements{HeadTailShard(1)}}) {
        const auto idx = distribute_tensor(fidx, mesh, p);
        ASSERT_TRUE(full_matches(at::embedding(w, idx), at::embedding(table, fidx)))
            << to_string(p);
      }
    });
  }
}

// The backward of a slice along another dim (slice_backward) and of an embedding
// (embedding_dense_backward) use no place along the head-tail dim: the gradients keep the
// order, and nothing is relayed.
TEST(HeadTail, SliceAndEmbeddingBackwardKeepTheOrder) {
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      const auto fx = tessera::test::randn({2, 13, 6}, 63, at::kDouble);
      const auto fgy = tessera::test::randn({2, 13, 3}, 64, at::kDouble);
      auto x = distribute_tensor(fx, mesh, {HeadTailShard(1)}).requires_grad_();
      const auto y = x.narrow(-1, 1, 3);
      EXPECT_TRUE(spec(y).placement(0).is_head_tail()) << spec(y).str();
      const auto gy = distribute_tensor(fgy, mesh, {HeadTailShard(1)});
      CommDebugMode slice_comm;
      const auto gx = torch::autograd::grad({y}, {x}, {gy})[0];
      EXPECT_EQ(slice_comm.get_total_counts(), 0) << slice_comm.table();
      EXPECT_TRUE(spec(gx).placement(0).is_head_tail()) << spec(gx).str();
      auto expected_gx = at::zeros_like(fx);
      expected_gx.narrow(-1, 1, 3).copy_(fgy);
      ASSERT_TRUE(full_matches(gx, expected_gx));

      auto g = tessera::test::generator(65);
      const auto ftokens = at::randint(0, 11, {2, 13}, g, at::kLong);
      const auto fw = tessera::test::randn({11, 6}, 66, at::kDouble).requires_grad_();
      const auto fge = tessera::test::randn({2, 13, 6}, 67, at::kDouble);
      auto w = distribute_tensor(fw.detach(), mesh, {Replicate()}).requires_grad_();
      const auto e = at::embedding(w, distribute_tensor(ftokens, mesh, {HeadTailShard(1)}));
      EXPECT_TRUE(spec(e).placement(0).is_head_tail()) << spec(e).str();
      const auto ge = distribute_tensor(fge, mesh, {HeadTailShard(1)});
      CommDebugMode embedding_comm;
      const auto gw = torch::autograd::grad({e}, {w}, {ge})[0];
      EXPECT_EQ(embedding_comm.get_comm_counts().count("send_recv"), 0u) << embedding_comm.table();
      const auto expected = torch::autograd::grad({at::embedding(fw, ftokens)}, {fw}, {fge})[0];
      ASSERT_TRUE(full_matches(gw, expected));
    });
  }
}

#if TORCH_VERSION_MAJOR >= 2  // LibTorch 1.13 has no scaled_dot_product_attention
// A causal transformer block on head-tail tokens, written as plain ATen code (embedding,
// RMS norm, projections, rotary tables laid out like the tokens, attention, SwiGLU, the loss):
// the activations stay head-tail from the embedding to the logits, with no all-gather (the
// attention takes them as stored), and the loss and every gradient equal one device's.
TEST(HeadTail, TransformerBlockStaysHeadTail) {
  if (!tessera::test::has_fused_cpu_attention()) GTEST_SKIP() << "LibTorch 1.13: no SDPA";
  const int64_t B = 1, L = 19, D = 16, H = 2, E = 8, F = 24, V = 11;
  auto forward = [&](const at::Tensor& tokens, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& w, at::Tensor* logits_out) {
    // w: embedding, norm, wq, wk, wv, wo, w1, w3, w2, output
    auto norm = [&](const at::Tensor& x) {
      return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-5) * w[1];
    };
    auto rope = [&](const at::Tensor& x) {  // [B, L, H, E]
      const auto c = cos.view({1, L, 1, E / 2}), s = sin.view({1, L, 1, E / 2});
      const auto x1 = x.narrow(-1, 0, E / 2), x2 = x.narrow(-1, E / 2, E / 2);
      return at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
    };
    auto h = at::embedding(w[0], tokens);
    const auto n = norm(h);
    const auto q = rope(at::matmul(n, w[2]).view({B, L, H, E})).transpose(1, 2);
    const auto k = rope(at::matmul(n, w[3]).view({B, L, H, E})).transpose(1, 2);
    const auto v = at::matmul(n, w[4]).view({B, L, H, E}).transpose(1, 2);
    const auto a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
    h = h + at::matmul(a.transpose(1, 2).reshape({B, L, D}), w[5]);
    const auto m = norm(h);
    h = h + at::matmul(at::silu(at::matmul(m, w[6])) * at::matmul(m, w[7]), w[8]);
    *logits_out = at::matmul(h, w[9]);
    return *logits_out;
  };
  const std::vector<std::vector<int64_t>> shapes = {{V, D}, {D},    {D, D}, {D, D}, {D, D},
                                                    {D, D}, {D, F}, {D, F}, {F, D}, {D, V}};
  auto g = tessera::test::generator(70);
  const auto tokens = at::randint(0, V, {B, L}, g, at::kLong);
  const auto targets = at::randint(0, V, {B * L}, g, at::kLong);
  const auto angles = at::outer(at::arange(L, at::kDouble), at::rand({E / 2}, g, at::kDouble));
  std::vector<at::Tensor> full;
  for (size_t i = 0; i < shapes.size(); ++i)
    full.push_back((tessera::test::randn(shapes[i], 71 + i, at::kDouble) * 0.3).requires_grad_());
  at::Tensor expected_logits;
  auto expected = at::cross_entropy_loss(
      forward(tokens, angles.cos(), angles.sin(), full, &expected_logits).reshape({-1, V}),
      targets);
  expected.backward();
  for (int world : {2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      std::vector<at::Tensor> w;
      for (const auto& p : full)
        w.push_back(distribute_tensor(p.detach(), mesh, {Replicate()}).requires_grad_());
      const auto t = distribute_tensor(tokens, mesh, {HeadTailShard(1)});
      const auto c = distribute_tensor(angles.cos(), mesh, {HeadTailShard(0)});
      const auto s = distribute_tensor(angles.sin(), mesh, {HeadTailShard(0)});
      at::Tensor logits;
      CommDebugMode comm;
      forward(t, c, s, w, &logits);
      const auto counts = comm.get_comm_counts();
      EXPECT_EQ(counts.count("all_gather"), 0u) << comm.table();
      EXPECT_TRUE(spec(logits).placement(0).is_head_tail()) << spec(logits).str();
      ASSERT_TRUE(full_matches(logits, expected_logits.detach()));
      auto loss = at::cross_entropy_loss(logits.reshape({-1, V}),
                                         distribute_tensor(targets, mesh, {HeadTailShard(0)}));
      ASSERT_TRUE(full_matches(loss, expected.detach()));
      loss.backward();
      for (size_t i = 0; i < w.size(); ++i)
        ASSERT_TRUE(full_matches(w[i].grad(), full[i].grad())) << "gradient of weight " << i;
    });
  }
}

#endif

// A checkpoint holds the rows in position order: a head-tail tensor saved loads into any
// other layout; loading into a head-tail tensor is refused on every rank before anything is
// read. Cross-entropy under loss_parallel takes head-tail rows.
TEST(HeadTail, CheckpointAndLossParallel) {
  namespace ckpt = tessera::checkpoint;
  const std::string dir = tessera::test::fresh_dir("head-tail") + "/c";
  const auto full = tessera::test::randn({11, 4}, 80, at::kDouble);
  tessera::testing::run_ranks(3, [&](int) {
    auto mesh = init_device_mesh("cpu", {3});
    ckpt::StateDict saved;
    saved.insert("x", distribute_tensor(full, mesh, {HeadTailShard(0)}));
    ckpt::save(saved, dir);
    ckpt::StateDict loaded;
    loaded.insert("x", distribute_tensor(at::zeros({11, 4}, at::kDouble), mesh, {Shard(1)}));
    ckpt::load(loaded, dir);
    ASSERT_TRUE(full_matches(loaded.tensor("x"), full));
  });
  tessera::test::expect_error_everywhere(
      3,
      [&](int) {
        auto mesh = init_device_mesh("cpu", {3});
        ckpt::StateDict into;
        into.insert("x",
                    distribute_tensor(at::zeros({11, 4}, at::kDouble), mesh, {HeadTailShard(0)}));
        ckpt::load(into, dir);
      },
      {"head-tail", "S(0)"});
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 1});
    const auto flogits = tessera::test::randn({9, 7}, 81, at::kDouble).requires_grad_();
    const auto target = at::arange(9, at::kLong).remainder(7);
    auto logits =
        distribute_tensor(flogits.detach(), mesh, {HeadTailShard(0), Shard(1)}).requires_grad_();
    at::Tensor loss;
    {
      LossParallel scope;
      loss = at::cross_entropy_loss(
          logits, distribute_tensor(target, mesh, {HeadTailShard(0), Replicate()}));
    }
    auto expected = at::cross_entropy_loss(flogits, target);
    ASSERT_TRUE(full_matches(loss, expected.detach()));
    loss.backward();
    expected.backward();
    ASSERT_TRUE(full_matches(logits.grad(), flogits.grad()));
  });
}
