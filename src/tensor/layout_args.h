#pragma once
// Checking user arguments into specs, and agreeing on them across the mesh (layout_args.cpp).
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "tessera/tensor/api.h"

namespace tessera::detail {

// Target tables: explicit ones win; tensor dims sharded by the same mesh dims keep `src`'s.
std::vector<ShardTable> target_tables(const char* what, const DTensorSpec* src,
                                      const DeviceMesh& mesh, const Placements& p,
                                      const std::vector<int64_t>& sizes, const ShardSizes& given);
// The spec, with errors naming the public function `what` and its arguments.
SpecPtr make_spec(const char* what, const DeviceMesh& mesh, const Placements& placements,
                  const std::vector<int64_t>& sizes, c10::ScalarType dtype,
                  std::vector<ShardTable> tables = {});
void check_placement_count(const char* what, const DeviceMesh& mesh, const Placements& placements);
void check_placements(const char* what, const DeviceMesh& mesh, const Placements& placements,
                      const std::vector<int64_t>& shape);

// comm::agree over the mesh; `check` sees the gathered ints once the arguments agree.
using IntsCheck = std::function<void(const std::vector<std::vector<int64_t>>&)>;
std::vector<std::vector<int64_t>> agree(const char* what, const DeviceMesh& mesh,
                                        const std::string& error, const std::string& args,
                                        const std::vector<int64_t>& ints,
                                        const IntsCheck& check = {});

// ", sizes ..." for messages and digests ("" for the chunk layout).
std::string sizes_str(const ShardSizes& sizes);

// The message of the c10::Error `checks` raises, or "" (checks run without throwing, so
// every rank can take part in the agreement first).
template <class F>
std::string error_of(F&& checks) {
  try {
    checks();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return {};
}

// The mesh coordinate of the rank at row-major position `flat`.
std::vector<int64_t> coord_of(const DeviceMesh& mesh, int64_t flat);
// As PyTorch: a tensor handed to a mesh moves to the mesh's device (differentiably).
at::Tensor on_mesh_device(const at::Tensor& t, const DeviceMesh& mesh);
void reject_partial(const Placements& p, const char* what);

}  // namespace tessera::detail
