#pragma once
// Helpers the built-in window ops share beyond the published toolkit (tessera/ops/window.h).
#include <vector>

#include "tessera/ops/window.h"

namespace tessera::ops::spatial {

// Integer division rounding down / up, for negative numerators too (rows before the domain).
int64_t floor_div(int64_t a, int64_t b);
int64_t ceil_div(int64_t a, int64_t b);
// A per-dim argument as ATen spells it (one value for every dim, or none: `if_empty`).
std::vector<int64_t> per_dim(std::vector<int64_t> v, size_t n, std::vector<int64_t> if_empty = {});

// Output sizes per member when member m holds in_sizes[m] input rows.
std::vector<int64_t> output_sizes(const Axis& axis, const std::vector<int64_t>& in_sizes);
// An input table whose outputs are exactly `out_sizes` (for backward ops that get only the
// output's layout), or an empty table when none exists.
std::vector<int64_t> input_sizes_for(const Axis& axis, const std::vector<int64_t>& out_sizes);
// Every member's window: the input rows its outputs read.
std::vector<Window> read_windows(const Axis& axis, const std::vector<int64_t>& out_sizes);

// Generic windowed fetch with explicit windows per member and dim (e.g. of gradients in
// output space). sizes[k] / windows[k] are per member for cuts[k].
at::Tensor fetch_ranges(const DeviceMesh& mesh, const at::Tensor& x,
                        const std::vector<DimCut>& cuts,
                        const std::vector<std::vector<int64_t>>& sizes,
                        const std::vector<std::vector<Window>>& windows);

// x's rows [from.lo, from.hi) along dim placed into rows [to.lo, to.hi) of a tensor of
// zeros: rows of `to` outside `from` are zero, rows of `from` outside `to` are dropped
// (a view of x when `to` lies inside `from`).
at::Tensor place(const at::Tensor& x, int64_t dim, Window from, Window to);

}  // namespace tessera::ops::spatial
