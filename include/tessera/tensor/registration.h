#pragma once

namespace tessera {
// Registers the boxed fallback for every op that needs an explicit PrivateUse1 kernel (see
// NOTE: [Which ops need an explicit kernel] in tensor/fallback.cpp). Idempotent, thread-safe;
// called on the first distributed tensor's creation.
void ensure_dispatch_registered();
}  // namespace tessera
