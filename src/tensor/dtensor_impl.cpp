#include "tessera/tensor/dtensor_impl.h"

#include <c10/util/Exception.h>

#include "tessera/tensor/registration.h"

namespace tessera {

c10::DispatchKeySet dtensor_key_set() {
  return c10::DispatchKeySet({c10::DispatchKey::PrivateUse1, c10::DispatchKey::AutogradPrivateUse1,
                              c10::DispatchKey::ADInplaceOrView});
}

// NOTE: [No data pointer]
// A distributed tensor's elements live on several ranks, so nothing can read them through a
// data pointer. ATen's printing (std::cout << t, at::print) converts the tensor to double and
// then reads its data pointer: without this it failed with "Cannot access data pointer of
// Tensor that doesn't have storage". Printing the global value from inside operator<< would
// need a collective that code printing on one rank only (if (rank == 0) std::cout << t) would
// hang on, so every data access raises this message instead, on the rank that tried.
namespace {
const char* const kNoDataPointer =
    "tessera: a distributed tensor's elements live on several ranks, so its data cannot be read "
    "in place (std::cout << t, at::print, data_ptr, accessor, storage). Print "
    "tessera::to_string(t) (its layout and this rank's shard, no communication), or "
    "tessera::full_tensor(t) (the global value, a plain tensor; collective: call it on every "
    "rank), or tessera::to_local(t) (this rank's shard)";
}  // namespace

DTensorImpl::DTensorImpl(at::Tensor local, SpecPtr spec)
    : c10::TensorImpl(dtensor_key_set(), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
  // (also sets storage_access_should_throw; older 2.x keep ATen's message)
  release_storage_and_set_meta_custom_data_ptr_error_msg_(std::string(kNoDataPointer));
#else
  set_storage_access_should_throw();
#endif
  refresh_global_metadata();
}

#if TORCH_VERSION_MAJOR < 2
bool DTensorImpl::has_storage() const {
  TORCH_CHECK(false, kNoDataPointer);
  return false;
}
const c10::Storage& DTensorImpl::storage() const {
  TORCH_CHECK(false, kNoDataPointer);
  return storage_;
}
#endif

void DTensorImpl::refresh_global_metadata() {
  // Global sizes with contiguous strides: what ordinary code (and autograd) should see.
  const auto& sizes = spec_->sizes();
  sizes_and_strides_.set_sizes(sizes);
  int64_t st = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    sizes_and_strides_.stride_at_unchecked(d) = st;
    st *= std::max<int64_t>(sizes[d], 1);
  }
  refresh_numel();
  refresh_contiguous();
}

void DTensorImpl::set_local_and_spec(at::Tensor local, SpecPtr spec) {
  TORCH_INTERNAL_ASSERT(local.scalar_type() == spec->dtype());
  local_ = std::move(local);
  spec_ = std::move(spec);
  data_type_ = local_.dtype();
  refresh_global_metadata();
}

// NOTE: [Shallow copies]
// detach() and views shallow-copy the TensorImpl. Without these overrides they would build a
// plain TensorImpl that still carries our dispatch keys, and the fallback would misread it.
c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, spec_);
  impl->set_version_counter(version_counter);
  impl->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, spec_);
  impl->set_version_counter(std::move(version_counter));
  impl->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
  return impl;
}

void DTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  auto* other = dynamic_cast<DTensorImpl*>(impl.get());
  TORCH_CHECK(other,
              "tessera: set_data/shallow copy of a plain tensor into a distributed one; "
              "wrap the data with tessera::distribute_tensor first");
  set_local_and_spec(other->local_, other->spec_);
}

bool is_dtensor(const at::Tensor& t) {
  return t.defined() && dynamic_cast<DTensorImpl*>(t.unsafeGetTensorImpl()) != nullptr;
}

DTensorImpl* dtensor_impl(const at::Tensor& t, const char* what) {
  auto* impl = t.defined() ? dynamic_cast<DTensorImpl*>(t.unsafeGetTensorImpl()) : nullptr;
  TORCH_CHECK(impl, "tessera: expected a distributed tensor for ", what, ", got ",
              t.defined() ? "a plain tensor" : "an undefined tensor",
              "; create one with tessera::distribute_tensor or tessera::from_local");
  return impl;
}

at::Tensor make_dtensor(at::Tensor local, SpecPtr spec) {
  ensure_dispatch_registered();
  TORCH_CHECK(!is_dtensor(local), "tessera: a distributed tensor cannot hold another as its shard");
  if (spec->mesh().contains_this_rank()) {
    auto expected = spec->local_sizes();
    TORCH_CHECK(local.sizes().vec() == expected, "tessera: local shard has shape ",
                shape_str(local.sizes().vec()), " but ", spec->str(), " gives this rank ",
                shape_str(expected));
  }
  TORCH_CHECK(local.scalar_type() == spec->dtype(), "tessera: local shard dtype ",
              local.scalar_type(), " differs from the spec's ", spec->dtype());
  return at::detail::make_tensor<DTensorImpl>(std::move(local), std::move(spec));
}

}  // namespace tessera
