#pragma once
// The c10d process-group type by name only: headers that pass groups around (the mesh, specs,
// every rule) stay light, as c10d's ProcessGroup.hpp costs ~70k preprocessed lines. Code that
// calls a group includes tessera/comm/collectives.h, which brings the full types.
#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>

namespace c10d {
class ProcessGroup;
class Backend;
}  // namespace c10d

namespace tessera::compat {

#if TORCH_VERSION_MAJOR >= 2
// 2.x: concrete transports (Gloo, NCCL) derive from c10d::Backend.
using Backend = c10d::Backend;
#else
// 1.13: concrete transports derive from c10d::ProcessGroup directly.
using Backend = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;

}  // namespace tessera::compat
