#pragma once
// Creating, converting and inspecting distributed tensors. Names follow
// torch.distributed.tensor (distribute_tensor, DTensor.from_local, to_local, full_tensor,
// redistribute) plus ShardTensor's scatter_tensor. Everything here is differentiable.
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/placement/spec.h"

namespace tessera {

// How from_local / scatter_tensor learn every rank's shard sizes.
class ShardSizes {
 public:
  enum class Mode : uint8_t { Chunk, Infer, Given };
  // torch.chunk layout; no communication.
  static ShardSizes Chunk() { return ShardSizes(Mode::Chunk, {}); }
  // One all-gather of local shapes over the mesh (from_local only); arbitrary uneven sizes.
  static ShardSizes Infer() { return ShardSizes(Mode::Infer, {}); }
  // tables[t] = every shard's size along tensor dim t (see NOTE: [Shard tables]); tensor dims
  // left empty get the chunk layout.
  static ShardSizes Given(std::vector<ShardTable> tables) {
    return ShardSizes(Mode::Given, std::move(tables));
  }
  // Convenience for one sharded tensor dim: every shard's size along `dim`.
  static ShardSizes Given(int64_t dim, ShardTable sizes);

  Mode mode() const { return mode_; }
  const std::vector<ShardTable>& tables() const { return tables_; }

 private:
  ShardSizes(Mode m, std::vector<ShardTable> t) : mode_(m), tables_(std::move(t)) {}
  Mode mode_;
  std::vector<ShardTable> tables_;
};

// Splits `tensor` (the full global value) over the mesh. With src_data_rank (a global rank),
// that rank's data is scattered and other ranks' values are ignored (shapes must match);
// with std::nullopt each rank slices its own copy, without communication.
// Backward: the full gradient (to src_data_rank only, zeros elsewhere, when given).
at::Tensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh,
                             const Placements& placements, std::optional<int> src_data_rank = 0,
                             const ShardSizes& sizes = ShardSizes::Chunk());

// ShardTensor's entry point: only rank `src` holds the data (others may pass an undefined
// tensor); shape and dtype are broadcast first. Uneven sizes via ShardSizes::Given.
at::Tensor scatter_tensor(const at::Tensor& full_on_src, int src, const DeviceMesh& mesh,
                          const Placements& placements,
                          const ShardSizes& sizes = ShardSizes::Chunk());

struct FromLocalOptions {
  // How the shard sizes are known. Unset (the default): when a placement shards a tensor dim,
  // every rank's local shape is exchanged once (one small all-gather over the mesh), so
  // uneven local batches (3 rows here, 2 there) give the true global shape on every rank;
  // Replicate / Partial only: nothing is exchanged. ShardSizes::Chunk() is PyTorch's
  // assumption (equal chunks, global = local x ranks, nothing exchanged: for a loop known to
  // be even), Given(...) states the sizes, Infer() always exchanges.
  std::optional<ShardSizes> sizes;
  // Check across ranks that shapes and dtypes fit together (one small all-gather); errors are
  // raised on every rank. Infer always checks.
  bool run_check = false;
};
at::Tensor from_local(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                      const FromLocalOptions& options = {});

// The local shard (shares storage). Backward wraps the local gradient with grad_placements
// (default: the tensor's placements with Partial turned into Replicate).
at::Tensor to_local(const at::Tensor& dtensor,
                    const std::optional<Placements>& grad_placements = std::nullopt);

// The whole global value on every rank (redistribute to Replicate, then to_local).
at::Tensor full_tensor(const at::Tensor& dtensor);

// Moves to new placements with the fewest bytes. Tensor dims whose sharding mesh dims do not
// change keep their shard sizes; newly sharded dims use `sizes` (chunk by default).
// Partial targets are for internal use (from_local is the way to declare partial values).
// Collective on a mesh of 2+ ranks: one small exchange checks that every rank asks for the
// same target from the same layout, so invalid or rank-dependent arguments raise the same
// error everywhere instead of leaving ranks in different collectives.
at::Tensor redistribute(const at::Tensor& dtensor, const Placements& placements,
                        const ShardSizes& sizes = ShardSizes::Chunk());
// Same, to a complete target spec (no such exchange: every rank must pass the same spec).
at::Tensor redistribute(const at::Tensor& dtensor, const SpecPtr& target);
// Onto another mesh with the same root: a slice of the tensor's mesh (mesh -> mesh["tp"]),
// the root itself, or a larger slice. Dims both meshes have take their target placement on
// the tensor's mesh first (an ordinary redistribute); dims the target drops become Replicate
// there (every group then holds the same value, as a tensor on a slice does); dims the target
// adds take the given Replicate() (the tensor is the same in every group along them) or
// Shard(d) (each group's tensor is its own block along d: per-group batches as one batch split
// over "dp"; shapes exchanged). Then each rank keeps its block. Differentiable.
at::Tensor redistribute(const at::Tensor& dtensor, const DeviceMesh& mesh,
                        const Placements& placements);

// Inspection.
const DTensorSpec& spec(const at::Tensor& dtensor);
const Placements& placements(const at::Tensor& dtensor);
const DeviceMesh& device_mesh(const at::Tensor& dtensor);
// Readable summary: placements, mesh, global and local shapes, shard sizes, local values.
std::string to_string(const at::Tensor& tensor);

}  // namespace tessera
