#pragma once
// The window toolkit: what convolution, pooling, interpolation and padding share on inputs
// sharded along spatial dims, published so that a new window op can be added from outside
// the tree (a rule plus a distributed kernel, see NOTE: [How to add an op] in rule.h).
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
//
// A window op, in outline:
//   rule:   layout = window_layout(in, dims, keep_others);
//           cuts = make_cuts(*layout, dims, axes);  // one Axis per window dim
//           plan.input("self", layout); plan.output(output_spec(*layout, cuts, dtype));
//           if (any_window_dim_sharded(*layout, dims)) plan.distributed_kernel = ...;
//   kernel: window = fetch(mesh, local_input, cuts, boundary);  // the rows my outputs read
//           run the local op on `window` without padding; backward: fetch_backward.
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/comm/halo.h"
#include "tessera/placement/spec.h"

namespace tessera::ops::spatial {

using comm::HaloBoundary;
using comm::Window;

// The last n dims of an ndim-dim tensor (the spatial dims of a window op).
std::vector<int64_t> trailing_dims(int64_t ndim, size_t n);

// NOTE: [Axis maps are an open set]
// An axis map answers the two questions above for one spatial dim. The built-in kinds cover
// convolution, transposed convolution, pooling, padding and interpolation; any other window
// op describes its rows by implementing AxisMap (neighbourhood attention's clamped windows
// are one, src/ops/window/neighborhood_attention.cpp) and gets the shard tables, the exact
// halos, fetch and its adjoint from this toolkit unchanged.
struct AxisMap {
  virtual ~AxisMap() = default;
  // The input row whose owner computes output o (clamped into the domain by the caller).
  virtual int64_t source_row(int64_t o) const = 0;
  // The input rows outputs [lo, hi) read; may reach outside [0, in) (the boundary rule of the
  // fetch fills those rows). Must be monotone: a wider output range never reads less.
  virtual Window reads(int64_t lo, int64_t hi) const = 0;
  virtual std::string str() const = 0;
};

// How one spatial dim of a window op maps input rows [0, in) to output rows [0, out).
struct Axis {
  enum class Kind : uint8_t { Stencil, Transposed, Nearest, Linear, Custom };
  Kind kind = Kind::Stencil;
  int64_t in = 0, out = 0;
  // Stencil: output o reads input rows o*stride - pad + dilation*j, j < kernel (conv, pooling,
  // padding with kernel 1). Transposed: input i writes outputs i*stride - pad + dilation*j.
  int64_t kernel = 1, stride = 1, pad = 0, dilation = 1;
  // Nearest / Linear (interpolation): the source coordinate scale, as ATen computes it.
  bool align_corners = false;
  double scale = 1.0;  // <= 0: in / out
  // Custom: the map itself.
  std::shared_ptr<const AxisMap> map;

  static Axis stencil(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad,
                      int64_t dilation);
  static Axis transposed(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad,
                         int64_t dilation);
  static Axis nearest(int64_t in, int64_t out, double scale);
  static Axis linear(int64_t in, int64_t out, bool align_corners, double scale);
  static Axis custom(int64_t in, int64_t out, std::shared_ptr<const AxisMap> map);

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

// One spatial dim as a rank sees it: whether (and over which mesh dim) it is cut, every
// member's input and output rows, and this rank's place among them. An uncut dim is a
// group of one, so every dim takes the same path.
struct DimCut {
  int64_t dim = 0;        // tensor dim
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

}  // namespace tessera::ops::spatial
