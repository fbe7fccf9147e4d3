// Fractional max pooling (nn::FractionalMaxPool2d / 3d) with given samples, and its backward.
//
// fractional_max_pool2d(self [N, C, H, W] or [C, H, W], kernel_size, output_size,
// random_samples [N, C, 2]) -> (output, indices): each (sample, channel) plane is pooled on
// its own, with its own pair of random offsets, so the batch and channel dims may stay
// sharded while the pooled dims are whole. The samples are sharded like self's batch and
// channel dims (a local slice of whole samples: no communication), and the output and the
// indices (positions within each plane) take self's layout with the pooled sizes. The
// backward keeps grad_output, self and indices on that layout. A rank whose shard is empty
// returns empty results (the kernels refuse empty input).
#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

// self with its last `pooled` dims whole and no Partial (max is not linear).
SpecPtr planes_layout(const DTensorSpec& self, int64_t pooled) {
  const int64_t first_pooled = self.ndim() - pooled;
  return std::make_shared<DTensorSpec>(
      self.replicate_where([first_pooled](int64_t, const Placement& x) {
        return x.is_partial() || (x.is_shard() && x.dim() >= first_pooled);
      }));
}

// A tensor whose leading dims are self's leading (batch, channel) dims, right-aligned: the
// samples [N, C, k] of a 3-D self [C, ...] have N = 1 unsharded.
SpecPtr follow_planes(const DTensorSpec& planes, int64_t pooled, std::vector<int64_t> sizes,
                      int64_t lead_of_other, c10::ScalarType dtype) {
  const int64_t lead = planes.ndim() - pooled;
  Placements p = planes.placements();
  std::vector<ShardTable> tables(sizes.size());
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    const int64_t t = x.dim() + (lead_of_other - lead);
    tables[t] = planes.shard_table(x.dim());
    x = Shard(t);
  }
  return std::make_shared<DTensorSpec>(planes.mesh(), p, std::move(sizes), dtype,
                                       std::move(tables));
}

// The same layout with the pooled dims resized to `pooled_sizes`.
SpecPtr with_pooled_sizes(const DTensorSpec& planes, const std::vector<int64_t>& pooled_sizes,
                          c10::ScalarType dtype) {
  auto sizes = planes.sizes();
  const size_t lead = sizes.size() - pooled_sizes.size();
  for (size_t i = 0; i < pooled_sizes.size(); ++i) sizes[lead + i] = pooled_sizes[i];
  return std::make_shared<DTensorSpec>(planes.mesh(), planes.placements(), std::move(sizes), dtype,
                                       planes.shard_tables());
}

bool empty_here(const DTensorSpec& s) {
  for (int64_t n : s.local_sizes())
    if (n == 0) return true;
  return false;
}

template <int64_t Pooled>
OpPlan fractional_pool_rule(const OpCall& call) {
  TORCH_CHECK(call.spec("self"), "tessera: ", call.describe(), ": the input must be distributed");
  const auto& self = *call.spec("self");
  auto in = planes_layout(self, Pooled);
  const auto output_size = call.arg<std::vector<int64_t>>("output_size");
  auto out = with_pooled_sizes(*in, output_size, in->dtype());
  auto idx = with_pooled_sizes(*in, output_size, c10::kLong);
  OpPlan plan(call);
  plan.input("self", in).output(out).output(idx);
  if (const auto* samples = call.spec("random_samples"))
    plan.input("random_samples", follow_planes(*in, Pooled, samples->sizes(), 2, samples->dtype()));
  if (empty_here(*in)) {
    const auto out_local = out->local_sizes();
    plan.local_kernel = [out_local](KernelCall& k) {
      const at::Tensor x = k.tensor("self");
      k.finish(
          {at::empty(out_local, x.options()), at::empty(out_local, x.options().dtype(c10::kLong))});
    };
  }
  return plan;
}

// fractional_max_pool{2,3}d_backward(grad_output, self, kernel_size, output_size, indices).
template <int64_t Pooled>
OpPlan fractional_pool_backward_rule(const OpCall& call) {
  TORCH_CHECK(call.spec("self"), "tessera: ", call.describe(), ": the input must be distributed");
  auto in = planes_layout(*call.spec("self"), Pooled);
  const auto output_size = call.arg<std::vector<int64_t>>("output_size");
  OpPlan plan(call);
  plan.input("self", in).output(in);
  if (const auto* g = call.spec("grad_output"))
    plan.input("grad_output", with_pooled_sizes(*in, output_size, g->dtype()));
  if (const auto* i = call.spec("indices"))
    plan.input("indices", with_pooled_sizes(*in, output_size, i->dtype()));
  if (empty_here(*in)) {
    plan.local_kernel = [](KernelCall& k) { k.finish({at::zeros_like(k.tensor("self"))}); };
  }
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::fractional_max_pool2d", fractional_pool_rule<2>);
  register_rule("aten::fractional_max_pool3d", fractional_pool_rule<3>);
  register_rule("aten::fractional_max_pool2d_backward", fractional_pool_backward_rule<2>);
  register_rule("aten::fractional_max_pool3d_backward", fractional_pool_backward_rule<3>);
}};

}  // namespace

}  // namespace tessera::ops
