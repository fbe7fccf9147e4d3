// Ops that move or copy elements to other places: flip, roll, repeat, pixel (un)shuffle and
// channel_shuffle. The dims whose elements move are whole, the other dims keep their shards
// (NOTE: [Dim-wise ops]); the shuffles work on the trailing (channel and spatial) dims, the
// batch dims keep theirs.
#include <c10/util/Exception.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

std::vector<int64_t> every_dim(const DTensorSpec& s) {
  std::vector<int64_t> all(static_cast<size_t>(s.ndim()));
  for (size_t t = 0; t < all.size(); ++t) all[t] = static_cast<int64_t>(t);
  return all;
}

// flip(dims); roll(shifts, dims) with no dims rolls the flattened tensor: every dim whole.
OpPlan along_dims(const OpCall& call) {
  auto dims = call.arg<std::vector<int64_t>>("dims");
  if (dims.empty()) dims = every_dim(self_of(call));
  return along(call, dims);
}

// repeat(self, repeats): dims repeated more than once are whole (a shard would have to appear
// at several places); the others keep their shards; new leading dims are unsharded.
OpPlan repeat_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const auto repeats = call.arg<std::vector<int64_t>>("repeats");
  const int64_t nd = self.ndim(), lead = static_cast<int64_t>(repeats.size()) - nd;
  TORCH_CHECK(lead >= 0, "tessera: ", call.describe(), ": ", repeats.size(), " repeats for a ", nd,
              "-dim tensor");
  std::vector<int64_t> dims;
  for (int64_t t = 0; t < nd; ++t)
    if (repeats[lead + t] != 1) dims.push_back(t);
  auto in = whole_along(self, dims);
  Placements p = in->placements();
  for (auto& x : p)
    if (x.is_shard()) x = Shard(x.dim() + lead);
  std::vector<int64_t> sizes(repeats.begin(), repeats.begin() + lead);
  std::vector<ShardTable> tables(lead);
  for (int64_t t = 0; t < nd; ++t) {
    sizes.push_back(in->sizes()[t] * repeats[lead + t]);
    tables.push_back(in->shard_table(t));
  }
  return along(call, dims,
               std::make_shared<DTensorSpec>(in->mesh(), p, sizes, in->dtype(), tables));
}

// pixel_shuffle(self, upscale_factor): [..., C r^2, H, W] -> [..., C, H r, W r]
OpPlan pixel_shuffle_rule(const OpCall& call) {
  const int64_t r = call.arg<int64_t>("upscale_factor");
  auto s = last_sizes(self_of(call), 3);
  return trailing(call, 3, {s[0] / (r * r), s[1] * r, s[2] * r});
}

// pixel_unshuffle(self, downscale_factor): [..., C, H, W] -> [..., C r^2, H / r, W / r]
OpPlan pixel_unshuffle_rule(const OpCall& call) {
  const int64_t r = call.arg<int64_t>("downscale_factor");
  auto s = last_sizes(self_of(call), 3);
  return trailing(call, 3, {s[0] * r * r, s[1] / r, s[2] / r});
}

// channel_shuffle(self, groups): [N, C, ...] with C and the planes whole.
OpPlan channel_shuffle_rule(const OpCall& call) {
  const auto& self = self_of(call);
  return trailing(call, self.ndim() - 1, last_sizes(self, self.ndim() - 1));
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::flip", "aten::roll"}) register_rule(op, along_dims);
  register_rule("aten::repeat", repeat_rule);
  register_rule("aten::pixel_shuffle", pixel_shuffle_rule);
  register_rule("aten::pixel_unshuffle", pixel_unshuffle_rule);
  register_rule("aten::channel_shuffle", channel_shuffle_rule);
}};

}  // namespace

}  // namespace tessera::ops
