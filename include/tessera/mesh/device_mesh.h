#pragma once
// DeviceMesh: an N-D grid of ranks with named dims; one process group per mesh dim.
// A cheap handle (shared implementation), like at::Tensor. Mirrors torch.distributed's
// DeviceMesh / init_device_mesh.
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>

#include "tessera/compat_c10d.h"

namespace tessera {

class World;
class DeviceMesh;

namespace detail {
// A cache slot and its mutex that die with the mesh (the redistribute planner's plans).
std::shared_ptr<void>& mesh_cache_slot(const DeviceMesh& mesh);
std::mutex& mesh_cache_mutex(const DeviceMesh& mesh);
// The mesh over `dims` of `mesh`, in that order, with the parent's groups (cached). The
// library's way to a slice of a mesh without dim names (the public one is by name).
DeviceMesh mesh_over_dims(const DeviceMesh& mesh, const std::vector<int64_t>& dims);
}  // namespace detail

class DeviceMesh {
 public:
  DeviceMesh() = default;

  // A mesh over the given global ranks (row-major over `shape`). Collective: every rank of the
  // world calls it, in the same order; ranks outside the mesh get a handle with no coordinate.
  // device_type: "cpu" (Gloo), "cuda" (NCCL, or Gloo after InitOptions::backend "cuda:gloo"),
  // or a device with its transport, "cuda:gloo" / "cuda:nccl". A CUDA mesh makes the current
  // device local_rank % device_count unless the program chose one (World::select_cuda_device).
  DeviceMesh(std::string device_type, std::vector<int64_t> shape, std::vector<int> ranks,
             std::vector<std::string> dim_names = {});

  bool defined() const { return impl_ != nullptr; }
  const std::string& device_type() const;  // "cpu" or "cuda"
  c10::DeviceType device_kind() const;
  // Where this rank's shards live: the host, or the calling thread's current CUDA device.
  c10::Device device() const;
  // How the mesh's collectives travel: "gloo" or "nccl". A "cuda:gloo" mesh keeps its tensors
  // on the GPU and stages them through host memory for Gloo (NOTE: [Devices on the wire]).
  const std::string& backend() const;
  int64_t ndim() const;
  int64_t size() const;  // number of ranks in the mesh
  int64_t size(int64_t mesh_dim) const;
  const std::vector<int64_t>& shape() const;
  const std::vector<int>& ranks() const;  // global ranks, row-major
  const std::vector<std::string>& dim_names() const;
  int64_t dim_index(const std::string& name) const;  // throws naming the known dims

  // This rank's coordinate (empty when this rank is not in the mesh).
  const std::vector<int64_t>& coordinate() const;
  bool contains_this_rank() const { return !coordinate().empty(); }
  int64_t local_rank(int64_t mesh_dim) const { return coordinate().at(mesh_dim); }

  // The ranks along `mesh_dim` that share this rank's other coordinates, and their group.
  compat::BackendPtr group(int64_t mesh_dim) const;
  std::vector<int> group_ranks(int64_t mesh_dim) const;
  // One group over all ranks of the mesh (scatter, shape agreement).
  compat::BackendPtr mesh_group() const;

  // Submesh over named dims, e.g. mesh["tp"] or mesh[{"dp", "tp"}]; reuses the parent's
  // groups (no new communicators) and is cached, so repeated slicing returns the same mesh.
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  // mesh[{"dp", "tp"}]: without this, a braced pair of literals could also build a string.
  DeviceMesh operator[](std::initializer_list<std::string> names) const {
    return (*this)[std::vector<std::string>(names)];
  }

  // The same ranks and groups with the dims reordered: dim i of the result is dim dims[i] of
  // this mesh. Shards of one tensor dim over several mesh dims nest in mesh-dim order (NOTE:
  // [Shard tables]), so a permuted mesh states another nesting: fully_shard keeps a
  // tensor-parallel shard outermost and nests its data-parallel rows inside it this way.
  // Cached like slices; root() and dims_in_root() see through it. Local.
  DeviceMesh permute(const std::vector<int64_t>& dims) const;

  // The mesh this one was sliced from, followed to the top (itself when not a slice), and
  // the root's dim behind each of this mesh's dims. Tensor parallelism on mesh["tp"] lays
  // parameters out on the root, replicated over its other dims, so they meet activations
  // sharded over "dp" in one op.
  DeviceMesh root() const;
  std::vector<int64_t> dims_in_root() const;

  // Global rank at a mesh coordinate.
  int rank_at(const std::vector<int64_t>& coord) const;

  // Identity: two handles are the same mesh iff they share an implementation.
  bool operator==(const DeviceMesh& o) const { return impl_ == o.impl_; }
  bool operator!=(const DeviceMesh& o) const { return impl_ != o.impl_; }
  const void* id() const { return impl_.get(); }

  std::string str() const;  // DeviceMesh(cpu, shape=[2, 2], ranks=[0,1,2,3], dims=(dp, tp))

  // A handle that does not keep the mesh alive, for caches the mesh owns (no ownership cycle).
  DeviceMesh unowned() const;

  struct Impl;

 private:
  friend std::shared_ptr<void>& detail::mesh_cache_slot(const DeviceMesh&);
  friend std::mutex& detail::mesh_cache_mutex(const DeviceMesh&);
  friend DeviceMesh detail::mesh_over_dims(const DeviceMesh&, const std::vector<int64_t>&);
  explicit DeviceMesh(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const Impl& impl() const;
  // The mesh over `dims` of this one, in that order (slices and permutations), cached.
  DeviceMesh sub(const std::vector<int64_t>& dims) const;
  std::shared_ptr<Impl> impl_;
};

// torch.distributed.device_mesh.init_device_mesh: a mesh over all ranks of the current world.
DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names = {});

}  // namespace tessera
