#pragma once
// Tensor parallelism for unchanged torch::nn models: torch.distributed.tensor.parallel's
// parallelize_module and ParallelStyle contract, in C++.
//
//   auto tp = mesh["tp"];
//   tessera::parallelize_module(*model, tp, {
//       {"tok_embeddings", tessera::RowwiseParallel().input_layouts(tessera::Replicate())},
//       {"layers.*.attention.wq", tessera::ColwiseParallel().use_local_output(false)},
//       {"layers.*.attention.wo", tessera::RowwiseParallel()},
//   });
//
// NOTE: [Module boundaries without hooks]
// LibTorch modules have no forward hooks and their forward() is non-virtual, so a style
// cannot wrap a module's call. Tessera realises styles at the ops that read the module's
// parameters instead (docs/tensor_parallel.md has the whole design and its limits):
//  * A style that shards parameters (Colwise, Rowwise, SequenceParallel) lays them out and
//    tags them with the module's boundary: its input layouts, desired input layouts, output
//    layouts and use_local_output. The ops that built-in leaves are (linear, embedding,
//    layer_norm) carry the boundary out around themselves when an operand is tagged, whatever
//    the call syntax (holder call, ->forward, Sequential, a raw F::linear on module->weight).
//  * PrepareModuleInput on a module is carried out at the tagged ops inside it: the tensor
//    the first of them receives after the module was entered is the module's input (and is
//    converted once, however many ops read it, e.g. wq, wk, wv).
//  * Everything Tessera cannot honour is an error at parallelize time naming the module path
//    and why (PrepareModuleOutput on a module whose output no tagged op produces, a style on
//    a module with nothing Tessera can see, two parameter styles on one module), or at run
//    time where only then visible (a plain tensor reaching a SequenceParallel module whose
//    forward is not one ATen op). Never a silent no-op.
//
// Differences from PyTorch (deliberate):
//  * A plan entry that matches no submodule is an error, not a warning.
//  * Layout comparisons use a distributed input's actual placements (PyTorch compares the
//    declared ones), so a distributed tensor is never mis-read.
//  * Plain inputs declared Shard(d) are read with exact shard sizes: from the parameter's own
//    table where the dim is the one the parameter is sharded on (a Rowwise input), else by
//    exchanging local sizes (metadata, not counted as a collective). Uneven splits work.
//  * shard_unit / shard_sizes make parameter shards uneven by design: 6 heads on 4 ranks as
//    2/2/1/1 whole heads. PyTorch requires divisibility.
//  * RowwiseParallel on an Embedding reads plain indices as Replicate (PyTorch's Shard(-1)
//    default there is a known trap); a declared input_layouts still wins.
//  * SequenceParallel parameters are broadcast from src_data_rank like every other style's
//    (PyTorch assumes they are already equal on all ranks).
//  * On a slice of a larger mesh (mesh["tp"] of a dp x tp mesh) parameters live on the root
//    mesh, replicated over its other dims, so batch-sharded distributed activations meet them
//    in one op and data-parallel gradients are exact global sums (no wrapper needed).
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "tessera/mesh/device_mesh.h"
#include "tessera/placement/placement.h"
#include "tessera/placement/spec.h"

namespace tessera {

// A module input's or output's layout on the tensor-parallel mesh dim; nullopt: leave the
// tensor (or non-tensor) as it is.
using IoLayout = std::optional<Placement>;
using IoLayouts = std::vector<IoLayout>;

namespace tp {

// NOTE: [Style conversions]
// One tensor's conversion at a module boundary: what PyTorch's ParallelStyle does in the
// input_fn / output_fn it gives distribute_module, as a value. A plain tensor is read as
// `plain` (nullopt: it stays plain and passes), a distributed one (or the one just read) is
// moved to `desired` (nullopt: kept), then made local if `to_local`. The tables give exact
// shard sizes on the tensor's last dim (a parameter's uneven feature split); without them a
// plain shard's sizes are exchanged and a redistribution follows torch.chunk. Every built-in
// style converts through ParallelStyle::set_input_conversion / add_output_conversion.
struct IoConversion {
  IoLayout plain;
  IoLayout desired;
  std::optional<ShardTable> plain_table, desired_table;
  bool to_local = false;
  std::string str() const;
};

}  // namespace tp

// The contract parallelize_module takes. A style lays out the module's parameters and
// declares how its inputs and outputs change layout; implement apply() for a style of your
// own (see tests/multirank/test_tensor_parallel.cpp for one), using the tp:: helpers below.
class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  // Lays out `module` on the 1-D `mesh`. tp::current_path() is the module's path in the
  // plan ("" for the root), for error messages.
  virtual void apply(torch::nn::Module& module, const DeviceMesh& mesh) const = 0;
  virtual std::string name() const = 0;

  // Where parameters come from: a global rank whose values are scattered/broadcast (PyTorch's
  // default 0), or nullopt: every rank slices its own copy, no communication. Set by
  // parallelize_module.
  std::optional<int> src_data_rank = 0;

 protected:
  // PyTorch's input_fn / output_fn, for use inside apply() (NOTE: [Style conversions]).
  // Where this style laid out `module`'s parameters (tp::distribute_parameter, before the
  // call) and the module is a leaf Tessera intercepts (tp::is_anchored_leaf), the conversion
  // runs around that op, whatever the call syntax. On any other module the input conversion
  // runs where the module's input reaches the first tensor-parallel op inside it (as
  // PrepareModuleInput), and an output conversion is an error at parallelize time (Tessera
  // cannot see a composite's output). Output conversions run in the order added, after the
  // parameter style's own. `mesh` is the 1-D mesh apply() was given.
  void set_input_conversion(torch::nn::Module& module, const DeviceMesh& mesh,
                            tp::IoConversion conversion) const;
  void add_output_conversion(torch::nn::Module& module, const DeviceMesh& mesh,
                             tp::IoConversion conversion) const;
};

// Shards a Linear's weight and bias on the output features (Shard(0)) or an Embedding's
// weight on the embedding dim (Shard(1)). Input: Replicate; output: Shard(-1).
class ColwiseParallel : public ParallelStyle {
 public:
  ColwiseParallel& input_layouts(Placement p) {
    input_ = p;
    return *this;
  }
  ColwiseParallel& output_layouts(Placement p) {
    output_ = p;
    return *this;
  }
  ColwiseParallel& use_local_output(bool b) {
    local_ = b;
    return *this;
  }
  // Shards of whole units of this many features, as even as possible (6 heads of 64 on 4
  // ranks: 128/128/64/64 features).
  ColwiseParallel& shard_unit(int64_t features) {
    unit_ = features;
    return *this;
  }
  // Explicit feature counts per tp rank.
  ColwiseParallel& shard_sizes(ShardTable sizes) {
    sizes_ = std::move(sizes);
    return *this;
  }

  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "ColwiseParallel"; }

 private:
  IoLayout input_, output_;
  bool local_ = true;
  int64_t unit_ = 1;
  std::optional<ShardTable> sizes_;
};

// Shards a Linear's weight on the input features (Shard(1), bias replicated): the output is
// Partial and made output_layouts (default Replicate: an all-reduce; Shard(d): a
// reduce-scatter). On an Embedding, the vocabulary is sharded (Shard(0)): out-of-range
// indices give zero rows on a rank, and the sum over ranks is the lookup.
class RowwiseParallel : public ParallelStyle {
 public:
  RowwiseParallel& input_layouts(Placement p) {
    input_ = p;
    return *this;
  }
  RowwiseParallel& output_layouts(Placement p) {
    output_ = p;
    return *this;
  }
  RowwiseParallel& use_local_output(bool b) {
    local_ = b;
    return *this;
  }
  RowwiseParallel& shard_unit(int64_t features) {
    unit_ = features;
    return *this;
  }
  RowwiseParallel& shard_sizes(ShardTable sizes) {
    sizes_ = std::move(sizes);
    return *this;
  }

  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "RowwiseParallel"; }

 private:
  IoLayout input_, output_;
  bool local_ = true;
  int64_t unit_ = 1;
  std::optional<ShardTable> sizes_;
};

// Runs a norm (LayerNorm, or a module of your own with parameters) on sequence shards:
// parameters replicated, inputs made Shard(sequence_dim), outputs kept distributed.
class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(int64_t sequence_dim = 1) : seq_(sequence_dim) {}
  SequenceParallel& use_local_output(bool b) {
    local_ = b;
    return *this;
  }

  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "SequenceParallel"; }

 private:
  int64_t seq_;
  bool local_ = false;
};

// Converts a module's inputs: plain inputs are read with input_layouts, then moved to
// desired_input_layouts. One entry per positional input; nullopt entries pass through.
class PrepareModuleInput : public ParallelStyle {
 public:
  PrepareModuleInput& input_layouts(IoLayouts l) {
    input_ = std::move(l);
    return *this;
  }
  PrepareModuleInput& desired_input_layouts(IoLayouts l) {
    desired_ = std::move(l);
    return *this;
  }
  PrepareModuleInput& input_kwarg_layouts(std::vector<std::pair<std::string, IoLayout>> l) {
    kw_input_ = std::move(l);
    return *this;
  }
  PrepareModuleInput& desired_input_kwarg_layouts(std::vector<std::pair<std::string, IoLayout>> l) {
    kw_desired_ = std::move(l);
    return *this;
  }
  PrepareModuleInput& use_local_output(bool b) {
    local_ = b;
    return *this;
  }

  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "PrepareModuleInput"; }

 private:
  friend class PrepareModuleInputOutput;
  IoLayouts input_, desired_;
  std::vector<std::pair<std::string, IoLayout>> kw_input_, kw_desired_;
  bool local_ = false;
};

// Converts a module's outputs (declared output_layouts -> desired_output_layouts).
class PrepareModuleOutput : public ParallelStyle {
 public:
  PrepareModuleOutput& output_layouts(IoLayouts l) {
    output_ = std::move(l);
    return *this;
  }
  PrepareModuleOutput& desired_output_layouts(IoLayouts l) {
    desired_ = std::move(l);
    return *this;
  }
  PrepareModuleOutput& use_local_output(bool b) {
    local_ = b;
    return *this;
  }

  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "PrepareModuleOutput"; }

 private:
  friend class PrepareModuleInputOutput;
  IoLayouts output_, desired_;
  bool local_ = true;
};

// Both, on one module.
class PrepareModuleInputOutput : public ParallelStyle {
 public:
  PrepareModuleInputOutput& input_layouts(IoLayouts l) {
    in_.input_layouts(std::move(l));
    return *this;
  }
  PrepareModuleInputOutput& desired_input_layouts(IoLayouts l) {
    in_.desired_input_layouts(std::move(l));
    return *this;
  }
  PrepareModuleInputOutput& use_local_input(bool b) {
    in_.use_local_output(b);
    return *this;
  }
  PrepareModuleInputOutput& output_layouts(IoLayouts l) {
    out_.output_layouts(std::move(l));
    return *this;
  }
  PrepareModuleInputOutput& desired_output_layouts(IoLayouts l) {
    out_.desired_output_layouts(std::move(l));
    return *this;
  }
  PrepareModuleInputOutput& use_local_output(bool b) {
    out_.use_local_output(b);
    return *this;
  }

  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "PrepareModuleInputOutput"; }

 private:
  PrepareModuleInput in_;
  PrepareModuleOutput out_;
};

// A style held by value in a plan: ColwiseParallel() converts implicitly.
class StyleRef {
 public:
  template <class Style, class = std::enable_if_t<std::is_base_of_v<ParallelStyle, Style>>>
  StyleRef(Style style) : style_(std::make_shared<Style>(std::move(style))) {}  // NOLINT
  StyleRef(std::shared_ptr<ParallelStyle> style) : style_(std::move(style)) {}  // NOLINT
  ParallelStyle& operator*() const { return *style_; }
  ParallelStyle* operator->() const { return style_.get(); }

 private:
  std::shared_ptr<ParallelStyle> style_;
};

// Module paths to styles, applied in order. A path names one child per level, each level a
// glob (`*`, `?`, `[0-2]`, `[!0]`) over child names ("layers.*.attention.wq"; ModuleList and
// Sequential children are "0", "1", ...); "" is the module itself.
using ParallelizePlan = std::vector<std::pair<std::string, StyleRef>>;

// torch.distributed.tensor.parallel.parallelize_module, in place. `mesh` is 1-D: a 1-D mesh
// or a slice such as mesh["tp"]. Also makes the random state agree over the root mesh, so
// dropout inside the model equals one device (docs/random.md). A plan entry that matches
// nothing, or a style its module cannot honour, is an error naming the path and why (every
// path is resolved before any style runs).
void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int> src_data_rank = 0);
void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int> src_data_rank = 0);
template <class Impl>
void parallelize_module(torch::nn::ModuleHolder<Impl>& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int> src_data_rank = 0) {
  parallelize_module(*module, mesh, plan, src_data_rank);
}
template <class Impl>
void parallelize_module(torch::nn::ModuleHolder<Impl>& module, const DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int> src_data_rank = 0) {
  parallelize_module(*module, mesh, style, src_data_rank);
}

namespace tp {

// The plan path of the module a style is being applied to ("" for the root).
const std::string& current_path();

// For styles of your own. Lays out parameter `name` of `module` with `placement` on the tp
// mesh dim (replicated over the root mesh's other dims), sourced from style.src_data_rank.
void distribute_parameter(const ParallelStyle& style, torch::nn::Module& module,
                          const std::string& name, const DeviceMesh& tp_mesh, Placement placement,
                          const std::optional<ShardTable>& sizes = std::nullopt);

// Whether Tessera can see the module's calls: its forward is an op Tessera anchors
// (Linear -> linear, Embedding -> embedding, LayerNorm -> layer_norm) or it holds parameters.
bool is_anchored_leaf(const torch::nn::Module& module);

// The path and style that laid out a tensor-parallel parameter, or "" (for messages, tests).
std::string describe_parameter(const at::Tensor& parameter);

}  // namespace tp

}  // namespace tessera
