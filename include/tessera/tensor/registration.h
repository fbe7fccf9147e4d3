#pragma once
#include <cstddef>
#include <cstdint>

namespace tessera {
// Registers the boxed fallback for every op that needs an explicit PrivateUse1 kernel (see
// NOTE: [Which ops need an explicit kernel] in tensor/fallback.cpp). Idempotent, thread-safe;
// called on the first distributed tensor's creation.
void ensure_dispatch_registered();

// The calling thread's op-decision cache (see NOTE: [Decision cache] in tensor/fallback.cpp).
struct DispatchCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  size_t entries = 0;
};
DispatchCacheStats dispatch_cache_stats();
void clear_dispatch_cache();
}  // namespace tessera
