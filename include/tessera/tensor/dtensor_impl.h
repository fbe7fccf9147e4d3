#pragma once
// NOTE: [DTensor is an at::Tensor]
// A distributed tensor is an at::Tensor whose TensorImpl is a storage-less wrapper: sizes()
// are the *global* shape, device() is the local shard's device, and its dispatch keys are
// {PrivateUse1, AutogradPrivateUse1, ADInplaceOrView}. Autograd runs above the wrapper
// (AutogradPrivateUse1 reuses every ordinary derivative formula); below it, one boxed
// fallback (tensor/fallback.cpp) applies the op's sharding rule to the local shards.
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/version.h>

#include "tessera/placement/spec.h"

namespace tessera {

class DTensorImpl final : public c10::TensorImpl {
 public:
  DTensorImpl(at::Tensor local, SpecPtr spec);

  const at::Tensor& local() const { return local_; }
  const DTensorSpec& spec() const { return *spec_; }
  const SpecPtr& spec_ptr() const { return spec_; }

  // In-place ops that change the layout (copy_ from another placement, set_data) swap both.
  void set_local_and_spec(at::Tensor local, SpecPtr spec);

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;
#if TORCH_VERSION_MAJOR < 2
  // LibTorch 1.13 asks this before reading a tensor's data (operator<<, data_ptr): the answer
  // for a distributed tensor is an error that says what to use instead (NOTE: [No data
  // pointer] in dtensor_impl.cpp). 2.x has a per-tensor message for the same check.
  bool has_storage() const override;
  // The same for code that asks for the storage itself (torch::save's pickler): ATen's own
  // "Cannot access storage of DTensorImpl" named no way out.
  const c10::Storage& storage() const override;
#endif

 private:
  const char* tensorimpl_type_name() const override { return "tessera::DTensorImpl"; }
  void refresh_global_metadata();

  at::Tensor local_;
  SpecPtr spec_;
};

// The dispatch keys every distributed tensor carries.
c10::DispatchKeySet dtensor_key_set();

bool is_dtensor(const at::Tensor& t);
// Checked access: throws "expected a distributed tensor" naming `what`.
DTensorImpl* dtensor_impl(const at::Tensor& t, const char* what = "argument");
// Wraps a local shard (no communication, no autograd edge). Checks the local shape against
// the spec and throws on a mismatch.
at::Tensor make_dtensor(at::Tensor local, SpecPtr spec);

}  // namespace tessera
