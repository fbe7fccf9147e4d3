// NOTE: [Compute dtype]
// FSDP2's MixedPrecisionPolicy(param_dtype) computes forward in param_dtype: the parameters are
// gathered in it and each module's forward inputs are cast to it by a pre-forward hook.
// LibTorch modules have no forward hooks, so Tessera casts where an input meets a parameter:
// the storage of every unsharded parameter is registered with its compute dtype, and an op
// whose floating-point tensor arguments mix dtypes, one of them on a registered storage, casts
// its other read-only floating-point arguments to that dtype before anything else happens (a
// written argument, such as batch norm's running statistics or an out= tensor, keeps its
// dtype). The cast runs below autograd, so the op's autograd node saved the uncast input; the
// input's storage is therefore registered too, and the backward op that reads the saved input
// next to a gradient (x^T mm dy for a weight's gradient) casts it the same way. The input's own
// gradient comes back in the compute dtype and the autograd engine casts it to the input's
// dtype, as the backward of FSDP2's explicit cast does. So the arithmetic is FSDP2's.
// Where they differ: a float32 tensor made inside forward that meets a parameter directly in
// a promoting op (x.float() * weight) is cast down here, where PyTorch would promote; and a
// cast input stays registered while it lives, so a later op mixing it with another dtype (a
// loss against the input itself) computes in the compute dtype too.
// LibTorch's composite convolutions (conv1d/2d/3d) check their operands' dtypes before any op
// reaches the fallback, so for them the cast happens at our autograd key, as an ordinary
// differentiable cast before the composite runs.
// Entries hold weak references: an entry dies with its storage and is pruned as others arrive.
#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/core/function_schema.h>
#include <torch/library.h>
#include <c10/util/intrusive_ptr.h>

#include "fallback_hooks.h"
#include "fast_path.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tessera/tensor/rule.h"

namespace tessera {

namespace detail {
std::atomic<bool> g_compute_dtypes{false};
}  // namespace detail

namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  c10::ScalarType dtype;
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, Entry> entries;
  size_t prune_at = 64;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: used by threads that outlive statics
  return *r;
}

const at::Tensor& local_of(const at::Tensor& t) {
  if (auto* d = detail::as_dtensor(t)) return d->local();
  return t;
}

// Drops the entries whose storage has died (caller holds r.mu).
void prune_expired(Registry& r) {
  for (auto it = r.entries.begin(); it != r.entries.end();)
    it = it->second.storage.expired() ? r.entries.erase(it) : std::next(it);
}

// The registered dtype of t's storage, if any (an expired entry is dropped).
c10::optional<c10::ScalarType> registered_dtype(const at::Tensor& t) {
  const at::Tensor& local = local_of(t);
  if (!local.has_storage()) return c10::nullopt;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(local.storage().unsafeGetStorageImpl());
  if (it == r.entries.end()) return c10::nullopt;
  if (it->second.storage.expired()) {  // a new storage at a dead one's address
    r.entries.erase(it);
    return c10::nullopt;
  }
  return it->second.dtype;
}

// Written by the op: annotated (a!), or a batch norm's running statistics, which some LibTorch
// versions' schemas (1.13's native_batch_norm) update without the annotation.
bool written(const c10::FunctionSchema& schema, size_t i) {
  const auto& arg = schema.arguments()[i];
  const auto* a = arg.alias_info();
  return (a != nullptr && a->isWrite()) || arg.name().rfind("running_", 0) == 0;
}

// A tensor argument that takes part: defined, not 0-dim (a scalar operand), floating point.
bool takes_part(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  return t.defined() && t.dim() > 0 && at::isFloatingType(t.scalar_type());
}

at::Tensor cast(const at::Tensor& t, c10::ScalarType dtype, bool differentiable) {
  if (differentiable) return t.to(dtype);
  at::NoGradGuard no_grad;  // below autograd: the op's own node covers the call
  if (auto* d = detail::as_dtensor(t)) {
    const DTensorSpec& s = d->spec();
    return make_dtensor(d->local().to(dtype),
                        std::make_shared<DTensorSpec>(s.mesh(), s.placements(), s.sizes(), dtype,
                                                      s.shard_tables()));
  }
  return t.to(dtype);
}

}  // namespace

void register_compute_dtype(const at::Tensor& t, c10::ScalarType dtype) {
  const at::Tensor& local = local_of(t);
  if (!local.has_storage()) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.entries.size() >= r.prune_at) {
    prune_expired(r);
    r.prune_at = std::max<size_t>(64, 2 * r.entries.size());
  }
  r.entries.insert_or_assign(local.storage().unsafeGetStorageImpl(),
                             Entry{local.storage().getWeakStorageImpl(), dtype});
  detail::g_compute_dtypes.store(true, std::memory_order_release);
}

void unregister_compute_dtype(const at::Tensor& t) {
  const at::Tensor& local = local_of(t);
  if (!local.has_storage()) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.entries.erase(local.storage().unsafeGetStorageImpl());
  prune_expired(r);
  if (r.entries.empty()) detail::g_compute_dtypes.store(false, std::memory_order_release);
}

namespace detail {

bool cast_to_compute_dtype(const c10::FunctionSchema& schema,
                           c10::SmallVectorImpl<c10::IValue>& args, bool differentiable) {
  // Cheap first: do the floating-point tensor arguments mix dtypes at all?
  c10::optional<c10::ScalarType> first;
  bool mixed = false;
  for (const auto& v : args) {
    if (!takes_part(v)) continue;
    const auto dtype = v.toTensor().scalar_type();
    if (!first) first = dtype;
    mixed = mixed || dtype != *first;
  }
  if (!mixed) return false;
  c10::optional<c10::ScalarType> target;
  for (size_t i = 0; i < args.size() && !target; ++i)
    if (takes_part(args[i])) target = registered_dtype(args[i].toTensor());
  if (!target) return false;
  bool any = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!takes_part(args[i]) || written(schema, i)) continue;
    const at::Tensor t = args[i].toTensor();
    if (t.scalar_type() == *target) continue;
    if (!differentiable) register_compute_dtype(t, *target);  // its backward reads it (NOTE)
    args[i] = cast(t, *target, differentiable);
    any = true;
  }
  return any;
}

}  // namespace detail

namespace {

// A composite convolution on a distributed tensor: its operands cast (differentiably), then
// LibTorch's composite kernel.
void cast_then_composite(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (detail::g_compute_dtypes.load(std::memory_order_relaxed)) {
    const size_t n = op.schema().arguments().size();
    c10::SmallVector<c10::IValue, 8> args(stack->end() - n, stack->end());
    if (detail::cast_to_compute_dtype(op.schema(), args, /*differentiable=*/true))
      std::move(args.begin(), args.end(), stack->end() - n);
  }
  c10::Dispatcher::singleton().callBoxedForDispatchKey(
      op, c10::DispatchKey::CompositeImplicitAutograd, stack);
}

const ops::RuleRegistrar registrar{[] {
  for (const char* op : {"aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv1d.padding",
                         "aten::conv2d.padding", "aten::conv3d.padding"})
    ops::register_autograd_kernel(
        op, torch::CppFunction::makeFromBoxedFunction<&cast_then_composite>());
}};

}  // namespace

}  // namespace tessera
