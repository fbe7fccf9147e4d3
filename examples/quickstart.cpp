// The README's first program: scatter uneven shards from rank 0, change layout, reduce.
//   tessera-run -n 4 ./build/examples/quickstart
// doc:begin
#include <iostream>

#include <tessera/tessera.h>
using namespace tessera;

int main() {
  init_process_group();  // torchrun / mpirun / Slurm / tessera-run variables
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  at::Tensor full = at::randn({13, 6}, at::TensorOptions().dtype(at::kDouble));
  // Uneven shards: 7, 2, 0 and 4 rows over the 2x2 mesh (both mesh dims shard dim 0).
  auto x = scatter_tensor(get_rank() == 0 ? full : at::Tensor(), /*src=*/0, mesh,
                          {Shard(0), Shard(0)}, ShardSizes::Given(0, {7, 2, 0, 4}));
  auto y = redistribute(x, {Shard(1), Replicate()});  // one all-to-all + one all-gather
  auto loss = (y * y).mean();                         // exact on uneven shards
  auto whole = full_tensor(x);                        // every rank sees rank 0's data
  std::cout << "rank " << get_rank() << ": mean(x*x) = " << loss.item<double>()
            << " (one device: " << (whole * whole).mean().item<double>() << ")\n";
  return 0;
}
// doc:end
