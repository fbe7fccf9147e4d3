// Indexing and joining ops (slice/narrow/select, split/chunk/unbind, cat/stack,
// index_select/index_add, gather/scatter, embedding, index) on even, uneven and zero-size
// shard tables, forward and backward, against the same code on one device.
#include <atomic>
#include <functional>

#include "helpers.h"

using namespace tessera;
using tessera::test::differential;
using tessera::test::on_meshes;
using tessera::test::Operand;
using tessera::test::Rng;

namespace {

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
    on_layouts(
        mesh, {7, 6},
        Cases{
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

// The wrapper reports contiguous strides while its shard may be a transposed or expanded
// view: code written for plain tensors views it after contiguous() (attention's
// transpose(1, 2).contiguous().view(...), matmul on 4-D operands).
TEST(TensorOps, ViewOfStridedShards) {
  on_meshes([](const DeviceMesh& mesh) {
    on_layouts(mesh, {4, 6, 3},
               Cases{
                   {"transpose(1, 2).contiguous().view(4, 18)",
                    [](auto& v) {
                      return v[0].transpose(1, 2).contiguous().view({4, 18});
                    }},
                   {"permute(2, 0, 1).contiguous().view(-1)",
                    [](auto& v) {
                      return v[0].permute({2, 0, 1}).contiguous().view({-1}) * 3;
                    }},
                   {"transpose(0, 1).reshape(6, 12)",
                    [](auto& v) {
                      return v[0].transpose(0, 1).reshape({6, 12});
                    }},
                   {"4-D matmul",
                    [](auto& v) {
                      auto a = v[0].view({2, 2, 6, 3});
                      return at::matmul(a, a.transpose(2, 3))
                          .transpose(1, 2)
                          .contiguous()
                          .view({2, 6, 12});
                    }},
               });
  });
}

// List results are summed back into one result.
TEST(TensorOps, SplitChunkUnbind) {
  on_meshes([](const DeviceMesh& mesh) {
    on_layouts(
        mesh, {7, 6},
        Cases{
            {"split(3, 0)", [](auto& v) { return weighted_cat(v[0].split(3, 0), 0); }},
            {"split(2, 1) reversed",
             [](auto& v) {
               auto p = v[0].split(2, 1);
               return at::cat({p[2] * 3, p[0], p[1] * 2}, 1);
             }},
            {"split_with_sizes",
             [](auto& v) {
               return weighted_cat(v[0].split_with_sizes({2, 0, 5}, 0), 0);
             }},
            {"unsafe_split", [](auto& v) { return weighted_cat(at::unsafe_split(v[0], 4, 1), 1); }},
            {"chunk(3, 1)", [](auto& v) { return weighted_cat(v[0].chunk(3, 1), 1); }},
            {"chunk(4, 0) sum",
             [](auto& v) {
               auto p = v[0].chunk(4, 0);
               return p[0] + p[1] * 2 + p[2].exp();
             }},
            {"unbind(0)",
             [](auto& v) {
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
      {"cat 0", 2,
       [](auto& v) {
         return at::cat({v[0], v[1]}, 0);
       }},
      {"cat 1", 3,
       [](auto& v) {
         return at::cat({v[0], v[1] * 2, v[2]}, 1);
       }},
      {"cat with a plain tensor", 2,
       [](auto& v) {
         return at::cat({v[0], at::ones({2, 4}), v[1].slice(0, 1, 3)}, 0);
       }},
      {"stack 0", 3,
       [](auto& v) {
         return at::stack({v[0], v[1], v[2]}, 0);
       }},
      {"stack -1", 2,
       [](auto& v) {
         return at::stack({v[0], v[1] * 3}, -1);
       }},
      {"stack 1", 2,
       [](auto& v) {
         return at::stack({v[0], v[1]}, 1).sum(1);
       }},
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
      differential(
          mesh, {x}, [&](auto& v) { return v[0].index_select(0, rows); },
          "index_select(0) on " + what);
      differential(
          mesh, {x}, [&](auto& v) { return v[0].index_select(1, cols) * 2; },
          "index_select(1) on " + what);
      for (const auto& s : layouts(mesh, {9, 5})) {
        differential(
            mesh, {x, s}, [&](auto& v) { return v[0].index_add(0, rows, v[1], 0.5); },
            "index_add(0) " + what + " <- " + name(s));
      }
      differential(
          mesh, {x, {{7, 3}, x.placements}}, [&](auto& v) { return v[0].index_add(1, cols, v[1]); },
          "index_add(1) " + what);
    }
    // A distributed index keeps its sharding in the result.
    Placements s0(mesh.ndim(), Replicate());
    s0[0] = Shard(0);
    differential(
        mesh, {{{7, 5}, Placements(mesh.ndim(), Replicate())}},
        [&](auto& v) {
          if (!is_dtensor(v[0])) return v[0].index_select(0, rows);
          return v[0].index_select(0, distribute_tensor(rows, mesh, s0, std::nullopt));
        },
        "index_select with a sharded index");
  });
}

TEST(TensorOps, GatherScatter) {
  on_meshes([](const DeviceMesh& mesh) {
    const auto g0 = randint(5, {3, 6}, 21), g1 = randint(6, {5, 4}, 22);
    const auto d0 = distinct({5, 6}, 0, 3, 23), d1 = distinct({5, 6}, 1, 4, 24);
    for (const auto& x : layouts(mesh, {5, 6})) {
      const auto what = name(x);
      differential(
          mesh, {x}, [&](auto& v) { return v[0].gather(0, g0); }, "gather(0) " + what);
      differential(
          mesh, {x}, [&](auto& v) { return v[0].gather(1, g1); }, "gather(1) " + what);
      differential(
          mesh, {x}, [&](auto& v) { return v[0].scatter(1, d1, 2.5); }, "scatter value " + what);
      // Sources of the index's shape, replicated or laid out like self.
      for (const auto& p : {Placements(mesh.ndim(), Replicate()), x.placements}) {
        const auto both = what + " <- " + to_string(p);
        differential(
            mesh, {x, {{3, 6}, p}}, [&](auto& v) { return v[0].scatter(0, d0, v[1]); },
            "scatter(0) " + both);
        differential(
            mesh, {x, {{5, 4}, p}}, [&](auto& v) { return v[0].scatter(1, d1, v[1]); },
            "scatter(1) " + both);
        differential(
            mesh, {x, {{3, 6}, p}}, [&](auto& v) { return v[0].scatter_add(0, g0, v[1]); },
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
      differential(
          mesh, {{{5, 6}, Placements(mesh.ndim(), Replicate())}, {{5, 4}, p}},
          [&](auto& v) { return v[0].gather(1, idx(v[0], g1)) * v[1]; },
          "gather with sharded index S(" + std::to_string(t) + ")");
      differential(
          mesh, {{{5, 6}, Placements(mesh.ndim(), Replicate())}, {{3, 6}, p}},
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
      differential(
          mesh, {w}, [&](auto& v) { return at::embedding(v[0], ids); }, "embedding " + what);
      differential(
          mesh, {w},
          [&](auto& v) {
            return at::embedding(v[0], ids, /*padding_idx=*/ids[0][1].item<int64_t>(),
                                 /*scale_grad_by_freq=*/true) *
                   3;
          },
          "embedding padding/scale_grad_by_freq " + what);
      differential(
          mesh, {w}, [&](auto& v) { return at::embedding(v[0], ids[1][2]); },
          "embedding of one index " + what);
    }
    // Data parallel: sharded indices, replicated table.
    Placements p(mesh.ndim(), Replicate());
    p[0] = Shard(0);
    differential(
        mesh, {{{11, 6}, Placements(mesh.ndim(), Replicate())}},
        [&](auto& v) {
          if (!is_dtensor(v[0])) return at::embedding(v[0], ids);
          return at::embedding(v[0], distribute_tensor(ids, mesh, p, std::nullopt));
        },
        "embedding with sharded indices");
  });
}

TEST(TensorOps, IndexReplicated) {
  on_meshes([](const DeviceMesh& mesh) {
    const auto rows = randint(6, {4}, 41), cols = randint(5, {4}, 42);
    Operand x{{6, 5}, Placements(mesh.ndim(), Replicate())};
    differential(
        mesh, {x}, [&](auto& v) { return v[0].index({rows}); }, "x[rows]");
    // Another self shape: the fallback's decision key leaves out Tensor?[] elements.
    differential(
        mesh, {{{6, 5, 1}, x.placements}},
        [&](auto& v) {
          return v[0].index({rows, cols}) * 2;
        },
        "x[rows, cols]");
  });
}

// The local forms: slicing a sharded dim, split + cat back, vocab- and column-parallel
// embedding, narrow_copy and select of a sharded dim communicate nothing.
TEST(TensorOps, LocalFormsDoNotCommunicate) {
  tessera::testing::run_ranks(3, [](int) {
    auto mesh = init_device_mesh("cpu", {3});
    auto full = tessera::test::randn({8, 6}, 5);
    auto x =
        distribute_tensor(full, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, {3, 0, 5}));
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

namespace {

// A random layout of an operand: each mesh dim shards a dim, replicates, or holds partial
// terms (uniformly), with random shard tables.
Operand random_operand(Rng& rng, const DeviceMesh& mesh, const std::vector<int64_t>& shape) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  Placements p;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const int64_t k = rng.uniform(0, nd + 1);
    p.push_back(k < nd ? Shard(k) : k == nd ? Replicate() : Partial());
  }
  return Operand{shape, p, tessera::test::random_tables(rng, mesh, p, shape)};
}

// What a random case draws before choosing its op: the first operand's shape, a dim d of it,
// slice bounds, a step, a second operand's shape (d resized) and the seed of any indices.
struct Draw {
  std::vector<int64_t> shape, other;
  int64_t nd, d, size, a, b, step;
  uint64_t ids_seed;
};

Draw draw(Rng& rng) {
  Draw x;
  x.shape = {rng.uniform(1, 6), rng.uniform(1, 5), rng.uniform(1, 4)};
  x.nd = rng.uniform(2, 3);
  x.shape.resize(x.nd);
  x.d = rng.uniform(0, x.nd - 1);
  x.size = x.shape[x.d];
  x.a = rng.uniform(-x.size, x.size);
  x.b = rng.uniform(-x.size, x.size + 2);
  x.step = rng.uniform(1, 3);
  x.ids_seed = rng.bits();
  x.other = x.shape;
  x.other[x.d] = rng.uniform(0, 4);
  return x;
}

struct RandomOp {
  std::string what;
  std::vector<Operand> ops;
  tessera::test::Fn fn;
};

auto str(std::initializer_list<int64_t> xs) { return shape_str(xs); }

// Kinds 0-3: views and lists of one operand (slice, select, split + cat, unbind + stack).
RandomOp view_op(int64_t kind, const Draw& x, Operand first) {
  const int64_t d = x.d, a = x.a, b = x.b, step = x.step, size = x.size, nd = x.nd;
  switch (kind) {
    case 0:
      return {"slice" + str({d, a, b, step}), {first}, [=](auto& v) {
                return v[0].slice(d, a, b, step) * 2;
              }};
    case 1:
      return {"select" + str({d, a % size}), {first}, [=](auto& v) {
                return v[0].select(d, a % size) + 1;
              }};
    case 2:
      return {"split" + str({step, d}) + " + cat", {first}, [=](auto& v) {
                return weighted_cat(v[0].split(step, d), d);
              }};
    default:
      return {"unbind" + str({d}) + " + stack", {first}, [=](auto& v) {
                return at::stack(v[0].unbind(d), nd - 1) * 2;
              }};
  }
}

// Kinds 4-9: ops with a second operand or random indices (cat, index_select, gather,
// index_add, scatter_add, embedding).
RandomOp joining_op(int64_t kind, const Draw& x, Operand first, Rng& rng, const DeviceMesh& mesh) {
  const int64_t d = x.d, size = x.size;
  auto other = x.other;
  switch (kind) {
    case 4:
      return {"cat" + str({d}), {first, random_operand(rng, mesh, other)}, [=](auto& v) {
                return at::cat({v[1], v[0] * 2}, d);
              }};
    case 5: {
      auto ids = randint(size, {rng.uniform(0, 5)}, x.ids_seed);
      return {
          "index_select" + str({d}), {first}, [=](auto& v) { return v[0].index_select(d, ids); }};
    }
    case 6: {
      other[d] = std::max<int64_t>(other[d], 1);
      auto ids = randint(size, other, x.ids_seed);
      return {"gather" + str({d}), {first}, [=](auto& v) { return v[0].gather(d, ids); }};
    }
    case 7: {
      auto ids = randint(size, {other[d]}, x.ids_seed);
      return {"index_add" + str({d}), {first, random_operand(rng, mesh, other)}, [=](auto& v) {
                return v[0].index_add(d, ids, v[1]);
              }};
    }
    case 8: {
      auto ids = randint(size, other, x.ids_seed);
      return {"scatter_add" + str({d}), {first, random_operand(rng, mesh, other)}, [=](auto& v) {
                return v[0].scatter_add(d, ids, v[1]);
              }};
    }
    default: {
      const int64_t rows = rng.uniform(1, 3), cols = rng.uniform(0, 4);
      auto ids = randint(size, {rows, cols}, x.ids_seed);
      return {"embedding", {random_operand(rng, mesh, {size, x.shape[x.nd - 1]})}, [=](auto& v) {
                return at::embedding(v[0], ids);
              }};
    }
  }
}

void random_case(const DeviceMesh& mesh, Rng& rng, const std::string& label) {
  const Draw x = draw(rng);
  Operand first = random_operand(rng, mesh, x.shape);
  const int64_t kind = rng.uniform(0, 9);
  RandomOp op = kind < 4 ? view_op(kind, x, first) : joining_op(kind, x, first, rng, mesh);
  std::string desc = label + " mesh " + shape_str(mesh.shape()) + ": " + op.what;
  for (auto& o : op.ops) desc += " | " + shape_str(o.shape) + " " + name(o);
  try {
    differential(mesh, op.ops, op.fn, desc, rng.bits());
  } catch (const std::exception& e) {
    throw std::runtime_error(desc + ": " + e.what());
  }
}

}  // namespace

// Random ops, shapes, layouts and tables: 60 cases on each standard mesh (cases 0-59 on one
// rank, 60-119 on two, ...). A failure prints the command that replays its case.
TEST(TensorOps, Randomized) {
  tessera::test::Sweep sweep;
  int64_t expected = 0;
  std::atomic<int64_t> ran{0};  // cases run by rank 0 of each mesh
  for (const auto& shape : tessera::test::standard_meshes()) {
    const auto cases = sweep.cases(60);
    if (!cases.any()) continue;
    expected += cases.selected();
    tessera::test::on_mesh(shape, [&](const DeviceMesh& mesh) {
      cases.run([&](Rng& rng, int64_t c) {
        random_case(mesh, rng, sweep.label(c));
        if (mesh.coordinate() == std::vector<int64_t>(mesh.ndim(), 0)) ++ran;
      });
    });
  }
  EXPECT_EQ(ran.load(), expected);
}
