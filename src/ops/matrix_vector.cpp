// addmv(self, mat, vec, beta, alpha) = beta self + alpha mat @ vec (linear with a 1-D input).
//
// Per mesh dim: mat's rows sharded shard the result (vec whole); mat's columns (or vec)
// sharded give a Partial(sum) result, vec cut like mat's columns and self turned into a
// Partial term (coordinate 0 keeps it, no communication). Partial inputs are reduced first.
// The backward is mv / outer products, which have their own rules.
#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

OpPlan addmv_rule(const OpCall& call) {
  const DTensorSpec* mat = call.spec("mat");
  const DTensorSpec* vec = call.spec("vec");
  TORCH_CHECK(mat && mat->ndim() == 2, "tessera: ", call.describe(), ": mat must be a matrix");
  const auto& mesh = mat->mesh();
  Placements pm(mesh.ndim(), Replicate()), pv = pm, po = pm;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& x = mat->placement(m);
    if (x.is_shard(0)) {
      pm[m] = x, po[m] = Shard(0);
    } else if (x.is_shard(1) || (vec && vec->placement(m).is_shard(0))) {
      pm[m] = Shard(1), pv[m] = Shard(0), po[m] = Partial();
    }
  }
  // Tables: mat's where it keeps them, else vec's for the columns, else chunks.
  auto table = [&](int64_t t, const Placements& p) -> ShardTable {
    std::vector<int64_t> dims;
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      if (p[m].is_shard(t)) dims.push_back(m);
    if (dims.empty()) return {};
    if (mat->mesh_dims_sharding(t) == dims) return mat->shard_table(t);
    if (t == 1 && vec && vec->mesh_dims_sharding(0) == dims) return vec->shard_table(0);
    return chunk_table(mesh, p, t, mat->sizes()[t]);
  };
  const ShardTable rows = table(0, pm), cols = table(1, pm);
  auto mat_t = std::make_shared<DTensorSpec>(mesh, pm, mat->sizes(), mat->dtype(),
                                             std::vector<ShardTable>{rows, cols});
  auto out = std::make_shared<DTensorSpec>(mesh, po, std::vector<int64_t>{mat->sizes()[0]},
                                           mat->dtype(), std::vector<ShardTable>{rows});
  OpPlan plan(call);
  plan.input("mat", mat_t).output(out);
  if (vec)
    plan.input("vec", std::make_shared<DTensorSpec>(mesh, pv, vec->sizes(), vec->dtype(),
                                                    std::vector<ShardTable>{cols}));
  if (const auto* self = call.spec("self")) plan.input("self", align_to(*out, *self, true));
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::addmv", "aten::addmv_", "aten::addmv.out"})
    register_rule(op, addmv_rule);
}};

}  // namespace

}  // namespace tessera::ops
