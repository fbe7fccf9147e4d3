#pragma once
// Comparing a result with its one-device reference. On failure the message names the first
// differing global index, both values, how many elements differ, the largest difference
// and, given the distributed result's layout, the ranks whose shards hold that index.
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include "tessera/placement/spec.h"

namespace tessera::test {

// Elementwise |actual - expected| <= atol + rtol * |expected| (at::isclose, as at::allclose);
// integers and bools compare exactly.
struct Tolerance {
  double rtol = 1e-5, atol = 1e-6;
  bool equal_nan = false;
};

// Plain tensors: shapes, dtypes and values must agree. `layout` (the spec the actual values
// were distributed with, if any) only adds the owning ranks to the report.
::testing::AssertionResult matches(const at::Tensor& actual, const at::Tensor& expected,
                                   const Tolerance& tol = {}, const DTensorSpec* layout = nullptr);

// The global value of `dt` (distributed; collective: every rank calls) against `expected`.
::testing::AssertionResult full_matches(const at::Tensor& dt, const at::Tensor& expected,
                                        const Tolerance& tol = {});

// This rank's shard of `dt` against its block of the global reference `full` (indices are
// reported globally). Not collective.
::testing::AssertionResult shard_matches(const at::Tensor& dt, const at::Tensor& full,
                                         const Tolerance& tol = {});

// Mesh coordinates whose shard under `spec` holds global index `index` (every rank along a
// Replicate or Partial mesh dim holds it).
// The block of `full` held at `coord` under `spec`, in the shard's local order (a head-tail
// dim's two ranges one after the other); partial dims ignored.
at::Tensor block_at(const at::Tensor& full, const DTensorSpec& spec,
                    const std::vector<int64_t>& coord);

std::vector<std::vector<int64_t>> holders(const DTensorSpec& spec,
                                          const std::vector<int64_t>& index);

}  // namespace tessera::test
