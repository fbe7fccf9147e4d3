// The ops built-in leaves are, taken at the autograd key of distributed tensors so a
// tensor-parallel module's boundary runs around them (NOTE: [Module boundaries without
// hooks] in tensor_parallel.h). Calls whose parameter carries no tag run the usual way.
//
//   Linear    -> F::linear is inline C++: addmm(bias, x, weight.t()) for 2-d inputs with a
//                bias, else matmul(x, weight.t()) then `+= bias`; at::linear for direct calls.
//                The weight is recognised through its transposed view's storage.
//   LayerNorm -> aten::layer_norm  (CompositeImplicitAutograd: native_layer_norm)
//   Embedding -> aten::embedding   (has its own autograd formula: rebuilt here as a node
//                                   whose backward is embedding_backward, as on one device)
//   Dropout   -> aten::dropout and its family: checked only (NOTE: [Plain dropout on local
//                shards] in tp_boundary.h), then LibTorch's own composite implementation
//
// NOTE: [Linear with bias]
// On inputs with other than 2 dims, F::linear adds the bias in place after matmul returns,
// outside any op Tessera sees as the module's. The matmul anchor therefore converts layouts
// but keeps the output distributed (the bias add is exact on distributed tensors); a style
// asking for a local output there is an error naming the way out (use_local_output(false)).
// addmm (2-d inputs) has its own autograd formula; untagged calls go to it unchanged.
#include <ATen/ATen.h>
#include <ATen/ops/alpha_dropout_native.h>
#include <ATen/ops/dropout_native.h>
#include <ATen/ops/feature_alpha_dropout_native.h>
#include <ATen/ops/feature_dropout_native.h>
#include <ATen/ops/linear_native.h>
#include <ATen/ops/matmul_native.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "tessera/compat_autograd.h"
#include "tessera/tensor/rule.h"
#include "tessera/placement/spec.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"
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

// NOTE: [Row splits through a linear layer]
// matmul(x [..., L, in], w [in, out]) folds x's leading dims into rows of one mm. A split of
// L (context parallelism's sequence, under a batch) does not survive that fold: the view
// would gather it. As bmm against w expanded over the batch (a view, no copy), L stays a row
// dim and keeps its split; w's gradient is the batch's sum, as on one device. Taken when L
// is split and no batch dim but the first is (those are folded into bmm's batch). Cost: the
// weight's gradient passes through a [batch, in, out] product before that sum (batch x the
// weight, transient); with one sequence per rank, the long-context case, that is the weight.
bool keep_row_split(const at::Tensor& self, const at::Tensor& other) {
  if (!tessera::is_dtensor(self) || self.dim() < 3 || other.dim() != 2) return false;
  const DTensorSpec& s = tessera::spec(self);
  for (int64_t d = 1; d + 2 < self.dim(); ++d)
    if (!s.mesh_dims_sharding(d).empty()) return false;
  return !s.mesh_dims_sharding(self.dim() - 2).empty();
}

at::Tensor row_split_matmul(const at::Tensor& self, const at::Tensor& other) {
  if (!keep_row_split(self, other)) return at::native::matmul(self, other);
  const int64_t rows = self.size(-2), in = self.size(-1), out = other.size(1);
  int64_t batch = 1;  // (not -1: a 0-row or 0-feature input has no size to infer it from)
  for (int64_t d = 0; d + 2 < self.dim(); ++d) batch *= self.size(d);
  const at::Tensor x = self.reshape({batch, rows, in});  // (only the outermost dim may be split)
  auto sizes = self.sizes().vec();
  sizes.back() = out;
  // (_unsafe_view, as matmul: the result is no view, so F::linear may add a bias in place)
  return at::_unsafe_view(at::bmm(x, other.unsqueeze(0).expand({x.size(0), in, out})), sizes);
}

// matmul(self, other): a tagged weight's transposed view as `other`.
at::Tensor matmul_kernel(const at::Tensor& self, const at::Tensor& other) {
  BoundaryPtr b = boundary_of_view(other);
  if (!b) return row_split_matmul(self, other);
  at::Tensor x = enter(*b, self, "aten::matmul");
  return leave(*b, row_split_matmul(x, other), "aten::matmul", /*allow_local=*/!b->linear_bias);
}

// The boxed kernels read their arguments by name; the stack holds exactly the op's arguments.
ops::KernelCall arguments_of(const c10::OperatorHandle& op, Stack* stack) {
  TORCH_INTERNAL_ASSERT(stack->size() == op.schema().arguments().size(), op.schema().name(),
                        ": expected a stack of its ", op.schema().arguments().size(),
                        " arguments, got ", stack->size());
  return ops::KernelCall(op, *stack);
}

// addmm(self, mat1, mat2, *, beta, alpha): F::linear on 2-d inputs with a bias.
void addmm_kernel(const c10::OperatorHandle& op, Stack* stack) {
  ops::KernelCall call = arguments_of(op, stack);
  const at::Tensor wt = call.tensor("mat2");
  BoundaryPtr b = boundary_of_view(wt);
  if (!b) {
    // The autograd kernel LibTorch registers for every backend (derivatives.yaml's addmm).
    c10::Dispatcher::singleton().callBoxedForDispatchKey(op, c10::DispatchKey::Autograd, stack);
    return;
  }
  const at::Tensor bias = call.tensor("self");
  at::Tensor x = call.tensor("mat1");
  const c10::Scalar beta = call.arg("beta").toScalar(), alpha = call.arg("alpha").toScalar();
  x = enter(*b, x, "aten::addmm");
  at::Tensor out = at::mm(x, wt);
  if (!(alpha.isIntegral(false) && alpha.toLong() == 1)) out = out * alpha;
  out = (beta.isIntegral(false) && beta.toLong() == 1) ? out + bias : out + bias * beta;
  call.finish({leave(*b, out, "aten::addmm")});
}

// layer_norm(input, normalized_shape, weight?, bias?, eps, cudnn_enable)
void layer_norm_kernel(const c10::OperatorHandle& op, Stack* stack) {
  ops::KernelCall call = arguments_of(op, stack);
  at::Tensor input = call.tensor("input");
  const std::vector<int64_t> shape = call.arg("normalized_shape").toIntVector();
  const auto weight = call.arg("weight").toOptional<at::Tensor>();
  const auto bias = call.arg("bias").toOptional<at::Tensor>();
  const double eps = call.arg("eps").toDouble();
  BoundaryPtr b = weight ? boundary_of(*weight) : nullptr;
  if (b) input = enter(*b, input, "aten::layer_norm");
  at::Tensor out = std::get<0>(at::native_layer_norm(input, shape, weight, bias, eps));
  if (b) out = leave(*b, out, "aten::layer_norm");
  call.finish({std::move(out)});
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
void embedding_kernel(const c10::OperatorHandle& op, Stack* stack) {
  ops::KernelCall call = arguments_of(op, stack);
  const at::Tensor weight = call.tensor("weight");
  at::Tensor indices = call.tensor("indices");
  const int64_t padding_idx = call.arg("padding_idx").toInt();
  const bool scale = call.arg("scale_grad_by_freq").toBool();
  const bool sparse = call.arg("sparse").toBool();
  BoundaryPtr b = boundary_of(weight);
  if (b) indices = enter(*b, indices, "aten::embedding");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = at::embedding(weight, indices, padding_idx, scale, sparse);
  }
  if (weight.requires_grad() && at::GradMode::is_enabled()) {
    auto node = compat::make_node<EmbeddingBackward>();
    node->indices = indices;
    node->num_weights = weight.size(0);
    node->padding_idx = padding_idx;
    node->scale_grad_by_freq = scale;
    node->sparse = sparse;
    node->set_next_edges(torch::autograd::collect_next_edges(weight));
    torch::autograd::set_history(out, node);
  }
  if (b) out = leave(*b, out, "aten::embedding");
  call.finish({std::move(out)});
}

// NOTE: [Plain dropout on local shards] (tp_boundary.h): the dropout family, for every tensor;
// anything but a plain dropout that draws while a local shard is open runs as LibTorch's.
void check_plain_dropout(const char* op, const at::Tensor& input, double p, bool train) {
  if (!train || p == 0 || !input.defined() || tessera::is_dtensor(input)) return;
  const auto where = open_local_shard();
  if (!where) return;
  TORCH_CHECK(false, "tessera: ", op, "(p=", p, ", train=true) on a plain tensor of shape ",
              shape_str(input.sizes().vec()), " while the local shard output of ", *where,
              " is in use. Each rank would draw its own mask for its shard, which is not one "
              "device's dropout (ranks seeded alike would even give every shard the same mask). "
              "Keep that output distributed with use_local_output(false) on the style (model "
              "code runs unchanged on distributed tensors) and dropout equals one device; or "
              "move the dropout after the RowwiseParallel module that reads the shards back");
}

#define TESSERA_DROPOUT_KERNELS(name)                                       \
  at::Tensor name##_kernel(const at::Tensor& input, double p, bool train) { \
    check_plain_dropout("aten::" #name, input, p, train);                   \
    return at::native::name(input, p, train);                               \
  }                                                                         \
  at::Tensor& name##__kernel(at::Tensor& self, double p, bool train) {      \
    check_plain_dropout("aten::" #name "_", self, p, train);                \
    return at::native::name##_(self, p, train);                             \
  }
TESSERA_DROPOUT_KERNELS(dropout)
TESSERA_DROPOUT_KERNELS(feature_dropout)
TESSERA_DROPOUT_KERNELS(alpha_dropout)
TESSERA_DROPOUT_KERNELS(feature_alpha_dropout)
#undef TESSERA_DROPOUT_KERNELS

template <class Impl>
bool is_a(const torch::nn::Module& m) {
  return dynamic_cast<const Impl*>(&m) != nullptr;
}

bool is_affine_layer_norm(const torch::nn::Module& m) {
  auto* ln = dynamic_cast<const torch::nn::LayerNormImpl*>(&m);
  return ln && ln->options.elementwise_affine();
}

// The anchored ops' kernels, by name; every op of anchored_modules() has one.
torch::CppFunction anchor_kernel(const std::string& op) {
  if (op == "aten::linear") return torch::CppFunction(TORCH_FN(linear_kernel));
  if (op == "aten::matmul") return torch::CppFunction(TORCH_FN(matmul_kernel));
  if (op == "aten::addmm") return torch::CppFunction::makeFromBoxedFunction<&addmm_kernel>();
  if (op == "aten::layer_norm")
    return torch::CppFunction::makeFromBoxedFunction<&layer_norm_kernel>();
  TORCH_INTERNAL_ASSERT(op == "aten::embedding", "tessera: no tensor-parallel anchor kernel for ",
                        op);
  return torch::CppFunction::makeFromBoxedFunction<&embedding_kernel>();
}

const ops::RuleRegistrar registrar{[] {
#define TESSERA_EVERY(name, kernel)               \
  ops::register_autograd_kernel_for_every_tensor( \
      name, [] { return torch::CppFunction(TORCH_FN(kernel)); })
  TESSERA_EVERY("aten::dropout", dropout_kernel);
  TESSERA_EVERY("aten::dropout_", dropout__kernel);
  TESSERA_EVERY("aten::feature_dropout", feature_dropout_kernel);
  TESSERA_EVERY("aten::feature_dropout_", feature_dropout__kernel);
  TESSERA_EVERY("aten::alpha_dropout", alpha_dropout_kernel);
  TESSERA_EVERY("aten::alpha_dropout_", alpha_dropout__kernel);
  TESSERA_EVERY("aten::feature_alpha_dropout", feature_alpha_dropout_kernel);
  TESSERA_EVERY("aten::feature_alpha_dropout_", feature_alpha_dropout__kernel);
#undef TESSERA_EVERY
  for (const auto& module : anchored_modules())
    for (const char* op : module.ops) ops::register_autograd_kernel(op, anchor_kernel(op));
}};

}  // namespace

// See NOTE: [Interceptable modules] in tp_boundary.h.
const std::vector<AnchoredModule>& anchored_modules() {
  static const std::vector<AnchoredModule> table{
      {"Linear", &is_a<torch::nn::LinearImpl>, {"aten::linear", "aten::matmul", "aten::addmm"}},
      {"Embedding", &is_a<torch::nn::EmbeddingImpl>, {"aten::embedding"}},
      {"LayerNorm", &is_affine_layer_norm, {"aten::layer_norm"}},
  };
  return table;
}

std::string anchored_module_names() {
  const auto& t = anchored_modules();
  std::string s;
  for (size_t i = 0; i < t.size(); ++i)
    s += std::string(i == 0 ? "" : i + 1 == t.size() ? " or " : ", ") + t[i].name;
  return s;
}

void ensure_anchors_registered() {}

}  // namespace tessera::tp::detail
