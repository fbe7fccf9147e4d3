#pragma once
// Placements: how one mesh dimension lays a tensor out. Mirrors torch.distributed.tensor's
// Shard(dim) / Replicate() / Partial(reduce_op), plus HeadTailShard(dim): a Shard(dim) whose
// rows are stored in the balanced causal order (NOTE: [Head-tail order] in spec.h).
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/comm/reduce_op.h"

namespace tessera {

class Placement {
 public:
  enum class Kind : uint8_t { Replicate, Shard, Partial };

  static Placement shard(int64_t dim) { return Placement(Kind::Shard, dim, PartialOp::Sum); }
  static Placement head_tail_shard(int64_t dim) {
    Placement p(Kind::Shard, dim, PartialOp::Sum);
    p.head_tail_ = true;
    return p;
  }
  static Placement replicate() { return Placement(Kind::Replicate, 0, PartialOp::Sum); }
  static Placement partial(PartialOp op = PartialOp::Sum) {
    return Placement(Kind::Partial, 0, op);
  }

  Kind kind() const { return kind_; }
  bool is_shard() const { return kind_ == Kind::Shard; }
  bool is_shard(int64_t dim) const { return kind_ == Kind::Shard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::Replicate; }
  bool is_partial() const { return kind_ == Kind::Partial; }
  int64_t dim() const { return dim_; }         // meaningful for Shard only
  PartialOp reduce_op() const { return op_; }  // meaningful for Partial only
  // A head-tail shard is a shard (is_shard() holds) whose local rows are two ranges.
  bool is_head_tail() const { return head_tail_; }
  // The same split in position order: HeadTailShard(d) -> Shard(d); others unchanged.
  Placement natural() const { return Placement(kind_, dim_, op_); }

  // Shard(-1) on a 3-d tensor becomes Shard(2); throws if the dim is out of range.
  Placement normalized(int64_t ndim) const;
  std::string str() const;  // "S(0)", "HT(1)", "R", "P(sum)"

  bool operator==(const Placement& o) const {
    return kind_ == o.kind_ &&
           (kind_ != Kind::Shard || (dim_ == o.dim_ && head_tail_ == o.head_tail_)) &&
           (kind_ != Kind::Partial || op_ == o.op_);
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }

 private:
  Placement(Kind k, int64_t dim, PartialOp op) : kind_(k), op_(op), dim_(dim) {}
  Kind kind_;
  PartialOp op_;
  bool head_tail_ = false;
  int64_t dim_;
};

using Placements = std::vector<Placement>;

// Python-style spellings: tessera::Shard(0), tessera::Replicate(), tessera::Partial().
inline Placement Shard(int64_t dim) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }
inline Placement Partial(PartialOp op = PartialOp::Sum) { return Placement::partial(op); }
// The sequence split that balances causal attention (docs/context_parallel.md).
inline Placement HeadTailShard(int64_t dim) { return Placement::head_tail_shard(dim); }

std::string to_string(const Placements& p);  // "(S(0), R)"

}  // namespace tessera
