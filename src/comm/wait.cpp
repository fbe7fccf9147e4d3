#include "wait.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "tessera/runtime/world.h"

namespace tessera::comm::detail {

namespace {

thread_local const char* t_caller = nullptr;

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

}  // namespace

CallerScope::CallerScope(const char* caller) : set_(t_caller == nullptr) {
  if (set_) t_caller = caller;
}
CallerScope::~CallerScope() {
  if (set_) t_caller = nullptr;
}

void rethrow_collective_failure(const char* op) {
  std::string original;
  try {
    throw;
  } catch (const std::exception& e) {
    original = message_of(e);
  }
  // A backend refusing an op it lacks is no transport failure: callers fall back on it.
  if (original.find("support") != std::string::npos) throw;
  std::shared_ptr<World> world;
  try {
    world = current_world();
  } catch (const std::exception&) {
  }
  std::string report, who;
  if (world) {
    who = " on rank " + std::to_string(world->rank()) + " of " + std::to_string(world->size());
    try {
      report = stuck_report(*world, op);
    } catch (const std::exception& e) {
      report = ". (The store could not be asked which ranks are missing: " + message_of(e) +
               "; rank 0 hosts it)";
    }
  }
  // A call made on some ranks only is the everyday cause: say which call waited.
  const std::string caller = t_caller ? std::string(" in ") + t_caller : std::string();
  const std::string hint =
      t_caller ? std::string(". Was it called on some ranks only? ") + t_caller +
                     " on a distributed tensor is collective: every rank must call it, in the "
                     "same order (not inside if (rank == 0))"
               : std::string(
                     ". Was it called on some ranks only? Every rank must make the same "
                     "collective calls in the same order");
  TORCH_CHECK(false, "tessera: ", op, " failed", who, caller, ": ", original, report, hint,
              ". The collective timeout is InitOptions::timeout, or TESSERA_TIMEOUT=<seconds>");
}

}  // namespace tessera::comm::detail
