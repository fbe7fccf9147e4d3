#include "tessera/placement/placement.h"

#include <c10/util/Exception.h>

namespace tessera {

Placement Placement::normalized(int64_t ndim) const {
  if (!is_shard()) return *this;
  TORCH_CHECK(dim_ >= -ndim && dim_ < std::max<int64_t>(ndim, 1) && ndim > 0,
              "tessera: ", head_tail_ ? "HeadTailShard(" : "Shard(", dim_,
              ") is out of range for a tensor with ", ndim, " dims; use a dim in [", -ndim, ", ",
              ndim - 1, "]");
  Placement p = *this;
  p.dim_ = dim_ < 0 ? dim_ + ndim : dim_;
  return p;
}

std::string Placement::str() const {
  switch (kind_) {
    case Kind::Shard: return (head_tail_ ? "HT(" : "S(") + std::to_string(dim_) + ")";
    case Kind::Replicate: return "R";
    case Kind::Partial: return std::string("P(") + to_string(op_) + ")";
  }
  return "?";
}

std::string to_string(const Placements& p) {
  std::string s = "(";
  for (size_t i = 0; i < p.size(); ++i) s += (i ? ", " : "") + p[i].str();
  return s + ")";
}

}  // namespace tessera
