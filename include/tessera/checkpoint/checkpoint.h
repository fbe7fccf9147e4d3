#pragma once
// Distributed checkpoints (torch.distributed.checkpoint's role): every rank writes the boxes
// of the tensors it owns, once per replica set, and a loader on any mesh, world size and
// placements reads back just the byte ranges its own boxes overlap. A checkpoint directory is
// complete or invisible: it is written under a temporary name and renamed after everything,
// metadata last, is on disk. Format and guarantees: docs/checkpoint.md.
//
//   checkpoint::StateDict state = checkpoint::model_state(*model);
//   state.merge(checkpoint::optimizer_state(optimizer, *model));
//   state.insert("step", int64_t{step});
//   checkpoint::save(state, "ckpt/step-100");          // collective
//   ...
//   checkpoint::load(state, "ckpt/step-100");          // fills the tensors in place
//   checkpoint::restore_optimizer_scalars(state, optimizer, *model);
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

namespace tessera::checkpoint {

// One saved value: a tensor (plain = the same full value on every rank, or distributed) or
// a scalar every rank agrees on.
using Value = std::variant<at::Tensor, int64_t, double, bool, std::string>;

// Named values in insertion order; every rank builds the same names in the same order.
class StateDict {
 public:
  void insert(const std::string& name, Value value);
  // Adds every entry of `other` (names must not repeat).
  void merge(const StateDict& other);
  bool contains(const std::string& name) const;
  const Value& at(const std::string& name) const;
  Value& at(const std::string& name);
  const at::Tensor& tensor(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  double real(const std::string& name) const;
  const std::vector<std::pair<std::string, Value>>& items() const { return items_; }
  std::vector<std::pair<std::string, Value>>& items() { return items_; }
  size_t size() const { return items_.size(); }

 private:
  std::vector<std::pair<std::string, Value>> items_;
};

// The module's registered parameters and buffers by qualified name (the tensors themselves:
// loading writes into them; under fully_shard these are the sharded parameters).
StateDict model_state(const torch::nn::Module& module, const std::string& prefix = "model.");

// The optimizer's per-parameter state, named after the module's parameter names:
// Adam / AdamW "exp_avg", "exp_avg_sq" (and "max_exp_avg_sq" with amsgrad) tensors and
// "step"; SGD "momentum_buffer"; and each parameter group's "lr". Missing state (a fresh
// optimizer that has not stepped) is created as zeros first, so load can fill it in place.
StateDict optimizer_state(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                          const std::string& prefix = "optim.");
// After load: writes the loaded scalars (steps, learning rates) back into the optimizer.
void restore_optimizer_scalars(const StateDict& state, torch::optim::Optimizer& optimizer,
                               const torch::nn::Module& module,
                               const std::string& prefix = "optim.");

// An LR scheduler's progress: its step count (the learning rates themselves are the
// optimizer's, in optimizer_state). After load, restore_scheduler puts it back, so the
// schedule continues where it stopped.
StateDict scheduler_state(const torch::optim::LRScheduler& scheduler,
                          const std::string& prefix = "scheduler.");
void restore_scheduler(const StateDict& state, torch::optim::LRScheduler& scheduler,
                       const std::string& prefix = "scheduler.");

struct SaveOptions {
  // Replace an existing checkpoint at the same path (the old one stays intact until the new
  // one is complete). Off: an existing path is an error.
  bool overwrite = false;
  // Called on each rank after each chunk it wrote (bytes written so far by this rank).
  std::function<void(int64_t)> on_progress;
};

// Collective over the world (every rank, same state names, kinds, shapes and dtypes, in the
// same order). Partial values are reduced first; each box is written by one rank.
void save(const StateDict& state, const std::string& path, const SaveOptions& options = {});

// A save whose file writing runs on a background thread: the tensors are first copied to
// host memory (so training may go on and change them), wait() finishes the save (collective:
// every rank calls it) and rethrows any error.
class AsyncSave {
 public:
  AsyncSave();
  AsyncSave(AsyncSave&&) noexcept;
  AsyncSave& operator=(AsyncSave&&) noexcept;
  ~AsyncSave();
  void wait();
  struct Impl;

 private:
  friend AsyncSave async_save(const StateDict&, const std::string&, const SaveOptions&);
  std::unique_ptr<Impl> impl_;
};
AsyncSave async_save(const StateDict& state, const std::string& path,
                     const SaveOptions& options = {});

// Collective. Fills every tensor of `state` in place from the checkpoint (any mesh, world
// size and placements: each rank reads the byte ranges its own boxes overlap, whole 1 MiB
// checksum blocks, and verifies them) and replaces its scalars. Every entry of `state` must
// be in the checkpoint with the same global shape and dtype; extra saved entries are
// ignored. Errors name the entry and are raised on every rank.
void load(StateDict& state, const std::string& path);

// The names, kinds, dtypes and global shapes saved at `path` (local: reads the metadata).
struct EntryInfo {
  std::string name, kind, dtype;
  std::vector<int64_t> shape;
};
std::vector<EntryInfo> describe(const std::string& path);

// One file in LibTorch's own format, loadable on one device with torch::load(module, path)
// into an unchanged module: the full parameters and buffers of `module`. Collective (the
// full tensors are gathered); rank 0 writes.
void export_module(const torch::nn::Module& module, const std::string& path);
// The reverse: every rank reads a torch::save'd module file and copies into each (plain or
// distributed) parameter and buffer of `module` the part it holds.
void import_module(torch::nn::Module& module, const std::string& path);

}  // namespace tessera::checkpoint
