#pragma once
// torch.distributed.fsdp.fully_shard (FSDP2) for LibTorch modules: parameters sharded along
// dim 0 over a data-parallel mesh dim, gathered when an op first reads them, freed after
// use, gradients reduce-scattered. See docs/fsdp.md and NOTE: [Gather on first touch] in
// src/parallel/fsdp_group.cpp.
//
// Tessera computes exact global means over distributed inputs, so gradients arrive as sums
// (Partial(sum)) over every mesh dim the activations were sharded on and are reduced with SUM,
// never divided: correct for uneven per-rank batches too. Wrap each rank's local batch with
// from_local(x, mesh.root(), {Shard(0), ...}).
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include "tessera/mesh/device_mesh.h"

namespace tessera {

struct MixedPrecisionPolicy {
  // Dtype of the unsharded parameters (all-gather and compute); the sharded parameters the
  // optimizer steps keep their own dtype. nullopt: no cast.
  std::optional<c10::ScalarType> param_dtype;
  // Dtype of the gradient reduction; nullopt: the unsharded gradient's dtype.
  std::optional<c10::ScalarType> reduce_dtype;
};

struct FullyShardOptions {
  // Free the unsharded parameters once forward has moved on to another group. nullopt: true,
  // except for the root (the outermost group), whose parameters backward needs first.
  TORCH_ARG(std::optional<bool>, reshard_after_forward) = std::nullopt;
  TORCH_ARG(MixedPrecisionPolicy, mp_policy) = {};
};

namespace detail {
class FsdpGroup;
}

// The handle fully_shard returns (torch's FSDPModule methods); also found with
// fsdp_module_of. Every method is local to this rank except unshard (an all-gather: call it
// on every rank).
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<detail::FsdpGroup> group) : group_(std::move(group)) {}

  // Gathers the group's parameters now (collective); reshard frees them (local).
  void unshard();
  void reshard();
  bool is_unsharded() const;

  // false = torch's no_sync: gradients accumulate unsharded (in the parameters' compute
  // dtype), without communication; the next backward with sync on reduces the sum.
  void set_requires_gradient_sync(bool requires_sync);
  void set_reshard_after_forward(bool reshard);
  // Off: the unsharded parameters stay after backward (micro-batches without a step between);
  // call reshard() before the optimizer steps, or forward would read stale values.
  void set_reshard_after_backward(bool reshard);

  // Prefetching (torch's FSDPModule methods of the same names). By default, when forward (or
  // backward) gathers this group, the all-gather of the group that came next in the previous
  // iteration's forward (backward) is started at once and runs on the backend's threads
  // while this group computes. These replace that guess for this group: the groups of
  // `modules` (each one fully_shard was applied to) are started instead; an empty list turns
  // prefetching off here. Every rank must set the same lists.
  void set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules);
  void set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<FSDPModule>>& modules);

  const DeviceMesh& mesh() const;  // the mesh fully_shard was given
  // The group's parameters, qualified from the module fully_shard was applied to.
  std::vector<std::string> parameter_names() const;
  // The tensors forward() reads (replicated over the data-parallel dims), in the order of
  // parameter_names(); their storage is empty while resharded.
  std::vector<at::Tensor> unsharded_parameters() const;

  const std::shared_ptr<detail::FsdpGroup>& group() const { return group_; }

 private:
  std::shared_ptr<detail::FsdpGroup> group_;
};

// Shards the parameters of `module` not already owned by a fully_shard call on one of its
// submodules (apply bottom-up: blocks first, then the root) as one group. `mesh`: 1-D ->
// FSDP, each parameter Shard(0) (torch.chunk layout: uneven and empty shards allowed) over
// it; 2-D (replicate, shard) -> HSDP. Parameters live on mesh.root(), replicated over the
// root's other dims, so they meet activations sharded over those dims (e.g. "domain") in one
// op. Tensor-parallel parameters (parallelize_module on another dim of the same root, before
// fully_shard) keep their tensor-parallel layout when gathered; the data-parallel rows nest
// inside the tensor-parallel shard (see docs/fsdp.md, "FSDP over tensor parallel"). Afterwards
// module.parameters() are the sharded parameters (give those to the optimizer); forward() reads
// unsharded ones, gathered on first use. Every rank must call it with the same module structure and
// the same initial values (nothing is broadcast).
std::shared_ptr<FSDPModule> fully_shard(torch::nn::Module& module, const DeviceMesh& mesh,
                                        FullyShardOptions options = {});
template <class Impl>
std::shared_ptr<FSDPModule> fully_shard(torch::nn::ModuleHolder<Impl>& module,
                                        const DeviceMesh& mesh, FullyShardOptions options = {}) {
  return fully_shard(*module, mesh, std::move(options));
}

// The handle of a fully_shard call on exactly this module, or nullptr.
std::shared_ptr<FSDPModule> fsdp_module_of(const torch::nn::Module& module);

// Parameters then buffers of `module` as full (unsharded, undistributed) tensors, named as
// named_parameters() / named_buffers() name them. Collective: every rank calls it.
torch::OrderedDict<std::string, at::Tensor> full_state_dict(torch::nn::Module& module);

}  // namespace tessera
