// Padding (constant, reflect, replicate, circular) on inputs sharded along any dims: the
// padding rows appear only at the true domain edges. Padding is a window op with a kernel of
// one row (NOTE: [Window ops on sharded spatial dims]): output row o is input row o - before,
// so the first shard grows by `before` rows and the last by `after`, and only rows outside
// the domain need anything: nothing (constant), or the rows reflection, replication or
// wrap-around maps them to, fetched from whichever ranks own them (the far edge, for
// circular). Negative padding (the backward of constant padding) crops the edge shards.
//
// Circular padding has no ATen kernel of its own (it is composed of slices and copies), so
// distributed tensors get it from an autograd kernel here, backward included (see NOTE:
// [How to add an op], path 3).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "tessera/compat_autograd.h"
#include "tessera/tensor/rule.h"
#include "tessera/ops/window.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::ops {

namespace {

using spatial::Axis;
using spatial::DimCut;
using spatial::HaloBoundary;

struct PadPlan {
  std::vector<int64_t> dims;
  std::vector<Axis> axes;
};

// pad = (before, after) pairs from the last dim backwards, as torch.nn.functional.pad.
PadPlan pad_plan(const std::string& op, const std::vector<int64_t>& sizes,
                 const std::vector<int64_t>& pad, bool skip_zero) {
  TORCH_CHECK(pad.size() % 2 == 0 && pad.size() / 2 <= sizes.size(), "tessera: ", op, ": padding ",
              shape_str(pad), " does not fit a tensor of shape ", shape_str(sizes));
  PadPlan p;
  const int64_t nd = static_cast<int64_t>(sizes.size());
  for (int64_t d = nd - static_cast<int64_t>(pad.size() / 2); d < nd; ++d) {
    const size_t i = static_cast<size_t>(nd - 1 - d);
    const int64_t before = pad[2 * i], after = pad[2 * i + 1];
    if (skip_zero && before == 0 && after == 0) continue;
    const int64_t out = sizes[d] + before + after;
    TORCH_CHECK(out >= 0, "tessera: ", op, ": padding ", shape_str(pad), " leaves dim ", d,
                " of size ", sizes[d], " with ", out, " rows");
    p.dims.push_back(d);
    p.axes.push_back(Axis::stencil(sizes[d], out, 1, 1, before, 1));
  }
  return p;
}

void check_reach(const std::string& op, const std::vector<int64_t>& sizes, const PadPlan& p,
                 HaloBoundary boundary) {
  for (size_t k = 0; k < p.dims.size(); ++k) {
    const int64_t in = sizes[p.dims[k]], before = p.axes[k].pad,
                  after = p.axes[k].out - in - before;
    if (boundary == HaloBoundary::Reflect)
      TORCH_CHECK(before < in && after < in, "tessera: ", op, ": reflection padding (", before,
                  ", ", after, ") must be smaller than dim ", p.dims[k], " of size ", in);
    if (boundary == HaloBoundary::Periodic)
      TORCH_CHECK(before <= in && after <= in, "tessera: ", op, ": circular padding (", before,
                  ", ", after, ") must not exceed dim ", p.dims[k], " of size ", in);
    if (boundary != HaloBoundary::Zeros)
      TORCH_CHECK(in > 0, "tessera: ", op, ": cannot pad an empty dim ", p.dims[k]);
  }
}

// constant_pad_nd(self, pad, value) and the reflection / replication pads (self, padding).
OpPlan pad_rule_with(const OpCall& call, HaloBoundary boundary) {
  const auto& in = *call.spec("self");
  const char* pad_arg = call.has("pad") ? "pad" : "padding";
  const auto p = pad_plan(call.describe(), in.sizes(), call.arg<std::vector<int64_t>>(pad_arg),
                          boundary == HaloBoundary::Zeros);
  check_reach(call.describe(), in.sizes(), p, boundary);
  auto layout = spatial::window_layout(in, p.dims, /*keep_others=*/true);
  const auto cuts = spatial::make_cuts(*layout, p.dims, p.axes);
  OpPlan plan(call);
  plan.input("self", layout);
  plan.output(spatial::output_spec(*layout, cuts, in.dtype()));
  // Always the window kernel, even without a cut dim: ATen rejects padding a tensor with an
  // empty dim, which a local shard may have.
  plan.distributed_kernel = [cuts, boundary](KernelCall& kc, const DeviceMesh& mesh) {
    // The fill value is read per call: decisions are cached without it.
    double value = 0.0;
    if (kc.index("value") >= 0 && !kc.arg("value").isNone())
      value = kc.arg("value").toScalar().toDouble();
    kc.finish({spatial::fetch(mesh, kc.tensor("self"), cuts, boundary, value)});
  };
  return plan;
}

// *_pad{1,2,3}d_backward(grad_output, self, padding)
OpPlan pad_backward_rule_with(const OpCall& call, HaloBoundary boundary) {
  const auto& in = *call.spec("self");
  const auto p =
      pad_plan(call.describe(), in.sizes(), call.arg<std::vector<int64_t>>("padding"), false);
  auto layout = spatial::window_layout(in, p.dims, /*keep_others=*/true);
  const auto cuts = spatial::make_cuts(*layout, p.dims, p.axes);
  OpPlan plan(call);
  plan.input("self", layout);
  plan.input("grad_output", spatial::output_spec(*layout, cuts, call.spec("grad_output")->dtype()));
  plan.output(layout);
  plan.distributed_kernel = [cuts, boundary](KernelCall& kc, const DeviceMesh& mesh) {
    kc.finish({spatial::fetch_backward(mesh, kc.tensor("grad_output"), cuts, boundary)});
  };
  return plan;
}

OpPlan constant_pad_rule(const OpCall& c) { return pad_rule_with(c, HaloBoundary::Zeros); }
OpPlan reflection_pad_rule(const OpCall& c) { return pad_rule_with(c, HaloBoundary::Reflect); }
OpPlan replication_pad_rule(const OpCall& c) { return pad_rule_with(c, HaloBoundary::Replicate); }
OpPlan reflection_pad_backward_rule(const OpCall& c) {
  return pad_backward_rule_with(c, HaloBoundary::Reflect);
}
OpPlan replication_pad_backward_rule(const OpCall& c) {
  return pad_backward_rule_with(c, HaloBoundary::Replicate);
}

// ---- circular padding: an autograd kernel for distributed tensors ----------------------

struct CircularPad {
  DeviceMesh mesh;
  SpecPtr layout, out;
  std::vector<DimCut> cuts;
};

CircularPad circular_plan(const DTensorSpec& in, c10::IntArrayRef pad) {
  const std::string op = "aten::_pad_circular(" + in.str() + ", pad " + shape_str(pad.vec()) + ")";
  const auto p = pad_plan(op, in.sizes(), pad.vec(), true);
  check_reach(op, in.sizes(), p, HaloBoundary::Periodic);
  CircularPad c;
  c.mesh = in.mesh();
  c.layout = spatial::window_layout(in, p.dims, /*keep_others=*/true);
  c.cuts = spatial::make_cuts(*c.layout, p.dims, p.axes);
  c.out = spatial::output_spec(*c.layout, c.cuts, in.dtype());
  return c;
}

struct CircularPadBackward : torch::autograd::Node {
  CircularPad plan;
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    at::Tensor g = grads[0];
    if (!is_dtensor(g) || spec(g) != *plan.out) g = redistribute(g, plan.out);
    at::Tensor local = spatial::fetch_backward(plan.mesh, dtensor_impl(g)->local(), plan.cuts,
                                               HaloBoundary::Periodic);
    return {make_dtensor(local, plan.layout)};
  }
  std::string name() const override { return "tessera::CircularPadBackward"; }
};

at::Tensor pad_circular(const at::Tensor& self, c10::IntArrayRef pad) {
  // Halos read positions: a head-tail input is relayed into position order (NOTE:
  // [Head-tail order]).
  auto plan = circular_plan(dtensor_impl(self, "aten::_pad_circular")->spec().natural_spec(), pad);
  at::Tensor laid = spec(self) == *plan.layout ? self : redistribute(self, plan.layout);
  at::Tensor local;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    local =
        spatial::fetch(plan.mesh, dtensor_impl(laid)->local(), plan.cuts, HaloBoundary::Periodic);
  }
  at::Tensor out = make_dtensor(local, plan.out);
  if (laid.requires_grad() && at::GradMode::is_enabled()) {
    auto node = compat::make_node<CircularPadBackward>();
    node->plan = std::move(plan);
    node->set_next_edges(torch::autograd::collect_next_edges(laid));
    torch::autograd::set_history(out, node);
  }
  return out;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::constant_pad_nd", constant_pad_rule);
  for (const char* op :
       {"aten::reflection_pad1d", "aten::reflection_pad2d", "aten::reflection_pad3d"})
    register_rule(op, reflection_pad_rule);
  for (const char* op :
       {"aten::replication_pad1d", "aten::replication_pad2d", "aten::replication_pad3d"})
    register_rule(op, replication_pad_rule);
  for (const char* op : {"aten::reflection_pad1d_backward", "aten::reflection_pad2d_backward",
                         "aten::reflection_pad3d_backward"})
    register_rule(op, reflection_pad_backward_rule);
  for (const char* op : {"aten::replication_pad1d_backward", "aten::replication_pad2d_backward",
                         "aten::replication_pad3d_backward"})
    register_rule(op, replication_pad_backward_rule);
  register_autograd_kernel("aten::_pad_circular", torch::CppFunction(TORCH_FN(pad_circular)));
}};

}  // namespace

}  // namespace tessera::ops
