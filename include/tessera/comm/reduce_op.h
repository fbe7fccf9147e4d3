#pragma once
// How terms held by several ranks combine: the reductions collectives perform, and the op of
// a Partial(op) placement.
#include <cstdint>

namespace tessera {

// Partial(op): every rank holds a term; the global value is op over the terms.
enum class PartialOp : uint8_t { Sum, Avg, Max, Min };
const char* to_string(PartialOp op);

}  // namespace tessera
