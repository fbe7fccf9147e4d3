#pragma once
// Layout helpers shared by the rule files that need some dims whole (dimwise.cpp, and the
// indexing and distance rules).
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/placement/spec.h"

namespace tessera::ops {

// `in`'s layout with `dims` whole on every rank (see NOTE: [Dim-wise ops] in dimwise.cpp): a
// mesh dim sharding one of them moves to the largest free dim (one all-to-all), else
// replicates; other shards keep their tables. Partial mesh dims are replicated unless
// `keep_partial` (ops that commute with the reduction of the terms: gathers).
SpecPtr whole_along(const DTensorSpec& in, const std::vector<int64_t>& dims,
                    bool keep_partial = false);

// This rank's shard of `t` laid out as `target` (t's dtype): a distributed tensor is
// redistributed (no autograd), a plain one (a replicated value) is cut to this rank's block.
at::Tensor local_as(const at::Tensor& t, const DTensorSpec& target);

}  // namespace tessera::ops
