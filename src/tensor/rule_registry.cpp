#include <algorithm>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "out_form.h"
#include "tessera/tensor/rule.h"
#include "tessera/redistribute/redistribute.h"

namespace tessera::ops {

namespace {
struct Registry {
  std::shared_mutex mu;
  std::unordered_map<std::string, Rule> by_name;  // nodes are stable: memo points into it
  std::unordered_set<std::string> head_tail;      // rules that see head-tail specs as stored
  std::unordered_map<const void*, const Rule*> by_schema;  // memo: one lookup per operator
  std::unordered_map<const void*, std::unique_ptr<detail::OutFormRule>> out_forms;  // memo
  // Memo entries a later registration invalidated: callers may still hold them.
  std::vector<std::unique_ptr<detail::OutFormRule>> retired;
};
Registry& registry() {
  static Registry r;
  return r;
}
std::string qualified(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

struct PositionKey {
  const void* schema;
  std::string name;
  bool operator==(const PositionKey& o) const { return schema == o.schema && name == o.name; }
};
struct PositionHash {
  size_t operator()(const PositionKey& k) const {
    return std::hash<const void*>()(k.schema) ^ (std::hash<std::string>()(k.name) << 1);
  }
};

// Kernels registered through register_kernel / register_autograd_kernel; each library object
// must outlive the program's dispatch.
void register_at(const char* qualified_name, c10::DispatchKey key, torch::CppFunction&& fn) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  const std::string full(qualified_name);
  const auto sep = full.find("::");
  TORCH_CHECK(sep != std::string::npos, "tessera: register_kernel needs a qualified op name ",
              "such as \"aten::sum\", got \"", full, "\"");
  std::lock_guard<std::mutex> lock(mu);
  libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, full.substr(0, sep),
                                                       key, __FILE__, __LINE__));
  libraries.back()->impl(full.substr(sep + 2).c_str(), std::move(fn));
}
}  // namespace

int arg_position(const c10::FunctionSchema& schema, const char* name) {
  // Per thread: rank threads never contend, and a hit is one hash of a short string.
  thread_local std::unordered_map<PositionKey, int, PositionHash> memo;
  PositionKey key{&schema, name};
  auto it = memo.find(key);
  if (it != memo.end()) return it->second;
  auto i = schema.argumentIndexWithName(name);
  const int pos = i ? static_cast<int>(*i) : -1;
  memo.emplace(std::move(key), pos);
  return pos;
}

void register_rule(const std::string& qualified_name, Rule rule) {
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  auto [it, inserted] = r.by_name.emplace(qualified_name, std::move(rule));
  TORCH_CHECK(inserted, "tessera: a second sharding rule for ", qualified_name,
              "; one rule per op");
  r.by_schema.clear();
  for (auto& kv : r.out_forms) r.retired.push_back(std::move(kv.second));
  r.out_forms.clear();
}

int register_rule_for_overloads(const std::string& base, const Rule& rule,
                                const std::vector<std::string>& skip) {
  int n = 0;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name != base) continue;
    if (std::find(skip.begin(), skip.end(), name.overload_name) != skip.end()) continue;
    register_rule(qualified(name), rule);
    ++n;
  }
  return n;
}

const Rule* find_rule(const c10::OperatorHandle& op) {
  auto& r = registry();
  const void* key = &op.schema();
  {
    std::shared_lock<std::shared_mutex> lock(r.mu);
    auto it = r.by_schema.find(key);
    if (it != r.by_schema.end()) return it->second;
  }
  std::unique_lock<std::shared_mutex> lock(r.mu);
  auto it = r.by_name.find(qualified(op.operator_name()));
  const Rule* rule = it == r.by_name.end() ? nullptr : &it->second;
  r.by_schema.emplace(key, rule);
  return rule;
}

// NOTE: [out= forms]
// An out= overload (cumsum.out, sort.values, ...) needs no rule of its own: ATen ends its
// schema with the written kwarg-only arguments, so without them it is its functional
// sibling's schema, every other argument at the same position. The fallback runs that
// sibling's rule and the sibling itself on the shards, then writes each result into its out
// tensor, which takes the rule's output spec (as ATen resizes `out`). An overload with a rule
// of its own (the pointwise family rules every overload) keeps it.
size_t detail::out_argument_count(const c10::FunctionSchema& schema) {
  size_t n = 0;
  const auto& args = schema.arguments();
  for (size_t i = args.size(); i-- > 0;) {
    const auto* alias = args[i].alias_info();
    if (!args[i].kwarg_only() || !alias || !alias->isWrite()) break;
    ++n;
  }
  return n;
}

namespace {
// The overloads of one base name, indexed once (the dispatcher lists about 2,500 names).
const std::vector<c10::OperatorName>& overloads_of(const std::string& base) {
  static const auto index = [] {
    std::unordered_map<std::string, std::vector<c10::OperatorName>> m;
    for (auto& name : c10::Dispatcher::singleton().getAllOpNames()) m[name.name].push_back(name);
    return m;
  }();
  static const std::vector<c10::OperatorName> none;
  auto it = index.find(base);
  return it == index.end() ? none : it->second;
}

detail::OutFormRule borrow_functional_rule(const c10::OperatorHandle& op) {
  detail::OutFormRule found;
  const auto& schema = op.schema();
  const size_t outs = detail::out_argument_count(schema);
  if (outs == 0 || schema.returns().size() != outs) return found;
  for (size_t i = schema.arguments().size() - outs; i < schema.arguments().size(); ++i)
    if (schema.arguments()[i].type()->kind() != c10::TypeKind::TensorType) return found;
  const size_t nargs = schema.arguments().size() - outs;
  for (const auto& name : overloads_of(schema.name())) {
    auto sibling = c10::Dispatcher::singleton().findOp(name);
    if (!sibling || detail::out_argument_count(sibling->schema()) != 0) continue;
    const auto& args = sibling->schema().arguments();
    if (args.size() != nargs || sibling->schema().returns().size() != schema.returns().size())
      continue;
    bool same = true;
    for (size_t i = 0; i < nargs && same; ++i)
      same = args[i].name() == schema.arguments()[i].name() &&
             args[i].type()->str() == schema.arguments()[i].type()->str();
    if (!same) continue;
    if (const Rule* rule = find_rule(*sibling)) {
      found.rule = rule;
      found.functional = *sibling;
      found.outs = outs;
      return found;
    }
  }
  return found;
}
}  // namespace

void detail::let_rule_see_head_tail(const std::string& qualified_name) {
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  r.head_tail.insert(qualified_name);
}

bool detail::rule_sees_head_tail(const c10::OperatorHandle& op) {
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  return !r.head_tail.empty() && r.head_tail.count(qualified(op.operator_name())) > 0;
}

const detail::OutFormRule* detail::find_out_form_rule(const c10::OperatorHandle& op) {
  auto& r = registry();
  const void* key = &op.schema();
  {
    std::shared_lock<std::shared_mutex> lock(r.mu);
    auto it = r.out_forms.find(key);
    if (it != r.out_forms.end()) return it->second->rule ? it->second.get() : nullptr;
  }
  auto made = std::make_unique<OutFormRule>(borrow_functional_rule(op));
  std::unique_lock<std::shared_mutex> lock(r.mu);
  auto it = r.out_forms.emplace(key, std::move(made)).first;
  return it->second->rule ? it->second.get() : nullptr;
}

std::vector<std::string> registered_rule_names() {
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& kv : r.by_name) names.push_back(kv.first);
  std::sort(names.begin(), names.end());
  return names;
}

void register_kernel(const char* qualified_name, torch::CppFunction&& fn) {
  register_at(qualified_name, c10::DispatchKey::PrivateUse1, std::move(fn));
}

void register_autograd_kernel(const char* qualified_name, torch::CppFunction&& fn) {
  register_at(qualified_name, c10::DispatchKey::AutogradPrivateUse1, std::move(fn));
}

void register_autograd_kernel_for_every_tensor(const char* qualified_name,
                                               const std::function<torch::CppFunction()>& make) {
  // Direct registrations: at the Autograd alias a CompositeImplicitAutograd kernel would win.
  register_at(qualified_name, c10::DispatchKey::AutogradCPU, make());
  register_at(qualified_name, c10::DispatchKey::AutogradCUDA, make());
}

const std::string& OpCall::name() const { return op.schema().name(); }

const c10::IValue& OpCall::arg(const char* arg_name) const {
  const int i = index(arg_name);
  TORCH_INTERNAL_ASSERT(i >= 0, name(), " has no argument ", arg_name);
  return args[static_cast<size_t>(i)];
}

const DTensorSpec* OpCall::spec(const char* arg_name) const {
  const int i = index(arg_name);
  TORCH_INTERNAL_ASSERT(i >= 0, name(), " has no argument ", arg_name);
  return specs[static_cast<size_t>(i)];
}

c10::IValue& KernelCall::arg(const char* arg_name) {
  const int i = index(arg_name);
  TORCH_INTERNAL_ASSERT(i >= 0 && static_cast<size_t>(i) < stack_.size(), op_.schema().name(),
                        " has no argument ", arg_name);
  return stack_[static_cast<size_t>(i)];
}

void KernelCall::finish(std::initializer_list<c10::IValue> results) {
  stack_.clear();
  for (const auto& r : results) stack_.push_back(r);
}

OpPlan& OpPlan::local_arg(const char* arg_name, c10::IValue value) {
  TORCH_INTERNAL_ASSERT(schema_, "OpPlan::local_arg needs a plan made with OpPlan(call)");
  const int i = arg_position(*schema_, arg_name);
  TORCH_INTERNAL_ASSERT(i >= 0, schema_->name(), " has no argument ", arg_name);
  local_args.emplace_back(i, std::move(value));
  return *this;
}

OpPlan& OpPlan::input(const char* arg_name, SpecPtr spec) {
  TORCH_INTERNAL_ASSERT(schema_, "OpPlan::input needs a plan made with OpPlan(call)");
  const int i = arg_position(*schema_, arg_name);
  TORCH_INTERNAL_ASSERT(i >= 0, schema_->name(), " has no argument ", arg_name);
  inputs.at(static_cast<size_t>(i)) = std::move(spec);
  return *this;
}

std::string OpCall::describe() const {
  std::string s = qualified(op.operator_name()) + "(";
  bool first = true;
  for (size_t i = 0; i < args.size(); ++i) {
    if (i < list_specs.size() && !list_specs[i].empty()) {
      s += first ? "[" : ", [";
      first = false;
      for (size_t k = 0; k < list_specs[i].size(); ++k) {
        const auto* sp = list_specs[i][k];
        s += (k ? ", " : "") + (sp ? to_string(sp->placements()) + " " + shape_str(sp->sizes())
                                   : std::string("scalar"));
      }
      s += "]";
      continue;
    }
    if (!args[i].isTensor()) continue;
    s += first ? "" : ", ";
    first = false;
    if (specs[i]) {
      s += to_string(specs[i]->placements()) + " " + shape_str(specs[i]->sizes());
    } else {
      const auto& t = args[i].toTensor();
      s += t.defined() ? "plain " + shape_str(t.sizes().vec()) : "undefined";
    }
  }
  return s + ")";
}

OpPlan cheapest(const OpCall& call, const std::vector<Strategy>& candidates) {
  TORCH_CHECK(!candidates.empty(), "tessera: ", call.describe(), ": no sharding strategy applies");
  // Fewest bytes first, then fewest layout changes: a move that costs no bytes (any move on
  // a 1-rank mesh) still changes specs, and a plan that keeps them can be replayed cheaply.
  size_t best = 0;
  std::pair<double, int> best_cost{0, 0};
  for (size_t c = 0; c < candidates.size(); ++c) {
    std::pair<double, int> cost{0, 0};
    const auto& cand = candidates[c];
    for (size_t i = 0; i < cand.inputs.size() && i < call.specs.size(); ++i) {
      if (!cand.inputs[i] || !call.specs[i]) continue;
      // The call's spec is borrowed; a shared_ptr that does not own it is enough for planning.
      SpecPtr from(std::shared_ptr<const DTensorSpec>(), call.specs[i]);
      cost.first += redistribute_cost(from, cand.inputs[i]);
      cost.second += *cand.inputs[i] != *call.specs[i];
    }
    if (c == 0 || cost < best_cost) {
      best = c;
      best_cost = cost;
    }
  }
  OpPlan plan(call);
  for (size_t i = 0; i < candidates[best].inputs.size() && i < plan.inputs.size(); ++i)
    plan.inputs[i] = candidates[best].inputs[i];
  plan.outputs = candidates[best].outputs;
  return plan;
}

SpecPtr same_layout_with_shape(const DTensorSpec& like, std::vector<int64_t> sizes,
                               c10::ScalarType dtype) {
  return std::make_shared<DTensorSpec>(like.mesh(), like.placements(), std::move(sizes), dtype,
                                       like.shard_tables());
}

OpPlan replicate_inputs(const OpCall& call) {
  OpPlan plan(call);
  for (size_t i = 0; i < call.args.size(); ++i)
    if (call.specs[i]) plan.inputs[i] = replicated(*call.specs[i]);
  if (!call.list_specs.empty()) {
    plan.list_inputs.resize(call.args.size());
    for (size_t i = 0; i < call.list_specs.size(); ++i)
      for (const auto* sp : call.list_specs[i])
        plan.list_inputs[i].push_back(sp ? replicated(*sp) : nullptr);
  }
  return plan;
}

OpPlan replicate_everything(const OpCall& call) {
  OpPlan plan = replicate_inputs(call);
  plan.data_dependent_shapes = true;
  return plan;
}

SpecPtr align_to(const DTensorSpec& ref, const DTensorSpec& operand, bool keep_partial) {
  const int64_t shift = ref.ndim() - operand.ndim();
  Placements p = ref.placements();
  std::vector<ShardTable> tables(operand.ndim());
  for (auto& x : p) {
    if (x.is_partial() && !keep_partial) x = Replicate();
    if (!x.is_shard()) continue;
    const int64_t t_in = x.dim() - shift;
    if (t_in < 0 || operand.sizes()[t_in] != ref.sizes()[x.dim()]) {
      x = Replicate();
      continue;
    }
    tables[t_in] = ref.shard_table(x.dim());
    x = Shard(t_in);
  }
  return std::make_shared<DTensorSpec>(ref.mesh(), p, operand.sizes(), operand.dtype(), tables);
}

SpecPtr summed_over_shards(const DTensorSpec& like, std::vector<int64_t> sizes) {
  Placements p = like.placements();
  for (auto& x : p) x = x.is_shard() ? Partial() : Replicate();
  return std::make_shared<DTensorSpec>(like.mesh(), p, std::move(sizes), like.dtype());
}

SpecPtr replicated(const DTensorSpec& like) {
  return std::make_shared<DTensorSpec>(like.mesh(), Placements(like.mesh().ndim(), Replicate()),
                                       like.sizes(), like.dtype());
}

namespace {
// Ops whose output shape depends on the values: gathered, then computed on every rank.
const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
                         "aten::unique_dim", "aten::unique_consecutive"})
    register_rule(op, replicate_everything);
}};
}  // namespace

}  // namespace tessera::ops
