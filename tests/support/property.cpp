#include "support/property.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>

namespace tessera::test {

uint64_t Rng::bits() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

int64_t Rng::uniform(int64_t lo, int64_t hi) {
  if (hi < lo) throw std::invalid_argument("Rng::uniform: empty range");
  const uint64_t n = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;  // 0: all 2^64
  uint64_t r = bits();
  if (n != 0) {
    // Reject the lowest 2^64 mod n values so that every residue is equally likely.
    const uint64_t skip = (0 - n) % n;
    while (r < skip) r = bits();
    r %= n;
  }
  return static_cast<int64_t>(static_cast<uint64_t>(lo) + r);
}

double Rng::real() { return static_cast<double>(bits() >> 11) * 0x1.0p-53; }

uint64_t mix(uint64_t a, uint64_t b) { return Rng(a ^ Rng(b).bits()).bits(); }

namespace {

std::optional<uint64_t> read_env(const char* name) {
  const char* s = std::getenv(name);
  if (!s || !*s) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (errno != 0 || *end != '\0' || *s == '-')
    throw std::invalid_argument(std::string(name) + "=\"" + s + "\" is not a non-negative integer");
  return v;
}

// FNV-1a: a portable string hash (std::hash is implementation-defined).
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ULL;
  return h;
}

std::string executable() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("tessera_tests");
}

}  // namespace

uint64_t property_seed() { return read_env("TESSERA_SEED").value_or(kDefaultSeed); }

std::optional<int64_t> property_case() {
  auto c = read_env("TESSERA_CASE");
  if (!c) return std::nullopt;
  return static_cast<int64_t>(*c);
}

Sweep::Sweep() : seed_(property_seed()), only_(property_case()) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (!info) throw std::logic_error("tessera::test::Sweep must be made inside a test");
  test_name_ = std::string(info->test_suite_name()) + "." + info->name();
  stream_ = mix(seed_, fnv1a(test_name_));
}

Sweep::Cases Sweep::cases(int64_t count) {
  Cases c(this, next_, count);
  next_ += count;
  return c;
}

std::string Sweep::replay(int64_t c) const {
  return "TESSERA_SEED=" + std::to_string(seed_) + " TESSERA_CASE=" + std::to_string(c) + " " +
         executable() + " --gtest_filter=" + test_name_;
}

std::string Sweep::label(int64_t c) const {
  return "seed " + std::to_string(seed_) + " case " + std::to_string(c);
}

int64_t Sweep::Cases::selected() const {
  if (!sweep_->only_) return count_;
  return *sweep_->only_ >= first_ && *sweep_->only_ < first_ + count_ ? 1 : 0;
}

}  // namespace tessera::test
