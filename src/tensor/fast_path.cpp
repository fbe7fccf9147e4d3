// NOTE: [Fast path]
// The boxed fallback costs a few thousand instructions per call on top of the op: arguments
// boxed into a stack and unboxed again, the decision key built and looked up, a boxed call
// of the local op. For the hottest ops (elementwise arithmetic, the optimizer's in-place
// updates, mm, view, detach, sum) a typed kernel at our key goes first. It remembers, per
// thread, calls that needed nothing but the op on the local shards: no redistribution, no
// kernel, no implicit conversion, one result. Such a call is keyed by the op, each input
// spec (found by its stored hash; the same object, the common case, compares by address,
// an equal one by value) and the non-tensor arguments that can change the result's layout
// or dtype. A hit calls the typed local op and wraps its result with the remembered spec;
// anything else boxes the arguments and runs the fallback, which reports whether the call
// may be replayed.
#include <array>
#include <type_traits>

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Operators.h>
#include <torch/library.h>

#include "fallback_hooks.h"
#include "fast_path.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

namespace {

using detail::as_dtensor;

// One call's arguments as the fast path keys them.
struct Probe {
  bool ok = true;
  c10::SmallVector<const SpecPtr*, 4> specs;  // per distributed argument
  c10::SmallVector<int64_t, 8> extras;        // non-tensor arguments, 0-dim plain tensors
  bool freed = false;  // a shard whose storage fully_shard freed (refilled before any read)
  c10::ScalarType floating = c10::ScalarType::Undefined;  // the first floating-point operand's
};

void probe(Probe& p, const at::Tensor& t) {
  if (auto* d = as_dtensor(t)) {
    p.freed = p.freed || detail::is_freed(d->local());
    p.specs.push_back(&d->spec_ptr());
    // Mixed floating-point dtypes may need a cast (NOTE: [Compute dtype]): the fallback decides.
    if (detail::g_compute_dtypes.load(std::memory_order_relaxed) && t.dim() > 0 &&
        at::isFloatingType(t.scalar_type())) {
      if (p.floating == c10::ScalarType::Undefined) p.floating = t.scalar_type();
      p.ok = p.ok && p.floating == t.scalar_type();
    }
  } else if (t.defined() && t.dim() == 0) {  // a scalar operand: its dtype can promote
    p.extras.push_back(0x5ca1a0 + static_cast<int64_t>(t.scalar_type()));
  } else {
    p.ok = false;  // plain tensors are admitted by the fallback
  }
}
void probe(Probe& p, const c10::Scalar& s) {  // values never matter; kinds can promote
  p.extras.push_back(s.isFloatingPoint() ? 1 : s.isIntegral(false) ? 2 : s.isBoolean() ? 3 : 4);
}
void probe(Probe& p, c10::SymIntArrayRef sizes) {
  p.extras.push_back(0xabc0 + static_cast<int64_t>(sizes.size()));
  for (const auto& s : sizes) {
    if (s.is_symbolic()) {
      p.ok = false;
      return;
    }
    p.extras.push_back(s.as_int_unchecked());
  }
}
void probe(Probe& p, c10::optional<at::ScalarType> t) {
  p.extras.push_back(t ? 0x700 + static_cast<int64_t>(*t) : 0x6ff);
}

template <class A>
void add_local(c10::SmallVector<at::Tensor, 4>& locals, const A& a) {
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
    if (auto* d = as_dtensor(a)) locals.push_back(d->local());
  }
}

template <class A>
decltype(auto) local_arg(A&& a) {
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
    auto* d = as_dtensor(a);
    // In-place ops write the shard's data through the handle, never the handle itself.
    return d ? const_cast<at::Tensor&>(d->local()) : const_cast<at::Tensor&>(a);
  } else {
    return std::forward<A>(a);
  }
}

struct Entry {
  const void* op = nullptr;
  c10::SmallVector<SpecPtr, 4> specs;
  c10::SmallVector<int64_t, 8> extras;
  SpecPtr output;      // null: in place on the first argument
  int sizes_arg = -1;  // a SymInt[] argument the local op gets as `local_sizes`
  std::vector<c10::SymInt> local_sizes;
};
constexpr size_t kSlots = 256;
thread_local std::array<Entry, kSlots> t_entries;

// Slots are chosen by the specs' values (their stored hash), not their addresses: the
// parameters of one shape each have their own spec object, and an optimizer step over many
// of them would otherwise need an entry per parameter and op, and evict its own entries.
size_t slot_of(const void* op, const Probe& p) {
  uint64_t h = detail::hash_mix(0, reinterpret_cast<uint64_t>(op));
  for (const auto* s : p.specs) h = detail::hash_mix(h, (*s)->hash());
  for (int64_t x : p.extras) h = detail::hash_mix(h, static_cast<uint64_t>(x));
  return h % kSlots;
}

const Entry* lookup(const void* op, const Probe& p, size_t slot) {
  const Entry& e = t_entries[slot];
  if (e.op != op || e.specs.size() != p.specs.size() || e.extras != p.extras) return nullptr;
  for (size_t i = 0; i < p.specs.size(); ++i) {
    const DTensorSpec* mine = e.specs[i].get();
    const DTensorSpec* theirs = p.specs[i]->get();
    if (mine != theirs && !(*mine == *theirs)) return nullptr;
  }
  return &e;
}

void remember(const void* op, const Probe& p, size_t slot, const detail::FallbackReport& r) {
  Entry& e = t_entries[slot];
  e.op = nullptr;  // invalid until complete
  e.sizes_arg = -1;
  e.local_sizes.clear();
  if (r.local_args.size() > 1) return;
  if (r.local_args.size() == 1) {
    if (!r.local_args[0].second.isIntList()) return;
    e.sizes_arg = r.local_args[0].first;
    for (int64_t x : r.local_args[0].second.toIntList()) e.local_sizes.emplace_back(x);
  }
  e.op = op;
  e.specs.clear();
  for (const auto* s : p.specs) e.specs.push_back(*s);
  e.extras = p.extras;
  e.output = r.output;
}

// A view of a contiguous shard (view_of_contiguous_shard makes it so) with `sizes` of its
// numel, built as ATen's view builds its result (an alias of the storage, the new sizes,
// contiguous strides) without a second dispatch or a stride search: for the shard, below
// autograd (the wrapper is the view autograd tracks), that is all view does.
at::Tensor contiguous_view(const at::Tensor& local, c10::SymIntArrayRef sizes) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(local.storage()), local.key_set(), local.dtype());
  impl->set_storage_offset(local.storage_offset());
  impl->set_sizes_contiguous(c10::asIntArrayRefUnchecked(sizes));
  return at::Tensor(std::move(impl));
}

template <class Op, class Sig = typename Op::schema>
struct FastKernel;

template <class Op, class Ret, class... Args>
struct FastKernel<Op, Ret(Args...)> {
  static Ret kernel(Args... args) {
    static const c10::OperatorHandle handle =
        c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    const void* id = &handle.schema();
    Probe p;
    (probe(p, args), ...);
    if (p.freed) {
      c10::SmallVector<at::Tensor, 4> locals;
      (add_local(locals, args), ...);
      detail::refill_freed(locals);
    }
    if constexpr (std::is_reference_v<Ret>)  // in place: the fallback refuses lost writes
      p.ok = p.ok && detail::writes_reach_base(first(args...));
    const size_t slot = p.ok ? slot_of(id, p) : 0;
    if (p.ok) {
      if (const Entry* e = lookup(id, p, slot)) {
        if constexpr (std::is_reference_v<Ret>) {
          call_local(*e, std::index_sequence_for<Args...>{}, args...);
          return first(args...);
        } else {
          SpecPtr out = e->output;
          return at::detail::make_tensor<DTensorImpl>(
              call_local(*e, std::index_sequence_for<Args...>{}, args...), std::move(out));
        }
      }
    }
    torch::jit::Stack stack;
    stack.reserve(sizeof...(Args));
    (stack.emplace_back(args), ...);
    detail::FallbackReport report;
    detail::dtensor_fallback_reporting(handle, &stack, &report);
    if (p.ok && report.replayable && (std::is_reference_v<Ret> == (report.output == nullptr)) &&
        replaceable(report))
      remember(id, p, slot, report);
    if constexpr (std::is_reference_v<Ret>) {
      return first(args...);
    } else {
      return std::move(stack.back()).toTensor();
    }
  }

 private:
  // The local op: shards for distributed tensors, the remembered local sizes for a SymInt[].
  template <size_t... I>
  static Ret call_local(const Entry& e, std::index_sequence<I...>, Args... args) {
    if constexpr (std::is_same_v<Op, at::_ops::view>) {
      return view_local(e, args...);
    } else {
      return Op::call(local_at<I>(e, std::forward<Args>(args))...);
    }
  }
  static at::Tensor view_local(const Entry& e, const at::Tensor& self, c10::SymIntArrayRef size) {
    const at::Tensor& local = local_arg(self);
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY(local.is_contiguous());
    return contiguous_view(local, local_at<1>(e, size));
  }
  template <size_t I, class A>
  static decltype(auto) local_at(const Entry& e, A&& a) {
    if constexpr (std::is_same_v<std::decay_t<A>, c10::SymIntArrayRef>) {
      return static_cast<int>(I) == e.sizes_arg ? c10::SymIntArrayRef(e.local_sizes)
                                                : c10::SymIntArrayRef(a);
    } else {
      return local_arg(std::forward<A>(a));
    }
  }
  // Argument replacements the hit path can make: one SymInt[] argument.
  static bool replaceable(const detail::FallbackReport& r) {
    if (r.local_args.empty()) return true;
    if (r.local_args.size() != 1) return false;
    static constexpr bool is_sizes[] = {std::is_same_v<std::decay_t<Args>, c10::SymIntArrayRef>...,
                                        false};
    const int i = r.local_args[0].first;
    return i >= 0 && i < static_cast<int>(sizeof...(Args)) && is_sizes[i];
  }
  template <class First, class... Rest>
  static First& first(First& a, Rest&...) {
    return a;
  }
};

template <class Op>
void fast(torch::Library& m) {
  std::string name = Op::name;
  name = name.substr(name.find("::") + 2);
  if (std::string(Op::overload_name).size()) name += std::string(".") + Op::overload_name;
  m.impl(name.c_str(), TORCH_FN(FastKernel<Op>::kernel));
}

// detach keeps the layout and the data: the result shares the shard's handle (autograd's
// view tracking happens on the wrapper), so no local op and no second TensorImpl.
at::Tensor detach_sharing_shard(const at::Tensor& self) {
  auto* d = detail::as_dtensor(self);
  TORCH_INTERNAL_ASSERT(d, "aten::detach reached the distributed-tensor key without one");
  return at::detail::make_tensor<DTensorImpl>(d->local(), d->spec_ptr());
}

// NOTE: [view of a strided shard]
// The wrapper reports the global contiguous strides, so contiguous() on it returns it
// unchanged and code written for plain tensors (x.transpose(1, 2).contiguous().view(...),
// matmul's folding of batch dims) views it, while its shard may come from transpose,
// permute or expand and not be viewable with the local sizes. The shard is made contiguous
// first, the copy contiguous() would have made of a plain tensor; the result then does not
// alias the input, as it would not have after contiguous(), and an in-place write into it
// raises (writes_reach_base) instead of missing the input.
// Row-major strides exactly, size-1 and empty dims included. is_contiguous() ignores the
// strides of size-1 dims, so a shard of one row would alias where the others copy: the ranks
// must decide alike (writes through a copy raise, writes_reach_base).
bool row_major(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.stride(d) != expected) return false;
    expected *= std::max<int64_t>(t.size(d), 1);
  }
  return true;
}

at::Tensor view_of_contiguous_shard(const at::Tensor& self, c10::SymIntArrayRef size) {
  auto* d = detail::as_dtensor(self);
  if (d && detail::is_freed(d->local())) detail::refill_freed({d->local()});  // read below
  if (d && !row_major(d->local())) {
    const at::Tensor packed = at::detail::make_tensor<DTensorImpl>(
        d->local().clone(at::MemoryFormat::Contiguous), d->spec_ptr());
    return FastKernel<at::_ops::view>::kernel(packed, size);
  }
  return FastKernel<at::_ops::view>::kernel(self, size);
}

}  // namespace

// The ops of a training step's inner loop (BENCHMARKS.md, "Per-op dispatch overhead").
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  fast<at::_ops::add_Tensor>(m);
  fast<at::_ops::add__Tensor>(m);
  fast<at::_ops::add__Scalar>(m);
  fast<at::_ops::sub_Tensor>(m);
  fast<at::_ops::mul_Tensor>(m);
  fast<at::_ops::mul_Scalar>(m);
  fast<at::_ops::mul__Tensor>(m);
  fast<at::_ops::mul__Scalar>(m);
  fast<at::_ops::div_Tensor>(m);
  fast<at::_ops::div_Scalar>(m);
  fast<at::_ops::sqrt>(m);
  fast<at::_ops::addcmul_>(m);
  fast<at::_ops::addcdiv_>(m);
  fast<at::_ops::mm>(m);
  m.impl("view", TORCH_FN(view_of_contiguous_shard));
  m.impl("detach", TORCH_FN(detach_sharing_shard));
  fast<at::_ops::sum>(m);
}

}  // namespace tessera
