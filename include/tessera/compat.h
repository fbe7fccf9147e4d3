#pragma once
// Every difference between the LibTorch versions Tessera builds against lives here (and, for
// autograd nodes, in compat_autograd.h).
// Supported: Debian 12's LibTorch 1.13, Debian 13's LibTorch 2.6, and pytorch.org LibTorch 2.x.
#include <sstream>
#include <string>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#include "tessera/compat_c10d.h"

namespace tessera::compat {

// c10::Allocator: 2.3 made allocate() non-const and added a pure virtual copy_data(); an
// allocator written for both declares `allocate(size_t) TESSERA_ALLOCATE_CONST override` and
// defines copy_data where TESSERA_ALLOCATOR_HAS_COPY_DATA.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define TESSERA_ALLOCATE_CONST
#define TESSERA_ALLOCATOR_HAS_COPY_DATA 1
#else
#define TESSERA_ALLOCATE_CONST const
#define TESSERA_ALLOCATOR_HAS_COPY_DATA 0
#endif

// The fused CPU attention kernel (_scaled_dot_product_flash_attention_for_cpu and its
// backward) takes fewer K/V heads than query heads (grouped-query attention) from 2.9; 2.8's
// refuses them and 2.6's computes garbage and crashes in backward, so callers repeat them.
constexpr bool kFusedCpuAttentionTakesGroups = TORCH_VERSION_MAJOR > 2 ||
                                               (TORCH_VERSION_MAJOR == 2 &&
                                                TORCH_VERSION_MINOR >= 9);

// c10d::TCPStoreOptions::useLibUV exists from 2.2 (and defaults to true from 2.4); a LibTorch
// built without libuv, as Debian 13's is, refuses it. Sets it where the field exists.
template <class Options>
auto set_tcp_store_libuv(Options& options, bool on, int)
    -> decltype(options.useLibUV = on, bool()) {
  options.useLibUV = on;
  return true;
}
template <class Options>
bool set_tcp_store_libuv(Options&, bool, long) {
  return false;  // 1.13: there is only the classic server
}

// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl: as a string in
// 1.13, as the pointer in 2.x. Takes the map, so the key type decides.
template <class StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap&, const at::Tensor& parameter) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream key;  // as 1.13's c10::guts::to_string prints the pointer
    key << parameter.unsafeGetTensorImpl();
    return key.str();
  } else {
    return parameter.unsafeGetTensorImpl();
  }
}

// A c10::Error with no backtrace in what(): 1.13 takes the backtrace as a string, 2.x as a
// lazily computed value (nullptr for none).
inline c10::Error error_without_backtrace(std::string msg) {
#if TORCH_VERSION_MAJOR >= 2
  return c10::Error(std::move(msg), nullptr);
#else
  return c10::Error(std::move(msg), "");
#endif
}

}  // namespace tessera::compat

#include <ATen/ops/cross_entropy_loss_native.h>

namespace tessera::compat {

// aten::cross_entropy_loss's own (CompositeImplicitAutograd) decomposition, for a kernel
// registered over it that wants the usual behaviour back: 2.x takes ignore_index as a SymInt.
inline at::Tensor cross_entropy_loss_composite(const at::Tensor& self, const at::Tensor& target,
                                               const c10::optional<at::Tensor>& weight,
                                               int64_t reduction, int64_t ignore_index,
                                               double label_smoothing) {
#if TORCH_VERSION_MAJOR >= 2
  return at::native::cross_entropy_loss_symint(self, target, weight, reduction,
                                               c10::SymInt(ignore_index), label_smoothing);
#else
  return at::native::cross_entropy_loss(self, target, weight, reduction, ignore_index,
                                        label_smoothing);
#endif
}

}  // namespace tessera::compat
