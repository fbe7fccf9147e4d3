#pragma once
// A sharding rule decides, for one op call, which layout each distributed input must have and
// what layout the outputs get. Rules are pure functions of specs and non-tensor arguments:
// they never touch data or communicate (the fallback does both).
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include "tessera/placement/spec.h"

namespace tessera::ops {

struct OpCall {
  const c10::OperatorHandle& op;
  c10::ArrayRef<c10::IValue> args;  // the op's arguments, distributed tensors still wrapped
  c10::SmallVector<const DTensorSpec*, 8> specs;  // per argument: its spec, or nullptr
  int first_dtensor = -1;                 // index of the first distributed Tensor argument
  // Per argument: the element specs of a Tensor[] argument holding distributed tensors
  // (plain elements are implicitly replicated, see docs/design.md); empty otherwise.
  std::vector<std::vector<const DTensorSpec*>> list_specs;
  const DTensorSpec* reference = nullptr;  // the first distributed tensor, in a list or not

  const DTensorSpec& first() const { return *reference; }
  const std::string& name() const;
  // Position of the schema argument `name` (-1 if the op has none): names hold across
  // LibTorch versions where positions may not. Local kernels' stacks use the same positions.
  int arg_index(const char* name) const;
  // The argument `name`; an internal error if the op has none.
  const c10::IValue& arg(const char* name) const;
  // "aten::add.Tensor(S(0) [8, 4], R [8, 4])": for error messages.
  std::string describe() const;
};

struct OpPlan {
  std::vector<SpecPtr> inputs;   // per argument: the spec it must be redistributed to, or null
  std::vector<std::vector<SpecPtr>> list_inputs;  // per Tensor[] argument, per element
  // Per return: the spec of the result. Rules give the inputs' dtype; where the local result
  // has another (comparisons, casts), the fallback substitutes it.
  std::vector<SpecPtr> outputs;
  // When set, runs instead of the op: receives a stack holding just the (redistributed)
  // local arguments and leaves just the local results on it: for ops whose local form differs from the global
  // one, e.g. mean over an unevenly sharded dim is a local sum divided by the global count.
  std::function<void(torch::jit::Stack&)> local_kernel;
  // Outputs whose shape depends on the data (nonzero, unique): computed on replicated
  // inputs, wrapped as replicated with the shape each call produces.
  bool data_dependent_shapes = false;
};

using Rule = OpPlan (*)(const OpCall&);

// Registers `rule` for an op ("aten::add.Tensor"). One rule per op. Decisions are cached per
// op, input specs and int / bool / string / float arguments (never `Scalar` ones: a rule
// must not depend on them; local kernels read them from their stack).
void register_rule(const std::string& qualified_name, Rule rule);
// The rule of an op, or nullptr. Memoised per operator after the first lookup.
Rule find_rule(const c10::OperatorHandle& op);

// A candidate: the layouts the inputs would need and the outputs it produces.
struct Strategy {
  std::vector<SpecPtr> inputs;   // per argument (null: not a distributed argument)
  std::vector<SpecPtr> outputs;
};
// The strategy whose input redistributions cost the fewest modelled bytes (ties: the first),
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
// Macro-free registration block for a rule family: `static const RuleRegistrar r{[] {...}};`
struct RuleRegistrar {
  explicit RuleRegistrar(void (*fn)()) { fn(); }
};

}  // namespace tessera::ops
