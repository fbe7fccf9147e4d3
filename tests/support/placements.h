#pragma once
// Every combination of per-mesh-dim placements, for tests that sweep layouts.
#include <cstdint>
#include <vector>

#include "tessera/placement/placement.h"

namespace tessera::test {

// One entry per mesh dim, each from `choices` (choices^mesh_ndim combinations).
inline std::vector<Placements> placement_combinations(int64_t mesh_ndim,
                                                      const std::vector<Placement>& choices) {
  std::vector<Placements> out = {{}};
  for (int64_t d = 0; d < mesh_ndim; ++d) {
    std::vector<Placements> next;
    for (const auto& p : out)
      for (const auto& c : choices) {
        auto q = p;
        q.push_back(c);
        next.push_back(q);
      }
    out = next;
  }
  return out;
}

}  // namespace tessera::test
