#include "wait.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

namespace tessera::comm::detail {

namespace {

thread_local const char* t_caller = nullptr;

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
    return c10_error->what_without_backtrace();
  return e.what();
}

// Set once by the runtime, which owns the store (comm sits below it).
std::atomic<FailureContextFn> g_failure_context{nullptr};

}  // namespace

CallerScope::CallerScope(const char* caller) : set_(t_caller == nullptr) {
  if (set_) t_caller = caller;
}
CallerScope::~CallerScope() {
  if (set_) t_caller = nullptr;
}

void set_failure_context(FailureContextFn fn) {
  g_failure_context.store(fn, std::memory_order_release);
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
  FailureContext context;
  if (FailureContextFn fn = g_failure_context.load(std::memory_order_acquire)) context = fn(op);
  const std::string& who = context.who;
  const std::string& report = context.report;
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
