#include "support/compare.h"

#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>

#include "tessera/tessera.h"

namespace tessera::test {

namespace {

std::vector<int64_t> unravel(int64_t flat, at::IntArrayRef sizes) {
  std::vector<int64_t> idx(sizes.size(), 0);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    idx[d] = flat % sizes[d];
    flat /= sizes[d];
  }
  return idx;
}

bool exact(at::ScalarType t) { return at::isIntegralType(t, /*includeBool=*/true); }

std::string num(double v, int digits = 6) {
  std::ostringstream s;
  s << std::setprecision(digits) << v;
  return s.str();
}

std::string value_at(const at::Tensor& flat, int64_t i) {
  const at::Tensor v = flat[i];
  if (exact(flat.scalar_type())) return std::to_string(v.item<int64_t>());
  return num(v.item<double>(), std::numeric_limits<double>::max_digits10);
}

std::string ranks_str(const DTensorSpec& spec, const std::vector<int64_t>& index) {
  const auto hs = holders(spec, index);
  std::string s;
  for (size_t i = 0; i < hs.size() && i < 8; ++i)
    s += (i ? ", " : "") + std::to_string(spec.mesh().rank_at(hs[i])) + " at " + shape_str(hs[i]);
  if (hs.size() > 8) s += ", ...";
  return (hs.size() == 1 ? "rank " : "ranks ") + s;
}

// The report for `actual` vs `expected` (same shape and dtype); `offset` shifts indices
// from a shard's to the global tensor's, `layout` names holders.
::testing::AssertionResult compare(const at::Tensor& actual_in, const at::Tensor& expected_in,
                                   const Tolerance& tol, const DTensorSpec* layout,
                                   const std::vector<int64_t>& offset, const std::string& where) {
  const at::Tensor actual = actual_in.detach().cpu(), expected = expected_in.detach().cpu();
  if (actual.sizes() != expected.sizes())
    return ::testing::AssertionFailure() << where << "shapes differ: actual " << actual.sizes()
                                         << ", expected " << expected.sizes();
  if (actual.scalar_type() != expected.scalar_type())
    return ::testing::AssertionFailure()
           << where << "dtypes differ: actual " << actual.scalar_type() << ", expected "
           << expected.scalar_type();
  const bool is_exact = exact(actual.scalar_type());
  const at::Tensor ok = is_exact ? at::eq(actual, expected)
                                 : at::isclose(actual, expected, tol.rtol, tol.atol, tol.equal_nan);
  const at::Tensor bad = at::logical_not(ok).reshape(-1).nonzero().reshape(-1);
  if (bad.numel() == 0) return ::testing::AssertionSuccess();

  const at::Tensor a = actual.reshape(-1), e = expected.reshape(-1);
  auto global = [&](int64_t flat) {
    auto idx = unravel(flat, actual.sizes());
    for (size_t d = 0; d < offset.size() && d < idx.size(); ++d) idx[d] += offset[d];
    return idx;
  };
  const int64_t first = bad[0].item<int64_t>();
  auto r = ::testing::AssertionFailure();
  r << where << "first mismatch at " << shape_str(global(first)) << ": actual "
    << value_at(a, first) << ", expected " << value_at(e, first) << "; " << bad.numel() << " of "
    << actual.numel() << " elements differ";
  if (!is_exact) {
    const at::Tensor diff =
        (a.index_select(0, bad).to(at::kDouble) - e.index_select(0, bad).to(at::kDouble)).abs();
    const int64_t worst = bad[diff.argmax().item<int64_t>()].item<int64_t>();
    r << ", largest |diff| " << num(std::abs(a[worst].item<double>() - e[worst].item<double>()))
      << " at " << shape_str(global(worst)) << " (tolerance " << num(tol.atol) << " + "
      << num(tol.rtol) << " * |expected|)";
  }
  if (layout)
    r << "; " << shape_str(global(first)) << " is held by " << ranks_str(*layout, global(first))
      << " under " << layout->str();
  return r;
}

}  // namespace

at::Tensor block_at(const at::Tensor& full, const DTensorSpec& spec,
                    const std::vector<int64_t>& coord) {
  at::Tensor b = full;
  for (int64_t t = 0; t < spec.ndim(); ++t) {
    std::vector<at::Tensor> parts;
    for (auto [lo, hi] : spec.local_ranges(t, coord)) parts.push_back(b.narrow(t, lo, hi - lo));
    b = parts.size() == 1 ? parts[0] : at::cat(parts, t);
  }
  return b;
}

std::vector<std::vector<int64_t>> holders(const DTensorSpec& spec,
                                          const std::vector<int64_t>& index) {
  const auto& shape = spec.mesh().shape();
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> coord(shape.size(), 0);
  for (int64_t n = spec.mesh().size(); n-- > 0;) {
    bool inside = static_cast<int64_t>(index.size()) == spec.ndim();
    for (int64_t t = 0; inside && t < spec.ndim(); ++t) {
      bool in_range = false;
      for (auto [lo, hi] : spec.local_ranges(t, coord))
        in_range = in_range || (index[t] >= lo && index[t] < hi);
      inside = in_range;
    }
    if (inside) out.push_back(coord);
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {  // row-major next
      if (++coord[d] < shape[d]) break;
      coord[d] = 0;
    }
  }
  return out;
}

::testing::AssertionResult matches(const at::Tensor& actual, const at::Tensor& expected,
                                   const Tolerance& tol, const DTensorSpec* layout) {
  return compare(actual, expected, tol, layout, {}, "");
}

::testing::AssertionResult full_matches(const at::Tensor& dt, const at::Tensor& expected,
                                        const Tolerance& tol) {
  if (!is_dtensor(dt)) return ::testing::AssertionFailure() << "the result is not distributed";
  return compare(full_tensor(dt), expected, tol, &spec(dt), {}, "");
}

::testing::AssertionResult shard_matches(const at::Tensor& dt, const at::Tensor& full,
                                         const Tolerance& tol) {
  if (!is_dtensor(dt)) return ::testing::AssertionFailure() << "the result is not distributed";
  const DTensorSpec& s = spec(dt);
  const auto& coord = s.mesh().coordinate();
  const at::Tensor block = block_at(full, s, coord);
  // (index reports in global positions where the shard is one range)
  const auto off = s.has_head_tail() ? std::vector<int64_t>{} : s.local_offsets();
  return compare(to_local(dt), block, tol, nullptr, off,
                 "shard of rank " + std::to_string(s.mesh().rank_at(coord)) + " at " +
                     shape_str(coord) + " under " + s.str() + ": ");
}

}  // namespace tessera::test
