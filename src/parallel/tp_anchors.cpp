// The ops built-in leaves are, taken at the autograd key of distributed tensors so a
// tensor-parallel module's boundary runs around them (NOTE: [Module boundaries without
// hooks] in tensor_parallel.h). Calls whose parameter carries no tag run the usual way.
//
//   Linear    -> aten::linear      (CompositeImplicitAutograd: we decompose it ourselves)
//   LayerNorm -> aten::layer_norm  (CompositeImplicitAutograd: native_layer_norm)
//   Embedding -> aten::embedding   (has its own autograd formula: rebuilt here as a node
//                                   whose backward is embedding_backward, as on one device)
#include <ATen/ATen.h>
#include <ATen/ops/linear_native.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "tessera/ops/rule.h"
#include "tp_boundary.h"

namespace tessera::tp::detail {

namespace {

using torch::jit::Stack;

at::Tensor linear_kernel(const at::Tensor& input, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias) {
  BoundaryPtr b = boundary_of(weight);
  if (!b) return at::native::linear(input, weight, bias);
  at::Tensor x = enter(*b, input, "aten::linear");
  return leave(*b, at::native::linear(x, weight, bias), "aten::linear");
}

// layer_norm(input, normalized_shape, weight?, bias?, eps, cudnn_enable)
void layer_norm_kernel(const c10::OperatorHandle&, Stack* stack) {
  const size_t n = stack->size();
  at::Tensor input = (*stack)[n - 6].toTensor();
  const std::vector<int64_t> shape = (*stack)[n - 5].toIntVector();
  const auto weight = (*stack)[n - 4].toOptional<at::Tensor>();
  const auto bias = (*stack)[n - 3].toOptional<at::Tensor>();
  const double eps = (*stack)[n - 2].toDouble();
  stack->resize(n - 6);
  BoundaryPtr b = weight ? boundary_of(*weight) : nullptr;
  if (b) input = enter(*b, input, "aten::layer_norm");
  at::Tensor out = std::get<0>(at::native_layer_norm(input, shape, weight, bias, eps));
  if (b) out = leave(*b, out, "aten::layer_norm");
  stack->emplace_back(std::move(out));
}

// embedding's backward, as derivatives.yaml has it on one device.
struct EmbeddingBackward : torch::autograd::Node {
  at::Tensor indices;
  int64_t num_weights = 0, padding_idx = -1;
  bool scale_grad_by_freq = false, sparse = false;
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {at::embedding_backward(grads[0], indices, num_weights, padding_idx, scale_grad_by_freq,
                                   sparse)};
  }
  void release_variables() override { indices.reset(); }
  std::string name() const override { return "tessera::EmbeddingBackward"; }
};

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
void embedding_kernel(const c10::OperatorHandle&, Stack* stack) {
  const size_t n = stack->size();
  const at::Tensor weight = (*stack)[n - 5].toTensor();
  at::Tensor indices = (*stack)[n - 4].toTensor();
  const int64_t padding_idx = (*stack)[n - 3].toInt();
  const bool scale = (*stack)[n - 2].toBool();
  const bool sparse = (*stack)[n - 1].toBool();
  stack->resize(n - 5);
  BoundaryPtr b = boundary_of(weight);
  if (b) indices = enter(*b, indices, "aten::embedding");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = at::embedding(weight, indices, padding_idx, scale, sparse);
  }
  if (weight.requires_grad() && at::GradMode::is_enabled()) {
    auto node = std::shared_ptr<EmbeddingBackward>(new EmbeddingBackward(),
                                                   torch::autograd::deleteNode);
    node->indices = indices;
    node->num_weights = weight.size(0);
    node->padding_idx = padding_idx;
    node->scale_grad_by_freq = scale;
    node->sparse = sparse;
    node->set_next_edges(torch::autograd::collect_next_edges(weight));
    torch::autograd::set_history(out, node);
  }
  if (b) out = leave(*b, out, "aten::embedding");
  stack->emplace_back(std::move(out));
}

const ops::RuleRegistrar registrar{[] {
  ops::register_autograd_kernel("aten::linear", torch::CppFunction(TORCH_FN(linear_kernel)));
  ops::register_autograd_kernel("aten::layer_norm",
                                torch::CppFunction::makeFromBoxedFunction<&layer_norm_kernel>());
  ops::register_autograd_kernel("aten::embedding",
                                torch::CppFunction::makeFromBoxedFunction<&embedding_kernel>());
}};

}  // namespace

void ensure_anchors_registered() {}

}  // namespace tessera::tp::detail
