// out= forms without a rule of their own run their functional sibling's rule (NOTE: [out=
// forms] in src/tensor/rule_registry.cpp): every kind of `out` (empty, the result's layout, another
// layout, a plain tensor) ends up holding one device's result, on uneven shards, 1-4 ranks.
#include "helpers.h"
#include "support/meshes.h"

#include <map>

#include <ATen/ops/add.h>
#include <ATen/ops/cummax.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/flip.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/renorm.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/tril.h>

using namespace tessera;

namespace {

using Outs = std::vector<at::Tensor>;
struct OutCase {
  std::string name;
  std::function<Outs(const at::Tensor&)> functional;
  std::function<void(Outs&, const at::Tensor&)> out_form;
  int outs = 1;
};

const at::Tensor kIndex = at::tensor({4, 0, 2, 2}, at::kLong);

std::vector<OutCase> cases() {
  return {
      // Point-wise forms (their rule sees `out` as an operand).
      {"mul.out", [](const at::Tensor& x) { return Outs{at::mul(x, x)}; },
       [](Outs& o, const at::Tensor& x) { at::mul_out(o[0], x, x); }},
      {"add.out", [](const at::Tensor& x) { return Outs{at::add(x, x, 2)}; },
       [](Outs& o, const at::Tensor& x) { at::add_out(o[0], x, x, 2); }},
      {"sigmoid.out", [](const at::Tensor& x) { return Outs{at::sigmoid(x)}; },
       [](Outs& o, const at::Tensor& x) { at::sigmoid_out(o[0], x); }},
      {"cumsum.out", [](const at::Tensor& x) { return Outs{at::cumsum(x, 0)}; },
       [](Outs& o, const at::Tensor& x) { at::cumsum_out(o[0], x, 0); }},
      {"renorm.out", [](const at::Tensor& x) { return Outs{at::renorm(x, 2, 0, 0.5)}; },
       [](Outs& o, const at::Tensor& x) { at::renorm_out(o[0], x, 2, 0, 0.5); }},
      {"tril.out", [](const at::Tensor& x) { return Outs{at::tril(x, 1)}; },
       [](Outs& o, const at::Tensor& x) { at::tril_out(o[0], x, 1); }},
      {"flip.out", [](const at::Tensor& x) { return Outs{at::flip(x, {1})}; },
       [](Outs& o, const at::Tensor& x) { at::flip_out(o[0], x, {1}); }},
      {"roll.out", [](const at::Tensor& x) { return Outs{at::roll(x, {2}, {0})}; },
       [](Outs& o, const at::Tensor& x) { at::roll_out(o[0], x, {2}, {0}); }},
      {"index_select.out", [](const at::Tensor& x) { return Outs{at::index_select(x, 0, kIndex)}; },
       [](Outs& o, const at::Tensor& x) { at::index_select_out(o[0], x, 0, kIndex); }},
      {"sort.values",
       [](const at::Tensor& x) {
         auto [v, i] = at::sort(x, 1);
         return Outs{v, i};
       },
       [](Outs& o, const at::Tensor& x) { at::sort_out(o[0], o[1], x, 1); }, 2},
      {"topk.values",
       [](const at::Tensor& x) {
         auto [v, i] = at::topk(x, 2, 1);
         return Outs{v, i};
       },
       [](Outs& o, const at::Tensor& x) { at::topk_out(o[0], o[1], x, 2, 1); }, 2},
      {"cummax.out",
       [](const at::Tensor& x) {
         auto [v, i] = at::cummax(x, 0);
         return Outs{v, i};
       },
       [](Outs& o, const at::Tensor& x) { at::cummax_out(o[0], o[1], x, 0); }, 2},
  };
}

// The kinds of `out` a user passes: what each starts as, given the expected result.
enum class OutKind { Empty, ResultLayout, OtherLayout, Plain };
const std::vector<OutKind> kKinds = {OutKind::Empty, OutKind::ResultLayout, OutKind::OtherLayout,
                                     OutKind::Plain};
const char* kind_name(OutKind k) {
  switch (k) {
    case OutKind::Empty: return "an empty distributed out";
    case OutKind::ResultLayout: return "an out with the result's layout";
    case OutKind::OtherLayout: return "an out with another layout";
    case OutKind::Plain: return "a plain out";
  }
  return "";
}

// `result`: the functional op's distributed result, whose layout ResultLayout copies.
at::Tensor make_out(OutKind kind, const at::Tensor& result, const DeviceMesh& mesh,
                    const at::Tensor& expected) {
  Placements r(mesh.ndim(), Replicate());
  switch (kind) {
    case OutKind::Empty:
      return distribute_tensor(at::empty({0}, expected.options()), mesh, r, std::nullopt);
    case OutKind::ResultLayout:
      return test::make_dtensor_from_full(at::zeros_like(expected), mesh, spec(result).placements(),
                                          spec(result).shard_tables());
    case OutKind::OtherLayout: {
      Placements p = r;
      p.back() = Shard(expected.dim() - 1);
      return test::make_dtensor_from_full(at::zeros_like(expected), mesh, p);
    }
    case OutKind::Plain: return at::zeros_like(expected);
  }
  return {};
}

// Every case, every kind of out, on one layout of x (uneven rows, maybe nested).
void check_all(const DeviceMesh& mesh, const Placements& placements,
               const std::vector<ShardTable>& tables) {
  const at::Tensor full = test::randn({7, 5}, 91, at::kDouble);
  const at::Tensor x = test::make_dtensor_from_full(full, mesh, placements, tables);
  for (const auto& c : cases()) {
    const Outs expected = c.functional(full);
    const Outs results = c.functional(x);
    for (OutKind kind : kKinds) {
      Outs outs;
      std::vector<const void*> storage;
      for (int k = 0; k < c.outs; ++k) {
        outs.push_back(make_out(kind, results[k], mesh, expected[k]));
        storage.push_back(is_dtensor(outs[k]) ? to_local(outs[k]).data_ptr() : outs[k].data_ptr());
      }
      const Outs before = outs;
      try {
        c.out_form(outs, x);
      } catch (const c10::Error& e) {
        ADD_FAILURE() << c.name << " into " << kind_name(kind) << " from " << test::describe(x)
                      << ": " << e.what_without_backtrace();
        continue;
      }
      for (int k = 0; k < c.outs; ++k) {
        const std::string what = c.name + " into " + kind_name(kind) + " (result " +
                                 std::to_string(k) + ") from " + test::describe(x);
        EXPECT_TRUE(outs[k].is_same(before[k])) << what;
        if (kind == OutKind::Plain) {
          EXPECT_FALSE(is_dtensor(outs[k])) << what;
          EXPECT_TRUE(test::same_values(outs[k], expected[k])) << what;
          continue;
        }
        EXPECT_TRUE(test::full_matches(outs[k], expected[k])) << what;
        // The result's layout: the functional rule's output spec.
        EXPECT_EQ(spec(outs[k]).placements(), spec(results[k]).placements()) << what;
        if (kind == OutKind::ResultLayout)  // written in place, as ATen's out= does
          EXPECT_EQ(to_local(outs[k]).data_ptr(), storage[k]) << what;
      }
    }
  }
}

}  // namespace

TEST(OutForms, EveryKindOfOutHoldsOneDevicesResult) {
  for (const auto& shape : std::vector<std::vector<int64_t>>{{1}, {2}, {3}, {4}, {2, 2}}) {
    test::on_mesh(shape, [&](const DeviceMesh& mesh) {
      Placements rows(mesh.ndim(), Replicate());
      rows[0] = Shard(0);
      check_all(mesh, rows, {});
      Placements cols(mesh.ndim(), Replicate());
      cols.back() = Shard(1);
      check_all(mesh, cols, {});
      // Uneven rows with an empty shard where the mesh has room for one.
      const std::map<int64_t, ShardTable> uneven = {
          {1, {7}}, {2, {5, 2}}, {3, {5, 0, 2}}, {4, {4, 0, 2, 1}}};
      const ShardTable table = uneven.at(mesh.size(0));
      std::vector<ShardTable> tables(2);
      tables[0] = table;
      check_all(mesh, rows, tables);
    });
  }
}

// A view of another tensor cannot take a new layout: its base would not see the write.
TEST(OutForms, AViewOutWhoseLayoutChangesRaisesOnEveryRank) {
  test::on_mesh({2}, [&](const DeviceMesh& mesh) {
    const at::Tensor full = test::randn({6, 4}, 92, at::kDouble);
    const at::Tensor x = distribute_tensor(full, mesh, {Shard(0)}, std::nullopt);
    at::Tensor other =
        distribute_tensor(at::zeros({6, 4}, at::kDouble), mesh, {Shard(1)}, std::nullopt);
    at::Tensor other_view = other.view({6, 4});
    try {
      at::cumsum_out(other_view, x, 0);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("on a view"), std::string::npos) << e.what();
    }
  });
}
