#pragma once
// Making a torch::nn module's parameters distributed, without changing the module's code.
//
// NOTE: [Swapping module parameters]
// A LibTorch module holds each parameter twice: in its registry (what parameters() returns)
// and in a member handle (LinearImpl::weight) that forward() reads. Both point at one plain
// TensorImpl, which cannot become a distributed one in place, so swapping a parameter means
// updating both handles. The registry is reached through Module's protected members; member
// handles through accessors registered per module type (all built-in modules with weight /
// bias / running-stat members are registered; add your own with register_member_accessor).
#include <functional>
#include <string>
#include <typeindex>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "tessera/mesh/device_mesh.h"
#include "tessera/placement/placement.h"

namespace tessera {

// Returns the member handle of `module` that holds parameter/buffer `name`, or nullptr.
using MemberAccessor =
    std::function<at::Tensor*(torch::nn::Module& module, const std::string& name)>;
// Accessor for every module whose dynamic type is ModuleImpl.
void register_member_accessor(MemberAccessor accessor);
template <class ModuleImpl, class F>
void register_member_accessor(F member_of) {
  register_member_accessor(
      [member_of](torch::nn::Module& m, const std::string& name) -> at::Tensor* {
        auto* impl = dynamic_cast<ModuleImpl*>(&m);
        return impl ? member_of(*impl, name) : nullptr;
      });
}

// The module types with a built-in member accessor, each once: every built-in LibTorch module
// that registers parameters or buffers of its own (modules holding parameters only through
// children, such as TransformerEncoderLayer, need none). For tests that check each is used.
std::vector<std::type_index> builtin_member_accessor_types();

// Replaces the directly registered parameter or buffer `name` of `module` (not a submodule's)
// with `value`, in the registry and in the member handle. Parameters become leaves with the
// old parameter's requires_grad. Throws if the module has no such entry, or if it is a
// module type without a member accessor whose forward() would keep using the old tensor.
void replace_parameter(torch::nn::Module& module, const std::string& name, at::Tensor value);

// For fully_shard: registers `registered` as parameter `name` of `module` (what parameters(),
// optimizers and state dicts see) and points the member handles forward() reads at `member`.
// Both are stored as given (no gradient-layout hook, requires_grad untouched). Throws, naming
// the module and the fix, if forward() reads the registry itself (ParameterDict,
// ParameterList) or the module type has no member accessor.
void split_parameter(torch::nn::Module& module, const std::string& name, at::Tensor registered,
                     at::Tensor member);
// The checks of split_parameter alone, changing nothing (so a caller can check every
// parameter before it changes any).
void check_splittable(torch::nn::Module& module, const std::string& name);

// torch.distributed.tensor.distribute_module: calls partition_fn(qualified_name, submodule,
// mesh) for the module and every submodule; partition_fn typically calls replace_parameter
// with distribute_tensor(...). Without partition_fn every parameter and buffer is
// replicated.
using PartitionFn =
    std::function<void(const std::string& name, torch::nn::Module& module, const DeviceMesh& mesh)>;
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn = {});

// Convenience: the parameter `name` of `module`, distributed with `placements` (each rank's
// copy is sliced locally: every rank must hold the same initial values).
void distribute_parameter(torch::nn::Module& module, const std::string& name,
                          const DeviceMesh& mesh, const Placements& placements);

// The module itself ("") then its submodules, with their paths: what
// named_modules(include_self=true) gives, also for a module no shared_ptr holds (a model on
// the stack, `Net net;`), which LibTorch's named_modules refuses.
std::vector<std::pair<std::string, torch::nn::Module*>> modules_with_self(
    torch::nn::Module& module);

}  // namespace tessera
