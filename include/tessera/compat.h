#pragma once
// Every difference between the LibTorch versions Tessera builds against lives here.
// Supported: Debian's libtorch 1.13 and pytorch.org LibTorch 2.x.
#include <torch/version.h>
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

}  // namespace tessera::compat
