// A 4-rank program where rank 2 fails: the launcher must stop the others and name rank 2.
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "tessera/tessera.h"

int main() {
  tessera::init_process_group();
  auto mesh = tessera::init_device_mesh("cpu", {tessera::get_world_size()});
  if (tessera::get_rank() == 2) throw std::runtime_error("rank 2 fails on purpose");
  // The others wait in a collective that rank 2 never joins.
  auto t = tessera::distribute_tensor(at::ones({8}), mesh, {tessera::Shard(0)});
  std::printf("unreachable: %f\n", tessera::full_tensor(t).sum().item<float>());
  return 0;
}
