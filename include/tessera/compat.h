#pragma once
// Every difference between the LibTorch versions Tessera builds against lives here.
// Supported: Debian's libtorch 1.13 and pytorch.org LibTorch 2.x.
#include <torch/version.h>
#include <ATen/core/jit_type_base.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace tessera::compat {

#if TORCH_VERSION_MAJOR >= 2
// 2.x: concrete transports (Gloo, NCCL) derive from c10d::Backend.
using Backend = c10d::Backend;
#else
// 1.13: concrete transports derive from c10d::ProcessGroup directly.
using Backend = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;

// LibTorch 2.1 added its own AutogradPrivateUse1 fallthrough; before that we register one.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define TESSERA_NEEDS_AUTOGRAD_FALLTHROUGH 0
#else
#define TESSERA_NEEDS_AUTOGRAD_FALLTHROUGH 1
#endif

// 2.x passes many sizes as SymInt / SymInt[]; 1.13 has plain ints only.
inline bool is_symint_type(c10::TypeKind kind) {
#if TORCH_VERSION_MAJOR >= 2
  return kind == c10::TypeKind::SymIntType;
#else
  (void)kind;
  return false;
#endif
}

}  // namespace tessera::compat
