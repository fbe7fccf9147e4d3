// Max and average pooling (2-D/3-D; 1-D arrives as 2-D) on inputs sharded along any dims.
// Pooling acts per channel, so batch and channel shards stay; spatially sharded dims take the
// window path (NOTE: [Window ops on sharded spatial dims]):
//  - max: the window is fetched with -inf outside the domain, pooled with zero padding, and
//    the local argmax turned into the global flat index one device returns. Backward adds
//    each gradient into the window at its index and sends halo rows home.
//  - avg: window sums (zero fill) divided by one device's divisor for each output, which
//    depends on where the window sits against the domain edge (count_include_pad,
//    ceil_mode overhang, divisor_override). Backward is the adjoint of the same sums.
// Adaptive average pooling with output sizes that divide the input is average pooling with
// kernel = stride = in/out; global pooling (1x1) arrives as mean (a reduction: Partial, then
// Replicate). Other adaptive sizes replicate the spatial dims. Adaptive max pooling makes the
// planes whole and keeps the batch and channel shards (NOTE: [Dim-wise ops]).
#include <array>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/Pool.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include "ops/dim_layout.h"
#include "tessera/tensor/rule.h"
#include "window_internal.h"

namespace tessera::ops {

namespace {

using spatial::Axis;
using spatial::DimCut;
using spatial::Window;

struct PoolArgs {
  bool max = true;
  std::vector<int64_t> kernel, stride, padding, dilation;
  bool ceil_mode = false, count_include_pad = true;
  int64_t divisor_override = 0;  // 0: none
};

// The forward and backward ops name these arguments alike.
PoolArgs pool_args(const OpCall& call, bool max, size_t nsp) {
  using Ints = std::vector<int64_t>;
  PoolArgs a;
  a.max = max;
  a.kernel = spatial::per_dim(call.arg<Ints>("kernel_size"), nsp);
  a.stride = spatial::per_dim(call.arg<Ints>("stride"), nsp, a.kernel);
  a.padding = spatial::per_dim(call.arg<Ints>("padding"), nsp);
  if (max) {
    a.dilation = spatial::per_dim(call.arg<Ints>("dilation"), nsp);
  } else {
    a.dilation.assign(nsp, 1);
    a.count_include_pad = call.arg<bool>("count_include_pad");
    a.divisor_override = call.arg<c10::optional<int64_t>>("divisor_override").value_or(0);
  }
  a.ceil_mode = call.arg<bool>("ceil_mode");
  return a;
}

std::vector<Axis> pool_axes(const OpCall& call, const std::vector<int64_t>& sizes,
                            const std::vector<int64_t>& dims, const PoolArgs& a) {
  std::vector<Axis> axes;
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t in = sizes[dims[i]];
    const int64_t span = a.dilation[i] * (a.kernel[i] - 1) + 1;
    TORCH_CHECK(2 * a.padding[i] <= (a.max ? span : a.kernel[i]), "tessera: ", call.describe(),
                ": padding ", a.padding[i], " is more than half the kernel size ", span);
    const int64_t out = at::native::pooling_output_shape<int64_t>(
        in, a.kernel[i], a.padding[i], a.stride[i], a.dilation[i], a.ceil_mode);
    TORCH_CHECK(out > 0, "tessera: ", call.describe(), ": output size along dim ", dims[i],
                " would be ", out);
    axes.push_back(Axis::stencil(in, out, a.kernel[i], a.stride[i], a.padding[i], a.dilation[i]));
  }
  return axes;
}

std::vector<int64_t> window_shape(const at::Tensor& x, const std::vector<DimCut>& cuts) {
  auto s = x.sizes().vec();
  for (const auto& c : cuts) s[c.dim] = c.axis.reads(c.my_outputs().lo, c.my_outputs().hi).size();
  return s;
}
std::vector<int64_t> output_shape(const at::Tensor& x, const std::vector<DimCut>& cuts) {
  auto s = x.sizes().vec();
  for (const auto& c : cuts) s[c.dim] = c.my_outputs().size();
  return s;
}
bool no_outputs(const std::vector<DimCut>& cuts) {
  for (const auto& c : cuts)
    if (c.my_outputs().size() == 0) return true;
  return false;
}

// reindex on the CPU in one pass (the tensor form below makes six passes over the indices,
// which cost a U-Net step more than the pooling itself). Indices are valid, so non-negative.
at::Tensor reindex_cpu(const at::Tensor& idx, const std::vector<int64_t>& from,
                       const std::vector<int64_t>& to, const std::vector<int64_t>& lo,
                       bool to_global) {
  const at::Tensor in = idx.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t* src = in.data_ptr<int64_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  const size_t n = from.size();
  at::parallel_for(0, in.numel(), 16384, [&](int64_t begin, int64_t end) {
    std::array<int64_t, 8> coord{};
    for (int64_t i = begin; i < end; ++i) {
      int64_t rem = src[i];
      for (size_t j = n; j-- > 0;) {
        coord[j] = rem % from[j];
        rem /= from[j];
      }
      int64_t v = 0;
      for (size_t j = 0; j < n; ++j) v = v * to[j] + coord[j] + (to_global ? lo[j] : -lo[j]);
      dst[i] = v;
    }
  });
  return out;
}

// Flat index over the trailing window dims: from `from` coordinates (sizes, origin) to `to`.
at::Tensor reindex(const at::Tensor& idx, const std::vector<DimCut>& cuts, bool to_global) {
  const size_t n = cuts.size();
  std::vector<int64_t> win(n), glob(n), lo(n);
  for (size_t j = 0; j < n; ++j) {
    const auto& c = cuts[j];
    const Window w = c.axis.reads(c.my_outputs().lo, c.my_outputs().hi);
    win[j] = w.size();
    glob[j] = c.axis.in;
    lo[j] = w.lo;
  }
  const auto& from = to_global ? win : glob;
  const auto& to = to_global ? glob : win;
  if (idx.device().is_cpu() && idx.scalar_type() == at::kLong && n <= 8)
    return reindex_cpu(idx, from, to, lo, to_global);
  std::vector<at::Tensor> coord(n);
  at::Tensor rem = idx;
  for (size_t j = n; j-- > 0;) {
    coord[j] = rem.remainder(from[j]);
    rem = rem.div(from[j], "floor");
  }
  at::Tensor out = at::zeros_like(idx);
  for (size_t j = 0; j < n; ++j)
    out = out * to[j] + (to_global ? coord[j] + lo[j] : coord[j] - lo[j]);
  return out;
}

// One device's divisor for every local output of average pooling (broadcastable).
at::Tensor avg_divisor(const std::vector<DimCut>& cuts, const PoolArgs& a, int64_t ndim,
                       const at::TensorOptions& opts) {
  if (a.divisor_override) return at::scalar_tensor(static_cast<double>(a.divisor_override), opts);
  at::Tensor div;
  for (size_t j = 0; j < cuts.size(); ++j) {
    const auto& c = cuts[j];
    const Window mine = c.my_outputs();
    std::vector<double> v;
    for (int64_t o = mine.lo; o < mine.hi; ++o) {
      const int64_t start = o * a.stride[j] - a.padding[j];
      const int64_t end = std::min(start + a.kernel[j], c.axis.in + a.padding[j]);
      const int64_t inside = std::min(end, c.axis.in) - std::max<int64_t>(start, 0);
      v.push_back(static_cast<double>(a.count_include_pad ? end - start : inside));
    }
    std::vector<int64_t> shape(ndim, 1);
    shape[c.dim] = static_cast<int64_t>(v.size());
    at::Tensor t = at::tensor(v, opts.dtype(at::kDouble)).to(opts.dtype()).view(shape);
    div = div.defined() ? div * t : t;
  }
  return div.clamp_min(1);
}

at::Tensor local_max_pool(const at::Tensor& win, const PoolArgs& a, at::Tensor& indices) {
  const std::vector<int64_t> zeros(a.kernel.size(), 0);
  auto r = a.kernel.size() == 2
               ? at::max_pool2d_with_indices(win, a.kernel, a.stride, zeros, a.dilation, false)
               : at::max_pool3d_with_indices(win, a.kernel, a.stride, zeros, a.dilation, false);
  indices = std::get<1>(r);
  return std::get<0>(r);
}

// Window sums (divisor 1) and their adjoint.
at::Tensor window_sums(const at::Tensor& win, const PoolArgs& a) {
  const std::vector<int64_t> zeros(a.kernel.size(), 0);
  return a.kernel.size() == 2 ? at::avg_pool2d(win, a.kernel, a.stride, zeros, false, true, 1)
                              : at::avg_pool3d(win, a.kernel, a.stride, zeros, false, true, 1);
}
at::Tensor window_sums_backward(const at::Tensor& g, const at::Tensor& win_like,
                                const PoolArgs& a) {
  const std::vector<int64_t> zeros(a.kernel.size(), 0);
  return a.kernel.size() == 2
             ? at::avg_pool2d_backward(g, win_like, a.kernel, a.stride, zeros, false, true, 1)
             : at::avg_pool3d_backward(g, win_like, a.kernel, a.stride, zeros, false, true, 1);
}

void pool_forward_kernel(KernelCall& kc, const DeviceMesh& mesh, const std::vector<DimCut>& cuts,
                         const PoolArgs& a) {
  const at::Tensor x = kc.tensor("self");
  const double fill = a.max ? -std::numeric_limits<double>::infinity() : 0.0;
  const at::Tensor win = spatial::fetch(mesh, x, cuts, spatial::HaloBoundary::Zeros, fill);
  if (no_outputs(cuts)) {
    const at::Tensor out = at::zeros(output_shape(x, cuts), x.options());
    if (a.max)
      kc.finish({out, at::zeros(output_shape(x, cuts), x.options().dtype(at::kLong))});
    else
      kc.finish({out});
    return;
  }
  if (a.max) {
    at::Tensor idx;
    at::Tensor out = local_max_pool(win, a, idx);
    kc.finish({out, reindex(idx, cuts, /*to_global=*/true)});
  } else {
    kc.finish({window_sums(win, a) / avg_divisor(cuts, a, x.dim(), x.options())});
  }
}

void pool_backward_kernel(KernelCall& kc, const DeviceMesh& mesh, const std::vector<DimCut>& cuts,
                          const PoolArgs& a) {
  const at::Tensor g = kc.tensor("grad_output"), x = kc.tensor("self");
  const auto wshape = window_shape(x, cuts);
  at::Tensor gw;
  if (no_outputs(cuts)) {
    gw = at::zeros(wshape, g.options());
  } else if (a.max) {
    const at::Tensor idx = reindex(kc.tensor("indices"), cuts, /*to_global=*/false);
    const int64_t lead = g.dim() - static_cast<int64_t>(cuts.size());
    auto flat = std::vector<int64_t>(wshape.begin(), wshape.begin() + lead);
    auto flat_out = flat;
    flat.push_back(c10::multiply_integers(wshape.begin() + lead, wshape.end()));
    flat_out.push_back(c10::multiply_integers(g.sizes().begin() + lead, g.sizes().end()));
    gw = at::zeros(wshape, g.options());
    gw.view(flat).scatter_add_(lead, idx.reshape(flat_out), g.reshape(flat_out));
  } else {
    gw = window_sums_backward(g / avg_divisor(cuts, a, g.dim(), g.options()),
                              at::empty(wshape, g.options()), a);
  }
  kc.finish({spatial::fetch_backward(mesh, gw, cuts, spatial::HaloBoundary::Zeros)});
}

// Forward (self, kernel_size, ...) or backward (grad_output, self, ..., [indices]).
OpPlan pool_plan(const OpCall& call, const PoolArgs& a) {
  const bool backward = call.has("grad_output");
  const auto& in = *call.spec("self");
  const size_t nsp = a.kernel.size();
  const auto dims = spatial::trailing_dims(in.ndim(), nsp);
  auto layout = spatial::window_layout(in, dims, /*keep_others=*/true);
  const auto cuts = spatial::make_cuts(*layout, dims, pool_axes(call, in.sizes(), dims, a));
  OpPlan plan(call);
  plan.input("self", layout);
  if (backward) {
    plan.input("grad_output",
               spatial::output_spec(*layout, cuts, call.spec("grad_output")->dtype()));
    if (a.max) plan.input("indices", spatial::output_spec(*layout, cuts, at::kLong));
    plan.output(layout);
  } else {
    plan.output(spatial::output_spec(*layout, cuts, in.dtype()));
    if (a.max) plan.output(spatial::output_spec(*layout, cuts, at::kLong));
  }
  // Without a cut window dim the local op is exact (batch / channel shards only), except
  // that max pooling's indices are already global along uncut dims: also exact.
  if (spatial::any_window_dim_sharded(*layout, dims)) {
    if (backward)
      plan.distributed_kernel = [cuts, a](KernelCall& kc, const DeviceMesh& mesh) {
        pool_backward_kernel(kc, mesh, cuts, a);
      };
    else
      plan.distributed_kernel = [cuts, a](KernelCall& kc, const DeviceMesh& mesh) {
        pool_forward_kernel(kc, mesh, cuts, a);
      };
  }
  return plan;
}

size_t nsp_of(const OpCall& call) { return call.name().find("3d") != std::string::npos ? 3 : 2; }

OpPlan max_pool_rule(const OpCall& c) { return pool_plan(c, pool_args(c, true, nsp_of(c))); }
OpPlan avg_pool_rule(const OpCall& c) { return pool_plan(c, pool_args(c, false, nsp_of(c))); }

// Adaptive average pooling: as average pooling where every output size divides its input.
// (self, output_size) / backward (grad_output, self).
OpPlan adaptive_rule(const OpCall& call) {
  const bool backward = call.has("grad_output");
  const auto& in = *call.spec("self");
  const size_t nsp = nsp_of(call);
  const auto dims = spatial::trailing_dims(in.ndim(), nsp);
  std::vector<int64_t> out;
  if (backward) {
    const auto* gspec = call.spec("grad_output");
    const auto& g = gspec ? gspec->sizes() : call.arg("grad_output").toTensor().sizes().vec();
    out.assign(g.end() - static_cast<int64_t>(nsp), g.end());
  } else {
    out = call.arg<std::vector<int64_t>>("output_size");
  }
  bool divides = true;
  PoolArgs a;
  a.max = false;
  for (size_t i = 0; i < nsp; ++i) {
    const int64_t n = in.sizes()[dims[i]];
    divides = divides && out[i] > 0 && n % out[i] == 0;
    a.kernel.push_back(out[i] > 0 ? std::max<int64_t>(n / out[i], 1) : 1);
  }
  a.stride = a.kernel;
  a.padding.assign(nsp, 0);
  a.dilation.assign(nsp, 1);
  if (divides) return pool_plan(call, a);
  // Uneven bins: keep batch and channel shards, replicate the spatial dims.
  auto layout = std::make_shared<DTensorSpec>(in.replicate_where([&](int64_t, const Placement& x) {
    return x.is_partial() || (x.is_shard() && x.dim() >= dims[0]);
  }));
  OpPlan plan(call);
  plan.input("self", layout);
  auto shape = in.sizes();
  for (size_t i = 0; i < nsp; ++i) shape[dims[i]] = out[i];
  if (backward) {
    plan.input("grad_output",
               same_layout_with_shape(*layout, shape, call.spec("grad_output")->dtype()));
    plan.output(layout);
  } else {
    plan.output(same_layout_with_shape(*layout, shape, in.dtype()));
  }
  return plan;
}

// adaptive_max_pool2d / 3d(self, output_size) -> (values, indices)
OpPlan adaptive_max_pool_rule(const OpCall& call) {
  const auto out = call.arg<std::vector<int64_t>>("output_size");
  return trailing(call, static_cast<int64_t>(out.size()), out, 2);
}

// adaptive_max_poolNd_backward(grad_output, self, indices): the planes whole on all three.
OpPlan adaptive_max_pool_backward_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const DTensorSpec* g = call.spec("grad_output");
  TORCH_INTERNAL_ASSERT(g, call.describe());
  const int64_t planes = call.name().find("3d") != std::string::npos ? 3 : 2;
  std::vector<int64_t> dims;
  for (int64_t t = self.ndim() - planes; t < self.ndim(); ++t) dims.push_back(t);
  auto in = whole_along(self, dims);
  auto grad_layout = [&](const DTensorSpec& like) {  // the planes differ in size only
    return std::make_shared<DTensorSpec>(in->mesh(), in->placements(), like.sizes(), like.dtype(),
                                         in->shard_tables());
  };
  OpPlan plan(call);
  plan.input("self", in).input("grad_output", grad_layout(*g)).output(in);
  if (const auto* idx = call.spec("indices")) plan.input("indices", grad_layout(*idx));
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op :
       {"aten::max_pool2d_with_indices", "aten::max_pool3d_with_indices",
        "aten::max_pool2d_with_indices_backward", "aten::max_pool3d_with_indices_backward"})
    register_rule(op, max_pool_rule);
  for (const char* op : {"aten::avg_pool2d", "aten::avg_pool3d", "aten::avg_pool2d_backward",
                         "aten::avg_pool3d_backward"})
    register_rule(op, avg_pool_rule);
  for (const char* op :
       {"aten::_adaptive_avg_pool2d", "aten::_adaptive_avg_pool3d",
        "aten::_adaptive_avg_pool2d_backward", "aten::_adaptive_avg_pool3d_backward"})
    register_rule(op, adaptive_rule);
  for (const char* op : {"aten::adaptive_max_pool2d", "aten::adaptive_max_pool3d"})
    register_rule(op, adaptive_max_pool_rule);
  for (const char* op :
       {"aten::adaptive_max_pool2d_backward", "aten::adaptive_max_pool3d_backward"})
    register_rule(op, adaptive_max_pool_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
