// from_local: each rank's shard declared as part of a distributed tensor, its global shape
// known, exchanged or checked across the mesh.
#include <ATen/ATen.h>

#include "layout_args.h"
#include "layout_autograd.h"
#include "tessera/comm/collectives.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

using namespace detail;

namespace {

// `error` and `args` as for agree_with_source.
SpecPtr infer_spec(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                   const std::string& error, const std::string& args,
                   std::vector<std::vector<int64_t>>* shapes_out = nullptr) {
  const bool def = local.defined();
  // The local shape rides in the agreement's own exchange when it has at most kInline dims
  // (every tensor in practice): one metadata all-gather per call. Longer shapes take a second.
  constexpr int64_t kInline = 8;
  std::vector<int64_t> head{def ? local.dim() : -1,
                            def ? static_cast<int64_t>(local.scalar_type()) : -1};
  for (int64_t i = 0; i < kInline; ++i) head.push_back(def && i < local.dim() ? local.size(i) : -1);
  auto heads = agree(
      "from_local", mesh, error, args, head, [&](const std::vector<std::vector<int64_t>>& heads) {
        for (size_t r = 1; r < heads.size(); ++r) {
          TORCH_CHECK(heads[r][0] == heads[0][0] && heads[r][1] == heads[0][1],
                      "tessera: from_local(", to_string(placements), "): mesh ranks ",
                      mesh.ranks()[0], " and ", mesh.ranks()[r], " disagree on the local tensor's ",
                      heads[r][0] != heads[0][0] ? "number of dims" : "dtype", " (", heads[0][0],
                      "-d ", c10::toString(static_cast<c10::ScalarType>(heads[0][1])), " vs ",
                      heads[r][0], "-d ", c10::toString(static_cast<c10::ScalarType>(heads[r][1])),
                      ")");
        }
      });
  // Every rank passed the same placements and a tensor of the same rank, and checked them.
  const int64_t nd = local.dim();
  std::vector<std::vector<int64_t>> shapes;
  if (nd <= kInline) {
    for (const auto& h : heads) shapes.emplace_back(h.begin() + 2, h.begin() + 2 + nd);
  } else {
    shapes = comm::all_gather_ints(mesh.mesh_group(), local.sizes().vec());
  }
  if (shapes_out) *shapes_out = shapes;
  std::vector<int64_t> global(nd);
  std::vector<ShardTable> tables(nd);
  std::vector<int64_t> coord(mesh.ndim());
  for (int64_t t = 0; t < nd; ++t) {
    std::vector<int64_t> dims;
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].normalized(nd).is_shard(t)) dims.push_back(static_cast<int64_t>(m));
    int64_t entries = 1;
    for (auto m : dims) entries *= mesh.size(m);
    std::vector<int64_t> table(entries, -1), owner(entries, -1);
    for (size_t f = 0; f < shapes.size(); ++f) {
      int64_t rem = static_cast<int64_t>(f);
      for (int64_t m = mesh.ndim() - 1; m >= 0; --m) {
        coord[m] = rem % mesh.size(m);
        rem /= mesh.size(m);
      }
      const int64_t idx = detail::table_index(mesh, dims, coord);
      if (table[idx] < 0) {
        table[idx] = shapes[f][t];
        owner[idx] = static_cast<int64_t>(f);
        continue;
      }
      TORCH_CHECK(table[idx] == shapes[f][t], "tessera: from_local(", to_string(placements),
                  "): ranks ", mesh.ranks()[owner[idx]], " and ", mesh.ranks()[f],
                  " hold the same ", dims.empty() ? "replicated extent" : "shard",
                  " of tensor dim ", t, " but their local shapes ", shape_str(shapes[owner[idx]]),
                  " and ", shape_str(shapes[f]), " differ there");
    }
    global[t] = dims.empty() ? table[0] : 0;
    if (!dims.empty()) {
      for (auto s : table) global[t] += s;
      tables[t] = std::move(table);
    }
  }
  return std::make_shared<DTensorSpec>(mesh, placements, global, local.scalar_type(), tables);
}

// The global shape implied by `local` under the chunk/given layout at this rank (no comm).
SpecPtr declared_spec(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                      const ShardSizes& sizes) {
  const int64_t nd = local.dim();
  std::vector<int64_t> global = local.sizes().vec();
  auto tables = target_tables("from_local", nullptr, mesh, placements, global, sizes);
  for (int64_t t = 0; t < nd; ++t) {
    int64_t shards = 1;
    bool sharded = false;
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].normalized(nd).is_shard(t)) shards *= mesh.size(m), sharded = true;
    if (!sharded) continue;
    if (!tables[t].empty()) {
      // The given sizes define the global size here: a negative one must be named as such.
      for (auto s : tables[t])
        TORCH_CHECK(s >= 0, "tessera: from_local(", to_string(placements),
                    "): negative shard size in ", shape_str(tables[t]), " along tensor dim ", t);
      global[t] = 0;
      for (auto s : tables[t]) global[t] += s;
    } else {
      // Chunk layout from one shard: torch's rule, local * shards (exact for even shards;
      // pass ShardSizes::Infer() or run_check for anything else).
      global[t] = local.size(t) * shards;
    }
  }
  return make_spec("from_local", mesh, placements, global, local.scalar_type(), tables);
}

}  // namespace

at::Tensor from_local(const at::Tensor& given, const DeviceMesh& mesh, const Placements& placements,
                      const FromLocalOptions& options) {
  const at::Tensor local = on_mesh_device(given, mesh);
  auto checks = [&] {
    TORCH_CHECK(local.defined(), "tessera: from_local needs a defined local tensor");
    TORCH_CHECK(!is_dtensor(local), "tessera: from_local: the tensor is already distributed");
    check_placement_count("from_local", mesh, placements);
    check_placements("from_local", mesh, placements, local.sizes().vec());
  };
  // Unset sizes: exchanged where a placement shards (never silently wrong on uneven local
  // batches); PyTorch's chunk assumption only when asked for.
  bool shards = false;
  for (const auto& p : placements) shards = shards || p.is_shard();
  const ShardSizes sizes = options.sizes ? *options.sizes
                           : shards      ? ShardSizes::Infer()
                                         : ShardSizes::Chunk();
  const auto mode = sizes.mode();
  if (mode != ShardSizes::Mode::Infer && !options.run_check) {
    checks();  // no communication: each rank decides alone
    return wrap_local(local, declared_spec(local, mesh, placements, sizes));
  }
  // Gather every rank's shape once: infer the layout, or check the declared one against it.
  // Every rank sees the same shapes and arguments, so every rank reaches the same verdict.
  const std::string error = error_of(checks);
  const std::string args = "placements " + to_string(placements) + sizes_str(sizes);
  std::vector<std::vector<int64_t>> shapes;
  SpecPtr inferred = infer_spec(local, mesh, placements, error, args, &shapes);
  if (mode == ShardSizes::Mode::Infer) return wrap_local(local, inferred);
  const auto& global = inferred->sizes();
  auto tables = target_tables("from_local", nullptr, mesh, placements, global, sizes);
  for (int64_t t = 0; t < inferred->ndim(); ++t) {
    auto dims = inferred->mesh_dims_sharding(t);
    if (dims.empty()) continue;
    auto table =
        tables[t].empty() ? chunk_table(mesh, inferred->placements(), t, global[t]) : tables[t];
    int64_t entries = 1;
    for (auto m : dims) entries *= mesh.size(m);
    if (static_cast<int64_t>(table.size()) != entries) continue;  // make_spec says why
    for (size_t f = 0; f < shapes.size(); ++f) {
      const int64_t want =
          table[detail::table_index(mesh, dims, coord_of(mesh, static_cast<int64_t>(f)))];
      if (want == shapes[f][t]) continue;
      auto expected = shapes[f];
      expected[t] = want;
      TORCH_CHECK(false, "tessera: from_local(", to_string(placements), ", run_check): rank ",
                  mesh.ranks()[f], " has local shape ", shape_str(shapes[f]), " but the declared ",
                  mode == ShardSizes::Mode::Chunk ? "chunk" : "given", " layout (shard sizes ",
                  shape_str(table), " along tensor dim ", t, ") gives it ", shape_str(expected),
                  "; pass the true sizes with ShardSizes::Given or use ShardSizes::Infer()");
    }
  }
  auto declared = make_spec("from_local", mesh, placements, global, local.scalar_type(), tables);
  return wrap_local(local, declared);
}

}  // namespace tessera
