// Processes seeded by rank (at::manual_seed(100 + rank), as data-parallel jobs do), with plain
// random draws of rank-dependent sizes before and between the distributed ones: random ops on
// distributed tensors still draw what one device seeded like rank 0 draws (docs/random.md),
// and re-seeding later restarts them as on one device.
#include <cstdio>

#include "tessera/tessera.h"

int main() {
  tessera::init_process_group();
  const int rank = tessera::get_rank();
  const int world = tessera::get_world_size();
  const at::Tensor x = at::arange(48, at::kFloat).reshape({8, 6}) / 10;

  // One device, doing what rank 0 does: seed 100, 3 plain draws, then the random ops.
  at::manual_seed(100);
  (void)at::rand({3});
  const at::Tensor want_drop = at::dropout(x, 0.3, true);
  const at::Tensor want_uniform = at::empty({8, 6}).uniform_();
  const at::Tensor want_randn = at::randn_like(x);

  at::manual_seed(100 + rank);
  (void)at::rand({rank + 3});
  auto mesh = tessera::init_device_mesh("cpu", {world});
  tessera::ShardTable rows(world, 0);  // uneven: all but two rows on rank 0, two on the last
  rows[0] = world > 1 ? 6 : 8;
  if (world > 1) rows.back() += 2;
  auto d = tessera::distribute_tensor(x, mesh, {tessera::Shard(0)}, std::nullopt,
                                      tessera::ShardSizes::Given(0, rows));
  auto r = tessera::distribute_tensor(x, mesh, {tessera::Replicate()}, std::nullopt);
  const at::Tensor drop = tessera::full_tensor(at::dropout(d, 0.3, true));
  (void)at::rand({2 * rank + 1});
  const at::Tensor uniform = tessera::full_tensor(at::empty_like(d).uniform_());
  (void)at::dropout(at::ones({rank + 1}), 0.5, true);
  const at::Tensor randn = tessera::to_local(at::randn_like(r));  // each replica on its own

  int failures = 0;
  auto check = [&](const char* what, const at::Tensor& got, const at::Tensor& want) {
    if (!at::equal(got, want)) {
      std::printf("rank %d: %s differs from one device seeded like rank 0\n", rank, what);
      ++failures;
    }
  };
  check("dropout on uneven S(0)", drop, want_drop);
  check("uniform_ on uneven S(0)", uniform, want_uniform);
  check("randn_like on R (this replica)", randn, want_randn);

  // Re-seeding later restarts them as it restarts one device (NOTE: [Re-seeding]): the same
  // seed on every rank, then plain draws, then a distributed dropout, twice; then seeds by rank
  // again, which draw what one device seeded like rank 0 draws.
  for (int round = 0; round < 2; ++round) {
    at::manual_seed(7);
    (void)at::rand({5});
    const at::Tensor want = at::dropout(x, 0.4, true);
    at::manual_seed(7);
    (void)at::rand({5});
    check("dropout after at::manual_seed(7) again", tessera::full_tensor(at::dropout(d, 0.4, true)),
          want);
  }
  at::manual_seed(50);
  (void)at::rand({1});
  const at::Tensor want_50 = at::rand_like(x);
  at::manual_seed(50 + rank);
  (void)at::rand({rank + 1});
  check("rand_like after at::manual_seed(50 + rank)", tessera::full_tensor(at::rand_like(d)),
        want_50);

  std::printf("rank %d: %s\n", rank, failures ? "FAILED" : "ok");
  tessera::destroy_process_group();
  return failures ? 1 : 0;
}
