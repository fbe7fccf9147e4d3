// distribute_tensor and scatter_tensor: a full tensor cut into its shards, from every rank or
// from one source rank.
#include <ATen/ATen.h>

#include "layout_args.h"
#include "layout_autograd.h"
#include "tessera/comm/collectives.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

using namespace detail;

namespace {

struct SourceMeta {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
  bool requires_grad;
};

// The source rank's shape, dtype and requires_grad, agreed by every rank (two small
// all-gathers). With every_rank_has_data, every rank's tensor must match the source's; any
// mismatch raises the same error on every rank.
// `error` and `args`: this rank's local checks and arguments (NOTE: [Agreeing on arguments]).
SourceMeta agree_with_source(const char* what, const DeviceMesh& mesh, const at::Tensor& t,
                             int src_flat, bool every_rank_has_data, const std::string& error,
                             const std::string& args) {
  const bool def = t.defined();
  const int src_rank = src_flat >= 0 ? mesh.ranks()[src_flat] : -1;
  auto heads = agree(
      what, mesh, error, args,
      {def, def ? t.dim() : -1, def ? static_cast<int64_t>(t.scalar_type()) : -1,
       def && t.requires_grad()},
      [&](const std::vector<std::vector<int64_t>>& heads) {
        const auto& src = heads[src_flat];
        TORCH_CHECK(src[0] == 1, "tessera: ", what, ": the source rank ", src_rank,
                    " passed an undefined tensor");
        for (size_t r = 0; every_rank_has_data && r < heads.size(); ++r) {
          TORCH_CHECK(heads[r][0] == 1 && heads[r][1] == src[1] && heads[r][2] == src[2],
                      "tessera: ", what, ": rank ", mesh.ranks()[r], " passed ",
                      heads[r][0] ? std::to_string(heads[r][1]) + "-d " +
                                        c10::toString(static_cast<c10::ScalarType>(heads[r][2]))
                                  : std::string("an undefined tensor"),
                      " but the source rank ", src_rank, " has a ", src[1], "-d ",
                      c10::toString(static_cast<c10::ScalarType>(src[2])),
                      " tensor; every rank must pass a tensor of the global shape");
        }
      });
  const auto& src = heads[src_flat];
  const auto dtype = static_cast<c10::ScalarType>(src[2]);
  auto pg = mesh.mesh_group();
  std::vector<int64_t> mine(src[1], -1);
  if (def && t.dim() == src[1]) mine = t.sizes().vec();
  auto shapes = comm::all_gather_ints(pg, mine);
  for (size_t r = 0; every_rank_has_data && r < shapes.size(); ++r) {
    TORCH_CHECK(shapes[r] == shapes[src_flat], "tessera: ", what, ": rank ", mesh.ranks()[r],
                " passed shape ", shape_str(shapes[r]), " but the source rank ", src_rank, " has ",
                shape_str(shapes[src_flat]), "; every rank must pass the global shape");
  }
  return {shapes[src_flat], dtype, src[3] == 1};
}

// Each rank's block of the global tensor, cut out by the spec.
at::Tensor block_of(const at::Tensor& full, const DTensorSpec& s,
                    const std::vector<int64_t>& coord) {
  at::Tensor b = full;
  for (int64_t t = 0; t < s.ndim(); ++t) {
    const auto ranges = s.local_ranges(t, coord);  // two on a head-tail dim
    if (ranges.size() == 1 && ranges[0].second - ranges[0].first == full.size(t)) continue;
    std::vector<at::Tensor> parts;
    for (auto [lo, hi] : ranges) parts.push_back(b.narrow(t, lo, hi - lo));
    b = parts.size() == 1 ? parts[0] : at::cat(parts, t);
  }
  return b;
}

int src_index(const DeviceMesh& mesh, int src, const char* what) {
  const auto& r = mesh.ranks();
  auto it = std::find(r.begin(), r.end(), src);
  TORCH_CHECK(it != r.end(), "tessera: ", what, ": source rank ", src, " is not in ", mesh.str());
  return static_cast<int>(it - r.begin());
}

// Rank `src` sends every rank its block in one all-to-all-v (nothing else moves).
// Every rank gets a backward node when the source's tensor requires grad: the backward
// gathers the gradient, a collective every rank must join.
at::Tensor scatter_impl(const at::Tensor& full, int src_flat, const SpecPtr& spec,
                        bool requires_grad) {
  const auto& mesh = spec->mesh();
  auto pg = mesh.mesh_group();
  const int64_t n = mesh.size();
  const bool is_src = comm::group_rank(pg) == src_flat;
  auto opts =
      at::TensorOptions().dtype(spec->dtype()).device(is_src ? full.device() : mesh.device());
  std::vector<at::Tensor> send;
  std::vector<std::vector<int64_t>> recv_shapes;
  for (int64_t f = 0; f < n; ++f) {
    send.push_back(is_src ? block_of(full, *spec, coord_of(mesh, f)).contiguous()
                          : at::empty({0}, opts));
    recv_shapes.push_back(f == src_flat ? spec->local_sizes() : std::vector<int64_t>{0});
  }
  auto blocks = comm::all_to_all_blocks(pg, send, recv_shapes, opts, comm::CollectiveKind::Scatter);
  at::Tensor out = make_dtensor(blocks[src_flat], spec);
  if (requires_grad) connect_scatter_backward(out, full, spec, is_src);
  return out;
}

}  // namespace

at::Tensor distribute_tensor(const at::Tensor& given, const DeviceMesh& mesh,
                             const Placements& placements, std::optional<int> src_data_rank,
                             const ShardSizes& sizes) {
  const at::Tensor tensor = on_mesh_device(given, mesh);
  const char* what = "distribute_tensor";
  SpecPtr spec;
  int src_flat = -1;
  auto checks = [&] {
    TORCH_CHECK(tensor.defined(), "tessera: distribute_tensor needs a defined tensor");
    TORCH_CHECK(!is_dtensor(tensor), "tessera: distribute_tensor: the tensor is already ",
                "distributed; use redistribute");
    reject_partial(placements, what);
    check_placements(what, mesh, placements, tensor.sizes().vec());
    TORCH_CHECK(sizes.mode() != ShardSizes::Mode::Infer,
                "tessera: distribute_tensor: ShardSizes::Infer() only applies to from_local");
    auto global = tensor.sizes().vec();
    spec = make_spec(what, mesh, placements, global, tensor.scalar_type(),
                     target_tables(what, nullptr, mesh, placements, global, sizes));
    if (src_data_rank && mesh.contains_this_rank())
      src_flat = src_index(mesh, *src_data_rank, what);
  };
  if (!src_data_rank || !mesh.contains_this_rank()) {
    checks();  // no communication: each rank decides alone
    if (!mesh.contains_this_rank()) return make_dtensor(tensor, spec);
    // Every rank holds the full value: replicated from_local, then local slicing (no comm).
    Placements rep(mesh.ndim(), Replicate());
    auto full = wrap_local(tensor, std::make_shared<DTensorSpec>(mesh, rep, tensor.sizes().vec(),
                                                                 tensor.scalar_type()));
    return redistribute_to(full, spec);
  }
  // A collective: decide together (NOTE: [Agreeing on arguments]).
  const std::string error = error_of(checks);
  const std::string args = "placements " + to_string(placements) + sizes_str(sizes) +
                           ", source rank " + std::to_string(*src_data_rank);
  auto meta = agree_with_source(what, mesh, tensor, src_flat, true, error, args);
  return scatter_impl(tensor, src_flat, spec, meta.requires_grad);
}

at::Tensor scatter_tensor(const at::Tensor& given, int src, const DeviceMesh& mesh,
                          const Placements& placements, const ShardSizes& sizes) {
  const at::Tensor full_on_src = on_mesh_device(given, mesh);
  int src_flat = -1;
  // Checks of the arguments alone; the rest needs the source's shape.
  const std::string error = error_of([&] {
    reject_partial(placements, "scatter_tensor");
    TORCH_CHECK(sizes.mode() != ShardSizes::Mode::Infer,
                "tessera: scatter_tensor: ShardSizes::Infer() only applies to from_local");
    check_placement_count("scatter_tensor", mesh, placements);
    src_flat = src_index(mesh, src, "scatter_tensor");
  });
  const std::string args = "placements " + to_string(placements) + sizes_str(sizes) +
                           ", source rank " + std::to_string(src);
  // Shape and dtype travel from the source (other ranks may pass nothing).
  auto meta = agree_with_source("scatter_tensor", mesh, full_on_src, src_flat, false, error, args);
  // Arguments and the source's shape are the same everywhere now: one verdict.
  check_placements("scatter_tensor", mesh, placements, meta.sizes);
  auto spec =
      make_spec("scatter_tensor", mesh, placements, meta.sizes, meta.dtype,
                target_tables("scatter_tensor", nullptr, mesh, placements, meta.sizes, sizes));
  return scatter_impl(full_on_src, src_flat, spec, meta.requires_grad);
}

}  // namespace tessera
