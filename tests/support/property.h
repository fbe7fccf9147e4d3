#pragma once
// Seeded randomized ("property") tests with one seed and one case index for every suite.
//
//   TESSERA_SEED=<n>   the seed of every randomized test (default kDefaultSeed)
//   TESSERA_CASE=<c>   run only case c of each randomized test (use with --gtest_filter)
//
// Case c of a test draws from its own generator, derived from (seed, test name, c), so any
// case replays alone; a failing case prints the command that does so. Draws are written out
// here (no std::*_distribution, whose results differ between standard libraries).
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace tessera::test {

// splitmix64: a 64-bit state advanced by a constant and finalised. Portable and
// deterministic; good enough for generating test cases.
class Rng {
 public:
  explicit Rng(uint64_t state) : state_(state) {}

  uint64_t bits();
  // Uniform in [lo, hi] (inclusive), without modulo bias.
  int64_t uniform(int64_t lo, int64_t hi);
  size_t index(size_t n) { return static_cast<size_t>(uniform(0, static_cast<int64_t>(n) - 1)); }
  double real();  // uniform in [0, 1), 53 random bits
  bool coin(double p = 0.5) { return real() < p; }

  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[index(v.size())];
  }
  template <class T>
  void shuffle(std::vector<T>& v) {  // Fisher-Yates
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[index(i)]);
  }

 private:
  uint64_t state_;
};

// splitmix64's finaliser over (a, b): derives independent streams from structured keys.
uint64_t mix(uint64_t a, uint64_t b);

constexpr uint64_t kDefaultSeed = 20240611;
uint64_t property_seed();                // TESSERA_SEED, else kDefaultSeed
std::optional<int64_t> property_case();  // TESSERA_CASE, if set

// The cases of the current gtest test. Construct it on the test's own thread (it reads the
// test's name); it may then be shared, read-only, with rank threads. Case indices are unique
// within the test: a test with several sweeps (one per mesh, say) numbers them on.
class Sweep {
 public:
  Sweep();

  // A block of `count` cases numbered after the previous block.
  class Cases;
  Cases cases(int64_t count);

  uint64_t seed() const { return seed_; }
  // Whether case c runs (every case, or only TESSERA_CASE).
  bool selected(int64_t c) const { return !only_ || *only_ == c; }
  Rng rng(int64_t c) const { return Rng(mix(stream_, static_cast<uint64_t>(c))); }
  // "TESSERA_SEED=7 TESSERA_CASE=41 /path/tessera_tests --gtest_filter=Suite.Name"
  std::string replay(int64_t c) const;
  // "seed 7 case 41": to start a case's description with.
  std::string label(int64_t c) const;

 private:
  uint64_t seed_, stream_;
  std::optional<int64_t> only_;
  std::string test_name_;
  int64_t next_ = 0;
};

class Sweep::Cases {
 public:
  Cases(const Sweep* sweep, int64_t first, int64_t count)
      : sweep_(sweep), first_(first), count_(count) {}

  int64_t first() const { return first_; }
  int64_t count() const { return count_; }
  // How many of the block's cases run (all, or at most one under TESSERA_CASE); callers
  // can skip starting ranks when none does.
  int64_t selected() const;
  bool any() const { return selected() > 0; }

  // body(rng, c) for every selected case c, until the test has a fatal failure. Assertions
  // inside carry the replay command; an exception leaves with it appended.
  template <class Body>
  void run(Body&& body) const {
    for (int64_t c = first_; c < first_ + count_; ++c) {
      if (!sweep_->selected(c)) continue;
      if (::testing::Test::HasFatalFailure()) return;
      const std::string replay = "replay: " + sweep_->replay(c);
      SCOPED_TRACE(replay);
      Rng rng = sweep_->rng(c);
      try {
        body(rng, c);
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string(e.what()) + "\n" + replay);
      }
    }
  }

 private:
  const Sweep* sweep_;
  int64_t first_, count_;
};

}  // namespace tessera::test
