#pragma once
// The autograd part of compat.h (kept apart: it needs autograd's Node, which most users of
// compat.h do not): how a custom autograd node is held and made.
//
// Up to the 2.11 wheels a Node is held by std::shared_ptr (and freed by LibTorch's iterative
// deleteNode, so long graphs do not recurse deeply); later LibTorch makes Node an
// intrusive_ptr_target held by c10::intrusive_ptr. Which one is read off the type itself.
#include <memory>
#include <type_traits>
#include <utility>

#include <c10/core/AutogradState.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

namespace tessera::compat {

inline constexpr bool kIntrusiveNodes =
    std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;

template <class T>
using NodePtr = std::conditional_t<kIntrusiveNodes, c10::intrusive_ptr<T>, std::shared_ptr<T>>;

template <class T, class... Args>
NodePtr<T> make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    // deleteNode is found by argument-dependent lookup (torch::autograd), and only where it
    // exists: this branch is not instantiated for intrusive nodes.
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](T* p) { deleteNode(p); });
  }
}

// LibTorch runs the backward of CUDA tensors on one engine thread per device, shared by every
// thread of the process. Ranks that are threads on one GPU would queue their collective
// backward nodes behind each other there and deadlock; from 2.0 the engine can keep a
// thread's backward on that thread (as Python's set_multithreading_enabled(False)).
// LibTorch 1.13 cannot, and has no CUDA build here: nothing to do.
inline void backward_on_calling_thread() {
#if TORCH_VERSION_MAJOR >= 2
  c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
#endif
}

}  // namespace tessera::compat
