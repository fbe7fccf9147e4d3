// Interpolation (upsample_nearest / linear / bilinear / trilinear, with and without
// align_corners, by size or scale factor) on inputs sharded along any dims.
// Batch and channel shards stay. Sharded spatial dims take the window path (NOTE: [Window
// ops on sharded spatial dims]): each output row reads one (nearest) or two (linear) input
// rows given by ATen's source-index formulas, so a rank fetches the rows its outputs read
// and blends them with the same weights; interpolation is separable, so dims are applied one
// after another. Backward scatters each gradient onto its source rows and sends halo rows
// home. The backward ops carry only the output's layout: the input table is the one whose
// outputs give that layout (the forward's, in the usual case).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "window_internal.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

using spatial::Axis;
using spatial::DimCut;
using spatial::Window;

struct Interp {
  size_t nsp = 0;
  bool linear = false, align_corners = false;
  std::vector<int64_t> in, out;  // spatial sizes
  std::vector<double> scales;    // per dim; <= 0: none
};

// The activation: `self`, but `input` in the .vec overloads.
const char* activation(const OpCall& call) { return call.has("self") ? "self" : "input"; }

// The per-dim scale arguments of the non-.vec overloads.
std::vector<const char*> scale_names(size_t nsp) {
  switch (nsp) {
    case 1: return {"scales"};
    case 2: return {"scales_h", "scales_w"};
    default: return {"scales_d", "scales_h", "scales_w"};
  }
}

// Reads both the per-dim ("scales_h") and the .vec ("scale_factors") forms, forward
// (self / input, output_size, [align_corners,] scales...) and backward (grad_output,
// output_size, input_size, [align_corners,] scales...).
Interp parse(const OpCall& call, const std::vector<int64_t>& input_shape) {
  Interp p;
  const std::string& name = call.name();
  p.linear = name.find("linear") != std::string::npos;
  p.nsp = name.find("3d") != std::string::npos ? 3 : name.find("2d") != std::string::npos ? 2 : 1;
  if (p.linear) p.align_corners = call.arg<bool>("align_corners");
  p.in.assign(input_shape.end() - static_cast<int64_t>(p.nsp), input_shape.end());
  p.scales.assign(p.nsp, 0.0);
  if (call.has("scale_factors")) {
    if (auto f = call.arg<c10::optional<std::vector<double>>>("scale_factors"))
      for (size_t d = 0; d < p.nsp; ++d) p.scales[d] = f->size() == 1 ? (*f)[0] : (*f)[d];
  } else {
    const auto names = scale_names(p.nsp);
    for (size_t d = 0; d < p.nsp; ++d)
      if (auto s = call.arg<c10::optional<double>>(names[d])) p.scales[d] = *s;
  }
  if (auto os = call.arg<c10::optional<std::vector<int64_t>>>("output_size")) {
    p.out = *os;
  } else {
    for (size_t d = 0; d < p.nsp; ++d)
      p.out.push_back(static_cast<int64_t>(std::floor(static_cast<double>(p.in[d]) * p.scales[d])));
  }
  return p;
}

std::vector<Axis> axes_of(const Interp& p) {
  std::vector<Axis> axes;
  for (size_t d = 0; d < p.nsp; ++d)
    axes.push_back(p.linear ? Axis::linear(p.in[d], p.out[d], p.align_corners, p.scales[d])
                            : Axis::nearest(p.in[d], p.out[d], p.scales[d]));
  return axes;
}

struct Taps {
  at::Tensor i0, i1, w0, w1;  // window-relative indices and weights of the rank's outputs
};
Taps taps_of(const DimCut& c, int64_t ndim, const at::TensorOptions& opts) {
  const Window mine = c.my_outputs();
  const Window win = c.axis.reads(mine.lo, mine.hi);
  std::vector<int64_t> i0, i1;
  std::vector<double> w0, w1;
  for (int64_t o = mine.lo; o < mine.hi; ++o) {
    const auto t = c.axis.taps(o);
    i0.push_back(t.i0 - win.lo);
    i1.push_back(t.i1 - win.lo);
    w0.push_back(t.w0);
    w1.push_back(t.w1);
  }
  std::vector<int64_t> shape(ndim, 1);
  shape[c.dim] = static_cast<int64_t>(i0.size());
  auto weights = [&](const std::vector<double>& w) {
    return at::tensor(w, opts.dtype(at::kDouble)).to(opts.dtype()).view(shape);
  };
  return {at::tensor(i0, opts.dtype(at::kLong)), at::tensor(i1, opts.dtype(at::kLong)), weights(w0),
          weights(w1)};
}

// Nearest upsampling by exactly 2 (or 1) along every cut dim, with the rank's outputs
// starting at twice its window's first row: ATen's own kernel on the window gives the same
// rows (its 2x and 1x cases are index shifts), so the gather is not needed.
bool native_nearest(const std::vector<DimCut>& cuts) {
  for (const auto& c : cuts) {
    const auto mine = c.my_outputs();
    const auto win = c.axis.reads(mine.lo, mine.hi);
    if (c.axis.kind != Axis::Kind::Nearest) return false;
    if (!c.cut()) {
      // Whole dims: the window must be the whole input (downsampling may leave rows unread).
      if (win.lo != 0 || win.hi != c.axis.in) return false;
      continue;
    }
    if (mine.size() == 0) return false;
    const bool twice =
        c.axis.out == 2 * c.axis.in && mine.lo == 2 * win.lo && mine.size() == 2 * win.size();
    const bool same = c.axis.out == c.axis.in && mine.lo == win.lo && mine.size() == win.size();
    if (!twice && !same) return false;
  }
  return true;
}
// Uncut dims keep the op's scales (same sizes as one device); cut dims need none.
std::vector<c10::optional<double>> native_scales(const std::vector<DimCut>& cuts) {
  std::vector<c10::optional<double>> s;
  for (const auto& c : cuts)
    s.push_back(!c.cut() && c.axis.scale > 0 ? c10::optional<double>(c.axis.scale) : c10::nullopt);
  return s;
}
std::vector<int64_t> local_out_sizes(const std::vector<DimCut>& cuts) {
  std::vector<int64_t> o;
  for (const auto& c : cuts) o.push_back(c.my_outputs().size());
  return o;
}
at::Tensor nearest_native(const at::Tensor& x, const std::vector<DimCut>& cuts) {
  const auto sc = native_scales(cuts);
  const auto out = local_out_sizes(cuts);
  switch (cuts.size()) {
    case 1: return at::upsample_nearest1d(x, out, sc[0]);
    case 2: return at::upsample_nearest2d(x, out, sc[0], sc[1]);
    default: return at::upsample_nearest3d(x, out, sc[0], sc[1], sc[2]);
  }
}
at::Tensor nearest_native_backward(const at::Tensor& g, const std::vector<int64_t>& window_shape,
                                   const std::vector<DimCut>& cuts) {
  const auto sc = native_scales(cuts);
  const auto out = local_out_sizes(cuts);
  switch (cuts.size()) {
    case 1: return at::upsample_nearest1d_backward(g, out, window_shape, sc[0]);
    case 2: return at::upsample_nearest2d_backward(g, out, window_shape, sc[0], sc[1]);
    default: return at::upsample_nearest3d_backward(g, out, window_shape, sc[0], sc[1], sc[2]);
  }
}

void forward_kernel(KernelCall& kc, const DeviceMesh& mesh, const char* act,
                    const std::vector<DimCut>& cuts, bool linear) {
  at::Tensor y = spatial::fetch(mesh, kc.tensor(act), cuts, spatial::HaloBoundary::Zeros);
  if (!linear && native_nearest(cuts) && y.numel() > 0) {
    kc.finish({nearest_native(y, cuts)});
    return;
  }
  for (const auto& c : cuts) {
    const auto t = taps_of(c, y.dim(), y.options());
    at::Tensor z = y.index_select(c.dim, t.i0);
    y = linear ? z * t.w0 + y.index_select(c.dim, t.i1) * t.w1 : z;
  }
  kc.finish({y});
}

void backward_kernel(KernelCall& kc, const DeviceMesh& mesh, const std::vector<DimCut>& cuts,
                     bool linear) {
  at::Tensor g = kc.tensor("grad_output");
  if (!linear && native_nearest(cuts) && g.numel() > 0) {
    auto shape = g.sizes().vec();
    for (const auto& c : cuts)
      shape[c.dim] = c.axis.reads(c.my_outputs().lo, c.my_outputs().hi).size();
    kc.finish({spatial::fetch_backward(mesh, nearest_native_backward(g, shape, cuts), cuts,
                                       spatial::HaloBoundary::Zeros)});
    return;
  }
  for (auto it = cuts.rbegin(); it != cuts.rend(); ++it) {
    const auto& c = *it;
    const auto t = taps_of(c, g.dim(), g.options());
    auto shape = g.sizes().vec();
    shape[c.dim] = c.axis.reads(c.my_outputs().lo, c.my_outputs().hi).size();
    at::Tensor h = at::zeros(shape, g.options());
    h.index_add_(c.dim, t.i0, linear ? g * t.w0 : g);
    if (linear) h.index_add_(c.dim, t.i1, g * t.w1);
    g = h;
  }
  kc.finish({spatial::fetch_backward(mesh, g, cuts, spatial::HaloBoundary::Zeros)});
}

OpPlan upsample_rule(const OpCall& call) {
  const char* act = activation(call);
  const auto& in = *call.spec(act);
  const Interp p = parse(call, in.sizes());
  const auto dims = spatial::trailing_dims(in.ndim(), p.nsp);
  auto layout = spatial::window_layout(in, dims, /*keep_others=*/true);
  const auto cuts = spatial::make_cuts(*layout, dims, axes_of(p));
  OpPlan plan(call);
  plan.input(act, layout);
  plan.output(spatial::output_spec(*layout, cuts, in.dtype()));
  if (spatial::any_window_dim_sharded(*layout, dims)) {
    plan.distributed_kernel = [act, cuts, linear = p.linear](KernelCall& kc,
                                                             const DeviceMesh& mesh) {
      forward_kernel(kc, mesh, act, cuts, linear);
    };
  }
  return plan;
}

// (grad_output, output_size, input_size, ...): the input's layout follows from grad_output's.
OpPlan upsample_backward_rule(const OpCall& call) {
  const auto& g = *call.spec("grad_output");
  const auto input_shape = call.arg<std::vector<int64_t>>("input_size");
  const Interp p = parse(call, input_shape);
  const auto dims = spatial::trailing_dims(g.ndim(), p.nsp);
  const auto axes = axes_of(p);
  auto glayout = spatial::window_layout(g, dims, /*keep_others=*/true);
  // The input table per cut dim: the one whose outputs are grad_output's table (if none
  // exists, the chunk layout, and grad_output is redistributed to match).
  auto tables = glayout->shard_tables();
  for (size_t k = 0; k < dims.size(); ++k) {
    if (tables[dims[k]].empty()) continue;
    auto t = spatial::input_sizes_for(axes[k], tables[dims[k]]);
    tables[dims[k]] =
        t.empty() ? chunk_sizes(p.in[k], static_cast<int64_t>(tables[dims[k]].size())) : t;
  }
  auto layout = std::make_shared<DTensorSpec>(g.mesh(), glayout->placements(), input_shape,
                                              g.dtype(), tables);
  const auto cuts = spatial::make_cuts(*layout, dims, axes);
  OpPlan plan(call);
  plan.input("grad_output", spatial::output_spec(*layout, cuts, g.dtype()));
  plan.output(layout);
  // Always the window kernel: the op's input_size argument is global, the batch may not be.
  plan.distributed_kernel = [cuts, linear = p.linear](KernelCall& kc, const DeviceMesh& mesh) {
    backward_kernel(kc, mesh, cuts, linear);
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op :
       {"aten::upsample_nearest1d", "aten::upsample_nearest2d", "aten::upsample_nearest3d",
        "aten::upsample_linear1d", "aten::upsample_bilinear2d", "aten::upsample_trilinear3d",
        "aten::upsample_nearest1d.vec", "aten::upsample_nearest2d.vec",
        "aten::upsample_nearest3d.vec", "aten::upsample_linear1d.vec",
        "aten::upsample_bilinear2d.vec", "aten::upsample_trilinear3d.vec"})
    register_rule(op, upsample_rule);
  for (const char* op :
       {"aten::upsample_nearest1d_backward", "aten::upsample_nearest2d_backward",
        "aten::upsample_nearest3d_backward", "aten::upsample_linear1d_backward",
        "aten::upsample_bilinear2d_backward", "aten::upsample_trilinear3d_backward",
        "aten::upsample_nearest1d_backward.vec", "aten::upsample_nearest2d_backward.vec",
        "aten::upsample_nearest3d_backward.vec", "aten::upsample_linear1d_backward.vec",
        "aten::upsample_bilinear2d_backward.vec", "aten::upsample_trilinear3d_backward.vec"})
    register_rule(op, upsample_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
