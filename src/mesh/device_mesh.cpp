#include "tessera/mesh/device_mesh.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>

#include <c10/util/Exception.h>

#include "tessera/comm/collectives.h"
#include "tessera/comm/device.h"
#include "tessera/runtime/world.h"

namespace tessera {

struct DeviceMesh::Impl {
  std::string device_type;
  c10::DeviceType kind = c10::DeviceType::CPU;
  std::string transport = "gloo";
  std::vector<int64_t> shape;
  std::vector<int> ranks;
  std::vector<std::string> names;
  std::vector<int64_t> coord;
  std::shared_ptr<World> world;
  std::string tag;  // unique store prefix of this mesh
  std::vector<compat::BackendPtr> groups;
  std::vector<std::vector<int>> group_ranks;

  std::mutex mu;  // guards the lazily built members below
  compat::BackendPtr all;
  std::map<std::vector<int64_t>, std::shared_ptr<Impl>> submeshes;

  std::mutex cache_mu;
  std::shared_ptr<void> cache;

  // Set on slices: the parent (weak: the parent owns its cached slices) and its dims.
  std::weak_ptr<Impl> parent;
  std::vector<int64_t> parent_dims;
};

namespace {

std::string shape_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// "cpu", "cuda", or either with its transport named after a colon ("cuda:gloo"), as in
// PyTorch's backend strings.
void parse_device(const std::string& d, const World& world, DeviceMesh::Impl& m) {
  const auto colon = d.find(':');
  const std::string type = d.substr(0, colon);
  const std::string transport = colon == std::string::npos ? "" : d.substr(colon + 1);
  const char* hint =
      "; use \"cpu\" (Gloo), \"cuda\" (NCCL) or \"cuda:gloo\" (CUDA tensors "
      "over Gloo, staged through host memory)";
  TORCH_CHECK(type == "cpu" || type == "cuda", "tessera: init_device_mesh: unknown device_type \"",
              d, "\"", hint);
  m.kind = type == "cpu" ? c10::DeviceType::CPU : c10::DeviceType::CUDA;
  m.device_type = type;
  m.transport = !transport.empty()               ? transport
                : m.kind == c10::DeviceType::CPU ? "gloo"
                                                 : world.cuda_transport();
  TORCH_CHECK(m.transport == "gloo" || (m.transport == "nccl" && type == "cuda"),
              "tessera: init_device_mesh: device_type \"", d, "\" names no transport Tessera has",
              hint);
}

// Ranks along `dim` through `coord`, in coordinate order.
std::vector<int> line_through(const DeviceMesh::Impl& m, const std::vector<int64_t>& coord,
                              int64_t dim) {
  std::vector<int> out;
  std::vector<int64_t> c = coord;
  for (int64_t i = 0; i < m.shape[dim]; ++i) {
    c[dim] = i;
    int64_t flat = 0;
    for (size_t d = 0; d < m.shape.size(); ++d) flat = flat * m.shape[d] + c[d];
    out.push_back(m.ranks[flat]);
  }
  return out;
}

}  // namespace

DeviceMesh::DeviceMesh(std::string device_type, std::vector<int64_t> shape, std::vector<int> ranks,
                       std::vector<std::string> dim_names) {
  auto world = current_world();
  auto m = std::make_shared<Impl>();
  parse_device(device_type, *world, *m);
  if (m->kind == c10::DeviceType::CUDA) world->select_cuda_device();
  TORCH_CHECK(!shape.empty(), "tessera: DeviceMesh needs at least one dim");
  for (auto s : shape)
    TORCH_CHECK(s >= 1, "tessera: DeviceMesh shape ", shape_str(shape),
                " has a dim smaller than 1");
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK(n == static_cast<int64_t>(ranks.size()), "tessera: DeviceMesh shape ",
              shape_str(shape), " holds ", n, " ranks but ", ranks.size(), " were given");
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
              "tessera: DeviceMesh ranks contain duplicates");
  TORCH_CHECK(sorted.front() >= 0 && sorted.back() < world->size(), "tessera: DeviceMesh shape ",
              shape_str(shape), " needs ranks up to ", sorted.back(), " but the world has only ",
              world->size(), " ranks; launch more ranks (tessera-run -n ", sorted.back() + 1,
              ") or use a smaller mesh");
  TORCH_CHECK(dim_names.empty() || dim_names.size() == shape.size(), "tessera: DeviceMesh has ",
              shape.size(), " dims but ", dim_names.size(), " dim names");
  for (size_t i = 0; i < dim_names.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      TORCH_CHECK(dim_names[i] != dim_names[j], "tessera: duplicate mesh dim name \"", dim_names[i],
                  "\"");
  m->shape = std::move(shape);
  m->ranks = std::move(ranks);
  m->names = std::move(dim_names);
  m->world = world;
  m->tag = "mesh" + std::to_string(world->next_mesh_id());

  auto it = std::find(m->ranks.begin(), m->ranks.end(), world->rank());
  if (it != m->ranks.end()) {
    int64_t flat = it - m->ranks.begin();
    m->coord.assign(m->shape.size(), 0);
    for (int64_t d = static_cast<int64_t>(m->shape.size()) - 1; d >= 0; --d) {
      m->coord[d] = flat % m->shape[d];
      flat /= m->shape[d];
    }
    for (size_t d = 0; d < m->shape.size(); ++d) {
      auto members = line_through(*m, m->coord, static_cast<int64_t>(d));
      m->groups.push_back(
          world->new_group(members, m->tag + "/dim" + std::to_string(d), m->kind, m->transport));
      m->group_ranks.push_back(std::move(members));
    }
    if (m->shape.size() == 1) m->all = m->groups[0];
  }
  impl_ = std::move(m);
}

const DeviceMesh::Impl& DeviceMesh::impl() const {
  TORCH_CHECK(impl_, "tessera: use of an undefined DeviceMesh");
  return *impl_;
}

const std::string& DeviceMesh::device_type() const { return impl().device_type; }
c10::DeviceType DeviceMesh::device_kind() const { return impl().kind; }
const std::string& DeviceMesh::backend() const { return impl().transport; }
c10::Device DeviceMesh::device() const {
  return impl().kind == c10::DeviceType::CPU ? c10::Device(c10::DeviceType::CPU)
                                             : comm::current_cuda_device();
}
int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(impl().shape.size()); }
int64_t DeviceMesh::size() const { return static_cast<int64_t>(impl().ranks.size()); }
int64_t DeviceMesh::size(int64_t mesh_dim) const { return impl().shape.at(mesh_dim); }
const std::vector<int64_t>& DeviceMesh::shape() const { return impl().shape; }
const std::vector<int>& DeviceMesh::ranks() const { return impl().ranks; }
const std::vector<std::string>& DeviceMesh::dim_names() const { return impl().names; }
const std::vector<int64_t>& DeviceMesh::coordinate() const { return impl().coord; }

int64_t DeviceMesh::dim_index(const std::string& name) const {
  const auto& names = impl().names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    std::string known;
    for (auto& n : names) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "tessera: mesh has no dim named \"", name,
                "\" (dims: ", known.empty() ? "unnamed; pass dim_names to init_device_mesh" : known,
                ")");
  }
  return it - names.begin();
}

compat::BackendPtr DeviceMesh::group(int64_t mesh_dim) const {
  TORCH_CHECK(contains_this_rank(), "tessera: rank ", impl().world->rank(), " is not part of ",
              str());
  return impl().groups.at(mesh_dim);
}

std::vector<int> DeviceMesh::group_ranks(int64_t mesh_dim) const {
  TORCH_CHECK(contains_this_rank(), "tessera: rank is not part of ", str());
  return impl().group_ranks.at(mesh_dim);
}

compat::BackendPtr DeviceMesh::mesh_group() const {
  TORCH_CHECK(contains_this_rank(), "tessera: rank is not part of ", str());
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->all) {
    // Group ranks follow the mesh's row-major order, so group rank == flat mesh index.
    impl_->all =
        impl_->world->new_group(impl_->ranks, impl_->tag + "/all", impl_->kind, impl_->transport);
  }
  return impl_->all;
}

int DeviceMesh::rank_at(const std::vector<int64_t>& coord) const {
  const auto& m = impl();
  TORCH_CHECK(coord.size() == m.shape.size(), "tessera: coordinate has wrong rank");
  int64_t flat = 0;
  for (size_t d = 0; d < m.shape.size(); ++d) flat = flat * m.shape[d] + coord[d];
  return m.ranks.at(flat);
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const {
  return (*this)[std::vector<std::string>{name}];
}

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  TORCH_CHECK(!names.empty(), "tessera: slicing a mesh needs at least one dim name");
  std::vector<int64_t> dims;
  for (auto& n : names) dims.push_back(dim_index(n));
  for (size_t i = 1; i < dims.size(); ++i)
    TORCH_CHECK(dims[i] > dims[i - 1], "tessera: mesh dims must be sliced in mesh order; got ",
                "out-of-order or repeated names");
  return detail::mesh_over_dims(*this, dims);
}

DeviceMesh DeviceMesh::permute(const std::vector<int64_t>& dims) const {
  const auto& m = impl();
  const int64_t nd = static_cast<int64_t>(m.shape.size());
  std::vector<int64_t> sorted = dims;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(nd);
  std::iota(identity.begin(), identity.end(), int64_t{0});
  TORCH_CHECK(sorted == identity, "tessera: DeviceMesh::permute", shape_str(dims), " of ", str(),
              ": give every mesh dim exactly once");
  if (dims == identity) return *this;
  TORCH_CHECK(contains_this_rank(), "tessera: cannot permute ", str(), " on a rank outside it");
  return sub(dims);
}

DeviceMesh DeviceMesh::sub(const std::vector<int64_t>& dims) const {
  const auto& m = impl();
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto& cached = impl_->submeshes[dims];
  if (!cached) {
    auto s = std::make_shared<Impl>();
    s->device_type = m.device_type;
    s->kind = m.kind;
    s->transport = m.transport;
    s->world = m.world;
    std::string tag = m.tag + "/sub";
    for (auto d : dims) {
      s->shape.push_back(m.shape[d]);
      if (!m.names.empty()) s->names.push_back(m.names[d]);  // (an unnamed mesh's stay so)
      s->coord.push_back(m.coord[d]);
      s->groups.push_back(m.groups[d]);
      s->group_ranks.push_back(m.group_ranks[d]);
      tag += std::to_string(d);
    }
    s->tag = tag;
    // Ranks of the submesh: vary the sliced dims, keep this rank's other coordinates.
    const int64_t n =
        std::accumulate(s->shape.begin(), s->shape.end(), int64_t{1}, std::multiplies<>());
    std::vector<int64_t> c = m.coord;
    for (int64_t flat = 0; flat < n; ++flat) {
      int64_t rem = flat;
      for (int64_t i = static_cast<int64_t>(dims.size()) - 1; i >= 0; --i) {
        c[dims[i]] = rem % s->shape[i];
        rem /= s->shape[i];
      }
      s->ranks.push_back(rank_at(c));
    }
    if (s->shape.size() == 1) s->all = s->groups[0];
    s->parent = impl_;
    s->parent_dims = dims;
    cached = std::move(s);
  }
  return DeviceMesh(cached);
}

DeviceMesh DeviceMesh::root() const {
  std::shared_ptr<Impl> m = impl_;
  while (m && !m->parent_dims.empty()) {
    auto up = m->parent.lock();
    TORCH_CHECK(up, "tessera: ", DeviceMesh(m).str(),
                " is a slice of a mesh that no longer exists");
    m = std::move(up);
  }
  return DeviceMesh(m);
}

std::vector<int64_t> DeviceMesh::dims_in_root() const {
  std::vector<int64_t> dims(impl().shape.size());
  std::iota(dims.begin(), dims.end(), int64_t{0});
  std::shared_ptr<Impl> m = impl_;
  while (m && !m->parent_dims.empty()) {
    for (auto& d : dims) d = m->parent_dims[d];
    m = m->parent.lock();
    TORCH_CHECK(m, "tessera: a mesh slice outlived the mesh it was sliced from");
  }
  return dims;
}

DeviceMesh DeviceMesh::unowned() const {
  // Aliasing constructor with an empty owner: points at the impl, owns nothing.
  return DeviceMesh(std::shared_ptr<Impl>(std::shared_ptr<Impl>(), impl_.get()));
}
std::shared_ptr<void>& detail::mesh_cache_slot(const DeviceMesh& mesh) { return mesh.impl_->cache; }
std::mutex& detail::mesh_cache_mutex(const DeviceMesh& mesh) { return mesh.impl_->cache_mu; }

DeviceMesh detail::mesh_over_dims(const DeviceMesh& mesh, const std::vector<int64_t>& dims) {
  TORCH_CHECK(!dims.empty(), "tessera: a slice of ", mesh.str(), " needs at least one dim");
  for (size_t i = 0; i < dims.size(); ++i)
    TORCH_CHECK(dims[i] >= 0 && dims[i] < mesh.ndim() && (i == 0 || dims[i] > dims[i - 1]),
                "tessera: slice dims ", shape_str(dims), " of ", mesh.str(),
                " must be distinct mesh dims in mesh order");
  if (static_cast<int64_t>(dims.size()) == mesh.ndim()) return mesh;
  TORCH_CHECK(mesh.contains_this_rank(), "tessera: cannot slice ", mesh.str(),
              " on a rank outside it");
  return mesh.sub(dims);
}

std::string DeviceMesh::str() const {
  if (!impl_) return "DeviceMesh(undefined)";
  const auto& m = *impl_;
  const bool usual = (m.kind == c10::DeviceType::CPU) == (m.transport == "gloo");
  std::string s = "DeviceMesh(" + m.device_type + (usual ? "" : ":" + m.transport) +
                  ", shape=" + shape_str(m.shape) + ", ranks=[";
  for (size_t i = 0; i < m.ranks.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(m.ranks[i]);
  }
  s += "]";
  if (!m.names.empty()) {
    s += ", dims=(";
    for (size_t i = 0; i < m.names.size(); ++i) {
      if (i) s += ", ";
      s += m.names[i];
    }
    s += ")";
  }
  return s + ")";
}

DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names) {
  auto world = current_world();
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK(n <= world->size(), "tessera: init_device_mesh: mesh shape ", shape_str(shape),
              " needs ", n, " ranks but the world has ", world->size(),
              "; launch with tessera-run -n ", n, " or use a smaller mesh");
  TORCH_CHECK(n == world->size(), "tessera: init_device_mesh: mesh shape ", shape_str(shape),
              " covers ", n, " of the world's ", world->size(),
              " ranks; init_device_mesh spans the whole world (use the DeviceMesh constructor ",
              "with explicit ranks for a subset)");
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  return DeviceMesh(device_type, shape, std::move(ranks), dim_names);
}

}  // namespace tessera
