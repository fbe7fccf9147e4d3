#pragma once
// Checks other layers install into the fallback (internal).
#include <atomic>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

namespace tessera {

// Called for an op that mixes plain tensors with distributed ones, before its rule runs, with
// the distributed arguments' impls and the plain tensors. Tensor parallelism installs one
// while parameters exist that must not meet plain activations (NOTE: [Plain operands at
// modules Tessera cannot intercept] in parallel/tp_boundary.cpp).
using PlainOperandCheck = void (*)(const c10::OperatorHandle& op,
                                   c10::ArrayRef<const c10::TensorImpl*> distributed,
                                   c10::ArrayRef<at::Tensor> plain);
void set_plain_operand_check(PlainOperandCheck check);

// Called, before anything reads them, when a distributed argument's local shard has elements
// but no bytes: fully_shard freed its storage (NOTE: [Freeing unsharded parameters] in
// parallel/fsdp_group.cpp) and the handler refills it. It gets the local shards of *all* the
// op's distributed arguments, so that refilling one parameter group never frees another the
// same op reads. Both the fallback and the fast path check every distributed argument;
// installed only while fully_shard groups exist, so otherwise the check is one relaxed load.
using FreedStorageHandler = void (*)(c10::ArrayRef<at::Tensor> locals);
void set_freed_storage_handler(FreedStorageHandler handler);

// NOTE: [Compute dtype] (compute_dtype.cpp): a storage registered here makes an op that reads
// it next to floating-point tensors of another dtype compute in the registered dtype.
// fully_shard registers its unsharded parameters under MixedPrecisionPolicy::param_dtype.
void register_compute_dtype(const at::Tensor& t, c10::ScalarType dtype);  // t's (local) storage
void unregister_compute_dtype(const at::Tensor& t);

namespace detail {
extern std::atomic<FreedStorageHandler> g_freed_storage_handler;
extern std::atomic<bool> g_compute_dtypes;  // anything registered (a fast first check)

// The op's read-only floating-point tensor arguments cast per NOTE: [Compute dtype]; true when
// any was (the call then is not one the fast path may replay). differentiable: the cast is an
// ordinary autograd op (above autograd); otherwise it runs below autograd and the uncast
// tensor's storage is registered for the backward op.
bool cast_to_compute_dtype(const c10::FunctionSchema& schema,
                           c10::SmallVectorImpl<c10::IValue>& args, bool differentiable);

inline bool is_freed(const at::Tensor& local) {
  return g_freed_storage_handler.load(std::memory_order_relaxed) && local.has_storage() &&
         local.numel() > 0 && local.storage().nbytes() == 0;
}
inline void refill_freed(c10::ArrayRef<at::Tensor> locals) {
  if (FreedStorageHandler handler = g_freed_storage_handler.load(std::memory_order_relaxed))
    handler(locals);
}
}  // namespace detail

}  // namespace tessera
