// Scatters a tensor unevenly over 4 ranks (2x2 mesh), walks it through every placement,
// prints the communication table and checks every step against the full tensor.
//   tessera-run -n 4 ./build/examples/redistribute_tour
#include <cstdio>

#include <ATen/ATen.h>

#include "tessera/tessera.h"

using namespace tessera;

int main() {
  init_process_group();
  const int rank = get_rank();
  const int world = get_world_size();
  TORCH_CHECK(world == 4, "redistribute_tour runs on 4 ranks: tessera-run -n 4 ",
              "redistribute_tour");
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});

  // Only rank 0's data pipeline holds the tensor; shard sizes along dim 0 are uneven: 7 + 2 + 0 + 4
  // over the 2x2 mesh when both mesh dims shard dim 0.
  at::manual_seed(0);
  const auto full = at::randn({13, 6});
  at::Tensor on_src = rank == 0 ? full : at::Tensor();
  auto dt =
      scatter_tensor(on_src, 0, mesh, {Shard(0), Shard(0)}, ShardSizes::Given(0, {7, 2, 0, 4}));
  if (rank == 0) std::printf("%s\n", to_string(dt).c_str());

  const std::vector<Placements> tour = {
      {Shard(0), Replicate()}, {Shard(1), Shard(0)},       {Replicate(), Shard(1)},
      {Shard(1), Shard(1)},    {Replicate(), Replicate()}, {Shard(0), Shard(1)},
  };
  bool ok = true;
  CommDebugMode total;  // everything the tour moves, checks included
  if (rank == 0)
    std::printf("\n%-14s %-10s %-32s %s\n", "placements", "local",
                "collectives (rank 0: calls, bytes sent)", "check");
  for (const auto& p : tour) {
    std::string moved;
    {
      CommDebugMode step;  // just this redistribute
      dt = redistribute(dt, p);
      for (auto& [kind, calls] : step.get_comm_counts())
        moved += kind + "x" + std::to_string(calls) + " ";
      moved += std::to_string(step.total_bytes_sent()) + " B";
      if (step.get_total_counts() == 0) moved = "none (local slice)";
    }
    const bool same = at::equal(full_tensor(dt), full);
    ok = ok && same;
    if (rank == 0)
      std::printf("%-14s %-10s %-32s %s\n", to_string(p).c_str(),
                  shape_str(spec(dt).local_sizes()).c_str(), moved.c_str(),
                  same ? "== full tensor" : "MISMATCH");
  }
  // Partial values: every rank contributes a term; the sum of the terms is the global value.
  auto part = from_local(full / 4, mesh, {Partial(), Partial()});
  auto rs = redistribute(part, {Shard(0), Shard(1)});
  const bool partial_ok = at::allclose(full_tensor(rs), full, 1e-5, 1e-6);
  ok = ok && partial_ok;
  // Gradients flow back through every layout change.
  auto leaf = distribute_tensor(full, mesh, {Shard(0), Shard(1)}).detach().requires_grad_();
  auto chain = redistribute(redistribute(leaf, {Replicate(), Shard(0)}), {Shard(1), Replicate()});
  (chain * chain).sum().backward();
  const bool grad_ok = at::allclose(full_tensor(leaf.grad()), 2 * full, 1e-5, 1e-6);
  ok = ok && grad_ok;
  if (rank == 0) {
    std::printf("(P(sum), P(sum)) -> (S(0), S(1)) via reduce-scatter: %s\n",
                partial_ok ? "== full tensor" : "MISMATCH");
    std::printf("gradient of sum(y*y) through two redistributes: %s\n",
                grad_ok ? "== 2*full" : "MISMATCH");
    std::printf("\nall communication on rank 0, checks included:\n%s", total.table().c_str());
  }
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
