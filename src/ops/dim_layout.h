#pragma once
// Layout helpers shared by the rule families: dims made whole (scans, sorting, reorder,
// diagonal, ... , adaptive max pooling, im2col, prelu, advanced indexing), results resized or
// reduced along them, a distributed or plain tensor cut to a layout, and broadcast shapes.
// Family files include this header, never one another's.
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/WrapDimMinimal.h>

#include "tessera/tensor/rule.h"
#include "tessera/placement/spec.h"

namespace tessera::ops {

// `in`'s layout with `dims` whole on every rank (see NOTE: [Dim-wise ops] in dim_layout.cpp): a
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

// An op's results after KernelCall::call_op(), read by the schema's return names (nll_loss's
// "total_weight"), or the only result of a single-result op. (Ops whose schema names none
// read KernelCall::stack() in order, saying which is which.)
c10::IValue& result_named(KernelCall& k, const char* name);
c10::IValue& only_result(KernelCall& k);

// The dims a reduction's `dim` argument names (int, int[] or optional; absent, None or an
// empty list: every dim), one flag per dim of an `nd`-dim input, and its `keepdim` flag.
struct ReducedDims {
  std::vector<bool> dims;
  bool keepdim = false;
  std::vector<int64_t> list() const;
};
ReducedDims reduced_dims_arg(const OpCall& call, int64_t nd);

// ---- dim-wise rules (NOTE: [Dim-wise ops]) ----------------------------------------------

inline int64_t wrap_dim(int64_t d, int64_t nd) { return c10::maybe_wrap_dim(d, nd); }

// The spec of the op's `self` (every dim-wise op has one, distributed).
const DTensorSpec& self_of(const OpCall& call);

// A layout with new global sizes (dims that change size must be unsharded in `like`).
SpecPtr resized(const DTensorSpec& like, std::vector<int64_t> sizes);

// `like` with unsharded `dim` reduced: kept with size 1, or removed (later dims renumbered).
SpecPtr reduced(const DTensorSpec& like, int64_t dim, bool keepdim);

// `self` made whole along `dims`; every return gets `out` (the redistributed input if null).
OpPlan along(const OpCall& call, const std::vector<int64_t>& dims, SpecPtr out = nullptr);

// The rule of ops along one `dim` whose results have the input's shape (sort, _safe_softmax):
// `dim` whole.
OpPlan along_dim(const OpCall& call);

// A backward op that builds its result of `input_sizes`: the gradient laid out as `grad`, the
// result as `out`, and the op run with the local sizes of its shard of the result.
OpPlan with_local_sizes(const OpCall& call, const char* grad_name, SpecPtr grad, SpecPtr out);

// Every input gathered; replicated results of whatever shape the op gives (diag, a
// broadcasting linalg_cross).
OpPlan computed_replicated(const OpCall& call);

// Ops over the trailing dims that keep the batch dims' shards (adaptive max pooling, pixel /
// channel shuffle, im2col / col2im): `self` made whole on its last `k` dims; `results`
// results whose last dims have `trailing_sizes`.
OpPlan trailing(const OpCall& call, int64_t k, const std::vector<int64_t>& trailing_sizes,
                size_t results = 1);

// The sizes of the last `k` dims of `s`.
std::vector<int64_t> last_sizes(const DTensorSpec& s, int64_t k);

}  // namespace tessera::ops
