#pragma once
// The extension surface: how an op learns to run on distributed tensors.
//
// NOTE: [How to add an op]
// Adding an op touches one file: a rule family under src/ops/ (or a new file there, picked up
// by the build), ending with its registration block. src/ops/renorm.cpp is the worked example
// in full:
//
//   OpPlan renorm_rule(const OpCall& call) {
//     const DTensorSpec& self = *call.spec("self");                 // arguments by name
//     const int64_t dim = c10::maybe_wrap_dim(call.arg<int64_t>("dim"), self.ndim());
//     auto layout = std::make_shared<DTensorSpec>(self.replicate_where(
//         [&](int64_t, const Placement& p) {                          // what must be whole
//           return p.is_partial() || (p.is_shard() && p.dim() != dim);
//         }));
//     OpPlan plan(call);
//     plan.input("self", layout);  // the fallback redistributes self to this layout,
//     plan.output(layout);         // runs aten::renorm on the shards, wraps the result so
//     return plan;
//   }
//   const RuleRegistrar registrar{[] {
//     register_rule("aten::renorm", renorm_rule);   // renorm.out borrows it (NOTE: [out= forms])
//     register_rule("aten::renorm_", renorm_rule);  // the in-place form is its own op
//   }};
//
// A rule never communicates and must not read Scalar arguments (they are not part of the
// cache key, NOTE: [Decision cache]). Tests: add the op to the sweep's table
// (tests/multirank/test_op_sweep.cpp), which checks it against one device, forward and
// backward, on uneven shards and several meshes; RegistrationPolicy checks the overloads.
//
// The three ways in, from most to least common:
//  1. register_rule: a sharding rule. It reads the input layouts (and non-tensor arguments by
//     schema name) and says which layout each input must have and which layout each result
//     gets; the fallback redistributes, runs the op on the shards and wraps the results. Most
//     ops need nothing else. When the op's local form differs from the global one, the plan
//     also carries a kernel:
//       - local_kernel: pure, the same code on every rank, no communication (mean over an
//         uneven dim is a local sum over the global count; slices shift their offsets);
//       - distributed_kernel: communicates through the mesh (halo exchange for
//         convolutions, statistics all-reduced by norms): DTensor's custom op handlers.
//  2. register_kernel: an op that never reaches the fallback on its own, because it is
//     CompositeImplicitAutograd above our key or because its formula builds plain buffers
//     that must not meet distributed tensors inside (value_selecting_reduction_backward).
//  3. register_autograd_kernel: an op whose whole forward and backward must be ours, at
//     the autograd key (circular padding exchanges halos in both directions).
// Rules run once per distinct call (their plans are cached, see NOTE: [Decision cache]);
// kernels run on every call.
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include "tessera/placement/spec.h"

namespace torch {
class CppFunction;
}

namespace tessera::ops {

// The position of schema argument `name` in `schema` (-1 if it has none), resolved once per
// (schema, name) and cached. Names hold across LibTorch versions where positions may not.
int arg_position(const c10::FunctionSchema& schema, const char* name);

// One call of an op on distributed tensors, as a rule sees it.
struct OpCall {
  const c10::OperatorHandle& op;
  c10::ArrayRef<c10::IValue> args;  // the op's arguments, distributed tensors still wrapped
  c10::SmallVector<const DTensorSpec*, 8> specs;  // per argument: its spec, or nullptr
  // Per argument: the element specs of a Tensor[] / Tensor?[] argument holding distributed
  // tensors (plain elements are implicitly replicated, see docs/design.md); empty otherwise.
  std::vector<std::vector<const DTensorSpec*>> list_specs;
  const DTensorSpec* reference = nullptr;  // the first distributed tensor, in a list or not

  const DTensorSpec& first() const { return *reference; }
  const std::string& name() const;
  const c10::FunctionSchema& schema() const { return op.schema(); }

  // Arguments by schema name. `arg<T>` converts as IValue::to<T> does: int64_t, double,
  // bool, std::vector<int64_t>, c10::optional<...>, std::string, c10::ScalarType.
  int index(const char* name) const { return arg_position(schema(), name); }
  bool has(const char* name) const { return index(name) >= 0; }
  const c10::IValue& arg(const char* name) const;  // an internal error if there is none
  template <class T>
  T arg(const char* name) const {
    return arg(name).to<T>();
  }
  // The spec of tensor argument `name`: nullptr for plain tensors and None.
  const DTensorSpec* spec(const char* name) const;

  // "aten::add.Tensor(S(0) [8, 4], R [8, 4])": for error messages.
  std::string describe() const;
};

// The op's arguments as a kernel sees them: local tensors, already redistributed as the
// plan asked, at their schema positions. A kernel leaves just the op's results on the stack.
class KernelCall {
 public:
  KernelCall(const c10::OperatorHandle& op, torch::jit::Stack& stack) : op_(op), stack_(stack) {}

  const c10::OperatorHandle& op() const { return op_; }
  torch::jit::Stack& stack() { return stack_; }
  int index(const char* name) const { return arg_position(op_.schema(), name); }
  bool has(const char* name) const { return index(name) >= 0; }
  c10::IValue& arg(const char* name);
  template <class T>
  T arg(const char* name) {
    return arg(name).to<T>();
  }
  at::Tensor tensor(const char* name) { return arg(name).toTensor(); }
  void set(const char* name, c10::IValue value) { arg(name) = std::move(value); }
  // Runs the op itself on the (local) arguments as they now stand; leaves its results.
  void call_op() { op_.callBoxed(&stack_); }
  // Replaces the arguments by the op's results.
  void finish(std::initializer_list<c10::IValue> results);

 private:
  const c10::OperatorHandle& op_;
  torch::jit::Stack& stack_;
};

using LocalKernel = std::function<void(KernelCall&)>;
using DistributedKernel = std::function<void(KernelCall&, const DeviceMesh&)>;

struct OpPlan {
  OpPlan() = default;
  // A plan for `call`: one empty input slot per argument (null: leave the input as it is).
  explicit OpPlan(const OpCall& call) : inputs(call.args.size()), schema_(&call.schema()) {}

  // Builders: the layout argument `name` must have, and the next result's layout.
  OpPlan& input(const char* name, SpecPtr spec);
  OpPlan& output(SpecPtr spec) {
    outputs.push_back(std::move(spec));
    return *this;
  }
  // The local op gets `value` for argument `name` (a view's sizes become the shard's).
  OpPlan& local_arg(const char* name, c10::IValue value);

  std::vector<SpecPtr> inputs;  // per argument: the spec it must be redistributed to, or null
  std::vector<std::vector<SpecPtr>> list_inputs;  // per Tensor[] argument, per element
  // Per return: the spec of the result. Rules give the inputs' dtype; where the local result
  // has another (comparisons, casts), the fallback substitutes it.
  std::vector<SpecPtr> outputs;
  // Per argument position: the value the local op gets instead (declarative, so the typed
  // fast path can replay it; prefer it to a kernel that only swaps arguments).
  std::vector<std::pair<int, c10::IValue>> local_args;
  // At most one of the two runs instead of the op; see NOTE: [How to add an op]. Kernels
  // capture values (offsets, counts), never meshes: a distributed kernel is handed its mesh.
  LocalKernel local_kernel;
  DistributedKernel distributed_kernel;
  // Outputs whose shape depends on the data (nonzero, unique): computed on replicated
  // inputs, wrapped as replicated with the shape each call produces.
  bool data_dependent_shapes = false;
  // Where the kernel (local_kernel, or local_args other than sizes) uses the shard's place (an
  // offset, a cut): along these dims of the result and no dim it reduces. Unset (the default):
  // anywhere. A head-tail dim keeps its stored order only through ops that use no place along
  // it (NOTE: [Head-tail arguments] in fallback.cpp).
  std::optional<std::vector<int64_t>> place_dims;

 private:
  const c10::FunctionSchema* schema_ = nullptr;
};

// A rule: the plan for one call. Decisions are cached per op, input specs and int / bool /
// string / float arguments (never `Scalar` ones: a rule must not depend on them; kernels
// read them from their stack).
using Rule = std::function<OpPlan(const OpCall&)>;

// Registers `rule` for an op ("aten::add.Tensor"). One rule per op: a second is an error.
void register_rule(const std::string& qualified_name, Rule rule);
// Registers `rule` for every overload of `base` ("aten::add") the running LibTorch has,
// except `skip`; returns how many. Overloads are read from the dispatcher, not guessed.
int register_rule_for_overloads(const std::string& base, const Rule& rule,
                                const std::vector<std::string>& skip = {});
// The rule of an op, or nullptr. Memoised per operator after the first lookup.
const Rule* find_rule(const c10::OperatorHandle& op);
// Every op name with a rule ("aten::add.Tensor"), for the registration-policy test.
std::vector<std::string> registered_rule_names();

// A kernel for `qualified_name` at the distributed-tensor key (PrivateUse1), or at its
// autograd key. The caller includes <torch/library.h> to build the CppFunction.
void register_kernel(const char* qualified_name, torch::CppFunction&& fn);
void register_autograd_kernel(const char* qualified_name, torch::CppFunction&& fn);
// At the CPU and CUDA autograd keys: plain tensors' autograd dispatch (distributed tensors keep
// theirs). Only for
// checks that must see plain tensors (NOTE: [Plain dropout on local shards]); the kernel must
// behave as LibTorch's otherwise.
void register_autograd_kernel_for_every_tensor(const char* qualified_name,
                                               const std::function<torch::CppFunction()>& make);

// A candidate: the layouts the inputs would need and the outputs it produces.
struct Strategy {
  std::vector<SpecPtr> inputs;  // per argument (null: not a distributed argument)
  std::vector<SpecPtr> outputs;
};
// The strategy whose input redistributions cost the fewest modelled bytes (ties: the fewest
// inputs whose layout changes, then the first),
// as a plan. Every rank computes the same choice.
OpPlan cheapest(const OpCall& call, const std::vector<Strategy>& candidates);

// Helpers shared by rule families.
SpecPtr same_layout_with_shape(const DTensorSpec& like, std::vector<int64_t> sizes,
                               c10::ScalarType dtype);
SpecPtr replicated(const DTensorSpec& like);  // every mesh dim Replicate, same shape
// `operand`'s layout lined up with `ref` (right-aligned dims, as in broadcasting): the same
// shard dims and tables where the operand has the full extent, Replicate where it
// broadcasts; Partial kept only when asked.
SpecPtr align_to(const DTensorSpec& ref, const DTensorSpec& operand, bool keep_partial);
// A tensor of `sizes` summed over what `like` shards (parameter gradients, fully reduced
// losses): Partial(sum) on the mesh dims where `like` is sharded, Replicate elsewhere.
SpecPtr summed_over_shards(const DTensorSpec& like, std::vector<int64_t> sizes);
// Every distributed input replicated, outputs replicated with data-dependent shapes.
OpPlan replicate_everything(const OpCall& call);
// Every distributed input (lists included) replicated; outputs left to the caller.
OpPlan replicate_inputs(const OpCall& call);

// Macro-free registration block for a rule family: `static const RuleRegistrar r{[] {...}};`.
// Rules register from static initialisers of the shared library; a static build must link
// the ops objects whole (see CMakeLists.txt).
struct RuleRegistrar {
  explicit RuleRegistrar(void (*fn)()) { fn(); }
};

}  // namespace tessera::ops
