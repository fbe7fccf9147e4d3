#include "tessera/testing/run_ranks.h"

#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "tessera/compat.h"
#include "tessera/compat_autograd.h"
#include "tessera/runtime/world.h"

namespace tessera::testing {

void run_ranks(int world_size, const std::function<void(int rank)>& fn, const RunOptions& options) {
  TORCH_CHECK(world_size >= 1, "tessera: run_ranks needs at least one rank");
  // Ranks share the cores; intra-op threads per rank would only oversubscribe them.
  at::set_num_threads(1);
  // A failing rank closes its groups on purpose; a peer still sending to it must get EPIPE
  // (and fail with an error naming the rank), not a SIGPIPE that kills the whole process.
  ::signal(SIGPIPE, SIG_IGN);
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(options.collective_timeout);

  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  int returned = 0;  // ranks whose fn returned normally
  std::vector<bool> done(world_size, false);
  int first_failed = -1;
  std::string first_message;
  std::vector<std::string> errors(world_size);
  std::vector<int> failure_order;

  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      std::string error;
      try {
        // CUDA ranks sharing a GPU: each rank's backward on its own thread (compat_autograd.h).
        compat::backward_on_calling_thread();
        ScopedWorld scope(
            std::make_shared<World>(store, r, world_size, options.collective_timeout));
        fn(r);
        // A rank's groups close with its World, while a peer may still be finishing a last
        // exchange or a connection handshake with it: leave together (or as soon as a rank
        // has failed, whose closing groups are what releases its peers).
        std::unique_lock<std::mutex> lock(mu);
        ++returned;
        cv.notify_all();
        cv.wait(lock, [&] { return returned == world_size || first_failed >= 0; });
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "unknown exception";
      }
      std::lock_guard<std::mutex> lock(mu);
      if (!error.empty()) {
        errors[r] = error;
        failure_order.push_back(r);
        if (first_failed < 0) {
          first_failed = r;
          first_message = error;
        }
      }
      done[r] = true;
      ++finished;
      cv.notify_all();
    });
  }

  {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, options.timeout, [&] { return finished == world_size; })) {
      std::string stuck;
      for (int r = 0; r < world_size; ++r)
        if (!done[r]) stuck += (stuck.empty() ? "" : ", ") + std::to_string(r);
      std::fprintf(
          stderr, "tessera::testing::run_ranks: ranks [%s] of %d still running after %lld ms%s%s\n",
          stuck.c_str(), world_size, static_cast<long long>(options.timeout.count()),
          first_failed >= 0 ? "; first failure: " : "", first_message.c_str());
      std::fflush(stderr);
      std::_Exit(124);  // a hung collective cannot be cancelled; fail loudly instead of hanging
    }
  }
  for (auto& t : threads) t.join();
  if (first_failed >= 0) {
    // A failing rank's communicators close as its stack unwinds, so its peers may report
    // "connection closed" before it reports the cause: name the first rank whose error is
    // not such a symptom.
    auto symptom = [](const std::string& e) {
      return e.find("Connection closed by peer") != std::string::npos ||
             e.find("Connection reset by peer") != std::string::npos ||
             e.find("Timed out waiting") != std::string::npos;
    };
    int cause = failure_order.front();
    for (int r : failure_order)
      if (!symptom(errors[r])) {
        cause = r;
        break;
      }
    std::string others;
    for (int r : failure_order)
      if (r != cause) others += (others.empty() ? "" : ", ") + std::to_string(r);
    throw compat::error_without_backtrace(
        "rank " + std::to_string(cause) + " of " + std::to_string(world_size) + " failed: " +
        errors[cause] + (others.empty() ? "" : " (ranks " + others + " failed after it)"));
  }
}

}  // namespace tessera::testing
