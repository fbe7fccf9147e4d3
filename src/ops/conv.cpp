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
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "spatial.h"
#include "tessera/ops/rule.h"

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

std::vector<int64_t> per_dim(std::vector<int64_t> v, size_t n) {
  if (v.size() == 1 && n > 1) v.assign(n, v[0]);
  return v;
}

// `first` = index of the stride argument (3 forward, 4 backward).
ConvArgs conv_args(const OpCall& call, size_t first, const std::vector<int64_t>& w, size_t nsp) {
  ConvArgs a;
  a.stride = per_dim(call.args[first].toIntVector(), nsp);
  a.padding = per_dim(call.args[first + 1].toIntVector(), nsp);
  a.dilation = per_dim(call.args[first + 2].toIntVector(), nsp);
  a.transposed = call.args[first + 3].toBool();
  a.output_padding = per_dim(call.args[first + 4].toIntVector(), nsp);
  a.groups = call.args[first + 5].toInt();
  a.kernel.assign(w.begin() + 2, w.end());
  a.out_channels = a.transposed ? w[1] * a.groups : w[0];
  return a;
}

std::vector<int64_t> spatial_dims(int64_t ndim) {
  std::vector<int64_t> d;
  for (int64_t i = 2; i < ndim; ++i) d.push_back(i);
  return d;
}

std::vector<Axis> conv_axes(const OpCall& call, const std::vector<int64_t>& in_sizes, const ConvArgs& a) {
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

std::vector<int64_t> zeros_like_list(size_t n) { return std::vector<int64_t>(n, 0); }

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

// The outputs that read (stencil) or are written by (transposed) input rows [a, b).
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
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, ax.out);
  return hi > lo ? Window{lo, hi} : Window{0, 0};
}

void conv_forward_kernel(torch::jit::Stack& stack, const DeviceMesh& mesh,
                         const std::vector<DimCut>& cuts, const ConvArgs& a) {
  const at::Tensor x = stack[0].toTensor(), w = stack[1].toTensor();
  const at::Tensor b = stack[2].isTensor() ? stack[2].toTensor() : at::Tensor();
  const size_t nsp = cuts.size();
  const at::Tensor win = spatial::fetch(mesh, x, cuts, spatial::HaloBoundary::Zeros);
  at::Tensor out;
  if (!a.transposed) {
    out = any_empty(cuts, true)
              ? at::zeros(local_shape(x, a.out_channels, cuts, true), x.options())
              : at::convolution(win, w, b, a.stride, zeros_like_list(nsp), a.dilation, false,
                                zeros_like_list(nsp), a.groups);
  } else {
    bool empty = any_empty(cuts, true);
    for (int64_t d = 2; d < win.dim(); ++d) empty = empty || win.size(d) == 0;
    if (empty) {
      out = at::zeros(local_shape(x, a.out_channels, cuts, true), x.options());
    } else {
      // The windowed input's full transposed convolution covers outputs from lo*stride - pad;
      // keep the rank's own range (outputs no input writes stay zero).
      out = at::convolution(win, w, {}, a.stride, zeros_like_list(nsp), a.dilation, true,
                            zeros_like_list(nsp), a.groups);
      for (const auto& c : cuts) {
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
  stack.clear();
  stack.emplace_back(out);
}

void conv_backward_kernel(torch::jit::Stack& stack, const DeviceMesh& mesh,
                          const std::vector<DimCut>& cuts, const ConvArgs& a) {
  const at::Tensor g = stack[0].toTensor(), x = stack[1].toTensor(), w = stack[2].toTensor();
  const auto mask = stack[10].toBoolList();
  const size_t nsp = cuts.size();
  // The gradient rows of every output that touches one of each member's input rows.
  std::vector<std::vector<int64_t>> sizes;
  std::vector<std::vector<Window>> windows;
  for (const auto& c : cuts) {
    sizes.push_back(c.out_sizes);
    std::vector<Window> ws;
    for (size_t m = 0; m < c.in_sizes.size(); ++m)
      ws.push_back(touched_outputs(c.axis, c.in_offset(m), c.in_offset(m) + c.in_sizes[m]));
    windows.push_back(std::move(ws));
  }
  at::Tensor gw = spatial::fetch_ranges(mesh, g, cuts, sizes, windows);

  at::Tensor grad_input, grad_weight, grad_bias;
  bool empty = false;
  for (size_t k = 0; k < nsp; ++k)
    empty = empty || windows[k][cuts[k].me].size() == 0 || cuts[k].my_inputs().size() == 0;
  if (empty) {
    if (mask[0]) grad_input = at::zeros_like(x);
    if (mask[1]) grad_weight = at::zeros_like(w);
  } else if (!a.transposed) {
    // My input rows inside the (zero) rows those outputs read: the weight gradient then
    // counts each (output, input row) pair exactly once across ranks.
    at::Tensor xe = x;
    std::vector<Window> reads;
    for (size_t k = 0; k < nsp; ++k) {
      const auto& c = cuts[k];
      const Window t = windows[k][c.me];
      reads.push_back(c.axis.reads(t.lo, t.hi));
      xe = spatial::place(xe, c.dim, c.my_inputs(), reads.back());
    }
    auto r = at::convolution_backward(gw, xe, w, c10::nullopt, a.stride, zeros_like_list(nsp),
                                      a.dilation, false, zeros_like_list(nsp), a.groups,
                                      {mask[0], mask[1], false});
    grad_input = std::get<0>(r);
    grad_weight = std::get<1>(r);
    if (mask[0])
      for (size_t k = 0; k < nsp; ++k)
        grad_input = spatial::place(grad_input, cuts[k].dim, reads[k], cuts[k].my_inputs());
  } else {
    // Transposed: my input rows write outputs from lo*stride - pad on; lay the fetched
    // gradient over exactly that range.
    at::Tensor gf = gw;
    for (size_t k = 0; k < nsp; ++k) {
      const auto& c = cuts[k];
      const Window in = c.my_inputs();
      const int64_t start = in.lo * c.axis.stride - c.axis.pad;
      const Window full{start, start + (in.size() - 1) * c.axis.stride +
                                   c.axis.dilation * (c.axis.kernel - 1) + 1};
      gf = spatial::place(gf, c.dim, windows[k][c.me], full);
    }
    auto r = at::convolution_backward(gf, x, w, c10::nullopt, a.stride, zeros_like_list(nsp),
                                      a.dilation, true, zeros_like_list(nsp), a.groups,
                                      {mask[0], mask[1], false});
    grad_input = std::get<0>(r);
    grad_weight = std::get<1>(r);
  }
  if (mask[2]) {
    std::vector<int64_t> dims = {0};
    for (int64_t d = 2; d < g.dim(); ++d) dims.push_back(d);
    grad_bias = g.sum(dims);
  }
  stack.clear();
  stack.emplace_back(grad_input);
  stack.emplace_back(grad_weight);
  stack.emplace_back(grad_bias);
}

std::vector<int64_t> weight_sizes(const OpCall& call, size_t i) {
  return call.specs[i] ? call.specs[i]->sizes() : call.args[i].toTensor().sizes().vec();
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
OpPlan convolution_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  TORCH_CHECK(call.specs[0], "tessera: ", call.describe(), ": the input must be distributed");
  const auto dims = spatial_dims(in.ndim());
  const auto w = weight_sizes(call, 1);
  const auto a = conv_args(call, 3, w, dims.size());
  auto layout = spatial::window_layout(in, dims);
  const auto cuts = spatial::make_cuts(*layout, dims, conv_axes(call, in.sizes(), a));
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = layout;
  if (call.specs[1]) plan.inputs[1] = replicated(*call.specs[1]);
  if (call.specs[2]) plan.inputs[2] = replicated(*call.specs[2]);
  plan.outputs.push_back(spatial::output_spec(*layout, cuts, in.dtype(), a.out_channels));
  if (spatial::any_window_dim_sharded(*layout, dims)) {
    DeviceMesh mesh = in.mesh();
    plan.local_kernel = [mesh, cuts, a](torch::jit::Stack& s) { conv_forward_kernel(s, mesh, cuts, a); };
  }
  return plan;
}

// convolution_backward(grad_out, input, weight, bias_sizes?, stride, padding, dilation,
//                      transposed, output_padding, groups, output_mask)
OpPlan convolution_backward_rule(const OpCall& call) {
  const auto& in = *call.specs[1];
  const auto dims = spatial_dims(in.ndim());
  const auto w = weight_sizes(call, 2);
  const auto a = conv_args(call, 4, w, dims.size());
  auto layout = spatial::window_layout(in, dims);
  const auto cuts = spatial::make_cuts(*layout, dims, conv_axes(call, in.sizes(), a));
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[1] = layout;
  if (call.specs[0])
    plan.inputs[0] = spatial::output_spec(*layout, cuts, call.specs[0]->dtype(), a.out_channels);
  if (call.specs[2]) plan.inputs[2] = replicated(*call.specs[2]);
  plan.outputs.push_back(layout);
  plan.outputs.push_back(summed_over_shards(*layout, w));
  plan.outputs.push_back(summed_over_shards(
      *layout, call.args[3].isIntList() ? call.args[3].toIntVector() : std::vector<int64_t>{a.out_channels}));
  if (spatial::any_window_dim_sharded(*layout, dims)) {
    DeviceMesh mesh = in.mesh();
    plan.local_kernel = [mesh, cuts, a](torch::jit::Stack& s) { conv_backward_kernel(s, mesh, cuts, a); };
  }
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::convolution", convolution_rule);
  register_rule("aten::convolution_backward", convolution_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
