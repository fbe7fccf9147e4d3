#pragma once
// Shared by the programs that compile and run the docs' snippets (tests/docs/*.cpp): each
// snippet's result is compared with the same computation on one device, and the program
// exits non-zero on any mismatch.
#include <cmath>
#include <cstdio>
#include <string>

#include <tessera/tessera.h>

namespace doc {

inline int failures = 0;

// The whole value of a plain or distributed tensor, detached, in double precision.
inline at::Tensor whole(const at::Tensor& t) {
  const auto d = t.detach();
  return (tessera::is_dtensor(d) ? tessera::full_tensor(d) : d).to(at::kDouble);
}

// `got` (plain or distributed) against `want` (computed on one device).
inline void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& want,
                         double rtol = 1e-6, double atol = 1e-9) {
  if (!got.defined() || !want.defined()) {
    ++failures;
    std::fprintf(stderr, "rank %d: %s: %s tensor is undefined\n", tessera::get_rank(), what.c_str(),
                 got.defined() ? "the one-device" : "the distributed");
    return;
  }
  const auto g = whole(got), w = whole(want);
  if (g.sizes() != w.sizes()) {
    ++failures;
    std::fprintf(stderr, "rank %d: %s: shape %s, one device %s\n", tessera::get_rank(),
                 what.c_str(), c10::str(g.sizes()).c_str(), c10::str(w.sizes()).c_str());
  } else if (!at::allclose(g, w, rtol, atol)) {
    ++failures;
    std::fprintf(stderr, "rank %d: %s differs from one device by up to %g\n", tessera::get_rank(),
                 what.c_str(), (g - w).abs().max().item<double>());
  }
}

// Every parameter's value (or gradient) of `model` against the one-device `reference`,
// matched by name.
inline void expect_same_parameters(const std::string& what, const torch::nn::Module& model,
                                   const torch::nn::Module& reference, bool gradients,
                                   double rtol = 1e-6, double atol = 1e-9) {
  const auto want = reference.named_parameters();
  int64_t compared = 0;
  for (const auto& p : model.named_parameters()) {
    const at::Tensor* ref = want.find(p.key());
    if (ref == nullptr) {
      ++failures;
      std::fprintf(stderr, "rank %d: %s: no parameter %s on one device\n", tessera::get_rank(),
                   what.c_str(), p.key().c_str());
      continue;
    }
    expect_close(what + " " + p.key() + (gradients ? " grad" : ""),
                 gradients ? p.value().grad() : p.value(), gradients ? ref->grad() : *ref, rtol,
                 atol);
    ++compared;
  }
  if (compared != static_cast<int64_t>(want.size())) {
    ++failures;
    std::fprintf(stderr, "rank %d: %s: compared %lld of %zu parameters\n", tessera::get_rank(),
                 what.c_str(), static_cast<long long>(compared), want.size());
  }
}

// main's return value.
inline int finish(const char* name) {
  if (failures > 0) {
    std::fprintf(stderr, "rank %d: %s: %d mismatch(es) against one device\n", tessera::get_rank(),
                 name, failures);
    return 1;
  }
  std::printf("rank %d: %s: matches one device\n", tessera::get_rank(), name);
  return 0;
}

}  // namespace doc
