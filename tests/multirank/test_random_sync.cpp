// Random ops on distributed tensors draw what one device draws even when the ranks were seeded
// differently (docs/random.md): every rank's generator is made equal to world rank 0's, plain
// random ops on local tensors never move it, and sync_random_state / explicit generators do
// what they promise. The oracle is always one device.
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/dropout.h>

#include "helpers.h"

using namespace tessera;

namespace {

constexpr int64_t kRows = 8, kCols = 6;

struct Layout {
  Placements placements;
  std::vector<ShardTable> tables;  // empty: chunk layout
  std::string name;
};

// Replicated, sharded evenly and unevenly (chunk and given tables), and nested, per mesh shape.
std::vector<Layout> layouts(const std::vector<int64_t>& mesh_shape) {
  if (mesh_shape.size() == 2) {
    return {{{Shard(0), Shard(1)}, {}, "(S(0), S(1))"},
            {{Shard(0), Shard(0)}, {}, "(S(0), S(0)) nested"},
            {{Replicate(), Shard(1)}, {}, "(R, S(1))"},
            {{Shard(1), Replicate()}, {}, "(S(1), R)"},
            {{Replicate(), Replicate()}, {}, "(R, R)"}};
  }
  const int64_t n = mesh_shape[0];
  ShardTable rows(n, 0);  // uneven, with empty shards between the first and the last
  rows[0] = n > 1 ? kRows - 2 : kRows;
  if (n > 1) rows.back() += 2;
  return {{{Replicate()}, {}, "R"},
          {{Shard(0)}, {}, "S(0) chunk"},
          {{Shard(0)}, {rows}, "S(0) uneven"},
          {{Shard(1)}, {}, "S(1) chunk"}};
}

at::Tensor input() { return tessera::test::randn({kRows, kCols}, 17); }

// The random ops under test, in order: functional dropout forward and backward, rand_like,
// randn_like, bernoulli_, uniform_, normal_ and a torch::nn::Dropout in training mode, on
// `make(x)` (x itself on one device, a distributed tensor on ranks). `between` runs plain
// random ops on local tensors between them. Results are full values (plain tensors), each
// with its distributed form when there is one.
struct Drawn {
  std::vector<at::Tensor> full;
  std::vector<at::Tensor> dist;  // empty on one device
};

Drawn draws(
    const std::function<at::Tensor(const at::Tensor&)>& make,
    const std::function<void()>& between = [] {}) {
  namespace F = torch::nn::functional;
  Drawn out;
  auto keep = [&](const at::Tensor& t) {
    if (is_dtensor(t)) {
      out.dist.push_back(t);
      out.full.push_back(full_tensor(t));
    } else {
      out.full.push_back(t);
    }
  };
  at::Tensor leaf = input().requires_grad_();
  at::Tensor x = make(leaf);
  at::Tensor y = F::dropout(x, F::DropoutFuncOptions().p(0.3).training(true));
  between();
  (y * y).sum().backward();
  keep(y.detach());
  out.full.push_back(leaf.grad());  // the gradient is plain: distribute_tensor's backward
  const at::Tensor d = x.detach();
  keep(at::rand_like(d));
  between();
  keep(at::randn_like(d));
  keep(at::empty_like(d).bernoulli_(0.4));
  between();
  keep(at::empty_like(d).uniform_(-2, 3));
  keep(at::zeros_like(d).normal_(1, 2));
  torch::nn::Dropout module(torch::nn::DropoutOptions(0.5));
  module->train();
  between();
  keep(module(d));
  return out;
}

// One device: the same random ops from ATen's default generator seeded with `seed`, `times`
// times in a row. Runs on the test thread while no rank thread exists.
std::vector<Drawn> one_device(uint64_t seed, size_t times) {
  at::manual_seed(seed);
  std::vector<Drawn> out;
  for (size_t i = 0; i < times; ++i) out.push_back(draws([](const at::Tensor& t) { return t; }));
  return out;
}

// Plain random ops on local tensors of rank-dependent sizes, from ATen's default generator
// (what a tensor-parallel style that returns local outputs leads to).
std::function<void()> local_noise(int rank) {
  return [rank] {
    (void)at::rand({rank + 1, 3});
    (void)at::dropout(at::ones({2 * rank + 1}), 0.5, true);
    (void)at::empty({rank + 2}).normal_();
  };
}

at::Tensor distribute(const at::Tensor& t, const DeviceMesh& mesh, const Layout& l) {
  return distribute_tensor(t, mesh, l.placements, std::nullopt,
                           l.tables.empty() ? ShardSizes::Chunk() : ShardSizes::Given(l.tables));
}

void expect_equal(const Drawn& got, const Drawn& want, const std::string& what) {
  ASSERT_EQ(got.full.size(), want.full.size()) << what;
  for (size_t i = 0; i < want.full.size(); ++i)
    EXPECT_TRUE(at::equal(got.full[i], want.full[i])) << what << ": result " << i;
  // Every rank's block is one device's block: replicas hold identical values.
  size_t d = 0;
  for (size_t i = 0; i < want.full.size() && d < got.dist.size(); ++i) {
    if (i == 1) continue;  // the plain gradient
    const auto& t = got.dist[d++];
    EXPECT_TRUE(at::equal(to_local(t), tessera::test::local_block(want.full[i], spec(t))))
        << what << ": rank's block of result " << i;
  }
}

// Every rank of `mesh` holds the same `local`.
void expect_same_everywhere(const DeviceMesh& mesh, const at::Tensor& local,
                            const std::string& what) {
  const auto all = comm::all_gather(mesh.mesh_group(), local.unsqueeze(0), 0,
                                    std::vector<int64_t>(mesh.size(), 1));
  for (int64_t r = 1; r < mesh.size(); ++r)
    EXPECT_TRUE(at::equal(all[r], all[0])) << what << ": rank " << mesh.ranks()[r];
}

const std::vector<std::vector<int64_t>> kMeshes = {{1}, {2}, {3}, {4}, {2, 2}};

}  // namespace

// Seeds by rank (what data-parallel jobs do): every layout draws what one device seeded with
// rank 0's seed draws, forward and dropout's backward, with plain local random ops of
// rank-dependent sizes in between.
TEST(RandomSync, RankSeedsDrawWhatOneDeviceSeededLikeRankZeroDraws) {
  for (const auto& shape : kMeshes) {
    const auto ls = layouts(shape);
    const auto want = one_device(100, ls.size());
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int rank) {
      auto mesh = init_device_mesh("cpu", shape);
      tessera::manual_seed(100 + 7 * rank);
      local_noise(rank)();
      for (size_t i = 0; i < ls.size(); ++i) {
        const auto got = draws([&](const at::Tensor& t) { return distribute(t, mesh, ls[i]); },
                               local_noise(rank));
        expect_equal(got, want[i], mesh.str() + " " + ls[i].name);
      }
    });
  }
}

// Without tessera::manual_seed the generator starts as a copy of ATen's default generator:
// at::manual_seed(s) means what it means on one device.
TEST(RandomSync, DefaultGeneratorSeedsTheFirstDraws) {
  for (const auto& shape : kMeshes) {
    const auto ls = layouts(shape);
    const auto want = one_device(5, ls.size());
    // Ranks as threads share the default generator: seed it before they exist, and let them
    // draw plain numbers only after their first distributed draw has returned (rank 0 copied
    // the default generator before that; draws runs local_noise only after its first op).
    at::manual_seed(5);
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int rank) {
      auto mesh = init_device_mesh("cpu", shape);
      for (size_t i = 0; i < ls.size(); ++i) {
        const auto got = draws([&](const at::Tensor& t) { return distribute(t, mesh, ls[i]); },
                               local_noise(rank));
        expect_equal(got, want[i], mesh.str() + " " + ls[i].name);
      }
    });
  }
}

// at::manual_seed after random ops on distributed tensors restarts them as it restarts one
// device, every time, on every layout: re-seeding is a reset (NOTE: [Re-seeding]).
TEST(RandomSync, AtManualSeedRestartsTheDrawsAsOnOneDevice) {
  const auto want_9 = one_device(9, 1), want_11 = one_device(11, 1);
  for (const auto& shape : kMeshes) {
    const auto ls = layouts(shape);
    // Rank threads share ATen's default generator (processes would not): every rank seeds it
    // between two barriers, so that no rank re-seeds while another is still drawing, or after
    // another started drawing. (Fully replicated layouts draw without any collective.)
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int) {
      auto mesh = init_device_mesh("cpu", shape);
      auto barrier = [&] { (void)comm::all_gather_ints(mesh.mesh_group(), {0}); };
      for (const auto& l : ls) {
        for (uint64_t seed : {9, 9, 11, 9}) {
          barrier();
          at::manual_seed(seed);
          barrier();
          const auto got = draws([&](const at::Tensor& t) { return distribute(t, mesh, l); });
          expect_equal(
              got, seed == 9 ? want_9[0] : want_11[0],
              mesh.str() + " " + l.name + " after at::manual_seed(" + std::to_string(seed) + ")");
        }
      }
    });
  }
}

// tessera::manual_seed then at::manual_seed: the later seeding wins, as each reset does.
TEST(RandomSync, LaterSeedingWins) {
  const auto want_5 = one_device(5, 1), want_40 = one_device(40, 1);
  for (int world : {1, 3}) {
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      auto dist = [&](const at::Tensor& t) {
        return distribute_tensor(t, mesh, {Shard(0)}, std::nullopt);
      };
      tessera::manual_seed(40 + 7 * rank);
      at::manual_seed(5);
      expect_equal(draws(dist), want_5[0], "at::manual_seed after tessera::manual_seed");
      tessera::manual_seed(40);
      expect_equal(draws(dist), want_40[0], "tessera::manual_seed after at::manual_seed");
    });
  }
}

// Reseeding by rank midway agrees again on rank 0's seed; sync_random_state(mesh, src) makes
// every rank take mesh rank src's state.
TEST(RandomSync, ReseedAndExplicitSync) {
  for (const auto& shape : kMeshes) {
    const int world = test::mesh_world(shape);
    const int src = world - 1;
    const auto ls = layouts(shape);
    const auto want_a = one_device(200, 1);
    const auto want_b = one_device(300 + 7 * src, 1);
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", shape);
      auto dist = [&](const at::Tensor& t) { return distribute(t, mesh, ls[1]); };
      tessera::manual_seed(100 + rank);
      (void)draws(dist, local_noise(rank));
      tessera::manual_seed(200 + 7 * rank);
      expect_equal(draws(dist, local_noise(rank)), want_a[0], mesh.str() + " reseeded");
      tessera::manual_seed(300 + 7 * rank);
      sync_random_state(mesh, src);
      expect_equal(draws(dist, local_noise(rank)), want_b[0],
                   mesh.str() + " synced from " + std::to_string(src));
    });
  }
}

// Submeshes of a 2 x 2 mesh: a tensor on mesh["tp"] draws one device's values in both "dp"
// replicas, interleaved with tensors on the whole mesh and on mesh["dp"] (agreement is
// world-wide). sync_random_state on a submesh agrees within each submesh only.
TEST(RandomSync, SubmeshesOfATwoByTwoMesh) {
  const std::vector<std::pair<std::string, Layout>> seq = {
      {"tp", {{Shard(0)}, {}, "tp S(0)"}},
      {"tp", {{Replicate()}, {}, "tp R"}},
      {"", {{Shard(0), Shard(1)}, {}, "mesh (S(0), S(1))"}},
      {"tp", {{Shard(0)}, {{7, 1}}, "tp S(0) uneven"}},
      {"dp", {{Shard(1)}, {}, "dp S(1)"}},
      {"tp", {{Shard(1)}, {}, "tp S(1)"}}};
  const auto want = one_device(400, seq.size());
  const auto want_group0 = one_device(500, 1);
  const auto want_group1 = one_device(500 + 7 * 2, 1);
  tessera::testing::run_ranks(4, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    tessera::manual_seed(400 + 7 * rank);
    for (size_t i = 0; i < seq.size(); ++i) {
      const auto m = seq[i].first.empty() ? mesh : mesh[seq[i].first];
      const auto got = draws([&](const at::Tensor& t) { return distribute(t, m, seq[i].second); },
                             local_noise(rank));
      expect_equal(got, want[i], "rank " + std::to_string(rank) + " " + seq[i].second.name);
    }
    tessera::manual_seed(500 + 7 * rank);
    sync_random_state(mesh["tp"]);  // from global rank 0 in dp group 0, rank 2 in group 1
    const Layout r{{Replicate()}, {}, "R"};
    const auto got = draws([&](const at::Tensor& t) { return distribute(t, mesh["tp"], r); });
    expect_equal(got, mesh.coordinate()[0] == 0 ? want_group0[0] : want_group1[0],
                 "rank " + std::to_string(rank) + " after sync_random_state(mesh[\"tp\"])");
  });
}

// An op's explicit generator is used as given and leaves the rank's generator alone.
TEST(RandomSync, ExplicitGeneratorIsUsedAsGiven) {
  at::manual_seed(9);
  const auto want_drop = at::dropout(input(), 0.3, true);
  const auto want_uniform = at::empty({kRows, kCols}).uniform_(0, 1, test::generator(77));
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      tessera::manual_seed(9 + rank);
      auto d = distribute_tensor(input(), mesh, {Shard(0)}, std::nullopt);
      auto u = at::empty_like(d).uniform_(0, 1, test::generator(77));
      EXPECT_TRUE(at::equal(full_tensor(u), want_uniform)) << world;
      EXPECT_TRUE(at::equal(full_tensor(at::dropout(d, 0.3, true)), want_drop)) << world;
    });
  }
}

// After clear_manual_seed each rank copies ATen's default generator (shared by rank threads
// and moved by their plain random ops at any time), yet the replicas agree.
TEST(RandomSync, ReplicasAgreeWhateverTheDefaultGenerator) {
  for (const auto& shape : kMeshes) {
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int rank) {
      auto mesh = init_device_mesh("cpu", shape);
      tessera::manual_seed(rank);
      tessera::clear_manual_seed();
      local_noise(rank)();
      auto r = distribute_tensor(input(), mesh, Placements(mesh.ndim(), Replicate()), std::nullopt);
      expect_same_everywhere(mesh, to_local(at::dropout(r, 0.5, true)), mesh.str() + " dropout");
      local_noise(rank)();
      expect_same_everywhere(mesh, to_local(at::randn_like(r)), mesh.str() + " randn_like");
    });
  }
}

// The agreement is one store exchange after each reset (metadata), not a collective.
TEST(RandomSync, AgreementIsOneStoreExchangePerReset) {
  for (int world : {1, 2, 3}) {
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      auto d = distribute_tensor(input(), mesh, {Shard(0)}, std::nullopt);
      CommDebugMode comm;
      tessera::manual_seed(1);  // rank 0 writes its state, the others read it at their dropout
      (void)at::dropout(d, 0.5, true);
      (void)at::rand_like(d);
      EXPECT_EQ(comm.get_total_counts(), 0);
      EXPECT_EQ(comm.stats(comm::CollectiveKind::Metadata).calls, world > 1 ? 1 : 0);
    });
  }
}

// A mesh without world rank 0, whose rank 0 draws nothing: rank 0's manual_seed is enough (it
// writes its state without waiting); without it the draw fails after the store timeout and
// names the remedy, and sync_random_state on the mesh replaces the agreement with rank 0.
TEST(RandomSync, MeshWithoutWorldRankZero) {
  at::manual_seed(600);
  const auto want_600 = at::dropout(input(), 0.3, true);
  at::manual_seed(607);
  const auto want_607 = at::dropout(input(), 0.3, true);
  tessera::testing::run_ranks(3, [&](int rank) {
    DeviceMesh mesh("cpu", {2}, {1, 2});
    tessera::manual_seed(600 + 7 * rank);
    if (rank == 0) return;
    auto d = distribute_tensor(input(), mesh, {Shard(0)}, std::nullopt);
    EXPECT_TRUE(at::equal(full_tensor(at::dropout(d, 0.3, true)), want_600)) << rank;
  });
  tessera::testing::RunOptions quick;
  quick.collective_timeout = std::chrono::seconds(2);
  tessera::testing::run_ranks(
      3,
      [&](int rank) {
        DeviceMesh mesh("cpu", {2}, {1, 2});
        if (rank == 0) return;
        auto d = distribute_tensor(input(), mesh, {Shard(0)}, std::nullopt);
        tessera::manual_seed(600 + 7 * rank);
        try {
          (void)at::dropout(d, 0.3, true);
          ADD_FAILURE() << "rank " << rank << " drew without rank 0's state";
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("sync_random_state"), std::string::npos) << e.what();
        }
        tessera::manual_seed(600 + 7 * rank);
        sync_random_state(mesh);
        EXPECT_TRUE(at::equal(full_tensor(at::dropout(d, 0.3, true)), want_607)) << rank;
      },
      quick);
}

// The hazard random.md warns about: dropout on plain local shards (a style that returned a
// local output) draws local-size numbers, so ranks whose generators agree repeat one mask on
// every shard. Kept distributed, the shards get one device's different masks.
TEST(RandomSync, PlainLocalDropoutRepeatsOneMaskOnEveryShard) {
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    tessera::manual_seed(3);
    auto d = distribute_tensor(at::ones({kRows, kCols}), mesh, {Shard(0)}, std::nullopt);
    // What processes seeded alike do with their default generators.
    auto local_mask = to_local(d).bernoulli(0.5, test::generator(3));
    auto gathered = full_tensor(from_local(local_mask, mesh, {Shard(0)}));
    EXPECT_TRUE(
        at::equal(gathered.narrow(0, 0, kRows / 2), gathered.narrow(0, kRows / 2, kRows / 2)));
    auto mask = full_tensor(at::empty_like(d).bernoulli_(0.5));
    EXPECT_FALSE(at::equal(mask.narrow(0, 0, kRows / 2), mask.narrow(0, kRows / 2, kRows / 2)));
  });
}
