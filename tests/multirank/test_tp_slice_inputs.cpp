// Plain inputs to a tensor-parallel model on a slice of a larger mesh (NOTE: [Plain inputs on
// a slice]): the parameters live on the root, replicated over "dp", so a plain input must be
// one value across "dp". Per-group plain batches raise on every rank, naming the ways out; the
// same plain input everywhere, or per-group batches said to be a batch split over "dp", equal
// one device, forward and backward.
#include <torch/nn/modules/embedding.h>

#include "helpers.h"

using namespace tessera;
using tessera::test::clone_of;

namespace {

const test::Tolerance kTol{1e-12, 1e-12};
constexpr int64_t kVocab = 9;  // uneven over 2 tp ranks

torch::nn::Embedding embedding() {
  torch::manual_seed(3);
  torch::nn::Embedding e(kVocab, 6);
  e->to(at::kDouble);
  return e;
}

// Group g's ids: g + 3 rows (uneven across groups), drawn from their own generator.
at::Tensor group_ids(int64_t g) {
  return at::randint(kVocab, {g + 3, 4}, test::generator(40 + g), at::kLong);
}

const std::vector<std::vector<int64_t>> kShapes = {{2, 2}, {3, 2}, {2, 3}};

}  // namespace

// Each dp group feeds its own plain ids (the habit, with gradients to be summed over dp by
// hand): an error on every rank, naming the dims and from_local.
TEST(TpSliceInputs, PerGroupPlainIdsRaiseOnEveryRank) {
  const auto ref = embedding();
  for (const auto& shape : kShapes) {
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int) {
      auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
      auto m = clone_of(ref);
      parallelize_module(m, mesh["tp"], RowwiseParallel().input_layouts(Replicate()));
      try {
        (void)m(group_ids(mesh.coordinate()[0]));
        ADD_FAILURE() << "per-group plain ids were read as one value on " << mesh.str();
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        for (const char* needle : {"aten::embedding", "differs across mesh dim(s) 'dp'",
                                   "from_local(x, mesh, {Shard(0), Replicate()})", "1-D mesh"})
          EXPECT_NE(msg.find(needle), std::string::npos) << needle << " missing from: " << msg;
      }
    });
  }
}

// The same plain ids on every rank: one device's forward and gradient.
TEST(TpSliceInputs, SamePlainIdsEverywhereEqualOneDevice) {
  auto ref = embedding();
  const auto init = clone_of(ref);
  const at::Tensor ids = group_ids(0);
  const at::Tensor want = ref(ids);
  want.pow(2).sum().backward();
  for (const auto& shape : kShapes) {
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int) {
      auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
      auto m = clone_of(init);
      parallelize_module(m, mesh["tp"], RowwiseParallel().input_layouts(Replicate()));
      const at::Tensor y = m(ids);
      ASSERT_TRUE(test::matches(y, want.detach(), kTol)) << mesh.str();
      y.pow(2).sum().backward();
      ASSERT_TRUE(test::full_matches(m->weight.grad(), ref->weight.grad(), kTol)) << mesh.str();
    });
  }
}

// The fix the error names: per-group batches as a batch split over "dp". Tessera sums the
// gradient over the groups: one device's gradient of the summed loss over all batches.
TEST(TpSliceInputs, PerGroupBatchesSplitOverDpEqualOneDevice) {
  const auto init = embedding();
  for (const auto& shape : kShapes) {
    auto ref = clone_of(init);
    std::vector<at::Tensor> all;
    for (int64_t g = 0; g < shape[0]; ++g) all.push_back(group_ids(g));
    const at::Tensor want = ref(at::cat(all));
    want.pow(2).sum().backward();
    tessera::testing::run_ranks(test::mesh_world(shape), [&](int) {
      auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
      auto m = clone_of(init);
      parallelize_module(m, mesh["tp"], RowwiseParallel().input_layouts(Replicate()));
      const int64_t g = mesh.coordinate()[0];
      const at::Tensor ids = from_local(group_ids(g), mesh, {Shard(0), Replicate()});
      const at::Tensor y = m(ids);  // local: this group's rows
      int64_t first = 0;
      for (int64_t i = 0; i < g; ++i) first += all[static_cast<size_t>(i)].size(0);
      ASSERT_TRUE(test::matches(y, want.detach().narrow(0, first, g + 3), kTol)) << mesh.str();
      y.pow(2).sum().backward();
      ASSERT_TRUE(test::full_matches(m->weight.grad(), ref->weight.grad(), kTol)) << mesh.str();
    });
  }
}
