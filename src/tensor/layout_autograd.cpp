// The differentiable layout changes: redistribute, from_local's wrap, to_local, full_tensor
// and scatter, each with its backward as an autograd Node (NOTE: [Backward of layout changes]).
#include "layout_autograd.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "comm/wait.h"
#include "tessera/compat_autograd.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

using torch::autograd::Node;
using torch::autograd::variable_list;
using detail::redistribute_to;
using detail::wrap_local;

namespace {

bool needs_grad(const at::Tensor& t) { return t.requires_grad() && at::GradMode::is_enabled(); }

void connect(const compat::NodePtr<Node>& node, const at::Tensor& input, at::Tensor& out) {
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(out, node);
}

// NOTE: [Backward of layout changes]
// The gradient of a layout change is the reverse layout change, except that a Partial
// source becomes Replicate: a gradient is never split into partial terms (dividing it would
// be wrong, seed 001), and a replicated gradient is the correct gradient of each term.
SpecPtr grad_spec_for(const DTensorSpec& s) {
  return std::make_shared<DTensorSpec>(s.partial_as_replicate());
}

// Incoming gradients may be plain (e.g. autograd's zeros of the global shape).
at::Tensor as_dtensor_grad(const at::Tensor& g, const DTensorSpec& like) {
  if (is_dtensor(g)) return g;
  Placements r(like.mesh().ndim(), Replicate());
  return make_dtensor(
      g, std::make_shared<DTensorSpec>(like.mesh(), r, g.sizes().vec(), g.scalar_type()));
}

SpecPtr with_dtype(const SpecPtr& s, c10::ScalarType dt) {
  if (s->dtype() == dt) return s;
  return std::make_shared<DTensorSpec>(s->mesh(), s->placements(), s->sizes(), dt,
                                       s->shard_tables());
}

struct RedistributeBackward : Node {
  SpecPtr from;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    auto g = as_dtensor_grad(grads[0], *from);
    return {redistribute_to(g, with_dtype(grad_spec_for(*from), g.scalar_type()))};
  }
  std::string name() const override { return "tessera::RedistributeBackward"; }
};

struct ToLocalBackward : Node {
  SpecPtr grad_spec;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    at::Tensor g = grads[0];
    // The local tensor met distributed ones, which admitted it as replicated: its gradient
    // came back distributed, and the local gradient is its whole value.
    if (is_dtensor(g)) g = full_tensor(g);
    return {wrap_local(g, with_dtype(grad_spec, g.scalar_type()))};
  }
  std::string name() const override { return "tessera::ToLocalBackward"; }
};

struct FromLocalBackward : Node {
  SpecPtr spec;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    auto g = as_dtensor_grad(grads[0], *spec);
    return {to_local(redistribute_to(g, with_dtype(grad_spec_for(*spec), g.scalar_type())))};
  }
  std::string name() const override { return "tessera::FromLocalBackward"; }
};

// Only the source rank's data reached the output, so only it gets a gradient.
struct ScatterBackward : Node {
  SpecPtr spec;
  bool is_src = false;
  std::vector<int64_t> input_sizes;
  at::TensorOptions input_options;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    auto full = full_tensor(as_dtensor_grad(grads[0], *spec));
    if (is_src) return {full};
    return {input_sizes.empty() && !input_options.has_dtype()
                ? at::Tensor()
                : at::zeros(input_sizes, input_options)};
  }
  std::string name() const override { return "tessera::ScatterBackward"; }
};

}  // namespace

namespace detail {

at::Tensor redistribute_to(const at::Tensor& x, const SpecPtr& target) {
  auto* d = dtensor_impl(x, "redistribute's input");
  TORCH_CHECK(d->spec().mesh() == target->mesh(), "tessera: redistribute: tensor is on ",
              d->spec().mesh().str(), " but the target is on ", target->mesh().str());
  if (d->spec() == *target && !needs_grad(x)) return x;
  at::Tensor out = make_dtensor(redistribute_local(d->local(), d->spec_ptr(), target), target);
  if (needs_grad(x)) {
    auto node = compat::make_node<RedistributeBackward>();
    node->from = d->spec_ptr();
    connect(node, x, out);
  }
  return out;
}

at::Tensor wrap_local(const at::Tensor& local, const SpecPtr& spec) {
  at::Tensor out = make_dtensor(local.detach(), spec);
  if (needs_grad(local)) {
    auto node = compat::make_node<FromLocalBackward>();
    node->spec = spec;
    connect(node, local, out);
  }
  return out;
}

void connect_scatter_backward(at::Tensor& out, const at::Tensor& full, const SpecPtr& spec,
                              bool is_src) {
  if (!at::GradMode::is_enabled()) return;
  auto node = compat::make_node<ScatterBackward>();
  node->spec = spec;
  node->is_src = is_src;
  if (full.defined()) {
    node->input_sizes = full.sizes().vec();
    node->input_options = full.options();
  }
  node->set_next_edges(torch::autograd::collect_next_edges(full));
  torch::autograd::set_history(out, node);
}

}  // namespace detail

at::Tensor to_local(const at::Tensor& dtensor, const std::optional<Placements>& grad_placements) {
  auto* d = dtensor_impl(dtensor, "to_local's input");
  at::Tensor out = d->local().detach();
  if (needs_grad(dtensor)) {
    auto node = compat::make_node<ToLocalBackward>();
    node->grad_spec = grad_placements ? std::make_shared<DTensorSpec>(d->spec().with_placements(
                                            *grad_placements, d->spec().shard_tables()))
                                      : grad_spec_for(d->spec());
    connect(node, dtensor, out);
  }
  return out;
}

at::Tensor full_tensor(const at::Tensor& dtensor) {
  comm::detail::CallerScope caller("full_tensor");  // named if its collective fails
  const auto& s = spec(dtensor);
  return to_local(redistribute_to(dtensor, std::make_shared<DTensorSpec>(s.with_placements(
                                               Placements(s.mesh().ndim(), Replicate())))));
}

}  // namespace tessera
