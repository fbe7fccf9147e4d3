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

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

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

}  // namespace tessera::compat
