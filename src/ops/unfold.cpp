// Tensor.unfold(dimension, size, step): the windows along one dim as a new last dim, and its
// backward. The windowed dim is whole, the other dims keep their shards (NOTE: [Dim-wise ops]).
#include <algorithm>
#include <vector>

#include <c10/util/Exception.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// unfold(self, dimension, size, step): `dimension` whole, resized to the window count; the
// windows are a new last dim.
OpPlan unfold_rule(const OpCall& call) {
  const auto& self = self_of(call);
  TORCH_CHECK(self.ndim() > 0, "tessera: ", call.describe(), ": unfold of a 0-dim tensor");
  const int64_t d = wrap_dim(call.arg<int64_t>("dimension"), self.ndim());
  const int64_t size = call.arg<int64_t>("size"), step = call.arg<int64_t>("step");
  TORCH_CHECK(size <= self.sizes()[d] && step > 0, "tessera: ", call.describe(), ": window ", size,
              " with step ", step, " does not fit dim ", d, " of size ", self.sizes()[d]);
  auto in = whole_along(self, {d});
  auto sizes = in->sizes();
  sizes[d] = (sizes[d] - size) / step + 1;
  sizes.push_back(size);
  auto tables = in->shard_tables();
  tables.emplace_back();
  return along(
      call, {d},
      std::make_shared<DTensorSpec>(in->mesh(), in->placements(), sizes, in->dtype(), tables));
}

// unfold_backward(grad_in, input_sizes, dim, size, step): the window dims whole; the result
// drops the last dim.
OpPlan unfold_backward_rule(const OpCall& call) {
  const auto* g = call.spec("grad_in");
  TORCH_INTERNAL_ASSERT(g, call.describe());
  const auto input_sizes = call.arg<std::vector<int64_t>>("input_sizes");
  const int64_t nd = static_cast<int64_t>(input_sizes.size());
  const int64_t d = wrap_dim(call.arg<int64_t>("dim"), std::max<int64_t>(nd, 1));
  auto in = whole_along(*g, {d, g->ndim() - 1});
  auto tables = in->shard_tables();
  tables.pop_back();
  return with_local_sizes(call, "grad_in", in,
                          std::make_shared<DTensorSpec>(in->mesh(), in->placements(), input_sizes,
                                                        in->dtype(), tables));
}

const RuleRegistrar registrar{[] {
  register_rule("aten::unfold", unfold_rule);
  register_rule("aten::unfold_backward", unfold_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
