// User arguments into specs: placement checks, target shard tables, and agreeing on them
// across the mesh before a collective (NOTE: [Agreeing on arguments] in comm/agree.cpp).
#include "layout_args.h"

#include <algorithm>
#include <functional>

#include <ATen/ATen.h>

#include "tessera/comm/agree.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

ShardSizes ShardSizes::Given(int64_t dim, ShardTable sizes) {
  TORCH_CHECK(dim >= 0, "tessera: ShardSizes::Given(dim, sizes) needs a non-negative dim");
  std::vector<ShardTable> tables(dim + 1);
  tables[dim] = std::move(sizes);
  return Given(std::move(tables));
}

namespace detail {

std::vector<ShardTable> target_tables(const char* what, const DTensorSpec* src,
                                      const DeviceMesh& mesh, const Placements& p,
                                      const std::vector<int64_t>& sizes, const ShardSizes& given) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t) {
    if (given.mode() == ShardSizes::Mode::Given &&
        t < static_cast<int64_t>(given.tables().size()) && !given.tables()[t].empty()) {
      tables[t] = given.tables()[t];
      continue;
    }
    if (!src) continue;
    std::vector<int64_t> dims;
    bool head_tail = false;  // its table is fixed by the length
    for (size_t m = 0; m < p.size(); ++m) {
      if (!p[m].normalized(nd).is_shard(t)) continue;
      dims.push_back(static_cast<int64_t>(m));
      head_tail = head_tail || p[m].is_head_tail();
    }
    if (head_tail) continue;
    // Keep the source's cut where the target's nesting is a prefix of the source's (e.g.
    // (S(0), S(0)) -> (S(0), R) keeps the outer boundaries); otherwise chunk layout.
    const auto src_dims = src->mesh_dims_sharding(t);
    if (!dims.empty() && dims.size() <= src_dims.size() &&
        std::equal(dims.begin(), dims.end(), src_dims.begin())) {
      std::vector<int64_t> levels;
      for (auto m : src_dims) levels.push_back(mesh.size(m));
      tables[t] = detail::marginalize(src->shard_table(t), levels, dims.size());
    }
  }
  if (given.mode() == ShardSizes::Mode::Given)
    TORCH_CHECK(static_cast<int64_t>(given.tables().size()) <= nd, "tessera: ", what, "(",
                to_string(p), ", global shape ", shape_str(sizes), "): ShardSizes::Given has ",
                given.tables().size(), " tables for a ", nd, "-dim tensor");
  return tables;
}

// Errors from the spec name the public function and its arguments.
std::string strip_prefix(const std::string& m) {
  const std::string p = "tessera: ";
  return m.rfind(p, 0) == 0 ? m.substr(p.size()) : m;
}

SpecPtr make_spec(const char* what, const DeviceMesh& mesh, const Placements& placements,
                  const std::vector<int64_t>& sizes, c10::ScalarType dtype,
                  std::vector<ShardTable> tables) {
  try {
    return std::make_shared<DTensorSpec>(mesh, placements, sizes, dtype, std::move(tables));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "tessera: ", what, "(", to_string(placements), ", global shape ",
                shape_str(sizes), "): ", strip_prefix(e.msg()));
  }
}

// Checks that need nothing but the arguments: the same verdict on every rank.
void check_placement_count(const char* what, const DeviceMesh& mesh, const Placements& placements) {
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "tessera: ", what, "(",
              to_string(placements), "): placements ", to_string(placements), " has ",
              placements.size(), " entries but ", mesh.str(), " has ", mesh.ndim(),
              " dims; give one placement per mesh dim");
}

void check_placements(const char* what, const DeviceMesh& mesh, const Placements& placements,
                      const std::vector<int64_t>& shape) {
  check_placement_count(what, mesh, placements);
  const int64_t ndim = static_cast<int64_t>(shape.size());
  for (auto& p : placements) {
    TORCH_CHECK(!p.is_shard() || (ndim > 0 && p.dim() >= -ndim && p.dim() < ndim),
                "tessera: ", what, "(", to_string(placements),
                "): ", p.is_head_tail() ? "HeadTailShard(" : "Shard(", p.dim(),
                ") is out of range for a tensor with ", ndim, " dims (shape ", shape_str(shape),
                "); use a dim in [", -ndim, ", ", ndim - 1, "]");
  }
}

// Ranks with the same text, for messages: "ranks 0, 2".
std::string ranks_str(const DeviceMesh& mesh, const std::vector<size_t>& members) {
  std::string s = members.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < members.size(); ++i)
    s += (i ? ", " : "") + std::to_string(mesh.ranks()[members[i]]);
  return s + " of " + mesh.str();
}

// comm::agree over the mesh (NOTE: [Agreeing on arguments]); `check` sees the gathered ints
// once the arguments are known to agree.
std::vector<std::vector<int64_t>> agree(const char* what, const DeviceMesh& mesh,
                                        const std::string& error, const std::string& args,
                                        const std::vector<int64_t>& ints, const IntsCheck& check) {
  // Alone, or outside the mesh (no group to talk on): this rank's verdict is the verdict.
  if (mesh.size() == 1 || !mesh.contains_this_rank()) TORCH_CHECK(error.empty(), error);
  std::vector<std::vector<int64_t>> all{ints};
  if (mesh.size() > 1 || !mesh.contains_this_rank())
    all = comm::agree(mesh.mesh_group(), what, {error, args, ints},
                      [&](const std::vector<size_t>& members) { return ranks_str(mesh, members); });
  if (check) check(all);
  return all;
}

std::string sizes_str(const ShardSizes& sizes) {
  switch (sizes.mode()) {
    case ShardSizes::Mode::Chunk: return "";
    case ShardSizes::Mode::Infer: return ", ShardSizes::Infer()";
    case ShardSizes::Mode::Given: break;
  }
  std::string s;
  for (size_t t = 0; t < sizes.tables().size(); ++t)
    if (!sizes.tables()[t].empty())
      s += (s.empty() ? "" : ", ") + std::to_string(t) + ": " + shape_str(sizes.tables()[t]);
  return ", shard sizes {" + s + "}";
}

// Local checks whose failure `agree` reports: the error's text, or "" when they pass.

// As PyTorch: a tensor handed to a mesh moves to the mesh's device (differentiably; a no-op
// when it is there already), so shards always live where the mesh's collectives expect them.
at::Tensor on_mesh_device(const at::Tensor& t, const DeviceMesh& mesh) {
  if (!t.defined() || !mesh.defined() || is_dtensor(t) || t.device().type() == mesh.device_kind())
    return t;
  return t.to(mesh.device());
}

void reject_partial(const Placements& p, const char* what) {
  for (auto& x : p)
    TORCH_CHECK(!x.is_partial(), "tessera: ", what, "(", to_string(p), "): Partial is not a ",
                "placement a full tensor can be split into; use from_local to declare partial ",
                "values");
}

std::vector<int64_t> coord_of(const DeviceMesh& mesh, int64_t flat) {
  std::vector<int64_t> c(mesh.ndim());
  for (int64_t m = mesh.ndim() - 1; m >= 0; --m) {
    c[m] = flat % mesh.size(m);
    flat /= mesh.size(m);
  }
  return c;
}

}  // namespace detail

}  // namespace tessera
