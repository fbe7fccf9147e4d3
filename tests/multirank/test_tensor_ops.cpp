// Indexing and joining ops (slice/narrow/select, split/chunk/unbind, cat/stack,
// index_select/index_add, gather/scatter, embedding, index) on even, uneven and zero-size
// shard tables, forward and backward, against the same code on one device.
#include <functional>
#include <random>

#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::Operand;

namespace {

void on_meshes(const std::function<void(const DeviceMesh&)>& body) {
  for (int world : {1, 2, 3})
    tessera::testing::run_ranks(world, [&](int) { body(init_device_mesh("cpu", {world})); });
  tessera::testing::run_ranks(4, [&](int) { body(init_device_mesh("cpu", {2, 2})); });
}

// Uneven, the middle pieces empty: [total - total/3, 0, ..., 0, total/3]; or everything on
// the last piece.
ShardTable skewed(int64_t parts, int64_t total, bool last_only = false) {
  ShardTable t(parts, 0);
  t[parts - 1] = last_only ? total : total / 3;
  t[0] += total - t[parts - 1];
  return t;
}

// Replicated, partial, and every tensor dim sharded with chunk, uneven and zero-size tables
// (1-d meshes); nested and mixed shardings on 2-d meshes.
std::vector<Operand> layouts(const DeviceMesh& mesh, const std::vector<int64_t>& shape) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  const Placements r(mesh.ndim(), Replicate());
  std::vector<Operand> out = {{shape, r}};
  auto add = [&](Placements p, int64_t t = -1, ShardTable table = {}) {
    std::vector<ShardTable> tables(nd);
    if (t >= 0) tables[t] = table;
    out.push_back({shape, p, tables});
  };
  if (mesh.ndim() == 1) {
    const int64_t n = mesh.size(0);
    add({Partial()});
    for (int64_t t = 0; t < nd; ++t) {
      add({Shard(t)});
      add({Shard(t)}, t, skewed(n, shape[t]));
      add({Shard(t)}, t, skewed(n, shape[t], true));
    }
  } else {
    add({Shard(0), Shard(nd - 1)});
    add({Shard(nd - 1), Partial()});
    add({Shard(0), Shard(0)}, 0, skewed(4, shape[0]));
    add({Replicate(), Shard(0)}, 0, skewed(2, shape[0], true));
  }
  return out;
}

std::string name(const Operand& o) {
  std::string s = to_string(o.placements);
  for (auto& t : o.tables)
    if (!t.empty()) s += " table " + shape_str(t);
  return s;
}

at::Tensor randint(int64_t hi, at::IntArrayRef shape, uint64_t seed) {
  auto g = tessera::test::generator(seed);
  return at::randint(hi, shape, g, at::kLong);
}

// Distinct positions along `dim` (first `k` of a random permutation per line).
at::Tensor distinct(const std::vector<int64_t>& shape, int64_t dim, int64_t k, uint64_t seed) {
  auto g = tessera::test::generator(seed);
  return at::argsort(at::randn(shape, g), dim).narrow(dim, 0, k).contiguous();
}

// Sums list results back into one, weighting each piece differently.
at::Tensor weighted_cat(const std::vector<at::Tensor>& pieces, int64_t dim) {
  std::vector<at::Tensor> scaled;
  for (size_t i = 0; i < pieces.size(); ++i) scaled.push_back(pieces[i] * double(i + 1));
  return at::cat(scaled, dim);
}

using Cases = std::vector<std::pair<std::string, tessera::test::Fn>>;

// Every case on every layout of one operand of `shape`.
void on_layouts(const DeviceMesh& mesh, const std::vector<int64_t>& shape, const Cases& cases) {
  for (const auto& x : layouts(mesh, shape))
    for (const auto& [op, fn] : cases) differential(mesh, {x}, fn, op + " on " + name(x));
}

}  // namespace

TEST(TensorOps, SliceNarrowSelect) {
  on_meshes([](const DeviceMesh& mesh) {
    on_layouts(mesh, {7, 6}, Cases{
        {"slice(0, 1, 6)", [](auto& v) { return v[0].slice(0, 1, 6) * 2; }},
        {"slice(0, 0, 7, 2)", [](auto& v) { return v[0].slice(0, 0, 7, 2); }},
        {"slice(0, 5, 100, 3)", [](auto& v) { return v[0].slice(0, 5, 100, 3); }},
        {"slice(1, -4, -1)", [](auto& v) { return v[0].slice(1, -4, -1).exp(); }},
        {"full slice", [](auto& v) { return v[0].slice(0) + v[0].slice(1, 0, 6, 1); }},
        {"empty slice", [](auto& v) { return v[0].slice(0, 3, 3); }},
        {"narrow(0, 2, 3)", [](auto& v) { return v[0].narrow(0, 2, 3); }},
        {"narrow(1, -2, 2)", [](auto& v) { return v[0].narrow(1, -2, 2); }},
        {"select(0, 3)", [](auto& v) { return v[0].select(0, 3); }},
        {"select(0, -1)", [](auto& v) { return v[0].select(0, -1).tanh(); }},
        {"select(1, 0)", [](auto& v) { return v[0].select(1, 0) * v[0].select(1, 5); }},
        {"chained", [](auto& v) { return v[0].slice(0, 1).slice(0, 0, 5, 2).select(1, 0); }},
    });
  });
}

// List results are summed back into one result.
TEST(TensorOps, SplitChunkUnbind) {
  on_meshes([](const DeviceMesh& mesh) {
    on_layouts(mesh, {7, 6}, Cases{
        {"split(3, 0)", [](auto& v) { return weighted_cat(v[0].split(3, 0), 0); }},
        {"split(2, 1) reversed", [](auto& v) {
           auto p = v[0].split(2, 1);
           return at::cat({p[2] * 3, p[0], p[1] * 2}, 1);
         }},
        {"split_with_sizes",
         [](auto& v) { return weighted_cat(v[0].split_with_sizes({2, 0, 5}, 0), 0); }},
        {"unsafe_split", [](auto& v) { return weighted_cat(at::unsafe_split(v[0], 4, 1), 1); }},
        {"chunk(3, 1)", [](auto& v) { return weighted_cat(v[0].chunk(3, 1), 1); }},
        {"chunk(4, 0) sum", [](auto& v) {
           auto p = v[0].chunk(4, 0);
           return p[0] + p[1] * 2 + p[2].exp();
         }},
        {"unbind(0)", [](auto& v) {
           auto p = v[0].unbind(0);
           return p[0] + p[3] * 2 + p[6] * p[1];
         }},
        {"unbind(1)", [](auto& v) { return at::stack(v[0].unbind(1), 0) * 2; }},
    });
  });
}

// Two or three inputs of mixed layouts (and a plain tensor), joined along each dim.
TEST(TensorOps, CatStackMixedLayouts) {
  const std::vector<std::tuple<std::string, size_t, tessera::test::Fn>> cases = {
      {"cat 0", 2, [](auto& v) { return at::cat({v[0], v[1]}, 0); }},
      {"cat 1", 3, [](auto& v) { return at::cat({v[0], v[1] * 2, v[2]}, 1); }},
      {"cat with a plain tensor", 2,
       [](auto& v) { return at::cat({v[0], at::ones({2, 4}), v[1].slice(0, 1, 3)}, 0); }},
      {"stack 0", 3, [](auto& v) { return at::stack({v[0], v[1], v[2]}, 0); }},
      {"stack -1", 2, [](auto& v) { return at::stack({v[0], v[1] * 3}, -1); }},
      {"stack 1", 2, [](auto& v) { return at::stack({v[0], v[1]}, 1).sum(1); }},
  };
  on_meshes([&](const DeviceMesh& mesh) {
    auto xs = layouts(mesh, {5, 4});
    for (size_t i = 0; i < xs.size(); ++i) {
      const std::vector<Operand> abc = {xs[i], xs[(i + 3) % xs.size()], xs[(i + 5) % xs.size()]};
      for (const auto& [op, n, fn] : cases) {
        std::string what = op;
        for (size_t k = 0; k < n; ++k) what += (k ? ", " : " ") + name(abc[k]);
        differential(mesh, {abc.begin(), abc.begin() + n}, fn, what);
      }
    }
  });
}

TEST(TensorOps, IndexSelectIndexAdd) {
  on_meshes([](const DeviceMesh& mesh) {
    const auto rows = randint(7, {9}, 11), cols = randint(5, {3}, 12);
    for (const auto& x : layouts(mesh, {7, 5})) {
      const auto what = name(x);
      differential(mesh, {x}, [&](auto& v) { return v[0].index_select(0, rows); },
                   "index_select(0) on " + what);
      differential(mesh, {x}, [&](auto& v) { return v[0].index_select(1, cols) * 2; },
                   "index_select(1) on " + what);
      for (const auto& s : layouts(mesh, {9, 5})) {
        differential(mesh, {x, s}, [&](auto& v) { return v[0].index_add(0, rows, v[1], 0.5); },
                     "index_add(0) " + what + " <- " + name(s));
      }
      differential(mesh, {x, {{7, 3}, x.placements}}, [&](auto& v) {
        return v[0].index_add(1, cols, v[1]);
      }, "index_add(1) " + what);
    }
    // A distributed index keeps its sharding in the result.
    Placements s0(mesh.ndim(), Replicate());
    s0[0] = Shard(0);
    differential(mesh, {{{7, 5}, Placements(mesh.ndim(), Replicate())}}, [&](auto& v) {
      if (!is_dtensor(v[0])) return v[0].index_select(0, rows);
      return v[0].index_select(0, distribute_tensor(rows, mesh, s0, std::nullopt));
    }, "index_select with a sharded index");
  });
}

TEST(TensorOps, GatherScatter) {
  on_meshes([](const DeviceMesh& mesh) {
    const auto g0 = randint(5, {3, 6}, 21), g1 = randint(6, {5, 4}, 22);
    const auto d0 = distinct({5, 6}, 0, 3, 23), d1 = distinct({5, 6}, 1, 4, 24);
    for (const auto& x : layouts(mesh, {5, 6})) {
      const auto what = name(x);
      differential(mesh, {x}, [&](auto& v) { return v[0].gather(0, g0); }, "gather(0) " + what);
      differential(mesh, {x}, [&](auto& v) { return v[0].gather(1, g1); }, "gather(1) " + what);
      differential(mesh, {x}, [&](auto& v) { return v[0].scatter(1, d1, 2.5); },
                   "scatter value " + what);
      // Sources of the index's shape, replicated or laid out like self.
      for (const auto& p : {Placements(mesh.ndim(), Replicate()), x.placements}) {
        const auto both = what + " <- " + to_string(p);
        differential(mesh, {x, {{3, 6}, p}}, [&](auto& v) { return v[0].scatter(0, d0, v[1]); },
                     "scatter(0) " + both);
        differential(mesh, {x, {{5, 4}, p}}, [&](auto& v) { return v[0].scatter(1, d1, v[1]); },
                     "scatter(1) " + both);
        differential(mesh, {x, {{3, 6}, p}}, [&](auto& v) { return v[0].scatter_add(0, g0, v[1]); },
                     "scatter_add(0) " + both);
      }
    }
    // Index sharded with the operands: gather keeps it, scatter_add makes partial sums.
    for (int64_t t : {0, 1}) {
      Placements p(mesh.ndim(), Replicate());
      p[0] = Shard(t);
      auto idx = [&](const at::Tensor& ref, const at::Tensor& i) {
        return is_dtensor(ref) ? distribute_tensor(i, mesh, p, std::nullopt) : i;
      };
      differential(mesh, {{{5, 6}, Placements(mesh.ndim(), Replicate())}, {{5, 4}, p}},
                   [&](auto& v) { return v[0].gather(1, idx(v[0], g1)) * v[1]; },
                   "gather with sharded index S(" + std::to_string(t) + ")");
      differential(mesh, {{{5, 6}, Placements(mesh.ndim(), Replicate())}, {{3, 6}, p}},
                   [&](auto& v) { return v[0].scatter_add(0, idx(v[0], g0), v[1]); },
                   "scatter_add with sharded index S(" + std::to_string(t) + ")");
    }
  });
}

TEST(TensorOps, Embedding) {
  on_meshes([](const DeviceMesh& mesh) {
    const auto ids = randint(11, {3, 4}, 31);
    for (const auto& w : layouts(mesh, {11, 6})) {
      const auto what = name(w);
      differential(mesh, {w}, [&](auto& v) { return at::embedding(v[0], ids); },
                   "embedding " + what);
      differential(mesh, {w}, [&](auto& v) {
        return at::embedding(v[0], ids, /*padding_idx=*/ids[0][1].item<int64_t>(),
                             /*scale_grad_by_freq=*/true) * 3;
      }, "embedding padding/scale_grad_by_freq " + what);
      differential(mesh, {w}, [&](auto& v) { return at::embedding(v[0], ids[1][2]); },
                   "embedding of one index " + what);
    }
    // Data parallel: sharded indices, replicated table.
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    differential(mesh, {{{11, 6}, Placements(mesh.ndim(), Replicate())}}, [&](auto& v) {
      if (!is_dtensor(v[0])) return at::embedding(v[0], ids);
      return at::embedding(v[0], distribute_tensor(ids, mesh, p, std::nullopt));
    }, "embedding with sharded indices");
  });
}

TEST(TensorOps, IndexReplicated) {
  on_meshes([](const DeviceMesh& mesh) {
    const auto rows = randint(6, {4}, 41), cols = randint(5, {4}, 42);
    Operand x{{6, 5}, Placements(mesh.ndim(), Replicate())};
    differential(mesh, {x}, [&](auto& v) { return v[0].index({rows}); }, "x[rows]");
    // Another self shape: the fallback's decision key leaves out Tensor?[] elements.
    differential(mesh, {{{6, 5, 1}, x.placements}}, [&](auto& v) {
      return v[0].index({rows, cols}) * 2;
    }, "x[rows, cols]");
  });
}

// The local forms: slicing a sharded dim, split + cat back, vocab- and column-parallel
// embedding, narrow_copy and select of a sharded dim communicate nothing.
TEST(TensorOps, LocalFormsDoNotCommunicate) {
  tessera::testing::run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    auto full = tessera::test::randn({8, 6}, 5);
    auto x = distribute_tensor(full, mesh, {Shard(0)}, std::nullopt,
                               ShardSizes::Given(0, {3, 0, 5}));
    auto x1 = redistribute(x, {Shard(1)});
    const auto ids = randint(8, {2, 5}, 6);
    CommDebugMode comm;
    auto s = x.slice(0, 1, 7, 2);
    auto p = x.split(3, 0);
    auto c = at::cat(p, 0);
    auto e0 = at::embedding(x, ids);
    auto e1 = at::embedding(x1, ids);
    auto r = x.select(0, 4);
    auto n = x.narrow_copy(0, 2, 5);
    EXPECT_EQ(comm.get_total_counts(), 0) << comm.table();
    EXPECT_EQ(spec(s).shard_table(0), (ShardTable{1, 0, 2}));
    EXPECT_EQ(spec(c).shard_table(0), (ShardTable{3, 0, 5}));
    EXPECT_EQ(placements(e0), (Placements{Partial()}));
    EXPECT_EQ(placements(e1), (Placements{Shard(2)}));
    EXPECT_EQ(placements(r), (Placements{Partial()}));
    EXPECT_TRUE(at::equal(full_tensor(s), full.slice(0, 1, 7, 2)));
    EXPECT_TRUE(at::equal(full_tensor(c), full));
    EXPECT_TRUE(at::equal(full_tensor(e0), at::embedding(full, ids)));
    EXPECT_TRUE(at::equal(full_tensor(r), full[4]));
    EXPECT_TRUE(at::equal(full_tensor(n), full.narrow(0, 2, 5)));
    // Integers take the partial form too; bool rows are gathered instead.
    EXPECT_TRUE(at::equal(full_tensor(x.to(at::kLong).select(0, 5)), full.to(at::kLong)[5]));
    auto bits = (x > 0).select(0, 1);
    EXPECT_EQ(placements(bits), (Placements{Replicate()}));
    EXPECT_TRUE(at::equal(full_tensor(bits), full[1] > 0));
    // Slices of a sharded dim are views of the local shards: writes reach the input.
    at::NoGradGuard no_grad;
    x.slice(0, 2, 6).mul_(0);
    EXPECT_TRUE(at::equal(full_tensor(x), full.index_fill(0, at::arange(2, 6), 0)));
  });
}

// Random ops, shapes, layouts and tables; every rank draws the same cases from the seed.
TEST(TensorOps, Randomized) {
  const char* env = std::getenv("TESSERA_TEST_SEED");  // replays another seed
  const uint64_t seed = env ? std::stoull(env) : 20240611;
  int cases = 0;
  for (int world : {1, 2, 3, 4}) {
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", world == 4 ? std::vector<int64_t>{2, 2}
                                                     : std::vector<int64_t>{world});
      std::mt19937 rng(seed + world);
      auto uni = [&](int64_t lo, int64_t hi) {
        return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
      };
      auto operand = [&](std::vector<int64_t> shape) {
        const int64_t nd = static_cast<int64_t>(shape.size());
        Placements p;
        for (int64_t m = 0; m < mesh.ndim(); ++m) {
          const int64_t k = uni(0, nd + 1);
          p.push_back(k < nd ? Shard(k) : k == nd ? Replicate() : Partial());
        }
        return Operand{shape, p, tessera::test::random_tables(rng, mesh, p, shape)};
      };
      auto str = [](std::initializer_list<int64_t> xs) { return shape_str(xs); };
      for (int i = 0; i < 60; ++i) {
        std::vector<int64_t> shape = {uni(1, 6), uni(1, 5), uni(1, 4)};
        const int64_t nd = uni(2, 3);
        shape.resize(nd);
        const int64_t d = uni(0, nd - 1), size = shape[d];
        std::vector<Operand> ops = {operand(shape)};
        std::string what;
        tessera::test::Fn fn;
        const int64_t a = uni(-size, size), b = uni(-size, size + 2), step = uni(1, 3);
        const uint64_t ids_seed = seed * 7 + i;
        auto other = shape;  // a second operand's shape
        other[d] = uni(0, 4);
        switch (uni(0, 9)) {
          case 0:
            what = "slice" + str({d, a, b, step});
            fn = [=](auto& v) { return v[0].slice(d, a, b, step) * 2; };
            break;
          case 1:
            what = "select" + str({d, a % size});
            fn = [=](auto& v) { return v[0].select(d, a % size) + 1; };
            break;
          case 2:
            what = "split" + str({step, d}) + " + cat";
            fn = [=](auto& v) { return weighted_cat(v[0].split(step, d), d); };
            break;
          case 3:
            what = "unbind" + str({d}) + " + stack";
            fn = [=](auto& v) { return at::stack(v[0].unbind(d), nd - 1) * 2; };
            break;
          case 4:
            ops.push_back(operand(other));
            what = "cat" + str({d});
            fn = [=](auto& v) { return at::cat({v[1], v[0] * 2}, d); };
            break;
          case 5: {
            auto ids = randint(size, {uni(0, 5)}, ids_seed);
            what = "index_select" + str({d});
            fn = [=](auto& v) { return v[0].index_select(d, ids); };
            break;
          }
          case 6: {
            other[d] = std::max<int64_t>(other[d], 1);
            auto ids = randint(size, other, ids_seed);
            what = "gather" + str({d});
            fn = [=](auto& v) { return v[0].gather(d, ids); };
            break;
          }
          case 7: {
            ops.push_back(operand(other));
            auto ids = randint(size, {other[d]}, ids_seed);
            what = "index_add" + str({d});
            fn = [=](auto& v) { return v[0].index_add(d, ids, v[1]); };
            break;
          }
          case 8: {
            ops.push_back(operand(other));
            auto ids = randint(size, other, ids_seed);
            what = "scatter_add" + str({d});
            fn = [=](auto& v) { return v[0].scatter_add(d, ids, v[1]); };
            break;
          }
          default: {
            ops[0] = operand({size, shape[nd - 1]});
            auto ids = randint(size, {uni(1, 3), uni(0, 4)}, ids_seed);
            what = "embedding";
            fn = [=](auto& v) { return at::embedding(v[0], ids); };
          }
        }
        std::string desc = "seed " + std::to_string(seed) + " world " + std::to_string(world) +
                           " case " + std::to_string(i) + ": " + what;
        for (auto& o : ops) desc += " | " + shape_str(o.shape) + " " + name(o);
        try {
          differential(mesh, ops, fn, desc, seed + i);
        } catch (const std::exception& e) {
          throw std::runtime_error(desc + ": " + e.what());
        }
        if (rank == 0) ++cases;
      }
    });
  }
  EXPECT_GE(cases, 200);
}
