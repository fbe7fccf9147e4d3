#pragma once
// Redistribute: move a distributed tensor from one layout to another with the fewest bytes.
//
// The planner (planner.cpp) turns (source spec, target spec) into a list of named primitive
// steps, each acting on one mesh dim; plans are cached per (source, target). The executor
// runs them on the local shard. See NOTE: [Redistribute planning] in planner.cpp.
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/placement/spec.h"

namespace tessera {

// The primitives. Bytes are per rank, n = size of the mesh dim's group, B = local bytes.
enum class StepKind : uint8_t {
  AllGather,      // S(t) -> R        all-gather(-v) along t: sends (n-1)*B (HT(t): then reorder)
  LocalSlice,     // R -> S(t)        no communication
  AllReduce,      // P -> R           all-reduce: 2*(n-1)/n*B
  ReduceScatter,  // P -> S(t)        reduce-scatter(-v): sends B - own piece
  AllToAll,       // S(t) -> S(u)     one all-to-all(-v), u may equal t (new boundaries)
  ToPartial,      // R -> P(op)       no communication (internal/backward use only)
  Relayout,       // S(t) <-> HT(t)   each row once, point to point to its new owner
};
const char* to_string(StepKind k);

struct RedistributeStep {
  StepKind kind;
  int64_t mesh_dim;
  SpecPtr before;
  SpecPtr after;
};

struct RedistributePlan {
  std::vector<RedistributeStep> steps;
  std::string str() const;  // e.g. "mesh dim 1: S(0)->R all_gather; mesh dim 0: ..."
};

// The cached plan from `from` to `to` (same mesh, shape and dtype).
std::shared_ptr<const RedistributePlan> plan_redistribute(const SpecPtr& from, const SpecPtr& to);

// Modelled bytes one rank sends to go from `from` to `to` (average shard sizes, so every
// rank computes the same number: strategy choices must agree across ranks).
double redistribute_cost(const SpecPtr& from, const SpecPtr& to);

// Runs a plan on a local shard; no autograd. Used by the sharding-propagation fallback.
at::Tensor redistribute_local(const at::Tensor& local, const SpecPtr& from, const SpecPtr& to);

// Set TESSERA_DEBUG_REDISTRIBUTE=1 (or call this) to print every plan when first built.
void set_redistribute_debug(bool on);

}  // namespace tessera
