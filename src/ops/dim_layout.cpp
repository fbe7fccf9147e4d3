#include "dim_layout.h"

#include <algorithm>

#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>

#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::ops {

SpecPtr whole_along(const DTensorSpec& in, const std::vector<int64_t>& dims, bool keep_partial) {
  const int64_t nd = in.ndim();
  std::vector<bool> touched(nd, false), sharded(nd, false), changed(nd, false);
  for (int64_t d : dims) touched[c10::maybe_wrap_dim(d, nd)] = true;
  Placements p = in.placements();
  for (const auto& x : p)
    if (x.is_shard() && !touched[x.dim()]) sharded[x.dim()] = true;
  for (auto& x : p) {
    if (x.is_partial() && !keep_partial) x = Replicate();
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

at::Tensor local_as(const at::Tensor& t, const DTensorSpec& target) {
  auto spec = std::make_shared<DTensorSpec>(target.mesh(), target.placements(), target.sizes(),
                                            t.scalar_type(), target.shard_tables());
  if (is_dtensor(t)) {
    const auto* d = dtensor_impl(t);
    return *d->spec_ptr() == *spec ? d->local()
                                   : redistribute_local(d->local(), d->spec_ptr(), spec);
  }
  at::Tensor block = t;
  const auto off = spec->local_offsets(), len = spec->local_sizes();
  for (int64_t i = 0; i < spec->ndim(); ++i) block = block.narrow(i, off[i], len[i]);
  return block;
}

std::vector<int64_t> broadcast_shapes(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                                      const std::string& who) {
  const size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n, 1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TORCH_CHECK(x == y || x == 1 || y == 1, "tessera: ", who, ": shapes ", shape_str(a), " and ",
                shape_str(b), " do not broadcast");
    out[i] = x == 1 ? y : x;
  }
  return out;
}

}  // namespace tessera::ops
