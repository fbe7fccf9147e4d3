// tril / triu: the lower / upper triangle of the last two dims. Those dims are whole, the
// batch dims keep their shards (NOTE: [Dim-wise ops]).
#include <c10/util/Exception.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// tril / triu: the last two dims.
OpPlan along_last_two(const OpCall& call) {
  TORCH_CHECK(self_of(call).ndim() >= 2, "tessera: ", call.describe(), ": needs 2 or more dims");
  return along(call, {-2, -1});
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::tril", "aten::triu"}) register_rule(op, along_last_two);
}};

}  // namespace

}  // namespace tessera::ops
