// transpose_ / t_: in-place transposes, which change the tensor's shape. LibTorch's RNN, LSTM
// and GRU with batch_first turn their output back with transpose_(0, 1).
//
// As for transpose (view.cpp), shard dims follow the swap and the shard stays where it is:
// the local op transposes the shard in place, and the tensor takes the swapped layout.
#include <c10/core/WrapDimMinimal.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// transpose_(self, dim0, dim1) / t_(self).
OpPlan transpose_inplace_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  const int64_t nd = in.ndim();
  OpPlan plan(call);
  if (nd < 2) {
    plan.output(std::make_shared<DTensorSpec>(in));
    return plan;
  }
  const bool dims = call.has("dim0");
  const int64_t a = c10::maybe_wrap_dim(dims ? call.arg<int64_t>("dim0") : 0, nd);
  const int64_t b = c10::maybe_wrap_dim(dims ? call.arg<int64_t>("dim1") : 1, nd);
  auto sizes = in.sizes();
  std::swap(sizes[a], sizes[b]);
  auto tables = in.shard_tables();
  std::swap(tables[a], tables[b]);
  Placements p = in.placements();
  for (auto& x : p) {
    if (x.is_shard(a))
      x = Shard(b);
    else if (x.is_shard(b))
      x = Shard(a);
  }
  plan.output(std::make_shared<DTensorSpec>(in.mesh(), p, sizes, in.dtype(), tables));
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::transpose_", transpose_inplace_rule);
  register_rule("aten::t_", transpose_inplace_rule);
}};

}  // namespace

}  // namespace tessera::ops
