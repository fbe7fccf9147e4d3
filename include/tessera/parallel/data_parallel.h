#pragma once
// replicate: data parallelism (PyTorch's DistributedDataParallel / composable replicate) for
// unchanged torch::nn modules. See docs/data_parallel.md.
//
// Two ways to feed it, chosen once per model:
//   - distributed inputs (default): the parameters become replicated distributed tensors and
//     each step's input is a distributed tensor (batch Shard(0) over the data-parallel mesh
//     dim, possibly spatial shards over domain dims). Tessera computes exact global means,
//     so every gradient arrives as a Partial sum of the global gradient: buckets are summed,
//     never divided, which is right even for uneven per-rank batches. The weight-gradient
//     all-reduces of domain parallelism go through the same buckets.
//     Fed each rank's own plain batch instead (torch DDP's habit), it trains as DDP: the
//     gradients then arrive replicated and are averaged (NOTE: [Replicated gradients are
//     averaged]), and replicated buffers are broadcast from the first rank.
//   - local batches (ReplicateOptions::local_batches): parameters stay plain tensors, every
//     rank runs the plain model on its own batch, and gradients are averaged over the mesh,
//     exactly as torch DistributedDataParallel does.
//
// Gradients are reduced in buckets (PyTorch's defaults: 25 MiB, the first one 1 MiB, in
// reverse registration order, rebuilt after the first step in the order gradients actually
// became ready). A bucket's all-reduce starts as soon as its last gradient is accumulated and
// runs on the backend's threads while backward goes on; the step's end waits for all of them.
// Buckets are launched in index order on every rank, so ranks never mismatch collectives.
// Parameters that get no gradient in a backward (unused ones) are handled with no option:
// the step's end reduces their buckets with zeros and leaves .grad undefined for parameters
// no rank used.
#include <memory>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "tessera/mesh/device_mesh.h"

namespace tessera {

struct ReplicateOptions {
  // Bucket capacities in MiB (torch's bucket_cap_mb; the first bucket is kept small so the
  // first all-reduce starts early in backward).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  // Plain local batches and averaged gradients (torch DDP) instead of distributed inputs.
  TORCH_ARG(bool, local_batches) = false;
  // Local batches: broadcast buffers (BatchNorm running stats) from the mesh's first rank at
  // the end of every synchronized backward. (With distributed inputs buffers are replicated
  // distributed tensors whose statistics already cover the global batch.)
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Rebuild the buckets once, after the first synchronized backward, in the order gradients
  // became ready there (rank 0's order, broadcast), as torch DDP does.
  TORCH_ARG(bool, rebuild_buckets) = true;
};

// The state replicate() attaches to a module. Keep it alive while training: gradient hooks
// refer to it weakly, and a dropped handle stops the synchronization (as dropping a torch
// DistributedDataParallel object would).
class ReplicatedModule {
 public:
  ~ReplicatedModule();
  ReplicatedModule(const ReplicatedModule&) = delete;
  ReplicatedModule& operator=(const ReplicatedModule&) = delete;

  // While alive, backward passes accumulate gradients locally and communicate nothing; the
  // next synchronized backward reduces the accumulated sum (torch DDP's no_sync()).
  class NoSync {
   public:
    explicit NoSync(ReplicatedModule& owner);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ReplicatedModule& owner_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

  // Broadcasts every buffer from the mesh's first rank (with distributed inputs: the
  // replicated ones).
  void sync_buffers();

  // Inspection (tests, logs): parameter names per bucket, in launch order.
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  const DeviceMesh& mesh() const;

  struct State;

 private:
  friend std::shared_ptr<ReplicatedModule> replicate(torch::nn::Module&, const DeviceMesh&,
                                                     const ReplicateOptions&);
  explicit ReplicatedModule(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

// Makes `module` data parallel over every rank of `mesh` (collective: all of them call it
// with the same model). Distributed inputs: plain parameters and buffers become replicated
// distributed tensors with the values of the mesh's first rank; parameters already
// distributed on `mesh` keep their layout and have their gradients reduced over the mesh dims
// they are replicated on. Local batches: parameters and buffers are broadcast from the
// mesh's first rank and stay plain. Build the optimizer after this call.
[[nodiscard]] std::shared_ptr<ReplicatedModule> replicate(torch::nn::Module& module,
                                                          const DeviceMesh& mesh,
                                                          const ReplicateOptions& options = {});
template <class ModuleType>
[[nodiscard]] std::shared_ptr<ReplicatedModule> replicate(
    torch::nn::ModuleHolder<ModuleType>& module, const DeviceMesh& mesh,
    const ReplicateOptions& options = {}) {
  return replicate(*module, mesh, options);
}

}  // namespace tessera
