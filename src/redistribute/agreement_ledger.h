#pragma once
// The mesh's record of the redistribute signatures every rank has agreed on (NOTE: [Agreed
// signatures] in src/tensor/api.cpp). It lives in the mesh's cache slot beside the planner's
// plans, so it dies with the mesh.
#include <cstdint>
#include <functional>
#include <unordered_set>

#include "tessera/mesh/device_mesh.h"

namespace tessera::detail {

struct AgreementLedger {
  std::unordered_set<uint64_t> agreed;  // signatures every rank has passed at an exchange
  uint64_t trusted_digest = 0;          // of the calls taken on trust since the last exchange
  int64_t trusted = 0;                  // how many
};

// Runs `f` on the mesh's ledger, under the mesh's cache mutex.
void with_agreement_ledger(const DeviceMesh& mesh, const std::function<void(AgreementLedger&)>& f);

}  // namespace tessera::detail
