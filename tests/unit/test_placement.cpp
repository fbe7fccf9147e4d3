// Placements: printing, equality and dim normalisation, against the spellings and rules the
// header documents. (The library prints placements but has no parser.)
#include "helpers.h"

using namespace tessera;
using tessera::test::Rng;

namespace {

// A placement and the fields that define it.
struct Drawn {
  Placement p;
  int kind;  // 0 Shard, 1 Replicate, 2 Partial
  int64_t dim;
  PartialOp op;
};

Drawn draw(Rng& rng) {
  static const PartialOp ops[] = {PartialOp::Sum, PartialOp::Avg, PartialOp::Max, PartialOp::Min};
  const int kind = static_cast<int>(rng.uniform(0, 2));
  const int64_t dim = rng.uniform(-4, 4);
  const PartialOp op = ops[rng.uniform(0, 3)];
  return {kind == 0 ? Shard(dim) : kind == 1 ? Replicate() : Partial(op), kind, dim, op};
}

std::string spelled(const Drawn& d) {
  static const char* ops[] = {"sum", "avg", "max", "min"};
  if (d.kind == 0) return "S(" + std::to_string(d.dim) + ")";
  if (d.kind == 1) return "R";
  return std::string("P(") + ops[static_cast<int>(d.op)] + ")";
}

}  // namespace

TEST(Placement, PrintsShortSpellings) {
  tessera::test::Sweep sweep;
  sweep.cases(300).run([](Rng& rng, int64_t) {
    Placements ps;
    std::string expected = "(";
    const int64_t n = rng.uniform(0, 4);
    for (int64_t i = 0; i < n; ++i) {
      const Drawn d = draw(rng);
      EXPECT_EQ(d.p.str(), spelled(d));
      ps.push_back(d.p);
      expected += (i ? ", " : "") + spelled(d);
    }
    EXPECT_EQ(to_string(ps), expected + ")");
  });
}

TEST(Placement, EqualityComparesTheDefiningFields) {
  tessera::test::Sweep sweep;
  sweep.cases(500).run([](Rng& rng, int64_t) {
    const Drawn a = draw(rng), b = draw(rng);
    const bool same =
        a.kind == b.kind && (a.kind != 0 || a.dim == b.dim) && (a.kind != 2 || a.op == b.op);
    EXPECT_EQ(a.p == b.p, same) << spelled(a) << " vs " << spelled(b);
    EXPECT_EQ(a.p != b.p, !same) << spelled(a) << " vs " << spelled(b);
  });
}

// Shard(d) on an n-dim tensor: d in [-n, n) counts from the back when negative; anything
// else (and any Shard of a 0-dim tensor) is an error. Other placements are unchanged.
TEST(Placement, NormalizedWrapsNegativeDims) {
  tessera::test::Sweep sweep;
  sweep.cases(500).run([](Rng& rng, int64_t) {
    const Drawn d = draw(rng);
    const int64_t ndim = rng.uniform(0, 4);
    if (d.kind != 0) {
      EXPECT_EQ(d.p.normalized(ndim), d.p);
      return;
    }
    if (ndim > 0 && d.dim >= -ndim && d.dim < ndim) {
      EXPECT_EQ(d.p.normalized(ndim), Shard((d.dim + ndim) % ndim))
          << spelled(d) << " ndim " << ndim;
    } else {
      EXPECT_THROW(d.p.normalized(ndim), c10::Error) << spelled(d) << " ndim " << ndim;
    }
  });
}
