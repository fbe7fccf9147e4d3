#pragma once
// The CPU allocator of the benchmarks that measure memory (bench_domain,
// bench_neighborhood_attention, tessera_peer dp): it counts the bytes it hands out. Install it
// before any tensor exists (counting_bench_main in bench_main.h does).
//
// CountingAllocator<Counter, charge>: charge() picks, on the allocating thread, the Counter
// an allocation is charged to (one per process, or one per thread as bench_domain does);
// the free is charged to the same Counter, whichever thread frees. Counter has add(n) and
// sub(n). Counts are requested bytes, not what malloc reserves.
#include <atomic>
#include <cstddef>
#include <cstdint>

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include "tessera/compat.h"

namespace bench {

// Live and peak bytes.
struct LiveBytes {
  std::atomic<int64_t> live{0}, peak{0};
  void add(int64_t n) {
    const int64_t now = live.fetch_add(n) + n;
    for (int64_t p = peak.load(); now > p && !peak.compare_exchange_weak(p, now);) {
    }
  }
  void sub(int64_t n) { live.fetch_sub(n); }
  void reset_peak() { peak.store(live.load()); }
};

// Every thread of the process, Gloo's and oneDNN's included.
inline LiveBytes& process_bytes() {
  static LiveBytes bytes;
  return bytes;
}
inline LiveBytes* charge_process() { return &process_bytes(); }

template <class Counter, Counter* (*charge)()>
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) {
    base_ = base;
    base_free_ = base->raw_deleter();
  }
  // A header in front of the data remembers the size and the counter for the free, and
  // makes a working raw_deleter (oneDNN allocates through raw_allocate / raw_deleter).
  c10::DataPtr allocate(size_t n) TESSERA_ALLOCATE_CONST override {
    void* raw = base_->raw_allocate(n + kHeader);
    auto* h = static_cast<Header*>(raw);
    h->bytes = static_cast<int64_t>(n);
    h->counter = charge();
    h->counter->add(h->bytes);
    void* data = static_cast<char*>(raw) + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
#if TESSERA_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif

 private:
  struct Header {
    int64_t bytes;
    Counter* counter;
  };
  static constexpr size_t kHeader = 64;  // keeps the data 64-byte aligned
  static_assert(sizeof(Header) <= kHeader);
  static void release(void* data) {
    if (!data) return;
    void* raw = static_cast<char*>(data) - kHeader;
    auto* h = static_cast<Header*>(raw);
    h->counter->sub(h->bytes);
    base_free_(raw);
  }
  static inline c10::Allocator* base_ = nullptr;
  static inline c10::DeleterFnPtr base_free_ = nullptr;
};

// Counts every allocation of the process in process_bytes().
using ProcessCountingAllocator = CountingAllocator<LiveBytes, &charge_process>;

}  // namespace bench
