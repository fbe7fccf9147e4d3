#pragma once
// Layout helpers shared by the rule families: dims made whole (the dim-wise, sorting, scan,
// window, indexing and distance rules), results resized or reduced along them, a
// distributed or plain tensor cut to a layout, and broadcast shapes. Family files include
// this header, never one another's.
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/ops/rule.h"
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

// The shape `a` and `b` broadcast to (right-aligned, as ATen broadcasts); an error naming
// `who` (an op, or a described call) where they do not broadcast.
std::vector<int64_t> broadcast_shapes(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                                      const std::string& who);

}  // namespace tessera::ops
