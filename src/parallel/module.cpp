#include "tessera/parallel/module.h"

#include <mutex>

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/functional/instancenorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

namespace {

using TensorDict = torch::OrderedDict<std::string, at::Tensor>;

// Module's registries: parameters_ is protected (a derived class may name it); buffers_ is
// private, reached through an explicit template instantiation, where access is not checked.
struct Registry : torch::nn::Module {
  static TensorDict torch::nn::Module::*parameters() { return &Registry::parameters_; }
};
TensorDict torch::nn::Module::*buffers_member();
template <TensorDict torch::nn::Module::*Member>
struct BufferAccess {
  friend TensorDict torch::nn::Module::*buffers_member() { return Member; }
};
template struct BufferAccess<&torch::nn::Module::buffers_>;

template <class Impl>
at::Tensor* weight_bias(Impl& m, const std::string& name) {
  if (name == "weight") return &m.weight;
  if (name == "bias") return &m.bias;
  return nullptr;
}

template <class Impl>
at::Tensor* norm_members(Impl& m, const std::string& name) {
  if (name == "weight") return &m.weight;
  if (name == "bias") return &m.bias;
  if (name == "running_mean") return &m.running_mean;
  if (name == "running_var") return &m.running_var;
  if (name == "num_batches_tracked") return &m.num_batches_tracked;
  return nullptr;
}

struct Accessors {
  std::mutex mu;
  std::vector<MemberAccessor> list;
  Accessors() {
    using namespace torch::nn;
    auto add = [this](auto f) { list.push_back(f); };
    add(accessor<LinearImpl>(weight_bias<LinearImpl>));
    add(accessor<BilinearImpl>(weight_bias<BilinearImpl>));
    add(accessor<Conv1dImpl>(weight_bias<Conv1dImpl>));
    add(accessor<Conv2dImpl>(weight_bias<Conv2dImpl>));
    add(accessor<Conv3dImpl>(weight_bias<Conv3dImpl>));
    add(accessor<ConvTranspose1dImpl>(weight_bias<ConvTranspose1dImpl>));
    add(accessor<ConvTranspose2dImpl>(weight_bias<ConvTranspose2dImpl>));
    add(accessor<ConvTranspose3dImpl>(weight_bias<ConvTranspose3dImpl>));
    add(accessor<LayerNormImpl>(weight_bias<LayerNormImpl>));
    add(accessor<GroupNormImpl>(weight_bias<GroupNormImpl>));
    add(accessor<BatchNorm1dImpl>(norm_members<BatchNorm1dImpl>));
    add(accessor<BatchNorm2dImpl>(norm_members<BatchNorm2dImpl>));
    add(accessor<BatchNorm3dImpl>(norm_members<BatchNorm3dImpl>));
    add(accessor<InstanceNorm1dImpl>(norm_members<InstanceNorm1dImpl>));
    add(accessor<InstanceNorm2dImpl>(norm_members<InstanceNorm2dImpl>));
    add(accessor<InstanceNorm3dImpl>(norm_members<InstanceNorm3dImpl>));
    add([](Module& m, const std::string& name) -> at::Tensor* {
      auto* e = dynamic_cast<EmbeddingImpl*>(&m);
      return e && name == "weight" ? &e->weight : nullptr;
    });
  }
  template <class Impl, class F>
  static MemberAccessor accessor(F f) {
    return [f](torch::nn::Module& m, const std::string& name) -> at::Tensor* {
      auto* impl = dynamic_cast<Impl*>(&m);
      return impl ? f(*impl, name) : nullptr;
    };
  }
};

Accessors& accessors() {
  static Accessors a;
  return a;
}

}  // namespace

void register_member_accessor(MemberAccessor accessor) {
  auto& a = accessors();
  std::lock_guard<std::mutex> lock(a.mu);
  a.list.push_back(std::move(accessor));
}

void replace_parameter(torch::nn::Module& module, const std::string& name, at::Tensor value) {
  auto& params = module.*Registry::parameters();
  auto& buffers = module.*buffers_member();
  at::Tensor* entry = params.find(name);
  const bool is_param = entry != nullptr;
  if (!entry) entry = buffers.find(name);
  TORCH_CHECK(entry, "tessera: replace_parameter: module ", module.name(),
              " has no parameter or buffer named \"", name, "\" (submodule entries are replaced ",
              "on the submodule itself)");
  at::Tensor* member = nullptr;
  {
    auto& a = accessors();
    std::lock_guard<std::mutex> lock(a.mu);
    for (auto& f : a.list)
      if ((member = f(module, name))) break;
  }
  TORCH_CHECK(member || !entry->defined(), "tessera: replace_parameter: ", module.name(),
              " keeps \"", name, "\" in a member tessera does not know; its forward() would go on ",
              "using the old tensor. Register an accessor with tessera::register_member_accessor");
  if (is_param && value.defined()) {
    value = value.detach().requires_grad_(entry->requires_grad());
    if (value.requires_grad() && is_dtensor(value)) {
      // A parameter's gradient takes the parameter's own layout as it arrives: a replicated
      // weight used on sharded activations gets Partial terms, reduced here once (one
      // all-reduce per mesh dim) instead of each time the optimizer reads the gradient.
      SpecPtr target = dtensor_impl(value)->spec_ptr();
      value.register_hook([target](const at::Tensor& g) -> at::Tensor {
        if (!g.defined() || !is_dtensor(g) || spec(g) == *target) return g;
        // (in the gradient's own dtype, should it differ from the parameter's)
        return redistribute(g, std::make_shared<DTensorSpec>(target->mesh(), target->placements(),
                                                             target->sizes(), g.scalar_type(),
                                                             target->shard_tables()));
      });
    }
  }
  *entry = value;
  if (member) *member = value;
}

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn) {
  auto visit = [&](const std::string& name, torch::nn::Module& m) {
    if (partition_fn) {
      partition_fn(name, m, mesh);
      return;
    }
    Placements rep(mesh.ndim(), Replicate());
    for (const auto& item : m.named_parameters(/*recurse=*/false))
      if (item.value().defined()) distribute_parameter(m, item.key(), mesh, rep);
    for (const auto& item : m.named_buffers(/*recurse=*/false))
      if (item.value().defined()) distribute_parameter(m, item.key(), mesh, rep);
  };
  visit("", module);
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false))
    visit(item.key(), *item.value());
}

void distribute_parameter(torch::nn::Module& module, const std::string& name,
                          const DeviceMesh& mesh, const Placements& placements) {
  // (named_parameters returns a dictionary by value: keep it alive while reading from it)
  at::Tensor current;
  const auto params = module.named_parameters(/*recurse=*/false);
  const auto buffers = module.named_buffers(/*recurse=*/false);
  if (const auto* p = params.find(name)) current = *p;
  else if (const auto* b = buffers.find(name)) current = *b;
  TORCH_CHECK(current.defined(), "tessera: distribute_parameter: module ", module.name(),
              " has no parameter or buffer named \"", name, "\"");
  replace_parameter(module, name,
                    distribute_tensor(current.detach(), mesh, placements, std::nullopt));
}

}  // namespace tessera
