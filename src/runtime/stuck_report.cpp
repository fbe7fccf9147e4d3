// Which ranks a failed collective left behind, asked of the world's store: the runtime's
// half of comm's failure reports (comm/wait.h), registered at start-up.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "comm/wait.h"
#include "tessera/runtime/world.h"

namespace tessera {

namespace {

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
    return c10_error->what_without_backtrace();
  return e.what();
}

std::string stuck_key(int rank) { return "tessera/stuck/" + std::to_string(rank); }

// Every rank that fails in a collective leaves a note in the store; after a short grace the
// ranks without a note are the suspects. One round trip per poll while waiting (a check of
// all keys), one per rank at the end.
std::string stuck_report(const World& world, const char* op) {
  const auto& store = world.store();
  const int n = world.size();
  const std::string note = std::string(op);
  store->set(stuck_key(world.rank()), std::vector<uint8_t>(note.begin(), note.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(stuck_key(r));
  const auto grace = std::min<std::chrono::milliseconds>(std::chrono::seconds(2), world.timeout());
  const auto until = std::chrono::steady_clock::now() + grace;
  while (!store->check(keys) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));

  constexpr int kListed = 16;
  std::string stuck, silent;
  int n_stuck = 0, n_silent = 0;
  for (int r = 0; r < n; ++r) {
    if (store->check({keys[r]})) {
      if (r == world.rank() || ++n_stuck > kListed) continue;
      const auto value = store->get(keys[r]);
      stuck += (stuck.empty() ? "" : ", ") + std::to_string(r) + " (" +
               std::string(value.begin(), value.end()) + ")";
    } else if (++n_silent <= kListed) {
      silent += (silent.empty() ? "" : ", ") + std::to_string(r);
    }
  }
  if (n_silent > kListed) silent += " and " + std::to_string(n_silent - kListed) + " more";
  if (n_stuck > kListed) stuck += " and " + std::to_string(n_stuck - kListed) + " more";
  std::string report;
  if (n_silent > 0)
    report += ". Ranks that never failed in a collective within " + std::to_string(grace.count()) +
              " ms: " + silent + " (hung, dead, or busy outside collectives: look there first)";
  else
    report +=
        ". Every rank failed in a collective (a network failure, or ranks calling "
        "different collectives)";
  if (!stuck.empty()) report += "; other ranks stuck: " + stuck;
  return report;
}

comm::detail::FailureContext failure_context(const char* op) {
  comm::detail::FailureContext context;
  std::shared_ptr<World> world;
  try {
    world = current_world();
  } catch (const std::exception&) {
    return context;  // no world: nothing to ask
  }
  context.who =
      " on rank " + std::to_string(world->rank()) + " of " + std::to_string(world->size());
  try {
    context.report = stuck_report(*world, op);
  } catch (const std::exception& e) {
    context.report = ". (The store could not be asked which ranks are missing: " + message_of(e) +
                     "; rank 0 hosts it)";
  }
  return context;
}

}  // namespace

namespace detail {
void install_failure_context();
}
void detail::install_failure_context() { comm::detail::set_failure_context(&failure_context); }

}  // namespace tessera
