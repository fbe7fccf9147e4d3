// Convolution (1-D/2-D/3-D, transposed or not) on inputs sharded along batch and spatial dims.
//
// Batch sharding alone: every sample is independent, the local op is exact.
// Spatial sharding: the window path of NOTE: [Window ops on sharded spatial dims]. Forward
// fetches the input rows the rank's outputs read (halo) and convolves with zero padding.
// Backward fetches instead the *gradient* rows of every output that reads one of the rank's
// input rows (the gradient's halo), which gives both the input gradient of the rank's own
// rows and its exact share of the weight gradient: one exchange per direction, the minimum.
// Weight and bias gradients are Partial(sum) over the batch and spatial mesh dims.
// Channel sharding and Partial inputs are replicated first.
#include <array>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "window_internal.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

using spatial::Axis;
using spatial::DimCut;
using spatial::Window;

struct ConvArgs {
  std::vector<int64_t> stride, padding, dilation, output_padding, kernel;
  bool transposed = false;
  int64_t groups = 1;
  int64_t out_channels = 0;
};

// convolution and convolution_backward name these arguments alike; `w` = the weight's sizes.
ConvArgs conv_args(const OpCall& call, const std::vector<int64_t>& w, size_t nsp) {
  using Ints = std::vector<int64_t>;
  ConvArgs a;
  a.stride = spatial::per_dim(call.arg<Ints>("stride"), nsp);
  a.padding = spatial::per_dim(call.arg<Ints>("padding"), nsp);
  a.dilation = spatial::per_dim(call.arg<Ints>("dilation"), nsp);
  a.transposed = call.arg<bool>("transposed");
  a.output_padding = spatial::per_dim(call.arg<Ints>("output_padding"), nsp);
  a.groups = call.arg<int64_t>("groups");
  a.kernel.assign(w.begin() + 2, w.end());
  a.out_channels = a.transposed ? w[1] * a.groups : w[0];
  return a;
}

std::vector<Axis> conv_axes(const OpCall& call, const std::vector<int64_t>& in_sizes,
                            const ConvArgs& a) {
  std::vector<Axis> axes;
  for (size_t i = 0; i < a.kernel.size(); ++i) {
    const int64_t in = in_sizes[2 + i], k = a.kernel[i], s = a.stride[i], p = a.padding[i],
                  d = a.dilation[i];
    if (a.transposed) {
      const int64_t out = (in - 1) * s - 2 * p + d * (k - 1) + a.output_padding[i] + 1;
      axes.push_back(Axis::transposed(in, out, k, s, p, d));
    } else {
      const int64_t span = in + 2 * p - d * (k - 1) - 1;
      TORCH_CHECK(span >= 0 && s > 0, "tessera: ", call.describe(), ": spatial dim ", 2 + i,
                  " of size ", in, " (padded ", in + 2 * p, ") is smaller than the dilated kernel ",
                  d * (k - 1) + 1);
      axes.push_back(Axis::stencil(in, span / s + 1, k, s, p, d));
    }
  }
  return axes;
}

bool any_empty(const std::vector<DimCut>& cuts, bool outputs) {
  for (const auto& c : cuts)
    if ((outputs ? c.my_outputs() : c.my_inputs()).size() == 0) return true;
  return false;
}

std::vector<int64_t> local_shape(const at::Tensor& x, int64_t channels,
                                 const std::vector<DimCut>& cuts, bool outputs) {
  auto s = x.sizes().vec();
  s[1] = channels;
  for (const auto& c : cuts) s[c.dim] = (outputs ? c.my_outputs() : c.my_inputs()).size();
  return s;
}

// The outputs that read (stencil) or are written by (transposed) input rows [a, b), not
// clipped to the domain: outputs beyond it arrive as zero gradient rows (fill, no bytes),
// which keeps the input margins of the backward symmetric, so they are the op's padding.
Window touched_outputs(const Axis& ax, int64_t a, int64_t b) {
  if (b <= a) return {0, 0};
  const int64_t reach = ax.dilation * (ax.kernel - 1);
  int64_t lo, hi;
  if (ax.kind == Axis::Kind::Transposed) {
    lo = a * ax.stride - ax.pad;
    hi = (b - 1) * ax.stride - ax.pad + reach + 1;
  } else {
    lo = spatial::ceil_div(a + ax.pad - reach, ax.stride);
    hi = spatial::floor_div(b - 1 + ax.pad, ax.stride) + 1;
  }
  return hi > lo ? Window{lo, hi} : Window{0, 0};
}

// Cut dims go through halo windows; uncut dims keep the op's own padding (they are whole on
// every rank), so they cost no copy.
struct CutDims {
  std::vector<DimCut> cut;            // the cut dims
  std::vector<size_t> index;          // their spatial index
  std::vector<int64_t> pad, out_pad;  // per spatial dim: the op's own (uncut) or 0 (cut)
};
CutDims separate_cut_dims(const std::vector<DimCut>& cuts, const ConvArgs& a) {
  CutDims s;
  for (size_t k = 0; k < cuts.size(); ++k) {
    if (cuts[k].cut()) {
      s.cut.push_back(cuts[k]);
      s.index.push_back(k);
      s.pad.push_back(0);
      s.out_pad.push_back(0);
    } else {
      s.pad.push_back(a.padding[k]);
      s.out_pad.push_back(a.output_padding[k]);
    }
  }
  return s;
}

// NOTE: [Interior and rim]
// The common case - one cut dim, stride 1, a "same" convolution (every rank's outputs are its
// own rows) - avoids copying the shard into a halo-extended window. The rank convolves its
// shard as it is, with the op's own zero padding: every output is right except the few
// within `pad` rows of a cut, whose windows reach into a neighbour. Those rim rows are
// recomputed from thin slabs (halo rows + a few own rows) and written over. Backward
// likewise: the shard's own gradient and input give the interior, and the neighbours'
// gradient rows within `pad` of the cut add their contributions to the rim rows and to the
// weight gradient. Bytes on the wire are the same halo rows as the general path.
struct Rim {
  size_t k = 0;     // spatial index of the cut dim
  int64_t pad = 0;  // rows of the rim = the op's padding along the cut dim
};
bool rim_path(const std::vector<DimCut>& cuts, const ConvArgs& a, Rim& rim) {
  if (a.transposed) return false;
  int n = 0;
  for (size_t k = 0; k < cuts.size(); ++k)
    if (cuts[k].cut()) ++n, rim.k = k;
  if (n != 1) return false;
  const auto& c = cuts[rim.k];
  rim.pad = a.padding[rim.k];
  return a.stride[rim.k] == 1 && a.dilation[rim.k] * (a.kernel[rim.k] - 1) == 2 * rim.pad &&
         rim.pad > 0 && c.out_sizes == c.in_sizes;
}

// Per member: its first (top) or last (bottom) `pad` outputs, and the neighbours' outputs
// within `pad` rows of its shard, both left out at the domain edges.
std::vector<Window> rim_outputs(const DimCut& c, int64_t pad, bool top, bool own) {
  std::vector<Window> w;
  const int64_t total = c.axis.out;
  for (size_t m = 0; m < c.in_sizes.size(); ++m) {
    const int64_t a = c.in_offset(m), b = a + c.in_sizes[m];
    Window r{0, 0};
    if (b > a && (top ? a > 0 : b < total)) {
      if (own)
        r = top ? Window{a, std::min(a + pad, b)} : Window{std::max(b - pad, a), b};
      else
        r = top ? Window{std::max<int64_t>(a - pad, 0), a} : Window{b, std::min(b + pad, total)};
    }
    w.push_back(r);
  }
  return w;
}

std::vector<Window> rows_read(const std::vector<Window>& outputs, int64_t pad) {
  std::vector<Window> w;
  for (const auto& o : outputs)
    w.push_back(o.size() ? Window{o.lo - pad, o.hi + pad} : Window{0, 0});
  return w;
}

at::Tensor rim_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                       const DeviceMesh& mesh, const std::vector<DimCut>& cuts, const ConvArgs& a,
                       const Rim& rim) {
  const auto& c = cuts[rim.k];
  const auto group = mesh.group(c.mesh_dim);
  auto slab_pad = a.padding;
  slab_pad[rim.k] = 0;
  // The halo rows travel while the interior is computed.
  const std::vector<Window> outs[2] = {rim_outputs(c, rim.pad, true, /*own=*/true),
                                       rim_outputs(c, rim.pad, false, /*own=*/true)};
  comm::PendingWindow slabs[2] = {
      comm::fetch_window_async(group, x, c.dim, c.in_sizes, rows_read(outs[0], rim.pad),
                               spatial::HaloBoundary::Zeros, 0.0, /*tag=*/0),
      comm::fetch_window_async(group, x, c.dim, c.in_sizes, rows_read(outs[1], rim.pad),
                               spatial::HaloBoundary::Zeros, 0.0, /*tag=*/1)};
  at::Tensor out = c.in_sizes[c.me] == 0
                       ? at::zeros(local_shape(x, a.out_channels, cuts, true), x.options())
                       : at::convolution(x, w, b, a.stride, a.padding, a.dilation, false,
                                         a.output_padding, a.groups);
  for (int side : {0, 1}) {
    at::Tensor slab = slabs[side].wait();
    const Window mine = outs[side][c.me];
    if (mine.size() == 0) continue;
    at::Tensor fixed = at::convolution(slab, w, b, a.stride, slab_pad, a.dilation, false,
                                       a.output_padding, a.groups);
    out.narrow(c.dim, mine.lo - c.in_offset(c.me), mine.size()).copy_(fixed);
  }
  return out;
}

// Returns (grad_input, grad_weight, grad_bias); the bias gradient sums the rank's own
// outputs only (the rim slabs add none).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rim_backward(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, const DeviceMesh& mesh,
    const std::vector<DimCut>& cuts, const ConvArgs& a, const Rim& rim, bool want_input,
    bool want_weight, bool want_bias) {
  const auto& c = cuts[rim.k];
  const auto group = mesh.group(c.mesh_dim);
  const Window mine = c.my_inputs();
  // The neighbours' gradient rows near my shard travel while the interior is computed.
  const std::vector<Window> outs[2] = {rim_outputs(c, rim.pad, true, /*own=*/false),
                                       rim_outputs(c, rim.pad, false, /*own=*/false)};
  comm::PendingWindow rims[2] = {
      comm::fetch_window_async(group, g, c.dim, c.out_sizes, outs[0], spatial::HaloBoundary::Zeros,
                               0.0, /*tag=*/0),
      comm::fetch_window_async(group, g, c.dim, c.out_sizes, outs[1], spatial::HaloBoundary::Zeros,
                               0.0, /*tag=*/1)};
  at::Tensor gi, gw, gb;
  if (mine.size() > 0) {
    const std::vector<int64_t> bias_sizes = {a.out_channels};
    std::tie(gi, gw, gb) =
        at::convolution_backward(g, x, w, bias_sizes, a.stride, a.padding, a.dilation, false,
                                 a.output_padding, a.groups, {want_input, want_weight, want_bias});
  } else {
    if (want_input) gi = at::zeros_like(x);
    if (want_weight) gw = at::zeros_like(w);
    if (want_bias) gb = at::zeros({a.out_channels}, g.options());
  }
  auto slab_pad = a.padding;
  slab_pad[rim.k] = 0;
  for (int side : {0, 1}) {
    // The neighbours' outputs near my shard: their gradient rows, my rows they read.
    at::Tensor g_rim = rims[side].wait();
    const Window o = outs[side][c.me];
    if (o.size() == 0) continue;
    const Window read{o.lo - rim.pad, o.hi + rim.pad};
    at::Tensor x_rim = spatial::place(x, c.dim, mine, read);
    auto r = at::convolution_backward(g_rim, x_rim, w, c10::nullopt, a.stride, slab_pad, a.dilation,
                                      false, a.output_padding, a.groups,
                                      {want_input, want_weight, false});
    if (want_input) {
      const int64_t lo = std::max(read.lo, mine.lo), hi = std::min(read.hi, mine.hi);
      if (hi > lo)
        gi.narrow(c.dim, lo - mine.lo, hi - lo)
            .add_(std::get<0>(r).narrow(c.dim, lo - read.lo, hi - lo));
    }
    if (want_weight) gw.add_(std::get<1>(r));
  }
  return {gi, gw, gb};
}

void conv_forward_kernel(KernelCall& kc, const DeviceMesh& mesh, const std::vector<DimCut>& cuts,
                         const ConvArgs& a) {
  const at::Tensor x = kc.tensor("input"), w = kc.tensor("weight");
  const at::Tensor b = kc.arg("bias").isTensor() ? kc.tensor("bias") : at::Tensor();
  Rim rim;
  if (rim_path(cuts, a, rim)) {
    kc.finish({rim_forward(x, w, b, mesh, cuts, a, rim)});
    return;
  }
  const CutDims sp = separate_cut_dims(cuts, a);
  const at::Tensor win = spatial::fetch(mesh, x, sp.cut, spatial::HaloBoundary::Zeros);
  at::Tensor out;
  if (!a.transposed) {
    out = any_empty(cuts, true) ? at::zeros(local_shape(x, a.out_channels, cuts, true), x.options())
                                : at::convolution(win, w, b, a.stride, sp.pad, a.dilation, false,
                                                  sp.out_pad, a.groups);
  } else {
    bool empty = any_empty(cuts, true);
    for (int64_t d = 2; d < win.dim(); ++d) empty = empty || win.size(d) == 0;
    if (empty) {
      out = at::zeros(local_shape(x, a.out_channels, cuts, true), x.options());
    } else {
      // The windowed input's full transposed convolution covers outputs from lo*stride - pad;
      // keep the rank's own range (outputs no input writes stay zero).
      out = at::convolution(win, w, {}, a.stride, sp.pad, a.dilation, true, sp.out_pad, a.groups);
      for (const auto& c : sp.cut) {
        const Window read = c.axis.reads(c.my_outputs().lo, c.my_outputs().hi);
        const int64_t start = read.lo * c.axis.stride - c.axis.pad;
        out = spatial::place(out, c.dim, {start, start + out.size(c.dim)}, c.my_outputs());
      }
    }
    if (b.defined()) {
      std::vector<int64_t> shape(out.dim(), 1);
      shape[1] = b.size(0);
      out = out + b.view(shape);
    }
  }
  kc.finish({out});
}

void conv_backward_kernel(KernelCall& kc, const DeviceMesh& mesh, const std::vector<DimCut>& cuts,
                          const ConvArgs& a) {
  const at::Tensor g = kc.tensor("grad_output"), x = kc.tensor("input"), w = kc.tensor("weight");
  const auto mask = kc.arg<std::array<bool, 3>>("output_mask");
  Rim rim;
  if (rim_path(cuts, a, rim)) {
    auto [gi, gwt, gb] = rim_backward(g, x, w, mesh, cuts, a, rim, mask[0], mask[1], mask[2]);
    kc.finish({gi, gwt, gb});
    return;
  }
  CutDims sp = separate_cut_dims(cuts, a);
  const size_t ncut = sp.cut.size();
  // The gradient rows of every output that touches one of each member's input rows.
  std::vector<std::vector<int64_t>> sizes;
  std::vector<std::vector<Window>> windows;
  for (const auto& c : sp.cut) {
    sizes.push_back(c.out_sizes);
    std::vector<Window> ws;
    for (size_t m = 0; m < c.in_sizes.size(); ++m)
      ws.push_back(touched_outputs(c.axis, c.in_offset(m), c.in_offset(m) + c.in_sizes[m]));
    windows.push_back(std::move(ws));
  }
  at::Tensor gw = spatial::fetch_ranges(mesh, g, sp.cut, sizes, windows);

  at::Tensor grad_input, grad_weight, grad_bias;
  bool empty = false;
  for (size_t k = 0; k < ncut; ++k)
    empty = empty || windows[k][sp.cut[k].me].size() == 0 || sp.cut[k].my_inputs().size() == 0;
  if (empty) {
    if (mask[0]) grad_input = at::zeros_like(x);
    if (mask[1]) grad_weight = at::zeros_like(w);
  } else if (!a.transposed) {
    // My input rows inside the rows those outputs read, zero elsewhere: the weight gradient
    // then counts each (output, input row) pair exactly once across ranks. Where the zero
    // rows are equally many on both sides (the usual case) they are the op's padding, not a
    // copy.
    at::Tensor xe = x;
    std::vector<Window> placed(ncut);
    for (size_t k = 0; k < ncut; ++k) {
      const auto& c = sp.cut[k];
      const Window t = windows[k][c.me], mine = c.my_inputs();
      const Window read = c.axis.reads(t.lo, t.hi);
      const int64_t before = mine.lo - read.lo, after = read.hi - mine.hi;
      if (before == after && before >= 0) {
        sp.pad[sp.index[k]] = before;
      } else {
        xe = spatial::place(xe, c.dim, mine, read);
        placed[k] = read;
      }
    }
    auto r = at::convolution_backward(gw, xe, w, c10::nullopt, a.stride, sp.pad, a.dilation, false,
                                      sp.out_pad, a.groups, {mask[0], mask[1], false});
    grad_input = std::get<0>(r);
    grad_weight = std::get<1>(r);
    if (mask[0])
      for (size_t k = 0; k < ncut; ++k)
        if (placed[k].size() > 0)
          grad_input = spatial::place(grad_input, sp.cut[k].dim, placed[k], sp.cut[k].my_inputs());
  } else {
    // Transposed: my input rows write outputs [lo*stride - pad, ...); the fetched gradient
    // covers the part inside the domain. Equal margins are the op's own cropping.
    at::Tensor gf = gw;
    for (size_t k = 0; k < ncut; ++k) {
      const auto& c = sp.cut[k];
      const Window in = c.my_inputs(), t = windows[k][c.me];
      const int64_t start = in.lo * c.axis.stride - c.axis.pad;
      const Window full{start, start + (in.size() - 1) * c.axis.stride +
                                   c.axis.dilation * (c.axis.kernel - 1) + 1};
      const int64_t before = t.lo - full.lo, after = full.hi - t.hi;
      if (before == after && before >= 0)
        sp.pad[sp.index[k]] = before;
      else
        gf = spatial::place(gf, c.dim, t, full);
    }
    auto r = at::convolution_backward(gf, x, w, c10::nullopt, a.stride, sp.pad, a.dilation, true,
                                      sp.out_pad, a.groups, {mask[0], mask[1], false});
    grad_input = std::get<0>(r);
    grad_weight = std::get<1>(r);
  }
  if (mask[2]) {
    std::vector<int64_t> dims = {0};
    for (int64_t d = 2; d < g.dim(); ++d) dims.push_back(d);
    grad_bias = g.sum(dims);
  }
  kc.finish({grad_input, grad_weight, grad_bias});
}

// What both convolution rules derive from the input's spec and the arguments.
struct ConvLayout {
  ConvArgs a;
  std::vector<int64_t> weight;
  SpecPtr layout;  // the input's layout for the op
  std::vector<DimCut> cuts;
  bool windowed = false;  // some spatial dim is cut: the distributed kernel runs
};
// Both convolution ops name their activation `input` and their weight `weight`.
ConvLayout conv_layout(const OpCall& call) {
  const DTensorSpec* input = call.spec("input");
  TORCH_CHECK(input, "tessera: ", call.describe(), ": the input must be distributed");
  const auto& in = *input;
  const auto dims = spatial::trailing_dims(in.ndim(), static_cast<size_t>(in.ndim() - 2));
  ConvLayout l;
  const DTensorSpec* weight = call.spec("weight");
  l.weight = weight ? weight->sizes() : call.arg("weight").toTensor().sizes().vec();
  l.a = conv_args(call, l.weight, dims.size());
  l.layout = spatial::window_layout(in, dims);
  l.cuts = spatial::make_cuts(*l.layout, dims, conv_axes(call, in.sizes(), l.a));
  l.windowed = spatial::any_window_dim_sharded(*l.layout, dims);
  return l;
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
OpPlan convolution_rule(const OpCall& call) {
  const auto l = conv_layout(call);
  OpPlan plan(call);
  plan.input("input", l.layout);
  if (const auto* w = call.spec("weight")) plan.input("weight", replicated(*w));
  if (const auto* b = call.spec("bias")) plan.input("bias", replicated(*b));
  plan.output(spatial::output_spec(*l.layout, l.cuts, l.layout->dtype(), l.a.out_channels));
  if (l.windowed) {
    plan.distributed_kernel = [cuts = l.cuts, a = l.a](KernelCall& kc, const DeviceMesh& mesh) {
      conv_forward_kernel(kc, mesh, cuts, a);
    };
  }
  return plan;
}

// convolution_backward(grad_output, input, weight, bias_sizes?, stride, padding, dilation,
//                      transposed, output_padding, groups, output_mask)
OpPlan convolution_backward_rule(const OpCall& call) {
  const auto l = conv_layout(call);
  OpPlan plan(call);
  plan.input("input", l.layout);
  if (const auto* g = call.spec("grad_output"))
    plan.input("grad_output",
               spatial::output_spec(*l.layout, l.cuts, g->dtype(), l.a.out_channels));
  if (const auto* w = call.spec("weight")) plan.input("weight", replicated(*w));
  const auto& bias_sizes = call.arg("bias_sizes");
  plan.output(l.layout)
      .output(summed_over_shards(*l.layout, l.weight))
      .output(summed_over_shards(*l.layout, bias_sizes.isIntList()
                                                ? bias_sizes.toIntVector()
                                                : std::vector<int64_t>{l.a.out_channels}));
  if (l.windowed) {
    plan.distributed_kernel = [cuts = l.cuts, a = l.a](KernelCall& kc, const DeviceMesh& mesh) {
      conv_backward_kernel(kc, mesh, cuts, a);
    };
  }
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::convolution", convolution_rule);
  register_rule("aten::convolution_backward", convolution_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
