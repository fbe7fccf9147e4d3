#pragma once
// Ranks as threads in one process: each thread gets its own World (its own Gloo groups)
// over one shared in-memory store. Used by the test suite and handy for experiments.
#include <chrono>
#include <functional>

namespace tessera::testing {

struct RunOptions {
  // Whole run: past it the stuck ranks are named and the process exits (never a silent hang).
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
  // Per collective (Gloo) and store wait: a rank whose peer died fails within this.
  std::chrono::milliseconds collective_timeout = std::chrono::seconds(30);
};

// Runs fn(rank) for rank = 0..world_size-1 concurrently. If any rank throws, every rank is
// released (the failing rank's groups close, so peers' collectives fail instead of waiting)
// and run_ranks throws a c10::Error carrying the first failing rank's message.
void run_ranks(int world_size, const std::function<void(int rank)>& fn,
               const RunOptions& options = {});

}  // namespace tessera::testing
