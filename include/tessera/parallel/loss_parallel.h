#pragma once
// loss_parallel: cross entropy on logits sharded on the class dim, without gathering them
// (torch.distributed.tensor.parallel.loss_parallel). C++ has no context manager, so the
// scope is an RAII guard:
//
//   {
//     tessera::LossParallel scope;   // or: auto scope = tessera::loss_parallel();
//     auto loss = torch::nn::functional::cross_entropy(logits, target, options);
//     loss.backward();                // may also run after the scope has closed
//   }
//
// Inside a scope, aten::cross_entropy_loss on a distributed `logits` sharded on the class
// dim (dim 1, or dim 0 for a 1-D input) runs a distributed log-softmax and picks each target
// logit on the rank that owns its class: two all-reduces per mesh dim that shards the
// classes (one MAX, one SUM that packs every per-row sum), plus, for reduction="mean" with
// the batch sharded over other mesh dims, one scalar SUM per such mesh dim for the global
// total weight. The backward communicates nothing. See docs/loss_parallel.md.
//
// The scope is per thread (ranks may be threads) and nests. Outside every scope, or for
// logits that are not distributed, cross_entropy runs its usual decomposition.

namespace tessera {

class LossParallel {
 public:
  LossParallel();
  ~LossParallel();
  LossParallel(const LossParallel&) = delete;
  LossParallel& operator=(const LossParallel&) = delete;
  LossParallel(LossParallel&&) = delete;
  LossParallel& operator=(LossParallel&&) = delete;

  // Whether the calling thread is inside at least one scope.
  static bool enabled();
};

// `auto scope = tessera::loss_parallel();` (C++17 guarantees the guard is not copied).
[[nodiscard]] inline LossParallel loss_parallel() { return LossParallel(); }

}  // namespace tessera
