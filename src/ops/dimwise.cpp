// Ops that work along some dims of one tensor and leave the others alone: cumsum,
// logcumsumexp, sort, flip, roll, tril / triu. (cumprod and cummax / cummin are not here:
// their LibTorch backward formulas call `any` on the input and build plain `zeros` buffers,
// so on sharded inputs they raise "no sharding rule" instead of running half-way.)
//
// NOTE: [Dim-wise ops]
// The op's own dims must be whole on every rank; every other dim keeps its shards. A mesh
// dim that shards one of the op's dims moves its shard to a free dim (the largest tensor dim
// the op does not touch and no mesh dim shards), which is one all-to-all, or replicates when
// there is none. Partial inputs are reduced first (none of these ops is linear in a way a
// Partial could pass through for every overload). Outputs have the input's shape and the
// redistributed input's layout (indices get their own dtype from the local result).
#include <algorithm>
#include <vector>

#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

// The input's layout with `dims` whole, as described in NOTE: [Dim-wise ops].
SpecPtr whole_along(const DTensorSpec& in, const std::vector<int64_t>& dims) {
  const int64_t nd = in.ndim();
  std::vector<bool> touched(nd, false), sharded(nd, false), changed(nd, false);
  for (int64_t d : dims) touched[c10::maybe_wrap_dim(d, nd)] = true;
  Placements p = in.placements();
  for (const auto& x : p)
    if (x.is_shard() && !touched[x.dim()]) sharded[x.dim()] = true;
  for (auto& x : p) {
    if (x.is_partial()) x = Replicate();
    if (!x.is_shard() || !touched[x.dim()]) continue;
    changed[x.dim()] = true;
    int64_t free_dim = -1;
    for (int64_t t = 0; t < nd; ++t)
      if (!touched[t] && !sharded[t] && (free_dim < 0 || in.sizes()[t] > in.sizes()[free_dim]))
        free_dim = t;
    if (free_dim < 0) {
      x = Replicate();
    } else {
      x = Shard(free_dim);
      sharded[free_dim] = changed[free_dim] = true;
    }
  }
  // Tables survive for dims whose sharding mesh dims did not change; new shards are chunks.
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t)
    if (sharded[t] && !changed[t]) tables[t] = in.shard_table(t);
  return std::make_shared<DTensorSpec>(in.mesh(), p, in.sizes(), in.dtype(), tables);
}

// self is argument 0; every return has self's shape.
OpPlan along(const OpCall& call, const std::vector<int64_t>& dims) {
  // Every op here has `self` as its only tensor argument.
  TORCH_INTERNAL_ASSERT(call.specs[0] != nullptr, call.describe());
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = whole_along(*call.specs[0], dims);
  for (size_t r = 0; r < call.op.schema().returns().size(); ++r)
    plan.outputs.push_back(plan.inputs[0]);
  return plan;
}

std::vector<int64_t> every_dim(const OpCall& call) {
  std::vector<int64_t> all(static_cast<size_t>(call.specs[0]->ndim()));
  for (size_t t = 0; t < all.size(); ++t) all[t] = static_cast<int64_t>(t);
  return all;
}

// cumsum, logcumsumexp, sort, sort.stable: one `dim`.
OpPlan along_dim(const OpCall& call) {
  if (call.specs[0]->ndim() == 0) return along(call, {});
  return along(call, {call.arg("dim").toInt()});
}

// flip(dims); roll(shifts, dims) with no dims rolls the flattened tensor: every dim whole.
OpPlan along_dims(const OpCall& call) {
  auto dims = call.arg("dims").toIntVector();
  if (dims.empty()) dims = every_dim(call);
  return along(call, dims);
}

// tril / triu: the last two dims.
OpPlan along_last_two(const OpCall& call) {
  TORCH_CHECK(call.specs[0]->ndim() >= 2, "tessera: ", call.describe(), ": needs 2 or more dims");
  return along(call, {-2, -1});
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::cumsum", "aten::logcumsumexp", "aten::sort", "aten::sort.stable"})
    register_rule(op, along_dim);
  for (const char* op : {"aten::flip", "aten::roll"}) register_rule(op, along_dims);
  for (const char* op : {"aten::tril", "aten::triu"}) register_rule(op, along_last_two);
}};

}  // namespace

}  // namespace tessera::ops
