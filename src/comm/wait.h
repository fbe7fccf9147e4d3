#pragma once
// Waiting for c10d work with errors that say what failed and who is missing.
#include <exception>
#include <string>

namespace tessera::comm::detail {

// The call a collective serves (".item()", "full_tensor", an ATen op), named when the
// collective fails: a call made on some ranks only (if (rank == 0) loss.item()) leaves the
// others out, and the error should say which call that was. The outermost scope on the
// thread wins: it is what the user called. `caller` must outlive the scope.
class CallerScope {
 public:
  explicit CallerScope(const char* caller);
  ~CallerScope();
  CallerScope(const CallerScope&) = delete;
  CallerScope& operator=(const CallerScope&) = delete;

 private:
  bool set_;
};

// Rethrows the exception being handled as a c10::Error naming `op` and this rank. After a
// transport failure (a timeout, a peer gone) it first asks the world's store which ranks also
// got stuck in a collective and names those that stayed silent: hung, dead or still busy
// outside any collective. Call from inside a catch block.
[[noreturn]] void rethrow_collective_failure(const char* op);

// What the runtime knows about a failed collective: " on rank 3 of 8" and which ranks it
// finds stuck or silent (it owns the store that can tell). Set by the runtime at start-up.
struct FailureContext {
  std::string who, report;
};
using FailureContextFn = FailureContext (*)(const char* op);
void set_failure_context(FailureContextFn fn);

// work->wait(), with failures reported as above.
template <class WorkPtr>
void wait(const WorkPtr& work, const char* op) {
  try {
    work->wait();
  } catch (const std::exception&) {
    rethrow_collective_failure(op);
  }
}

}  // namespace tessera::comm::detail
