#pragma once
// Which device a tensor handed to a collective lives on. See NOTE: [Devices on the wire].
//
// NOTE: [Devices on the wire]
// A group has a home device (its mesh's: the host, or the current CUDA device) and a transport
// (Gloo or NCCL). Tensors given to and returned by the collectives of src/comm/ always live on
// the home device; each collective moves them to where its transport reads them:
//   cpu  mesh, Gloo : host memory as it is;
//   cuda mesh, NCCL : device memory as it is;
//   cuda mesh, Gloo ("cuda:gloo", tests on one GPU): staged through a host copy both ways.
// A tensor on another device reaching a collective is a Tessera bug: check_home raises an
// internal error naming the call site, instead of the transport's "Tensors must be CUDA and
// dense" on some ranks. Code that makes tensors to send (metadata, flags, tables, buckets)
// makes them with home_options(group), the one place that decides.
#include <c10/core/Device.h>
#include <c10/core/TensorOptions.h>

#include "tessera/compat.h"

namespace at {
class Tensor;
}

namespace tessera::comm {

using Group = compat::BackendPtr;

// Records a group's home device type; World::new_group calls it for every group it makes.
// A group never recorded is homed by its transport: NCCL on CUDA, Gloo on the host.
void set_home(const Group& pg, c10::DeviceType home);

// The group's home device: the host, or the calling thread's current CUDA device.
c10::Device home_device(const Group& pg);
at::TensorOptions home_options(const Group& pg, at::ScalarType dtype);

// True when the transport reads host memory but the home is a GPU (cuda:gloo).
bool staged(const Group& pg);

// Internal check at every collective's entry: `x` must live on the group's home device type.
void check_home(const Group& pg, const at::Tensor& x, const char* site);

// The current CUDA device, without linking CUDA libraries (through c10's device-guard
// registry); throws a clear error where LibTorch has no CUDA.
c10::Device current_cuda_device();

}  // namespace tessera::comm
