#pragma once
// One handle for every communication left in flight (an all-reduce of a gradient bucket,
// fully_shard's prefetching all-gather, a halo exchange): start it, compute, then wait().
#include <functional>
#include <memory>
#include <utility>

namespace tessera::comm {

// A result still arriving. wait() finishes the transfer and hands the result over; the handle
// keeps nothing (a prefetched layer's parameters must not outlive their use), so a later
// wait() returns an empty Result. The transport writes into buffers the handle owns until the
// transfer finishes, so a handle is never dropped in flight: the destructor and assigning
// over it finish the transfer first (the destructor swallows its errors; the assignment
// raises them).
template <class Result>
class Pending {
 public:
  using Finish = std::function<Result()>;

  Pending() = default;
  explicit Pending(Finish finish) : finish_(std::move(finish)) {}
  // A result that needed no transfer (one member, nothing to send).
  static Pending ready(Result result) {
    return Pending([r = std::make_shared<Result>(std::move(result))] { return std::move(*r); });
  }
  Pending(Pending&& o) noexcept : finish_(std::exchange(o.finish_, nullptr)) {}
  Pending& operator=(Pending&& o) {
    if (this != &o) {
      if (finish_) (void)wait();
      finish_ = std::exchange(o.finish_, nullptr);
    }
    return *this;
  }
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() {
    if (!finish_) return;
    try {
      (void)wait();
    } catch (...) {  // destructors must not throw; the next collective reports the failure
    }
  }

  // Whether the transfer still runs (wait() has not been called).
  bool pending() const { return static_cast<bool>(finish_); }

  Result wait() {
    if (!finish_) return Result();
    return std::exchange(finish_, nullptr)();
  }

 private:
  Finish finish_;
};

}  // namespace tessera::comm
