// The one boxed fallback for distributed tensors. See NOTE: [DTensor is an at::Tensor].
//
// Per call: find the distributed arguments, apply the op's sharding rule, redistribute the
// inputs the rule asks for, run the op on the local shards, wrap the results.
#include <cstring>
#include <mutex>
#include <unordered_map>


#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "tessera/compat.h"
#include "tessera/ops/rule.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tessera/tensor/registration.h"

namespace tessera {

namespace {

DTensorImpl* as_dtensor(const at::Tensor& t) {
  // The key check is one bit test; DTensorImpl is final, so an exact type check suffices
  // (cheaper than dynamic_cast on this hot path).
  if (!t.defined() || !t.key_set().has(c10::DispatchKey::PrivateUse1)) return nullptr;
  auto* impl = t.unsafeGetTensorImpl();
  return typeid(*impl) == typeid(DTensorImpl) ? static_cast<DTensorImpl*>(impl) : nullptr;
}

// Plain tensors next to distributed ones: 0-dim tensors stay scalars; any other plain tensor
// is taken as a replicated global value (every rank must hold the same data), which is what
// autograd's own zeros and user constants need. See docs/design.md "Plain tensors".
at::Tensor implicit_replicate(const at::Tensor& plain, const DTensorSpec& like) {
  Placements r(like.mesh().ndim(), Replicate());
  return make_dtensor(plain, std::make_shared<DTensorSpec>(like.mesh(), r, plain.sizes().vec(),
                                                           plain.scalar_type()));
}

// The rule's output spec, checked against the local result (first call only: a cached
// decision has been checked), with the result's dtype where it differs (comparisons, casts).
SpecPtr checked_output(const ops::OpCall& call, const at::Tensor& local, const SpecPtr& planned) {
  SpecPtr spec = planned;
  if (spec->dtype() != local.scalar_type()) {
    spec = std::make_shared<DTensorSpec>(spec->mesh(), spec->placements(), spec->sizes(),
                                         local.scalar_type(), spec->shard_tables());
  }
  TORCH_CHECK(local.sizes().vec() == spec->local_sizes(), "tessera: ", call.describe(),
              ": the sharding rule expected a local result of shape ",
              shape_str(spec->local_sizes()), " but the op produced ",
              shape_str(local.sizes().vec()), " (", spec->str(), "); this is a rule bug");
  return spec;
}

at::Tensor wrap_unchecked(const at::Tensor& local, SpecPtr spec) {
  return at::detail::make_tensor<DTensorImpl>(local, std::move(spec));
}

// The return `ret` aliases (and writes) argument `arg`: in-place and out= ops.
int aliased_argument(const c10::FunctionSchema& schema, size_t ret) {
  const auto* ainfo = schema.returns()[ret].alias_info();
  if (!ainfo || !ainfo->isWrite()) return -1;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto* a = schema.arguments()[i].alias_info();
    if (a && a->isWrite() && a->beforeSets() == ainfo->beforeSets()) return static_cast<int>(i);
  }
  return -1;
}

// NOTE: [Decision cache]
// A decision (the rule's plan, with output specs fixed up after the first run) depends only
// on the op, the input specs and the arguments that can change shapes (int, int[], bool,
// dtype, string), never on floating-point or Scalar values (learning rates change every
// step). Decisions are cached per thread: no locks, and rank threads never share. The cache
// holds specs (and so meshes); clear_dispatch_cache() releases them, and a full cache starts
// over.
struct Decision {
  ops::OpPlan plan;
  bool replicate_all = false;
};

using Key = c10::SmallVector<size_t, 16>;

struct KeyedDecision {
  Key key;
  // The input specs the key's hashes stand for, compared on every hit: a hash collision
  // must never hand one op another op's layouts.
  std::vector<SpecPtr> specs;
  std::shared_ptr<const Decision> decision;
};

struct DecisionCache {
  std::unordered_map<size_t, std::vector<KeyedDecision>> map;
  size_t entries = 0;
  int64_t hits = 0, misses = 0;
};
thread_local DecisionCache t_cache;
constexpr size_t kMaxCachedDecisions = 16384;

bool is_optional_tensor_list(const c10::IValue& v) {
  if (!v.isList() || v.isTensorList()) return false;
  const auto& elem = v.toList().elementType();
  const auto* opt = elem->castRaw<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::TensorType;
}

bool shapes_matter(const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:  // concrete SymInts arrive as ints
    case c10::TypeKind::BoolType:
    case c10::TypeKind::StringType:
    case c10::TypeKind::FloatType:
    case c10::TypeKind::ListType:
    case c10::TypeKind::OptionalType:
      return true;
    default:
      return false;
  }
}

// `float`, `float?` and `float[]` arguments (interpolation scales, eps) join the key by
// value; `Scalar` ones (alpha, lr, momentum: they change every step and only reach kernels)
// never do, and `Scalar?` by presence only.
bool declares_float(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::OptionalType)
    return declares_float(type->castRaw<c10::OptionalType>()->getElementType());
  if (type->kind() == c10::TypeKind::ListType)
    return declares_float(type->castRaw<c10::ListType>()->getElementType());
  return type->kind() == c10::TypeKind::FloatType;
}

void hash_value(const c10::IValue& v, Key& key, bool floats) {
  if (v.isNone()) key.push_back(0x9e37);
  else if (v.isInt()) key.push_back(static_cast<size_t>(v.toInt()) * 3 + 1);
  else if (v.isBool()) key.push_back(v.toBool() ? 0x51 : 0x50);
  else if (v.isIntList()) {
    key.push_back(0xabc0 + v.toIntList().size());
    for (int64_t x : v.toIntList()) key.push_back(static_cast<size_t>(x));
  } else if (v.isBoolList()) {
    key.push_back(0xb001 + v.toBoolList().size());
    for (bool b : v.toBoolList()) key.push_back(b);
  } else if (floats && v.isDouble()) {
    double d = v.toDouble();
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    key.push_back(0xd0b1e);
    key.push_back(static_cast<size_t>(bits));
  } else if (floats && v.isDoubleList()) {
    key.push_back(0xd0b70 + v.toDoubleList().size());
    for (double d : v.toDoubleList()) {
      uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(static_cast<size_t>(bits));
    }
  } else if (v.isString()) key.push_back(std::hash<std::string>()(v.toStringRef()));
  else key.push_back(0x7f);  // other optional/list payloads: only their presence
}

void dtensor_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  c10::SmallVector<c10::IValue, 8> args(std::make_move_iterator(stack->begin() + base),
                                        std::make_move_iterator(stack->end()));
  stack->resize(base);

  ops::OpCall call{op, args, c10::SmallVector<const DTensorSpec*, 8>(nargs, nullptr),
                   /*list_specs=*/{}, /*reference=*/nullptr};
  bool lists = false;
  for (size_t i = 0; i < nargs; ++i) {
    if (args[i].isTensor()) {
      if (auto* d = as_dtensor(args[i].toTensor())) {
        call.specs[i] = &d->spec();
        if (!call.reference) call.reference = call.specs[i];
      }
    } else if (args[i].isTensorList()) {
      for (const c10::IValue& t_elem : args[i].toListRef()) {
        const at::Tensor& t = t_elem.toTensor();
        if (auto* d = as_dtensor(t)) {
          lists = true;
          if (!call.reference) call.reference = &d->spec();
        }
      }
    } else if (is_optional_tensor_list(args[i])) {  // Tensor?[] (index, index_put_)
      for (const auto& e : args[i].toListRef()) {
        if (!e.isTensor()) continue;
        if (auto* d = as_dtensor(e.toTensor())) {
          lists = true;
          if (!call.reference) call.reference = &d->spec();
        }
      }
    }
  }
  TORCH_CHECK(call.reference, "tessera: ", schema.operator_name(),
              " reached the distributed-tensor fallback without a distributed tensor argument");

  std::vector<at::Tensor> keep_alive;  // implicit conversions must outlive the call
  const DTensorSpec& ref = *call.reference;
  // Every distributed argument must live on the reference's mesh; plain tensors join it as
  // replicated values (0-dim ones stay scalars).
  c10::SmallVector<DTensorImpl*, 8> impls(nargs, nullptr);
  // Plain tensors admitted as replicated values; an in-place op on one returns the original.
  c10::SmallVector<std::pair<size_t, at::Tensor>, 2> admitted_plain;
  // Every input spec in argument order (list elements included): the decision cache
  // compares them on a hit.
  c10::SmallVector<SpecPtr, 8> seen;
  auto admit = [&](const at::Tensor& t, const DTensorSpec*& spec_out) -> at::Tensor {
    if (!t.defined()) return t;
    if (auto* d = as_dtensor(t)) {
      TORCH_CHECK(d->spec().mesh() == ref.mesh(), "tessera: ", call.describe(),
                  ": arguments live on different meshes (", ref.mesh().str(), " and ",
                  d->spec().mesh().str(), "); redistribute them onto one mesh first");
      spec_out = &d->spec();
      seen.push_back(d->spec_ptr());
      return t;
    }
    if (t.dim() == 0) return t;
    keep_alive.push_back(implicit_replicate(t, ref));
    auto* d = dtensor_impl(keep_alive.back());
    spec_out = &d->spec();
    seen.push_back(d->spec_ptr());
    return keep_alive.back();
  };
  if (lists) call.list_specs.resize(nargs);
  // The decision key: see NOTE: [Decision cache].
  Key key;
  key.push_back(reinterpret_cast<size_t>(&schema));
  for (size_t i = 0; i < nargs; ++i) {
    if (args[i].isTensor()) {
      const DTensorSpec* sp = nullptr;
      at::Tensor before = args[i].toTensor();
      args[i] = admit(before, sp);
      if (sp && !as_dtensor(before)) admitted_plain.emplace_back(i, std::move(before));
      call.specs[i] = sp;
      if (sp) impls[i] = static_cast<DTensorImpl*>(args[i].toTensor().unsafeGetTensorImpl());
      const auto& t = args[i].toTensor();
      key.push_back(sp ? sp->hash() : t.defined() ? 0x5ca1a0 + static_cast<size_t>(t.scalar_type()) : 1);
    } else if (lists && args[i].isTensorList()) {
      c10::List<at::Tensor> admitted;
      for (const c10::IValue& t_elem : args[i].toListRef()) {
        const at::Tensor& t = t_elem.toTensor();
        const DTensorSpec* sp = nullptr;
        admitted.push_back(admit(t, sp));
        call.list_specs[i].push_back(sp);
        key.push_back(sp ? sp->hash() : 0x5ca1a0 + static_cast<size_t>(t.scalar_type()));
      }
      args[i] = std::move(admitted);
    } else if (lists && is_optional_tensor_list(args[i])) {
      c10::List<c10::optional<at::Tensor>> admitted;
      for (const auto& e : args[i].toListRef()) {
        const DTensorSpec* sp = nullptr;
        if (e.isTensor()) {
          admitted.push_back(admit(e.toTensor(), sp));
          key.push_back(sp ? sp->hash() : 0x5ca1a0 + static_cast<size_t>(e.toTensor().scalar_type()));
        } else {
          admitted.push_back(c10::nullopt);
          key.push_back(3);
        }
        call.list_specs[i].push_back(sp);
      }
      args[i] = std::move(admitted);
    } else if (shapes_matter(schema.arguments()[i].type())) {
      hash_value(args[i], key, declares_float(schema.arguments()[i].type()));
    } else {
      key.push_back(2);
    }
  }
  size_t h = 0;
  for (auto k : key) h = hash_mix(h, k);

  auto same_specs = [&](const KeyedDecision& e) {
    if (e.specs.size() != seen.size()) return false;
    for (size_t k = 0; k < seen.size(); ++k)
      if (e.specs[k] != seen[k] && *e.specs[k] != *seen[k]) return false;
    return true;
  };
  std::shared_ptr<const Decision> decision;
  if (auto it = t_cache.map.find(h); it != t_cache.map.end()) {
    for (auto& e : it->second)
      if (e.key == key && same_specs(e)) decision = e.decision;
  }
  const bool hit = decision != nullptr;
  std::shared_ptr<Decision> fresh;
  if (hit) {
    ++t_cache.hits;
  } else {
    ++t_cache.misses;
    fresh = std::make_shared<Decision>();
    if (const ops::Rule* rule = ops::find_rule(op)) {
      fresh->plan = (*rule)(call);
      // Share spec objects the inputs already carry: later calls then match by pointer.
      auto& in = fresh->plan.inputs;
      for (size_t i = 0; i < in.size() && i < nargs; ++i)
        if (in[i] && impls[i] && *in[i] == impls[i]->spec()) in[i] = impls[i]->spec_ptr();
    } else {
      for (size_t i = 0; i < nargs; ++i) {
        TORCH_CHECK(!call.specs[i] || call.specs[i]->is_replicated(), "tessera: ",
                    call.describe(), ": no sharding rule for this op on non-replicated inputs; ",
                    "redistribute the inputs to Replicate() first, or register a rule with ",
                    "tessera::ops::register_rule");
      }
      for (auto& l : call.list_specs)
        for (auto* sp : l)
          TORCH_CHECK(!sp || sp->is_replicated(), "tessera: ", call.describe(),
                      ": no sharding rule for this op on a list of non-replicated tensors");
      fresh->replicate_all = true;  // fully replicated: every rank computes the same thing
    }
    decision = fresh;
  }
  const ops::OpPlan& plan = decision->plan;

  // Redistribute where the plan asks, then swap every distributed argument for its shard.
  c10::SmallVector<at::Tensor, 8> locals(nargs);
  for (size_t i = 0; i < nargs; ++i) {
    if (args[i].isTensorList() && lists) {
      c10::List<at::Tensor> out;
      size_t k = 0;
      for (const c10::IValue& t_elem : args[i].toListRef()) {
        const at::Tensor& t = t_elem.toTensor();
        auto* d = as_dtensor(t);
        at::Tensor local = d ? d->local() : t;
        if (d && i < plan.list_inputs.size() && k < plan.list_inputs[i].size() &&
            plan.list_inputs[i][k] && *plan.list_inputs[i][k] != d->spec()) {
          local = redistribute_local(local, d->spec_ptr(), plan.list_inputs[i][k]);
        }
        out.push_back(local);
        ++k;
      }
      stack->emplace_back(std::move(out));
      continue;
    }
    if (lists && is_optional_tensor_list(args[i])) {
      c10::List<c10::optional<at::Tensor>> out;
      for (const auto& e : args[i].toListRef()) {
        if (!e.isTensor()) {
          out.push_back(c10::nullopt);
          continue;
        }
        auto* d = as_dtensor(e.toTensor());
        out.push_back(d ? d->local() : e.toTensor());
      }
      stack->emplace_back(std::move(out));
      continue;
    }
    if (!call.specs[i]) {
      stack->push_back(args[i]);
      continue;
    }
    const auto* d = impls[i];
    at::Tensor local = d->local();
    if (i < plan.inputs.size() && plan.inputs[i] && plan.inputs[i].get() != call.specs[i] &&
        *plan.inputs[i] != *call.specs[i]) {
      local = redistribute_local(local, d->spec_ptr(), plan.inputs[i]);
    }
    locals[i] = local;
    stack->push_back(local);
  }

  if (plan.stack_kernel || plan.local_kernel || plan.distributed_kernel) {
    torch::jit::Stack own(stack->begin() + base, stack->end());
    stack->resize(base);
    ops::KernelCall kc(op, own);
    if (plan.local_kernel) plan.local_kernel(kc);
    else if (plan.distributed_kernel) plan.distributed_kernel(kc, ref.mesh());
    else plan.stack_kernel(own);
    stack->insert(stack->end(), own.begin(), own.end());
  } else {
    op.callBoxed(stack);
  }

  // Wrap the results. Returns that alias a written argument hand back that argument itself.
  // On a miss the output specs are checked against the local results and completed (dtype,
  // replicated shapes) into the cached decision; a hit reuses them as they are.
  const size_t nret = schema.returns().size();
  c10::SmallVector<c10::IValue, 4> results(std::make_move_iterator(stack->end() - nret),
                                           std::make_move_iterator(stack->end()));
  stack->resize(stack->size() - nret);
  std::vector<SpecPtr> final_outputs;
  size_t next_out = 0;
  auto output_spec = [&](const at::Tensor& local) -> SpecPtr {
    if (decision->replicate_all || plan.data_dependent_shapes) {
      // Ops without a rule may have data-dependent shapes (nonzero, unique): read them off
      // the result every time.
      auto sp = std::make_shared<DTensorSpec>(ref.mesh(), Placements(ref.mesh().ndim(), Replicate()),
                                              local.sizes().vec(), local.scalar_type());
      if (!hit) final_outputs.push_back(sp);
      return sp;
    }
    if (hit) return plan.outputs[next_out];
    TORCH_CHECK(next_out < plan.outputs.size(), "tessera: ", call.describe(),
                ": the sharding rule gave too few output layouts (rule bug)");
    auto sp = checked_output(call, local, plan.outputs[next_out]);
    final_outputs.push_back(sp);
    return sp;
  };
  for (size_t r = 0; r < nret; ++r) {
    auto& v = results[r];
    const int alias = aliased_argument(schema, r);
    auto plain = std::find_if(admitted_plain.begin(), admitted_plain.end(),
                              [&](const auto& a) { return static_cast<int>(a.first) == alias; });
    if (alias >= 0 && plain != admitted_plain.end()) {
      // An in-place op on a plain tensor: it must end up holding the whole result. If the
      // plan worked on a redistributed copy, gather that copy back into it.
      SpecPtr planned = hit ? plan.outputs[next_out]
                            : (plan.outputs.size() > next_out ? plan.outputs[next_out] : nullptr);
      if (!hit) final_outputs.push_back(planned);
      ++next_out;
      at::Tensor& target = plain->second;
      if (planned && (!locals[alias].is_same(target) || !planned->is_replicated())) {
        auto whole = std::make_shared<DTensorSpec>(planned->with_placements(
            Placements(planned->mesh().ndim(), Replicate())));
        target.copy_(redistribute_local(locals[alias], planned, whole));
      }
      stack->push_back(target);
      continue;
    }
    if (alias >= 0 && args[alias].isTensor() && call.specs[alias]) {
      auto* self = impls[alias];
      SpecPtr planned;
      if (hit) {
        planned = plan.outputs[next_out];
      } else {
        planned = decision->replicate_all || plan.outputs.size() <= next_out
                      ? self->spec_ptr()
                      : plan.outputs[next_out];
        final_outputs.push_back(planned);
      }
      if (!locals[alias].is_same(self->local()) ||
          (planned != self->spec_ptr() && *planned != self->spec())) {
        self->set_local_and_spec(locals[alias], planned);
      }
      ++next_out;
      stack->push_back(args[alias]);
      continue;
    }
    if (v.isTensor()) {
      const at::Tensor& local = v.toTensor();
      if (!local.defined()) {
        if (!hit) final_outputs.push_back(nullptr);
        ++next_out;
        stack->push_back(v);
        continue;
      }
      auto sp = output_spec(local);
      ++next_out;
      stack->push_back(wrap_unchecked(local, std::move(sp)));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const c10::IValue& local_elem : v.toListRef()) {
        const at::Tensor& local = local_elem.toTensor();
        auto sp = output_spec(local);
        ++next_out;
        out.push_back(wrap_unchecked(local, std::move(sp)));
      }
      stack->emplace_back(std::move(out));
    } else {
      stack->push_back(std::move(v));
    }
  }
  if (!hit) {
    fresh->plan.outputs = std::move(final_outputs);
    if (t_cache.entries >= kMaxCachedDecisions) {
      t_cache.map.clear();
      t_cache.entries = 0;
    }
    t_cache.map[h].push_back({std::move(key), std::vector<SpecPtr>(seen.begin(), seen.end()), fresh});
    ++t_cache.entries;
  }
}

// NOTE: [Which ops need an explicit kernel]
// A backend fallback is consulted only when an op has no kernel for the key. Ops with a
// CompositeExplicitAutograd(NonFunctional) kernel have one for every backend key, ours
// included, so they would run that kernel on the wrapper (and fail or return plain
// tensors). We register the fallback explicitly for each such op. CompositeImplicitAutograd
// ops must keep decomposing above autograd, so they are left alone.
void register_explicit_kernels() {
  static std::vector<std::unique_ptr<torch::Library>> libs;
  auto& dispatcher = c10::Dispatcher::singleton();
  std::map<std::string, std::unique_ptr<torch::Library>> by_ns;
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto handle = dispatcher.findOp(name);
    if (!handle) continue;
    if (handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    const bool explicit_composite =
        handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
        handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
    if (!explicit_composite) continue;
    const std::string& full = name.name;
    const auto sep = full.find("::");
    if (sep == std::string::npos) continue;
    const std::string ns = full.substr(0, sep);
    auto& lib = by_ns[ns];
    if (!lib) {
      lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                             c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    }
    std::string op_name = full.substr(sep + 2);
    if (!name.overload_name.empty()) op_name += "." + name.overload_name;
    lib->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&dtensor_fallback>());
  }
  for (auto& kv : by_ns) libs.push_back(std::move(kv.second));
}

}  // namespace

void clear_dispatch_cache() {
  t_cache.map.clear();
  t_cache.entries = 0;
}

DispatchCacheStats dispatch_cache_stats() { return {t_cache.hits, t_cache.misses, t_cache.entries}; }

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&dtensor_fallback>());
}

// Custom ops with only a CPU kernel must pass through autograd on distributed inputs, which
// needs a fallback at AutogradPrivateUse1. LibTorch 1.13 has none, and neither has Debian's
// 2.6 build (upstream 2.x builds may): asked of the dispatcher, not guessed from the version.
void ensure_autograd_fallthrough() {
  auto& dispatcher = c10::Dispatcher::singleton();
  if (dispatcher.hasBackendFallbackForDispatchKey(c10::DispatchKey::AutogradPrivateUse1)) return;
  static torch::Library library(torch::Library::IMPL, "_", c10::DispatchKey::AutogradPrivateUse1,
                                __FILE__, __LINE__);
  library.fallback(torch::CppFunction::makeFallthrough());
}

void ensure_dispatch_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    ensure_autograd_fallthrough();
    register_explicit_kernels();
  });
}

}  // namespace tessera
