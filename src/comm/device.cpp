#include "tessera/comm/device.h"
#include "tessera/comm/collectives.h"

#include <mutex>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace tessera::comm {

namespace {
// Keyed by the backend object. A backend freed and another made at the same address is
// re-recorded by set_home before anyone can ask about it.
std::mutex g_mu;
std::unordered_map<const void*, c10::DeviceType>& homes() {
  static std::unordered_map<const void*, c10::DeviceType> h;
  return h;
}

bool is_nccl(const Group& pg) { return pg->getBackendName() == "nccl"; }

c10::DeviceType home_type(const Group& pg) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = homes().find(pg.get());
    if (it != homes().end()) return it->second;
  }
  return is_nccl(pg) ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
}
}  // namespace

void set_home(const Group& pg, c10::DeviceType home) {
  std::lock_guard<std::mutex> lock(g_mu);
  homes()[pg.get()] = home;
}

c10::Device current_cuda_device() {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getDevice();
}

c10::Device home_device(const Group& pg) {
  if (!pg || home_type(pg) == c10::DeviceType::CPU) return c10::Device(c10::DeviceType::CPU);
  return current_cuda_device();
}

at::TensorOptions home_options(const Group& pg, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(home_device(pg));
}

bool staged(const Group& pg) { return pg && !is_nccl(pg) && home_type(pg) != c10::DeviceType::CPU; }

void check_home(const Group& pg, const at::Tensor& x, const char* site) {
  if (!pg || !x.defined()) return;
  const auto home = home_type(pg);
  TORCH_INTERNAL_ASSERT(x.device().type() == home, "tessera: ", site, " was handed a tensor on ",
                        x.device(), " for a ", pg->getBackendName(), " group whose home is ",
                        c10::DeviceTypeName(home, /*lower_case=*/true),
                        " (see NOTE: [Devices on the wire]); this is a bug in Tessera: please ",
                        "report it with the call that led here");
}

}  // namespace tessera::comm
