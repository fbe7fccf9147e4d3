#pragma once
// Module boundaries of tensor-parallel styles, carried out at the ops that read the module's
// parameters (NOTE: [Module boundaries without hooks] in tensor_parallel.h).
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "tessera/mesh/device_mesh.h"
#include "tessera/parallel/tensor_parallel.h"

namespace tessera::tp::detail {

// Where tensor-parallel layouts live: the root mesh and its tensor-parallel dim.
struct TpMesh {
  DeviceMesh root;
  int64_t dim = 0;
  static TpMesh of(const DeviceMesh& tp_mesh, const std::string& where);
  // `base` (a tensor's placements on the root, or all Replicate) with the tp dim set to p.
  Placements with(Placements base, Placement p) const;
};

// One tensor's conversion at a boundary (NOTE: [Style conversions] in tensor_parallel.h).
using Convert = tp::IoConversion;

// PrepareModuleInput on a module: its input is recognised at the first tagged op inside the
// module after the module was entered (see enter()).
struct ModuleInput {
  std::string fqn;
  TpMesh mesh;
  Convert convert;
};

// Everything tensor parallelism attached to one module.
struct Boundary {
  std::string fqn;    // plan path
  std::string style;  // "ColwiseParallel on Linear(in=16, out=16)"
  TpMesh mesh;
  bool anchored = false;         // the module's forward is an op Tessera intercepts
  bool plain_forbidden = false;  // SequenceParallel on a module Tessera cannot intercept
  int64_t sequence_dim = 1;
  std::optional<Convert> input;        // the parameter style's own input conversion
  std::vector<Convert> style_outputs;  // the parameter style's own output conversions
  std::vector<Convert> outputs;        // style_outputs, then PrepareModuleOutput's (linked)
  std::vector<std::shared_ptr<const ModuleInput>> enclosing;  // outermost first, self last
  bool has_param_style = false;
  uint64_t application = 0;  // the style application that claimed it (begin_application)
  bool linear_bias = false;  // a Linear with bias (see NOTE: [Linear with bias] in tp_anchors.cpp)
};
using BoundaryPtr = std::shared_ptr<Boundary>;

// NOTE: [Interceptable modules]
// The one table of built-in modules whose forward is an op family Tessera anchors
// (tp_anchors.cpp registers exactly these ops): tp::is_anchored_leaf, the parallelize-time
// messages and the anchors' registration all read it.
struct AnchoredModule {
  const char* name;                             // "Linear"
  bool (*matches)(const torch::nn::Module& m);  // m is one, and Tessera sees its op
  std::vector<const char*> ops;                 // what its forward calls
};
const std::vector<AnchoredModule>& anchored_modules();
// "Linear, Embedding or LayerNorm", for messages.
std::string anchored_module_names();

// One style application (parallelize_module applying one style to one module): the modules
// whose parameters it laid out so far (tp::distribute_parameter), so its conversions know
// where they run. Reset per application by tp_plan.cpp.
void begin_application();
void note_laid_out(const torch::nn::Module& module);
bool laid_out_in_application(const torch::nn::Module& module);

// The module's boundary claimed by the current style application (made, named and checked
// to have no other parameter style on first claim).
BoundaryPtr claim_boundary(torch::nn::Module& module, const ParallelStyle& style,
                           const DeviceMesh& mesh);

// ParallelStyle::set_input_conversion / add_output_conversion.
void style_conversion(const ParallelStyle& style, torch::nn::Module& module, const DeviceMesh& mesh,
                      Convert conversion, bool input);

// The module's boundary, made on first use (one per module; shared by its parameters' tags).
BoundaryPtr boundary_for(torch::nn::Module& module);
BoundaryPtr find_boundary(const torch::nn::Module& module);
void set_module_input(torch::nn::Module& module, std::shared_ptr<const ModuleInput> input);
std::shared_ptr<const ModuleInput> module_input(const torch::nn::Module& module);
// PrepareModuleOutput's conversion on a module, checked and linked by parallelize_module.
void add_module_output(torch::nn::Module& module, Convert output);
std::vector<Convert> module_outputs(const torch::nn::Module& module);

// Tags a tensor-parallel parameter with its module's boundary.
void tag_parameter(const at::Tensor& parameter, BoundaryPtr boundary);
// The boundary of a tagged parameter, or null. Cheap when no parameter is tagged.
BoundaryPtr boundary_of(const at::Tensor& parameter);
// The same for a distributed view of a tagged parameter (weight.t()), found through the
// storage of its local shard.
BoundaryPtr boundary_of_view(const at::Tensor& view);

// Around a tagged op: the operand the module receives, and the op's result.
at::Tensor enter(const Boundary& b, const at::Tensor& input, const char* op);
// allow_local=false: the caller still changes the output afterwards (F::linear's bias add),
// so it must stay distributed; a style that asks for a local output is then an error.
at::Tensor leave(const Boundary& b, const at::Tensor& output, const char* op,
                 bool allow_local = true);

// NOTE: [Plain dropout on local shards]
// A style that hands the module's code a local shard (use_local_output on a Colwise output,
// use_local_input) makes later element-wise ops plain. A dropout there draws each rank's own
// mask for its shard: not one device's mask, and with ranks seeded alike every shard gets the
// same one. Tessera cannot tell which global element a plain tensor's entry is (a view into
// heads changes that), so such a dropout is an error naming the way out while a shard is
// open: from the style's local output until a style reads a plain input (RowwiseParallel
// reading the shards back, or the next forward's first module). Tessera cannot tell what a
// plain tensor was computed from either, so a dropout on an unrelated plain tensor in that
// window raises too; use_local_output(false) is the way out for both. A dropout in eval mode
// or with p = 0 draws nothing and passes.
// Where an open local shard was handed out ("'mlp.w1' (ColwiseParallel on ...)"), if any.
std::optional<std::string> open_local_shard();

// One conversion (differentiable), for styles of the user's own and for tests.
at::Tensor convert(const TpMesh& mesh, const Convert& c, const at::Tensor& x,
                   const std::string& where);

// The anchored ops' autograd kernels (tp_anchors.cpp); referencing this keeps that file
// (and its static registration) in a static link.
void ensure_anchors_registered();

}  // namespace tessera::tp::detail
