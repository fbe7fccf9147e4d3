// Moving a distributed tensor between meshes that share a root (include/tessera/tensor/api.h,
// redistribute with a mesh): a redistribute on the tensor's own mesh, then a change of mesh that
// keeps every rank's block where it is (to_local, then from_local on the other mesh).
#include <algorithm>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "tessera/tensor/api.h"

namespace tessera {

namespace {

// Root dim of each of the mesh's dims.
std::vector<int64_t> root_dims(const DeviceMesh& m) { return m.dims_in_root(); }

int64_t position(const std::vector<int64_t>& dims, int64_t root_dim) {
  auto it = std::find(dims.begin(), dims.end(), root_dim);
  return it == dims.end() ? -1 : static_cast<int64_t>(it - dims.begin());
}

std::string placements_str(const Placements& ps) {
  std::string s = "{";
  for (size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + ps[i].str();
  return s + "}";
}

}  // namespace

at::Tensor redistribute(const at::Tensor& dtensor, const DeviceMesh& mesh,
                        const Placements& placements) {
  const DTensorSpec& s = spec(dtensor);
  const DeviceMesh& from = s.mesh();
  const std::string what =
      "redistribute(" + s.str() + " -> " + mesh.str() + " " + placements_str(placements) + ")";
  TORCH_CHECK(mesh.defined() && static_cast<int64_t>(placements.size()) == mesh.ndim(),
              "tessera: ", what, ": give one placement per dim of the target mesh (",
              mesh.defined() ? mesh.ndim() : 0, ")");
  if (mesh == from) return redistribute(dtensor, placements);
  TORCH_CHECK(
      mesh.root() == from.root(), "tessera: ", what, ": the target mesh is not a slice of ",
      "the tensor's root mesh (nor that root); a tensor moves between meshes only where "
      "each rank's block can stay put. Across unrelated meshes use to_local and from_local");
  const auto src_dims = root_dims(from), dst_dims = root_dims(mesh);
  // Step 1, on the tensor's own mesh: dims the target keeps take their target placement; dims
  // it drops become Replicate (every group then holds the same value, as on a slice).
  Placements here(static_cast<size_t>(from.ndim()), Replicate());
  bool added_shard = false;
  for (size_t i = 0; i < dst_dims.size(); ++i) {
    const int64_t j = position(src_dims, dst_dims[i]);
    if (j >= 0)
      here[static_cast<size_t>(j)] = placements[i];
    else
      added_shard = added_shard || placements[i].is_shard();
    TORCH_CHECK(j >= 0 || !placements[i].is_partial(), "tessera: ", what, ": a dim the tensor's ",
                "mesh lacks cannot become Partial (declare partial values with from_local)");
  }
  at::Tensor x = redistribute(dtensor, here);
  // Step 2: the same blocks on the target mesh. Shard sizes carry over when the kept dims keep
  // their order and no dim is added as a shard; otherwise every rank's shape is exchanged.
  std::vector<int64_t> kept;
  for (int64_t d : src_dims)
    if (position(dst_dims, d) >= 0) kept.push_back(d);
  std::vector<int64_t> kept_in_dst;
  for (int64_t d : dst_dims)
    if (position(src_dims, d) >= 0) kept_in_dst.push_back(d);
  FromLocalOptions o;
  if (added_shard || kept != kept_in_dst)
    o.sizes = ShardSizes::Infer();
  else
    o.sizes = ShardSizes::Given(spec(x).shard_tables());
  return from_local(to_local(x), mesh, placements, o);
}

}  // namespace tessera
