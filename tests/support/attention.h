#pragma once
// Attention tests' helper: one device's scaled_dot_product_attention as every 2.x version
// spells it.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

namespace tessera::test {

#if TORCH_VERSION_MAJOR >= 2  // (LibTorch 1.13 has no scaled_dot_product_attention)
// Whether scaled_dot_product_attention takes enable_gqa (LibTorch 2.5 on): grouped-query
// cases run only where it does.
constexpr bool kSdpaTakesGqa = TORCH_VERSION_MAJOR > 2 ||
                               (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5);
// scaled_dot_product_attention without dropout, with enable_gqa where LibTorch takes it.
inline at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& mask, bool causal, bool gqa = false) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, c10::nullopt, gqa);
#else
  TORCH_CHECK(!gqa, "enable_gqa needs LibTorch 2.5");
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal);
#endif
}
#endif

}  // namespace tessera::test
