#include "tessera/comm/reduce_op.h"

namespace tessera {

const char* to_string(PartialOp op) {
  switch (op) {
    case PartialOp::Sum: return "sum";
    case PartialOp::Avg: return "avg";
    case PartialOp::Max: return "max";
    case PartialOp::Min: return "min";
  }
  return "?";
}

}  // namespace tessera
