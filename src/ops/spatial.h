#pragma once
// Shared machinery of the domain-parallel (window) rules: convolution, pooling,
// interpolation and padding on inputs sharded along spatial dims.
//
// NOTE: [Window ops on sharded spatial dims]
// Along each spatial dim a window op maps input rows to output rows (an Axis). Two questions
// decide a distributed window op:
//  - Who computes output o? The owner of input row source_row(o) (clamped into the domain):
//    the input row at the centre of o's window. Output shards then line up with input shards
//    ("same" convolution keeps the table, pooling by 2 halves it, upsampling by 2 doubles it,
//    so U-Net skip connections meet without communication), and they come out uneven
//    wherever the input is, or wherever a stride does not divide the offsets.
//  - What does a rank read? reads(lo, hi): the input rows its outputs [lo, hi) touch. These
//    can reach into neighbours (the halo), past neighbours (thin shards: rows are fetched
//    from whoever owns them), or past the domain (padding, filled per the boundary rule).
// The local op then runs on the fetched window with zero padding and exactly reproduces the
// global op's outputs for the rank's range. Dims are fetched one after another, each time
// from the already extended tensor, so corner rows arrive without diagonal messages.
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/comm/halo.h"
#include "tessera/placement/spec.h"

namespace tessera::ops::spatial {

using comm::HaloBoundary;
using comm::Window;

int64_t floor_div(int64_t a, int64_t b);
int64_t ceil_div(int64_t a, int64_t b);
// The last n dims of an ndim-dim tensor (the spatial dims of a window op).
std::vector<int64_t> trailing_dims(int64_t ndim, size_t n);
// A per-dim argument as ATen spells it (one value for every dim, or none: `if_empty`).
std::vector<int64_t> per_dim(std::vector<int64_t> v, size_t n, std::vector<int64_t> if_empty = {});

// How one spatial dim of a window op maps input rows [0, in) to output rows [0, out).
struct Axis {
  enum class Kind : uint8_t { Stencil, Transposed, Nearest, Linear };
  Kind kind = Kind::Stencil;
  int64_t in = 0, out = 0;
  // Stencil: output o reads input rows o*stride - pad + dilation*j, j < kernel (conv, pooling,
  // padding with kernel 1). Transposed: input i writes outputs i*stride - pad + dilation*j.
  int64_t kernel = 1, stride = 1, pad = 0, dilation = 1;
  // Nearest / Linear (interpolation): the source coordinate scale, as ATen computes it.
  bool align_corners = false;
  double scale = 1.0;  // <= 0: in / out

  static Axis stencil(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad,
                      int64_t dilation);
  static Axis transposed(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad,
                         int64_t dilation);
  static Axis nearest(int64_t in, int64_t out, double scale);
  static Axis linear(int64_t in, int64_t out, bool align_corners, double scale);

  // The input row whose owner computes output o (may be outside [0, in): clamp it).
  int64_t source_row(int64_t o) const;
  // The input rows outputs [lo, hi) read (empty when hi <= lo).
  Window reads(int64_t lo, int64_t hi) const;
  // Interpolation: the one or two source rows of output o and their weights.
  struct Taps {
    int64_t i0, i1;
    double w0, w1;
  };
  Taps taps(int64_t o) const;
  std::string str() const;
};

// Output sizes per member when member m holds in_sizes[m] input rows.
std::vector<int64_t> output_sizes(const Axis& axis, const std::vector<int64_t>& in_sizes);
// An input table whose outputs are exactly `out_sizes` (for backward ops that get only the
// output's layout), or an empty table when none exists.
std::vector<int64_t> input_sizes_for(const Axis& axis, const std::vector<int64_t>& out_sizes);
// Every member's window: the input rows its outputs read.
std::vector<Window> read_windows(const Axis& axis, const std::vector<int64_t>& out_sizes);

// One spatial dim as a rank sees it: whether (and over which mesh dim) it is cut, every
// member's input and output rows, and this rank's place among them. An uncut dim is a
// group of one, so every dim takes the same path.
struct DimCut {
  int64_t dim = 0;       // tensor dim
  int64_t mesh_dim = -1;  // -1: not cut
  Axis axis;
  std::vector<int64_t> in_sizes, out_sizes;  // per member
  int64_t me = 0;                            // this rank's index in the group

  bool cut() const { return mesh_dim >= 0; }
  int64_t in_offset(int64_t m) const;
  int64_t out_offset(int64_t m) const;
  Window my_inputs() const { return {in_offset(me), in_offset(me) + in_sizes[me]}; }
  Window my_outputs() const { return {out_offset(me), out_offset(me) + out_sizes[me]}; }
};

// The layout a window op takes its activation in: each of `window_dims` keeps a shard over
// one mesh dim (the outermost, when several nest); other dims keep their shards when
// `keep_others` (ops that act per channel: pooling, interpolation, padding), otherwise only
// batch (dim 0) does (convolution mixes channels); Partial becomes Replicate.
SpecPtr window_layout(const DTensorSpec& s, const std::vector<int64_t>& window_dims,
                      bool keep_others = false);
// True when some window dim is sharded (the op needs the window path at all).
bool any_window_dim_sharded(const DTensorSpec& s, const std::vector<int64_t>& window_dims);

// The cuts of `layout` (a window_layout) for these dims and axes, from this rank's view.
std::vector<DimCut> make_cuts(const DTensorSpec& layout, const std::vector<int64_t>& window_dims,
                              const std::vector<Axis>& axes);
// The output spec: layout's placements, window dims resized to the axes' outputs with the
// output tables; `channels` (>= 0) replaces dim 1's size.
SpecPtr output_spec(const DTensorSpec& layout, const std::vector<DimCut>& cuts,
                    c10::ScalarType dtype, int64_t channels = -1);

// Fetches, dim after dim, the rows this rank's outputs read (its read windows). `mesh`
// provides the groups of cut dims.
at::Tensor fetch(const DeviceMesh& mesh, const at::Tensor& x, const std::vector<DimCut>& cuts,
                 HaloBoundary boundary, double fill = 0.0);
// The adjoint of fetch: sends every window row's gradient home (in reverse dim order).
at::Tensor fetch_backward(const DeviceMesh& mesh, const at::Tensor& grad_window,
                          const std::vector<DimCut>& cuts, HaloBoundary boundary);

// Generic windowed fetch with explicit windows per member and dim (e.g. of gradients in
// output space). sizes[k] / windows[k] are per member for cuts[k].
at::Tensor fetch_ranges(const DeviceMesh& mesh, const at::Tensor& x, const std::vector<DimCut>& cuts,
                        const std::vector<std::vector<int64_t>>& sizes,
                        const std::vector<std::vector<Window>>& windows);

// x's rows [from.lo, from.hi) along dim placed into rows [to.lo, to.hi) of a tensor of
// zeros: rows of `to` outside `from` are zero, rows of `from` outside `to` are dropped
// (a view of x when `to` lies inside `from`).
at::Tensor place(const at::Tensor& x, int64_t dim, Window from, Window to);

}  // namespace tessera::ops::spatial
