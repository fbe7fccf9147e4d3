#pragma once
// One handle for every communication left in flight (an all-reduce of a gradient bucket,
// fully_shard's prefetching all-gather, a halo exchange): start it, compute, then wait().
#include <functional>
#include <optional>
#include <utility>

#include <c10/util/Exception.h>

namespace tessera::comm {

// A result still arriving. wait() finishes the transfer once and returns the result (again
// on later calls). The transport writes into buffers the handle owns until then, so a handle
// is never dropped in flight: the destructor and assigning over it finish the transfer first
// (the destructor swallows its errors; the assignment raises them).
template <class Result>
class Pending {
 public:
  using Finish = std::function<Result()>;

  Pending() = default;
  explicit Pending(Finish finish) : finish_(std::move(finish)) {}
  static Pending ready(Result result) {
    Pending p;
    p.result_ = std::move(result);
    return p;
  }
  Pending(Pending&& o) noexcept
      : finish_(std::exchange(o.finish_, nullptr)), result_(std::move(o.result_)) {}
  Pending& operator=(Pending&& o) {
    if (this != &o) {
      if (finish_) (void)wait();
      finish_ = std::exchange(o.finish_, nullptr);
      result_ = std::move(o.result_);
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
    if (finish_) result_ = std::exchange(finish_, nullptr)();
    TORCH_CHECK(result_.has_value(), "tessera: wait() on an empty pending transfer");
    return *result_;
  }

 private:
  Finish finish_;
  std::optional<Result> result_;
};

}  // namespace tessera::comm
