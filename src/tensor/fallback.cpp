// The one boxed fallback for distributed tensors. See NOTE: [DTensor is an at::Tensor].
//
// Per call, in named steps (see dtensor_fallback): collect the distributed arguments, admit
// plain ones and build the decision key, decide (cache or rule), unwrap and redistribute,
// run the op or the plan's kernel, wrap the results and write back aliased arguments.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "comm/wait.h"
#include "tensor/out_form.h"
#include "fallback_hooks.h"
#include "tessera/compat.h"
#include "tessera/tensor/rule.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tessera/tensor/registration.h"
#include "fast_path.h"

namespace tessera {

namespace {

using detail::as_dtensor;

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
// dtype, string, and `float` ones such as interpolation scales), never on `Scalar` values
// (alpha, lr, momentum: they change every step and only reach kernels). Rules must not read
// Scalars. Decisions are cached per thread: no locks, and rank threads never share. The
// cache holds specs (and so meshes); clear_dispatch_cache() releases them, and a full cache
// starts over.
struct Decision {
  ops::OpPlan plan;
  bool replicate_all = false;
  // An out= form run through its functional sibling (NOTE: [out= forms] in
  // tensor/rule_registry.cpp).
  std::optional<c10::OperatorHandle> functional;
  size_t outs = 0;
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

bool shapes_matter(const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:  // concrete SymInts arrive as ints
    case c10::TypeKind::BoolType:
    case c10::TypeKind::StringType:
    case c10::TypeKind::FloatType:
    case c10::TypeKind::ListType:
    case c10::TypeKind::OptionalType: return true;
    default: return false;
  }
}

// `float`, `float?` and `float[]` arguments join the key by value; `Scalar` ones never do,
// and `Scalar?` by presence only.
bool declares_float(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::OptionalType)
    return declares_float(type->castRaw<c10::OptionalType>()->getElementType());
  if (type->kind() == c10::TypeKind::ListType)
    return declares_float(type->castRaw<c10::ListType>()->getElementType());
  return type->kind() == c10::TypeKind::FloatType;
}

size_t double_bits(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return static_cast<size_t>(bits);
}

void hash_value(const c10::IValue& v, Key& key, bool floats) {
  if (v.isNone())
    key.push_back(0x9e37);
  else if (v.isInt())
    key.push_back(static_cast<size_t>(v.toInt()) * 3 + 1);
  else if (v.isBool())
    key.push_back(v.toBool() ? 0x51 : 0x50);
  else if (v.isIntList()) {
    key.push_back(0xabc0 + v.toIntList().size());
    for (int64_t x : v.toIntList()) key.push_back(static_cast<size_t>(x));
  } else if (v.isBoolList()) {
    key.push_back(0xb001 + v.toBoolList().size());
    for (bool b : v.toBoolList()) key.push_back(b);
  } else if (floats && v.isDouble()) {
    key.push_back(0xd0b1e);
    key.push_back(double_bits(v.toDouble()));
  } else if (floats && v.isDoubleList()) {
    key.push_back(0xd0b70 + v.toDoubleList().size());
    for (double d : v.toDoubleList()) key.push_back(double_bits(d));
  } else if (v.isString())
    key.push_back(std::hash<std::string>()(v.toStringRef()));
  else
    key.push_back(0x7f);  // other optional/list payloads: only their presence
}

size_t scalar_kind(const c10::IValue& v) {
  if (v.isDouble()) return 0x5c0;
  if (v.isInt()) return 0x5c1;
  if (v.isBool()) return 0x5c2;
  if (v.isComplexDouble()) return 0x5c3;
  return 2;
}

// ---- One visitor for the argument kinds that hold tensors ------------------------------

enum class Holds : uint8_t { Nothing, Tensor, TensorList, OptionalTensorList };

Holds holds(const c10::IValue& v) {
  if (v.isTensor()) return Holds::Tensor;
  if (!v.isList()) return Holds::Nothing;
  if (v.isTensorList()) return Holds::TensorList;
  const auto* opt = v.toList().elementType()->castRaw<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::TensorType
             ? Holds::OptionalTensorList  // Tensor?[]: index, index_put_
             : Holds::Nothing;
}

const at::Tensor& none_tensor() {
  static const at::Tensor none;
  return none;
}

// Calls fn(element, tensor) for every tensor an argument holds; a None element of a
// Tensor?[] comes as an undefined tensor, so element numbers line up with the list.
template <class F>
void for_each_tensor(const c10::IValue& v, Holds h, F&& fn) {
  if (h == Holds::Tensor) {
    fn(size_t{0}, v.toTensor());
  } else if (h != Holds::Nothing) {
    size_t k = 0;
    for (const auto& e : v.toListRef()) fn(k++, e.isTensor() ? e.toTensor() : none_tensor());
  }
}

// The argument rebuilt with fn(element, tensor) in place of each tensor; None stays None.
template <class F>
c10::IValue map_tensors(const c10::IValue& v, Holds h, F&& fn) {
  if (h == Holds::Tensor) return fn(size_t{0}, v.toTensor());
  size_t k = 0;
  if (h == Holds::TensorList) {
    c10::List<at::Tensor> out;
    out.reserve(v.toListRef().size());
    for (const auto& e : v.toListRef()) out.push_back(fn(k++, e.toTensor()));
    return out;
  }
  c10::List<c10::optional<at::Tensor>> out;
  out.reserve(v.toListRef().size());
  for (const auto& e : v.toListRef()) {
    if (e.isTensor())
      out.push_back(fn(k, e.toTensor()));
    else
      out.push_back(c10::nullopt);
    ++k;
  }
  return out;
}

// ---- The fallback, step by step ----------------------------------------------------------

// Everything one call of the fallback knows, filled in by the steps in order.
struct Frame {
  Frame(const c10::OperatorHandle& handle, torch::jit::Stack* s)
      : op(handle),
        schema(handle.schema()),
        stack(s),
        nargs(schema.arguments().size()),
        base(s->size() - nargs),
        args(std::make_move_iterator(s->begin() + base), std::make_move_iterator(s->end())),
        holds(nargs, Holds::Nothing),
        call{handle, args, c10::SmallVector<const DTensorSpec*, 8>(nargs, nullptr), {}, nullptr},
        impls(nargs, nullptr),
        locals(nargs) {
    stack->resize(base);
  }

  const c10::OperatorHandle& op;
  const c10::FunctionSchema& schema;
  torch::jit::Stack* stack;
  const size_t nargs, base;
  c10::SmallVector<c10::IValue, 8> args;  // moved off the stack; plain tensors admitted
  c10::SmallVector<Holds, 8> holds;
  ops::OpCall call;
  bool lists = false;  // a Tensor[] / Tensor?[] argument holds a distributed tensor
  bool cast = false;   // arguments cast to a compute dtype (NOTE: [Compute dtype])
  c10::SmallVector<DTensorImpl*, 8> impls;  // per Tensor argument: its wrapper, if any
  // Plain tensors admitted as replicated values; an in-place op on one returns the original.
  c10::SmallVector<std::pair<size_t, at::Tensor>, 2> admitted_plain;
  // Every input spec in argument order (list elements included): compared on a cache hit.
  c10::SmallVector<SpecPtr, 8> seen;
  std::vector<at::Tensor> keep_alive;  // implicit conversions must outlive the call
  Key key;
  size_t hash = 0;
  std::shared_ptr<const Decision> decision;
  std::shared_ptr<Decision> fresh;  // on a miss: the decision being made
  bool hit = false;
  c10::SmallVector<at::Tensor, 8> locals;  // per Tensor argument: the local shard the op ran on
  std::vector<SpecPtr> final_outputs;      // on a miss: the output specs, completed
  size_t next_out = 0;
  // Head-tail arguments (NOTE: [Head-tail arguments]): the stand-in the steps see, and the
  // tensor the caller passed.
  struct Stored {
    const DTensorImpl* stand_in;
    at::Tensor original;
    SpecPtr natural;
  };
  c10::SmallVector<Stored, 2> stored;
  bool keeps_order = false;  // the op runs on the stored shards (keeps_head_tail)
  // With keeps_order: replicated operands that the plan cuts locally, and the cut they take
  // (head-tail along head-tail mesh dims, as the natural one; head_tail_cut).
  c10::SmallVector<std::pair<size_t, SpecPtr>, 2> head_tail_cuts;

  const Stored* stored_for(const DTensorImpl* d) const {
    for (const auto& s : stored)
      if (s.stand_in == d) return &s;
    return nullptr;
  }

  const DTensorSpec& ref() const { return *call.reference; }
  const ops::OpPlan& plan() const { return decision->plan; }
};

// NOTE: [Head-tail arguments]
// Rules never see the head-tail order (NOTE: [Head-tail order] in spec.h): each head-tail
// argument is swapped for a stand-in with the natural spec over the same stored shard, so
// the steps decide and cache as for Shard(t). Then, per call:
//  - a call whose plan cannot tell the order apart (keeps_head_tail: position-free ops such
//    as element-wise ones, products, norms and views that keep the dim whole) runs on the
//    stored shards, and its results are head-tail on that dim. So a model keeps the order
//    from layer to layer without moving anything, and a view aliases the shard;
//  - any other call relays its head-tail shards into the natural order (to whatever layout
//    the plan wants) before the op runs, and returns the natural order. A view of that kind
//    would alias a relayed copy, and writes through it would be lost: it raises instead;
//  - in-place and out= results land in the caller's own shard in its stored order, so the
//    tensor stays head-tail and its aliases see the write.
// Such calls never feed the fast path, which would replay them without these steps.
void substitute_head_tail(Frame& f) {
  auto stand_in = [&](const at::Tensor& t) -> at::Tensor {
    auto* d = as_dtensor(t);
    if (!d || !d->spec().has_head_tail()) return t;
    auto natural = std::make_shared<DTensorSpec>(d->spec().natural_spec());
    at::Tensor s = wrap_unchecked(d->local(), natural);
    f.stored.push_back({static_cast<const DTensorImpl*>(s.unsafeGetTensorImpl()), t, natural});
    f.keep_alive.push_back(s);
    return s;
  };
  for (size_t i = 0; i < f.nargs; ++i)
    if (f.holds[i] != Holds::Nothing)
      f.args[i] = map_tensors(f.args[i], f.holds[i],
                              [&](size_t, const at::Tensor& t) { return stand_in(t); });
}

// Step 1: find the distributed arguments and the reference (the first one, in a list or not).
void collect(Frame& f) {
  bool any_freed = false, head_tail = false;
  for (size_t i = 0; i < f.nargs; ++i) {
    f.holds[i] = holds(f.args[i]);
    for_each_tensor(f.args[i], f.holds[i], [&](size_t, const at::Tensor& t) {
      auto* d = as_dtensor(t);
      if (!d) return;
      head_tail = head_tail || d->spec().has_head_tail();
      any_freed = any_freed || detail::is_freed(d->local());
      if (f.holds[i] == Holds::Tensor) {
        f.impls[i] = d;
        f.call.specs[i] = &d->spec();
      } else {
        f.lists = true;
      }
      if (!f.call.reference) f.call.reference = &d->spec();
    });
  }
  TORCH_CHECK(f.call.reference, "tessera: ", f.schema.operator_name(),
              " reached the distributed-tensor fallback without a distributed tensor argument");
  if (head_tail && !ops::detail::rule_sees_head_tail(f.op)) {  // once: stand-ins are natural
    substitute_head_tail(f);
    std::fill(f.impls.begin(), f.impls.end(), nullptr);
    std::fill(f.call.specs.begin(), f.call.specs.end(), nullptr);
    f.call.reference = nullptr;
    f.lists = false;
    collect(f);
    return;
  }
  if (any_freed) {
    c10::SmallVector<at::Tensor, 8> locals;
    for (size_t i = 0; i < f.nargs; ++i)
      for_each_tensor(f.args[i], f.holds[i], [&](size_t, const at::Tensor& t) {
        if (auto* d = as_dtensor(t)) locals.push_back(d->local());
      });
    detail::refill_freed(locals);
  }
  if (f.lists) f.call.list_specs.resize(f.nargs);
}

// Step 2: every distributed argument must live on the reference's mesh; plain tensors join it
// as replicated values (0-dim ones stay scalars). Builds the decision key as it goes.
std::atomic<PlainOperandCheck> g_plain_operand_check{nullptr};

void admit_and_key(Frame& f) {
  const DTensorSpec& ref = f.ref();
  auto admit = [&](const at::Tensor& t) -> std::pair<at::Tensor, const DTensorSpec*> {
    if (!t.defined()) return {t, nullptr};
    if (auto* d = as_dtensor(t)) {
      TORCH_CHECK(d->spec().mesh() == ref.mesh(), "tessera: ", f.call.describe(),
                  ": arguments live on different meshes (", ref.mesh().str(), " and ",
                  d->spec().mesh().str(), "); redistribute them onto one mesh first");
      f.seen.push_back(d->spec_ptr());
      return {t, &d->spec()};
    }
    if (t.dim() == 0) return {t, nullptr};
    f.keep_alive.push_back(implicit_replicate(t, ref));
    auto* d = dtensor_impl(f.keep_alive.back());
    f.seen.push_back(d->spec_ptr());
    return {f.keep_alive.back(), &d->spec()};
  };
  auto tensor_key = [](const at::Tensor& t, const DTensorSpec* sp) -> size_t {
    if (sp) return sp->hash();
    return t.defined() ? 0x5ca1a0 + static_cast<size_t>(t.scalar_type()) : 3;
  };
  f.key.push_back(reinterpret_cast<size_t>(&f.schema));
  for (size_t i = 0; i < f.nargs; ++i) {
    const Holds h = f.holds[i];
    if (h == Holds::Tensor) {
      const at::Tensor& before = f.args[i].toTensor();
      auto [t, sp] = admit(before);
      if (sp && !f.impls[i]) {  // a plain tensor admitted
        f.admitted_plain.emplace_back(i, before);
        f.impls[i] = static_cast<DTensorImpl*>(t.unsafeGetTensorImpl());
        f.call.specs[i] = sp;
        f.args[i] = t;
      }
      f.key.push_back(tensor_key(t, sp));
    } else if (h != Holds::Nothing && f.lists) {
      f.args[i] = map_tensors(f.args[i], h, [&](size_t, const at::Tensor& t) {
        auto [admitted, sp] = admit(t);
        f.call.list_specs[i].push_back(sp);
        f.key.push_back(tensor_key(t, sp));
        return admitted;
      });
    } else if (h != Holds::Nothing) {
      // A list of plain tensors (an index list): each element's presence, dtype and shape
      // decide the result's shape (x[idx] is not x[:, idx]).
      f.key.push_back(0x11570);
      for_each_tensor(f.args[i], h, [&](size_t, const at::Tensor& t) {
        f.key.push_back(tensor_key(t, nullptr));
        if (!t.defined()) return;
        f.key.push_back(static_cast<size_t>(t.dim()));
        for (int64_t x : t.sizes()) f.key.push_back(static_cast<size_t>(x));
      });
    } else if (shapes_matter(f.schema.arguments()[i].type())) {
      hash_value(f.args[i], f.key, declares_float(f.schema.arguments()[i].type()));
    } else {
      // Scalars join by kind only: an int or a float operand can change the result's dtype.
      f.key.push_back(scalar_kind(f.args[i]));
    }
  }
  for (auto k : f.key) f.hash = detail::hash_mix(f.hash, k);
  if (!f.admitted_plain.empty()) {
    if (PlainOperandCheck check = g_plain_operand_check.load(std::memory_order_acquire)) {
      c10::SmallVector<const c10::TensorImpl*, 4> distributed;
      c10::SmallVector<at::Tensor, 2> plain;
      for (size_t i = 0; i < f.nargs; ++i) {
        if (!f.impls[i]) continue;
        bool admitted = false;
        for (const auto& a : f.admitted_plain) admitted = admitted || a.first == i;
        if (!admitted) distributed.push_back(f.impls[i]);
      }
      for (const auto& a : f.admitted_plain) plain.push_back(a.second);
      check(f.call.op, distributed, plain);
    }
  }
}

// Step 3: the cached decision for this key, or a new one from the op's rule. Without a rule
// every input must be replicated: every rank then computes the same thing.
// `want` with `operand`'s dtype (itself where they agree).
SpecPtr with_dtype_of(const SpecPtr& want, const DTensorSpec& operand) {
  if (want->dtype() == operand.dtype()) return want;
  return std::make_shared<DTensorSpec>(want->mesh(), want->placements(), want->sizes(),
                                       operand.dtype(), want->shard_tables());
}

void decide(Frame& f) {
  auto same_specs = [&](const KeyedDecision& e) {
    if (e.specs.size() != f.seen.size()) return false;
    for (size_t k = 0; k < f.seen.size(); ++k)
      if (e.specs[k] != f.seen[k] && *e.specs[k] != *f.seen[k]) return false;
    return true;
  };
  if (auto it = t_cache.map.find(f.hash); it != t_cache.map.end()) {
    for (auto& e : it->second)
      if (e.key == f.key && same_specs(e)) f.decision = e.decision;
  }
  f.hit = f.decision != nullptr;
  if (f.hit) {
    ++t_cache.hits;
    return;
  }
  ++t_cache.misses;
  f.fresh = std::make_shared<Decision>();
  if (const ops::Rule* rule = ops::find_rule(f.op)) {
    try {
      f.fresh->plan = (*rule)(f.call);
    } catch (c10::Error& e) {
      // The rule saw natural stand-ins (NOTE: [Head-tail arguments]): say so.
      if (!f.stored.empty())
        e.add_context(
            "(its head-tail arguments appear as Shard, the position order it plans "
            "for)");
      throw;
    }
  } else if (const auto* out_form = ops::detail::find_out_form_rule(f.op)) {
    // The functional rule sees the inputs only: the out tensors are overwritten.
    const size_t first_out = f.nargs - out_form->outs;
    c10::SmallVector<const DTensorSpec*, 2> out_specs(f.call.specs.begin() + first_out,
                                                      f.call.specs.end());
    std::fill(f.call.specs.begin() + first_out, f.call.specs.end(), nullptr);
    f.fresh->plan = (*out_form->rule)(f.call);
    std::copy(out_specs.begin(), out_specs.end(), f.call.specs.begin() + first_out);
    if (f.fresh->plan.inputs.size() > first_out) f.fresh->plan.inputs.resize(first_out);
    f.fresh->functional = out_form->functional;
    f.fresh->outs = out_form->outs;
  } else {
    for (size_t i = 0; i < f.nargs; ++i)
      TORCH_CHECK(!f.call.specs[i] || f.call.specs[i]->is_replicated(),
                  "tessera: ", f.call.describe(),
                  ": no sharding rule for this op on non-replicated inputs; ",
                  "redistribute the inputs to Replicate() first, or register a rule with ",
                  "tessera::ops::register_rule");
    for (auto& l : f.call.list_specs)
      for (auto* sp : l)
        TORCH_CHECK(!sp || sp->is_replicated(), "tessera: ", f.call.describe(),
                    ": no sharding rule for this op on a list of non-replicated tensors; ",
                    "redistribute the list's tensors to Replicate() first, or register a ",
                    "rule with tessera::ops::register_rule");
    f.fresh->replicate_all = true;
    f.decision = f.fresh;
    return;
  }
  // An input spec says where an operand's data goes; its dtype stays the operand's. Rules
  // build some from other operands' specs, and kernels keep statistics in float32 beside
  // bfloat16 activations (attention's log-sum-exp; norms' mean and rstd on CUDA, or with
  // float32 weights), so a planned dtype can differ without any cast meant.
  auto& in = f.fresh->plan.inputs;
  // Spec objects the inputs already carry are shared: later calls then match by pointer.
  for (size_t i = 0; i < in.size() && i < f.nargs; ++i) {
    if (!in[i] || !f.impls[i]) continue;
    in[i] = with_dtype_of(in[i], f.impls[i]->spec());
    if (*in[i] == f.impls[i]->spec()) in[i] = f.impls[i]->spec_ptr();
  }
  auto& lists = f.fresh->plan.list_inputs;
  for (size_t i = 0; i < lists.size() && i < f.call.list_specs.size(); ++i)
    for (size_t k = 0; k < lists[i].size() && k < f.call.list_specs[i].size(); ++k)
      if (lists[i][k] && f.call.list_specs[i][k])
        lists[i][k] = with_dtype_of(lists[i][k], *f.call.list_specs[i][k]);
  f.decision = f.fresh;
}

// A head-tail split of a mesh dim among a call's operands: its dim's length and table.
struct HeadTailDim {
  int64_t mesh_dim, length;
  ShardTable table;
};

// `s` with its splits and sums on mesh dims of one member made Replicate: one member holds
// the whole dim, so the local data is the same (a "tp" of size 1 in a dp x cp x tp mesh:
// plans change layouts there freely, no bytes move). Empty where a table would not survive
// (a split of one member nested outside a real one of a dim with its own table; such
// operands relay, as before).
std::optional<DTensorSpec> without_single_member_dims(const DTensorSpec& s) {
  const DeviceMesh& mesh = s.mesh();
  auto single = [&](int64_t k, const Placement& p) {
    return mesh.size(k) == 1 && !p.is_replicate() && !p.is_head_tail();
  };
  for (int64_t t = 0; t < s.ndim(); ++t) {
    if (s.shard_tables()[t].empty()) continue;
    bool dropped = false;  // only trailing levels drop out of a table exactly
    for (int64_t k : s.mesh_dims_sharding(t)) {
      if (single(k, s.placement(k)))
        dropped = true;
      else if (dropped)
        return std::nullopt;
    }
  }
  return s.replicate_where(single);
}

// Whether two specs of a tensor put the same data on every rank (they differ only on mesh
// dims of one member).
bool same_local_data(const DTensorSpec& a, const DTensorSpec& b) {
  if (a == b) return true;
  const auto x = without_single_member_dims(a), y = without_single_member_dims(b);
  return x && y && *x == *y;
}

// A replicated operand that the plan cuts along a head-tail mesh dim as the head-tail
// operands are (same dim length and table: the rows it meets) has no order of its own:
// cut head-tail instead, it meets the stored rows (a gradient arriving replicated next to
// head-tail activations). Cuts along other mesh dims and other tensor dims (a weight
// expanded over a batch split over "dp") are the plan's own local slices, which the order
// does not touch. The spec of those cuts, or null.
SpecPtr head_tail_cut(const DTensorSpec& have_as_is, const DTensorSpec& want_as_is,
                      const c10::SmallVector<HeadTailDim, 2>& dims) {
  // (Changes on mesh dims of one member move nothing: left out.)
  const auto have_or = without_single_member_dims(have_as_is);
  const auto want_or = without_single_member_dims(want_as_is);
  if (!have_or || !want_or) return nullptr;
  const DTensorSpec& have = *have_or;
  const DTensorSpec& want = *want_or;
  if (have.sizes() != want.sizes()) return nullptr;
  Placements p = want.placements();
  std::vector<bool> cut_dims(static_cast<size_t>(want.ndim()), false);
  for (int64_t k = 0; k < want.mesh().ndim(); ++k) {
    if (have.placement(k) == want.placement(k)) continue;
    const HeadTailDim* d = nullptr;
    for (const auto& x : dims)
      if (x.mesh_dim == k) d = &x;
    const Placement& w = want.placement(k);
    if (!have.placement(k).is_replicate() || !w.is_shard()) return nullptr;
    if (!d) {  // the plan's slice, if no head-tail mesh dim splits that tensor dim
      for (int64_t m : want.mesh_dims_sharding(w.dim()))
        for (const auto& x : dims)
          if (x.mesh_dim == m) return nullptr;
      cut_dims[static_cast<size_t>(w.dim())] = true;
      continue;
    }
    if (want.mesh_dims_sharding(w.dim()).front() != k || want.sizes()[w.dim()] != d->length ||
        want.shard_table(w.dim()) != d->table)
      return nullptr;
    p[k] = Placement::head_tail_shard(w.dim());
    cut_dims[static_cast<size_t>(w.dim())] = true;
  }
  // Nothing else may change (placements compare without their tables).
  bool any = false;
  for (int64_t t = 0; t < want.ndim(); ++t) {
    any = any || cut_dims[static_cast<size_t>(t)];
    if (!cut_dims[static_cast<size_t>(t)] && have.shard_table(t) != want.shard_table(t))
      return nullptr;
  }
  if (!any) return nullptr;
  for (const auto& d : dims)  // a natural split where the stored rows are head-tail: no
    if (p[d.mesh_dim].is_shard() && !p[d.mesh_dim].is_head_tail()) return nullptr;
  return std::make_shared<DTensorSpec>(want.mesh(), std::move(p), want.sizes(), want.dtype(),
                                       want.shard_tables());
}

// Step 3b (head-tail arguments only): whether the op may run on the stored shards and keep
// the head-tail order (NOTE: [Head-tail arguments]). It may when the plan is the op itself on
// the shards as they are (nothing moved but replicated operands cut locally, head-tail
// instead; no kernel and no local argument but sizes, unless the rule states where its
// kernel uses the shard's place, OpPlan::place_dims, and that is not along the head-tail
// dim), every operand split along a head-tail mesh dim is head-tail there alike, and every
// result is
// head-tail-shaped on that mesh dim (its dim of the same length and table) or Partial (a
// sum over it). A rule can only have planned such a call for the natural order if the op
// treats the rows of that dim alike, position-free: element-wise ops, products and sums over
// other dims or over that one with both operands in the same order, views that keep it whole.
// Ops that read positions (scans, slices of it, triangles, windows, random numbers) need a
// kernel, a move or a local offset, and so relay their head-tail operands instead.
bool keeps_head_tail(Frame& f) {
  const ops::OpPlan& plan = f.plan();
  if (f.decision->replicate_all || f.decision->functional || plan.data_dependent_shapes ||
      plan.distributed_kernel || plan.outputs.empty() || (plan.local_kernel && !plan.place_dims))
    return false;
  for (const auto& [i, value] : plan.local_args)
    if (!value.isIntList() && !plan.place_dims) return false;  // (int lists: local sizes)
  c10::SmallVector<HeadTailDim, 2> dims;
  for (const auto& s : f.stored) {
    const DTensorSpec& in = dtensor_impl(s.original)->spec();
    for (int64_t k = 0; k < in.mesh().ndim(); ++k) {
      if (!in.placement(k).is_head_tail()) continue;
      const int64_t t = in.placement(k).dim();
      for (const auto& d : dims)
        if (d.mesh_dim == k && (d.length != in.sizes()[t] || d.table != in.shard_table(t)))
          return false;
      dims.push_back({k, in.sizes()[t], in.shard_table(t)});
    }
  }
  // Nothing moves (but such cuts), and no natural operand is split along the same mesh dim.
  f.head_tail_cuts.clear();
  auto operand_keeps = [&](size_t i, const DTensorImpl* impl, const DTensorSpec* want) {
    if (want && !same_local_data(*want, impl->spec())) {  // (equal specs first)
      if (f.stored_for(impl)) return false;
      auto cut = head_tail_cut(impl->spec(), *want, dims);
      if (!cut) return false;
      f.head_tail_cuts.emplace_back(i, std::move(cut));
      return true;
    }
    if (f.stored_for(impl)) return true;
    for (const auto& d : dims)
      if (impl->spec().placement(d.mesh_dim).is_shard()) return false;
    return true;
  };
  for (size_t i = 0; i < f.nargs; ++i) {
    if (f.impls[i] &&
        !operand_keeps(i, f.impls[i], i < plan.inputs.size() ? plan.inputs[i].get() : nullptr))
      return false;
    if (f.holds[i] == Holds::Nothing || f.holds[i] == Holds::Tensor || !f.lists) continue;
    const auto* wants = i < plan.list_inputs.size() ? &plan.list_inputs[i] : nullptr;
    bool keeps = true;
    for_each_tensor(f.args[i], f.holds[i], [&](size_t k, const at::Tensor& t) {
      const auto* d = as_dtensor(t);
      const DTensorSpec* want = wants && k < wants->size() ? (*wants)[k].get() : nullptr;
      // (list elements: no cuts, they would need a slot of their own)
      keeps =
          keeps &&
          (!d || ((!want || *want == d->spec() || f.stored_for(d)) && operand_keeps(i, d, want)));
    });
    if (!keeps) return false;
  }
  // Written arguments: head-tail ones whose layout the op keeps (an out= tensor in another
  // layout, or an in-place op that changes the layout, takes the relayed path).
  for (size_t r = 0; r < f.schema.returns().size(); ++r) {
    const int alias = aliased_argument(f.schema, r);
    if (alias < 0) continue;
    const auto* impl = f.impls[alias];
    if (!impl || !f.stored_for(impl) || r >= plan.outputs.size() || !plan.outputs[r] ||
        *plan.outputs[r] != impl->spec())
      return false;
  }
  for (size_t i = 0; i < f.nargs; ++i) {
    const auto* a = f.schema.arguments()[i].alias_info();
    if (a && a->isWrite() && !(f.impls[i] && f.stored_for(f.impls[i]))) return false;
  }
  for (const auto& out : plan.outputs) {
    if (!out) continue;
    for (const auto& d : dims) {
      const Placement& o = out->placement(d.mesh_dim);
      if (o.is_partial()) {
        // A kernel that sums over the head-tail dim and states no result dim where it reads
        // a place may read one along the summed dim, which place_dims (result dims) cannot
        // say: the vocabulary-parallel embedding's offset into a head-tail table. Relayed.
        // A kernel that states result dims reads places there only (the embedding's
        // backward: its vocabulary rows, summing over positions it does not read).
        if (plan.local_kernel && plan.place_dims->empty()) return false;
        continue;
      }
      if (!o.is_shard() || out->mesh_dims_sharding(o.dim()).front() != d.mesh_dim ||
          (plan.place_dims && std::find(plan.place_dims->begin(), plan.place_dims->end(),
                                        o.dim()) != plan.place_dims->end()) ||
          out->sizes()[o.dim()] != d.length || out->shard_table(o.dim()) != d.table)
        return false;
    }
  }
  return true;
}

// TESSERA_DEBUG_HEAD_TAIL=1: each op that relays its head-tail operands is printed when it
// first does, so a model that loses the order shows where (its head-tail arguments appear as
// Shard, the natural stand-ins its rule planned for).
void report_relay(const Frame& f) {
  static const bool on = std::getenv("TESSERA_DEBUG_HEAD_TAIL") != nullptr;
  if (!on) return;
  static std::mutex mutex;
  static std::unordered_set<std::string> seen;
  std::string what = f.call.describe();
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(what).second)
    std::fprintf(stderr, "tessera: %s relays its head-tail operands to the natural order\n",
                 what.c_str());
}

// Whether every return of the op is a view of an argument (and nothing is written).
bool is_view_op(const c10::FunctionSchema& schema) {
  if (schema.returns().empty()) return false;
  for (const auto& r : schema.returns())
    if (!r.alias_info() || r.alias_info()->isWrite()) return false;
  for (const auto& a : schema.arguments())
    if (a.alias_info() && a.alias_info()->isWrite()) return false;
  return true;
}

// A view that cannot keep the order would read relayed rows: a copy that misses later writes
// to the tensor, and whose own writes are lost. Refused, alike on every rank (specs only),
// unless its plan moves the operand: then it is a copy in the natural order too (a reshape
// that folds the split dim into another, `logits.reshape({-1, vocab})`), taken alike, and
// writes through it raise there as here (check_written_views).
void check_head_tail_view(const Frame& f) {
  const ops::OpPlan& plan = f.plan();
  for (size_t i = 0; i < f.nargs && i < plan.inputs.size(); ++i)
    if (f.impls[i] && f.stored_for(f.impls[i]) && plan.inputs[i] &&
        *plan.inputs[i] != f.impls[i]->spec())
      return;
  std::string what = "head-tail";
  for (const auto& s : f.stored)
    for (const auto& p : dtensor_impl(s.original)->spec().placements())
      if (p.is_head_tail()) what = p.str();
  TORCH_CHECK(!is_view_op(f.schema), "tessera: ", f.call.describe(), ": this view of a ", what,
              " tensor cuts or reorders its head-tail dim, so it could not share the tensor's "
              "rows (it would miss later writes to the tensor, and its own writes would be "
              "lost); redistribute the tensor to the natural order first (Shard on that dim) "
              "and take the view of that");
}

// Writes into a view whose shard is a copy (cut from a head-tail tensor's relayed rows, or
// made contiguous by `view`) would never reach its base: refused before the op runs.
void check_written_views(const Frame& f) {
  if (!f.schema.is_mutable()) return;
  for (size_t i = 0; i < f.nargs; ++i) {
    const auto* a = f.schema.arguments()[i].alias_info();
    if (!a || !a->isWrite() || f.holds[i] != Holds::Tensor || !f.impls[i]) continue;
    const auto* s = f.stored_for(f.impls[i]);
    const at::Tensor& t = s ? s->original : f.args[i].toTensor();
    TORCH_CHECK(detail::writes_reach_base(t), "tessera: ", f.call.describe(),
                ": writes into a view whose shard is a copy (cut from a head-tail tensor's "
                "relayed rows, or made contiguous by view()), so its base would not see the "
                "write; do the op on the base, or out of place");
  }
}

// An out= shard whose shape is not the planned result's is handed to the op empty: ATen then
// resizes it without its warning about resizing a non-empty out (deprecated, to become an
// error), and a caller's plain out keeps its strides (wrap_results writes the whole result).
void empty_mismatched_outs(Frame& f) {
  const ops::OpPlan& plan = f.plan();
  for (size_t r = 0; r < f.schema.returns().size() && r < plan.outputs.size(); ++r) {
    const int a = aliased_argument(f.schema, r);
    if (a < 0 || f.holds[a] != Holds::Tensor || !f.impls[a] || !plan.outputs[r]) continue;
    at::Tensor& local = f.locals[a];
    if (local.numel() == 0 || local.sizes().vec() == plan.outputs[r]->local_sizes()) continue;
    local = local.new_empty({0});
    (*f.stack)[f.base + a] = local;
  }
}

// Step 4: redistribute where the plan asks, then push every argument with each distributed
// tensor swapped for its local shard.
void unwrap(Frame& f) {
  const ops::OpPlan& plan = f.plan();
  for (size_t i = 0; i < f.nargs; ++i) {
    const Holds h = f.holds[i];
    if (h == Holds::Tensor && f.impls[i]) {
      const auto* d = f.impls[i];
      at::Tensor local = d->local();
      const auto* want = i < plan.inputs.size() ? plan.inputs[i].get() : nullptr;
      if (const auto* s = f.stored_for(d)) {
        if (!f.keeps_order)
          local = redistribute_local(local, dtensor_impl(s->original)->spec_ptr(),
                                     want ? plan.inputs[i] : s->natural);
      } else if (want && want != f.call.specs[i] && *want != *f.call.specs[i]) {
        const SpecPtr* cut = nullptr;
        for (const auto& [k, spec] : f.head_tail_cuts)
          if (k == i) cut = &spec;
        local = redistribute_local(local, d->spec_ptr(), cut ? *cut : plan.inputs[i]);
      }
      f.locals[i] = local;
      f.stack->push_back(std::move(local));
    } else if (h != Holds::Nothing && h != Holds::Tensor && f.lists) {
      const auto* wants = i < plan.list_inputs.size() ? &plan.list_inputs[i] : nullptr;
      f.stack->push_back(map_tensors(f.args[i], h, [&](size_t k, const at::Tensor& t) {
        auto* d = as_dtensor(t);
        if (!d) return t;
        if (const auto* s = f.stored_for(d)) {
          if (f.keeps_order) return d->local();
          const bool wanted = wants && k < wants->size() && (*wants)[k];
          return redistribute_local(d->local(), dtensor_impl(s->original)->spec_ptr(),
                                    wanted ? (*wants)[k] : s->natural);
        }
        if (wants && k < wants->size() && (*wants)[k] && *(*wants)[k] != d->spec())
          return redistribute_local(d->local(), d->spec_ptr(), (*wants)[k]);
        return d->local();
      }));
    } else {
      f.stack->push_back(f.args[i]);
    }
  }
  for (const auto& [i, value] : plan.local_args) (*f.stack)[f.base + i] = value;
  if (f.nargs > 0 && f.schema.arguments()[f.nargs - 1].is_out() && !f.decision->functional)
    empty_mismatched_outs(f);
}

// The op (or the plan's kernel in its place) on the stack's local arguments.
void run_local(Frame& f, const c10::OperatorHandle& op) {
  const ops::OpPlan& plan = f.plan();
  if (!plan.local_kernel && !plan.distributed_kernel) {
    op.callBoxed(f.stack);
    return;
  }
  torch::jit::Stack own(f.stack->begin() + f.base, f.stack->end());
  f.stack->resize(f.base);
  ops::KernelCall kernel(op, own);
  if (plan.local_kernel)
    plan.local_kernel(kernel);
  else
    plan.distributed_kernel(kernel, f.ref().mesh());
  f.stack->insert(f.stack->end(), std::make_move_iterator(own.begin()),
                  std::make_move_iterator(own.end()));
}

// An out= form without its own rule: the functional sibling on the shards, its results
// written into the out shards (or replacing them where the layout changes the local shape).
void run_out_form(Frame& f) {
  const size_t first_out = f.nargs - f.decision->outs;
  f.stack->resize(f.base + first_out);
  run_local(f, *f.decision->functional);
  const size_t results_at = f.stack->size() - f.decision->outs;
  for (size_t k = 0; k < f.decision->outs; ++k) {
    at::Tensor result = (*f.stack)[results_at + k].toTensor();
    at::Tensor& out = f.locals[first_out + k];
    if (out.sizes() == result.sizes())
      out.copy_(result);
    else
      out = result.to(out.scalar_type());
    (*f.stack)[results_at + k] = out;
  }
}

// Step 5: the op itself on the local shards, or the plan's kernel in its place.
void run(Frame& f) {
  if (f.decision->functional)
    run_out_form(f);
  else
    run_local(f, f.op);
}

// The planned spec of the next result. On a miss it is checked against the local result and
// completed (dtype, data-dependent shapes) for the cached decision; a hit reuses it as is.
SpecPtr next_output_spec(Frame& f, const at::Tensor& local) {
  const ops::OpPlan& plan = f.plan();
  const size_t r = f.next_out++;
  if (f.decision->replicate_all || plan.data_dependent_shapes) {
    // Ops without a rule may have data-dependent shapes (nonzero, unique): read them off the
    // result every time.
    auto sp = std::make_shared<DTensorSpec>(f.ref().mesh(),
                                            Placements(f.ref().mesh().ndim(), Replicate()),
                                            local.sizes().vec(), local.scalar_type());
    if (!f.hit) f.final_outputs.push_back(sp);
    return sp;
  }
  if (f.hit) return plan.outputs[r];
  TORCH_CHECK(r < plan.outputs.size(), "tessera: ", f.call.describe(),
              ": the sharding rule gave too few output layouts (rule bug)");
  auto sp = checked_output(f.call, local, plan.outputs[r]);
  f.final_outputs.push_back(sp);
  return sp;
}

// The planned spec of a result that writes argument `alias` (in-place and out= ops), with
// the dtype the written argument has (an out= tensor keeps its own).
SpecPtr next_aliased_spec(Frame& f, const SpecPtr& otherwise, const at::Tensor& local) {
  const ops::OpPlan& plan = f.plan();
  const size_t r = f.next_out++;
  if (f.hit) return plan.outputs[r];
  SpecPtr planned =
      f.decision->replicate_all || plan.outputs.size() <= r ? otherwise : plan.outputs[r];
  if (planned && local.defined() && planned->dtype() != local.scalar_type())
    planned =
        std::make_shared<DTensorSpec>(planned->mesh(), planned->placements(), planned->sizes(),
                                      local.scalar_type(), planned->shard_tables());
  f.final_outputs.push_back(planned);
  return planned;
}

// An in-place or out= result on a head-tail argument, computed in the natural order: into
// the caller's shard in its stored order (NOTE: [Head-tail arguments]).
void write_back_head_tail(Frame& f, const Frame::Stored& s, int alias) {
  SpecPtr planned = next_aliased_spec(f, s.natural, f.locals[alias]);
  auto* original = dtensor_impl(s.original);
  if (f.keeps_order) {  // computed on the stored shard: in place already
    if (!f.locals[alias].is_same(original->local())) original->local().copy_(f.locals[alias]);
  } else if (planned->sizes() == original->spec().sizes() &&
             planned->dtype() == original->spec().dtype()) {
    original->local().copy_(redistribute_local(f.locals[alias], planned, original->spec_ptr()));
  } else {  // an out= tensor resized or recast: it takes the result's layout
    TORCH_CHECK(!s.original.is_view(), "tessera: ", f.call.describe(),
                ": this op would give a view of a head-tail tensor another shape or dtype, "
                "which its base would not see; do the op out of place");
    original->set_local_and_spec(f.locals[alias], planned);
  }
  f.stack->push_back(s.original);
}

// A result computed on the stored shards (keeps_head_tail), made head-tail where its
// operands are (Partial results stay Partial).
SpecPtr head_tail_result_spec(const Frame& f, const SpecPtr& out) {
  Placements p = out->placements();
  for (const auto& s : f.stored) {
    const DTensorSpec& in = dtensor_impl(s.original)->spec();
    for (int64_t k = 0; k < in.mesh().ndim(); ++k)
      if (in.placement(k).is_head_tail() && p[k].is_shard())
        p[k] = Placement::head_tail_shard(p[k].dim());
  }
  return std::make_shared<DTensorSpec>(out->mesh(), std::move(p), out->sizes(), out->dtype(),
                                       out->shard_tables());
}

// Step 6: wrap the results. Returns that alias a written argument hand back that argument.
void wrap_results(Frame& f) {
  const size_t nret = f.schema.returns().size();
  c10::SmallVector<c10::IValue, 4> results(std::make_move_iterator(f.stack->end() - nret),
                                           std::make_move_iterator(f.stack->end()));
  f.stack->resize(f.stack->size() - nret);
  for (size_t r = 0; r < nret; ++r) {
    auto& v = results[r];
    const int alias = aliased_argument(f.schema, r);
    auto plain = std::find_if(f.admitted_plain.begin(), f.admitted_plain.end(),
                              [&](const auto& a) { return static_cast<int>(a.first) == alias; });
    if (alias >= 0 && plain != f.admitted_plain.end()) {
      // An in-place op on a plain tensor: it must end up holding the whole result. If the
      // plan worked on a redistributed copy, gather that copy back into it.
      SpecPtr planned = next_aliased_spec(f, nullptr, f.locals[alias]);
      at::Tensor& target = plain->second;
      if (planned && (!f.locals[alias].is_same(target) || !planned->is_replicated())) {
        auto whole = std::make_shared<DTensorSpec>(
            planned->with_placements(Placements(planned->mesh().ndim(), Replicate())));
        // Gathered before `target` is resized (out=): the shard may be `target` itself.
        at::Tensor gathered = redistribute_local(f.locals[alias], planned, whole);
        if (target.sizes().vec() != planned->sizes()) target.resize_(planned->sizes());
        if (!gathered.is_same(target)) target.copy_(gathered);
      }
      f.stack->push_back(target);
    } else if (alias >= 0 && f.holds[alias] == Holds::Tensor && f.impls[alias] &&
               f.stored_for(f.impls[alias])) {
      write_back_head_tail(f, *f.stored_for(f.impls[alias]), alias);
    } else if (alias >= 0 && f.holds[alias] == Holds::Tensor && f.impls[alias]) {
      auto* self = f.impls[alias];
      SpecPtr planned = next_aliased_spec(f, self->spec_ptr(), f.locals[alias]);
      if (!f.locals[alias].is_same(self->local()) ||
          (planned != self->spec_ptr() && *planned != self->spec())) {
        // A view's new shard would not be its base's: the base would miss the write.
        TORCH_CHECK(!f.args[alias].toTensor().is_view(), "tessera: ", f.call.describe(),
                    ": this in-place op on a view needs the view's layout changed (to ",
                    planned->str(), "), which its base would not see; redistribute the base ",
                    "first, or do the op out of place");
        self->set_local_and_spec(f.locals[alias], planned);
      }
      f.stack->push_back(f.args[alias]);
    } else if (v.isTensor()) {
      const at::Tensor& local = v.toTensor();
      if (!local.defined()) {
        if (!f.hit) f.final_outputs.push_back(nullptr);
        ++f.next_out;
        f.stack->push_back(std::move(v));
        continue;
      }
      auto sp = next_output_spec(f, local);
      if (f.keeps_order) sp = head_tail_result_spec(f, sp);
      f.stack->push_back(wrap_unchecked(local, std::move(sp)));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const c10::IValue& e : v.toListRef()) {
        const at::Tensor& local = e.toTensor();
        SpecPtr sp = next_output_spec(f, local);
        if (f.keeps_order) sp = head_tail_result_spec(f, sp);
        out.push_back(wrap_unchecked(local, std::move(sp)));
      }
      f.stack->emplace_back(std::move(out));
    } else {
      f.stack->push_back(std::move(v));
    }
  }
}

// Step 7 (misses only): cache the decision with its completed output specs.
void remember(Frame& f) {
  if (f.hit) return;
  f.fresh->plan.outputs = std::move(f.final_outputs);
  if (t_cache.entries >= kMaxCachedDecisions) {
    t_cache.map.clear();
    t_cache.entries = 0;
  }
  t_cache.map[f.hash].push_back(
      {std::move(f.key), std::vector<SpecPtr>(f.seen.begin(), f.seen.end()), f.fresh});
  ++t_cache.entries;
}

// Whether the fast path may replay this call (see detail::FallbackReport).
void report(const Frame& f, detail::FallbackReport* out) {
  const ops::OpPlan& plan = f.plan();
  if (f.lists || f.cast || !f.keep_alive.empty() || !f.stored.empty() ||
      f.decision->replicate_all || f.decision->functional || plan.data_dependent_shapes ||
      plan.local_kernel || plan.distributed_kernel || f.schema.returns().size() != 1 ||
      plan.outputs.size() != 1)
    return;
  for (size_t i = 0; i < f.nargs; ++i) {
    if (!f.impls[i]) continue;
    const auto* want = i < plan.inputs.size() ? plan.inputs[i].get() : nullptr;
    if (want && want != f.call.specs[i] && *want != *f.call.specs[i]) return;
  }
  out->local_args = plan.local_args;
  const int alias = aliased_argument(f.schema, 0);
  if (alias < 0) {
    out->output = plan.outputs[0];
    out->replayable = out->output != nullptr;
  } else if (alias == 0 && f.call.specs[0] && plan.outputs[0] &&
             *plan.outputs[0] == *f.call.specs[0]) {
    out->replayable = true;  // in place on self, layout unchanged (`seen` keeps the spec alive)
  }
}

// The name a failed collective reports for the op that waited on it (NOTE in comm/wait.h).
const char* caller_name(const c10::OperatorHandle& op) {
  const std::string& name = op.schema().name();  // lives as long as the registration
  if (name == "aten::_local_scalar_dense") return ".item() (aten::_local_scalar_dense)";
  return name.c_str();
}

void dtensor_fallback_impl(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                           detail::FallbackReport* out) {
  comm::detail::CallerScope caller(caller_name(op));
  Frame f(op, stack);
  // NOTE: [Compute dtype] (compute_dtype.cpp)
  if (detail::g_compute_dtypes.load(std::memory_order_relaxed))
    f.cast = detail::cast_to_compute_dtype(f.schema, f.args, /*differentiable=*/false);
  collect(f);
  admit_and_key(f);
  decide(f);
  if (!f.stored.empty()) {
    f.keeps_order = keeps_head_tail(f);
    if (!f.keeps_order) {
      f.head_tail_cuts.clear();
      check_head_tail_view(f);
      report_relay(f);
    }
  }
  check_written_views(f);
  unwrap(f);
  run(f);
  wrap_results(f);
  remember(f);
  if (out) report(f, out);
}

void dtensor_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  dtensor_fallback_impl(op, stack, nullptr);
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

void set_plain_operand_check(PlainOperandCheck check) {
  g_plain_operand_check.store(check, std::memory_order_release);
}

namespace detail {
std::atomic<FreedStorageHandler> g_freed_storage_handler{nullptr};
}  // namespace detail

void set_freed_storage_handler(FreedStorageHandler handler) {
  detail::g_freed_storage_handler.store(handler, std::memory_order_release);
}

namespace detail {
void dtensor_fallback_reporting(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                                FallbackReport* report) {
  dtensor_fallback_impl(op, stack, report);
}
}  // namespace detail

void clear_dispatch_cache() {
  t_cache.map.clear();
  t_cache.entries = 0;
}

DispatchCacheStats dispatch_cache_stats() {
  return {t_cache.hits, t_cache.misses, t_cache.entries};
}

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
