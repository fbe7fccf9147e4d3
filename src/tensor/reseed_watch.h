#pragma once
// Counts re-seeds of ATen's default CPU generator (at::manual_seed, torch::manual_seed,
// Generator::seed, set_state), so random ops on distributed tensors can restart from it as one
// device would (NOTE: [Re-seeding] in reseed_watch.cpp).
#include <cstdint>

namespace tessera::detail {

// Re-seeds seen so far: by any thread of the process, and by the calling thread. Both only
// grow. Without the watch (see reseed_watch_installed) both stay 0.
uint64_t process_reseeds();
uint64_t thread_reseeds();

// Whether the default generator is watched. It is not when a Python interpreter runs in the
// process (torch.default_generator must stay the generator ATen's kernels use).
bool reseed_watch_installed();

}  // namespace tessera::detail
