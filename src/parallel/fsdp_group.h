#pragma once
// One fully_shard parameter group (internal). See NOTE: [Gather on first touch] in
// fsdp_group.cpp.
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include "tessera/compat_autograd.h"
#include "tessera/comm/collectives.h"
#include "tessera/mesh/device_mesh.h"
#include "tessera/parallel/fully_shard.h"

namespace tessera::detail {

struct FsdpParam {
  // Where it is registered: (module, name) pairs, more than one for a tied parameter.
  std::vector<std::pair<torch::nn::Module*, std::string>> owners;
  std::string fqn;       // qualified from the fully_shard module (first owner)
  at::Tensor sharded;    // registered: Shard(0) over the shard dim, the optimizer's
  at::Tensor unsharded;  // read by forward(): replicated over the data-parallel dims
                         // (tensor-parallel shards kept)
  compat::NodePtr<torch::autograd::Node> accumulator;  // unsharded's; held so the hook lives
  std::vector<int64_t> rows;  // dim-0 rows of the unsharded local, per shard-dim rank (chunk)
  std::vector<int64_t> row_offsets;
  int64_t row_numel = 1;         // elements per dim-0 row
  bool ready = false;            // gradient accumulated in this backward
  int64_t gathered_version = 0;  // the sharded parameter's version when last gathered
};

class FsdpContext;
struct GradientReduction;

class FsdpGroup : public std::enable_shared_from_this<FsdpGroup> {
 public:
  FsdpGroup(const torch::nn::Module& module, DeviceMesh mesh, FullyShardOptions options,
            std::shared_ptr<FsdpContext> context);
  ~FsdpGroup();
  FsdpGroup(const FsdpGroup&) = delete;
  FsdpGroup& operator=(const FsdpGroup&) = delete;

  void unshard();  // collective over the shard dim; no-op when unsharded
  // Starts the all-gather and returns (prefetch); unshard() or a touch finishes it.
  void unshard_start();
  void reshard();  // local; drops a started all-gather
  bool unsharded() const { return unsharded_; }
  bool gathering() const { return gathering_; }
  // Unsharded, but a sharded parameter changed since (an optimizer step, a load).
  bool stale() const;

  // The grad-accumulator hook of params[index].
  void on_grad_ready(size_t index);
  // Hands the gradients accumulated so far to a reduction (sync on; see NOTE: [Gradient
  // reduction]), resets readiness, reshards if set.
  void finish_gradients();
  bool any_ready() const { return ready_ > 0; }

  bool is_root() const;  // no live group encloses this one
  bool reshard_after_forward() const;
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool has_ancestor(const FsdpGroup* other) const;

  const torch::nn::Module* module() const { return module_; }
  const std::string& module_name() const { return module_name_; }
  const DeviceMesh& mesh() const { return mesh_; }
  const DeviceMesh& root() const { return root_; }
  int64_t shard_dim() const { return shard_dim_; }  // in the root mesh
  FsdpContext& context() const { return *context_; }

  std::vector<FsdpParam> params;
  std::vector<std::weak_ptr<FsdpGroup>> ancestors;  // groups of enclosing modules
  // set_modules_to_{forward,backward}_prefetch: replace the recorded order when set.
  std::optional<std::vector<std::weak_ptr<FsdpGroup>>> forward_prefetch, backward_prefetch;
  // The parameters as they were before fully_shard: weak, so their memory goes, but their
  // addresses are never reused while the group lives (tied-parameter checks).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> originals;
  FullyShardOptions options;

 private:
  // The ready gradients copied into one reduce-scatter buffer, the unsharded ones dropped.
  std::unique_ptr<GradientReduction> stage_reduction(const std::vector<size_t>& ready);
  c10::ScalarType compute_dtype(const at::Tensor& original) const;

  const torch::nn::Module* module_;
  std::string module_name_;
  DeviceMesh mesh_, root_;
  int64_t shard_dim_;  // in the root mesh
  std::shared_ptr<FsdpContext> context_;
  bool unsharded_ = false;
  bool gathering_ = false;
  comm::PendingAllGather gather_;
  size_t ready_ = 0;
  size_t requiring_grad_ = 0;

 public:
  // After the parameters are added and swapped in: installs the gradient hooks, frees the
  // unsharded storage (groups start sharded) and registers it with the freed-storage handler.
  static void activate(const std::shared_ptr<FsdpGroup>& group);
  c10::ScalarType compute_dtype_of(const at::Tensor& original) const {
    return compute_dtype(original);
  }
};

// Every group of this rank on one root mesh, in creation (bottom-up) order.
class FsdpContext {
 public:
  FsdpContext();
  ~FsdpContext();
  std::vector<std::weak_ptr<FsdpGroup>> groups;
  std::vector<std::shared_ptr<FsdpGroup>> live() const;
  // Once per backward, on its first gradient: the engine's final callback (finish_backward).
  void queue_final_callback();
  void finish_backward();
  // A touch gathered `g` (forward or backward): record the order, start the prefetches.
  void on_gathered(const std::shared_ptr<FsdpGroup>& g, bool backward);
  // NOTE: [Gradient reduction]: queue a staged reduction; start the one staged before (its
  // gradients are gone by now), after finishing the one in flight; finish every one.
  void stage(std::unique_ptr<GradientReduction> reduction);
  void advance();
  void drain();

 private:
  // The order groups were gathered in, this pass and the previous one, per direction.
  struct Order {
    std::vector<std::weak_ptr<FsdpGroup>> last, current;
    void roll() {
      if (!current.empty()) last = std::move(current);
      current.clear();
    }
  };
  Order forward_, backward_;
  bool callback_queued_ = false;
  std::deque<std::unique_ptr<GradientReduction>> reductions_;  // in flight first, then staged
};

// The context of `root` on this rank (created on first use).
std::shared_ptr<FsdpContext> context_of(const DeviceMesh& root);

}  // namespace tessera::detail
