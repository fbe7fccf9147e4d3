// The public style boundary (NOTE: [Style conversions] in tensor_parallel.h): a parallel
// style written here, outside the library and with public headers only, converts its module's
// input and output through ParallelStyle::set_input_conversion / add_output_conversion (the
// path the built-in styles take), against one device forward and backward on 1-3 ranks with
// uneven sequence lengths. Also PrepareModuleInput with several inputs, and the styles'
// setters that had no test (input_kwarg_layouts, use_local_input, SequenceParallel's
// use_local_output): each checked by an effect that is wrong when the setter is ignored.
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "helpers.h"
#include "tessera/parallel/tensor_parallel.h"

using namespace tessera;
using tessera::test::full_matches;
using tessera::test::matches;

namespace {

const test::Tolerance kTol{1e-5, 1e-5};

template <class Holder>
Holder clone_of(const Holder& m) {
  using Impl = typename Holder::ContainedType;
  return Holder(std::dynamic_pointer_cast<Impl>(m->clone()));
}

// Rank r's torch.chunk piece of `full` along `dim`.
at::Tensor piece(const at::Tensor& full, int64_t dim, int64_t r, int64_t parts) {
  const auto sizes = chunk_sizes(full.size(dim), parts);
  int64_t off = 0;
  for (int64_t i = 0; i < r; ++i) off += sizes[static_cast<size_t>(i)];
  return full.narrow(dim, off, sizes[static_cast<size_t>(r)]);
}

int64_t count(const CommDebugMode& m, const char* kind) {
  auto c = m.get_comm_counts();
  auto it = c.find(kind);
  return it == c.end() ? 0 : it->second;
}

// A style of the user's own: the Linear's parameters stay whole, its input (a plain
// [sequence, features] tensor, equal on every rank) is cut along the sequence, each rank
// computes its rows, and the output is gathered whole and handed back as a plain tensor.
class ShardSequenceGatherOutput : public ParallelStyle {
 public:
  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override {
    for (const auto& p : module.named_parameters(/*recurse=*/false))
      tp::distribute_parameter(*this, module, p.key(), mesh, Replicate());
    tp::IoConversion in;
    in.plain = Replicate();
    in.desired = Shard(0);
    set_input_conversion(module, mesh, in);
    tp::IoConversion out;
    out.desired = Replicate();
    out.to_local = true;
    add_output_conversion(module, mesh, out);
  }
  std::string name() const override { return "ShardSequenceGatherOutput"; }
};

// The same style asked to convert a composite's output: Tessera cannot see it.
class GatherCompositeOutput : public ParallelStyle {
 public:
  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override {
    tp::IoConversion out;
    out.plain = Shard(0);
    out.desired = Replicate();
    add_output_conversion(module, mesh, out);
  }
  std::string name() const override { return "GatherCompositeOutput"; }
};

// forward(scale, x): the laid-out input is the second.
struct ScaledImpl : torch::nn::Cloneable<ScaledImpl> {
  torch::nn::Linear linear{nullptr};
  ScaledImpl() { reset(); }
  void reset() override { linear = register_module("linear", torch::nn::Linear(8, 7)); }
  at::Tensor forward(const at::Tensor& scale, const at::Tensor& x) { return linear(x) * scale; }
};
TORCH_MODULE(Scaled);

}  // namespace

TEST(TpStyleBoundary, UserStyleConvertsInputAndOutputLikeOneDevice) {
  for (int world : {1, 2, 3}) {
    for (int64_t seq : {7, 2}) {  // uneven; fewer rows than ranks (an empty shard)
      torch::manual_seed(21);
      torch::nn::Linear ref(5, 4);
      const at::Tensor x = test::randn({seq, 5}, 22);
      at::Tensor xr = x.clone().requires_grad_();
      at::Tensor y_ref = ref(xr);
      y_ref.pow(2).sum().backward();
      tessera::testing::run_ranks(world, [&](int) {
        auto mesh = init_device_mesh("cpu", {world});
        auto m = clone_of(ref);
        parallelize_module(m, mesh, ShardSequenceGatherOutput());
        EXPECT_EQ(placements(m->weight), (Placements{Replicate()}));
        at::Tensor xi = x.clone().requires_grad_();
        CommDebugMode fwd;
        at::Tensor y = m(xi);
        ASSERT_FALSE(is_dtensor(y)) << "the output conversion's to_local";
        ASSERT_TRUE(matches(y, y_ref.detach(), kTol)) << "world " << world << " seq " << seq;
        // The rows were computed apart and gathered: the input really was cut.
        if (world > 1) EXPECT_EQ(count(fwd, "all_gather"), 1);
        y.pow(2).sum().backward();
        ASSERT_TRUE(matches(xi.grad(), xr.grad(), kTol)) << "input gradient";
        ASSERT_TRUE(full_matches(m->weight.grad(), ref->weight.grad(), kTol));
        ASSERT_TRUE(full_matches(m->bias.grad(), ref->bias.grad(), kTol));
      });
    }
  }
}

TEST(TpStyleBoundary, UserStyleOutputOnACompositeIsAnError) {
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Scaled m;
    try {
      parallelize_module(m, mesh, {{"linear", ColwiseParallel()}, {"", GatherCompositeOutput()}});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("<root>"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("add_output_conversion"), std::string::npos) << e.what();
    }
  });
}

// input_layouts / desired_input_layouts of length 2, PyTorch's way: the laid-out input is
// the second; the first (a scale) passes through.
TEST(TpStyleBoundary, PrepareModuleInputWithSeveralInputs) {
  for (int world : {1, 2, 3}) {
    torch::manual_seed(23);
    Scaled ref;
    const at::Tensor x = test::randn({world + 2, 8}, 24), scale = test::randn({1}, 25);
    at::Tensor xr = x.clone().requires_grad_();
    at::Tensor y_ref = ref(scale, xr);
    y_ref.pow(2).sum().backward();
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      auto m = clone_of(ref);
      parallelize_module(m, mesh,
                         {{"", PrepareModuleInput()
                                   .input_layouts({std::nullopt, Shard(0)})
                                   .desired_input_layouts({std::nullopt, Replicate()})},
                          {"linear", ColwiseParallel()}});
      at::Tensor xi = piece(x, 0, rank, world).clone().requires_grad_();
      at::Tensor y = m(scale, xi);
      ASSERT_TRUE(matches(y, piece(y_ref.detach(), 1, rank, world), kTol)) << "world " << world;
      y.pow(2).sum().backward();
      ASSERT_TRUE(matches(xi.grad(), piece(xr.grad(), 0, rank, world), kTol));
      ASSERT_TRUE(full_matches(m->linear->weight.grad(), ref->linear->weight.grad(), kTol));
    });
  }
}

// Two laid-out inputs: Tessera can tell only one apart at the ops inside the module, so
// it is an error naming the style, the module, the inputs and the fix.
TEST(TpStyleBoundary, PrepareModuleInputWithTwoLaidOutInputsIsAnError) {
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Scaled m;
    try {
      parallelize_module(m, mesh,
                         {{"linear", ColwiseParallel()},
                          {"", PrepareModuleInput()
                                   .input_layouts({Shard(0), Shard(0)})
                                   .desired_input_layouts({Replicate(), Replicate()})}});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      for (const char* needle :
           {"PrepareModuleInput on ''", "2 inputs have layouts", "input 0, input 1", "from_local"})
        EXPECT_NE(what.find(needle), std::string::npos) << needle << " in " << what;
    }
  });
}

// input_kwarg_layouts / desired_input_kwarg_layouts: the named input is gathered once; ignored,
// the Linear would read each rank's rows as the whole input.
TEST(TpStyleBoundary, PrepareModuleInputKwargLayouts) {
  for (int world : {1, 2, 3}) {
    torch::manual_seed(26);
    Scaled ref;
    const at::Tensor x = test::randn({2 * world + 1, 8}, 27), scale = test::randn({1}, 28);
    at::Tensor y_ref = ref(scale, x);
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      auto m = clone_of(ref);
      parallelize_module(m, mesh,
                         {{"", PrepareModuleInput()
                                   .input_kwarg_layouts({{"x", Shard(0)}})
                                   .desired_input_kwarg_layouts({{"x", Replicate()}})},
                          {"linear", ColwiseParallel()}});
      at::Tensor y = m(scale, piece(x, 0, rank, world));
      ASSERT_TRUE(matches(y, piece(y_ref.detach(), 1, rank, world), kTol)) << "world " << world;
    });
  }
}

// use_local_input: the Linear gets this rank's rows as a plain tensor (which Colwise reads as
// the whole input), so each rank computes its own rows: the output holds this rank's rows of
// its columns. Without it, the distributed rows are gathered first and the output holds every
// row of this rank's columns. The output conversion keeps the columns local.
TEST(TpStyleBoundary, PrepareModuleInputOutputUseLocalInput) {
  for (int world : {2, 3}) {
    for (bool local : {true, false}) {
      torch::manual_seed(29);
      torch::nn::Linear ref(8, 5);
      const at::Tensor x = test::randn({world + 3, 8}, 30);
      at::Tensor y_ref = ref(x);
      tessera::testing::run_ranks(world, [&](int rank) {
        auto mesh = init_device_mesh("cpu", {world});
        auto m = clone_of(ref);
        parallelize_module(m, mesh,
                           {{"", ColwiseParallel().use_local_output(false)},
                            {"", PrepareModuleInputOutput()
                                     .input_layouts({Shard(0)})
                                     .desired_input_layouts({Shard(0)})
                                     .use_local_input(local)
                                     .output_layouts({Shard(1)})
                                     .desired_output_layouts({Shard(1)})
                                     .use_local_output(true)}});
        at::Tensor y = m(piece(x, 0, rank, world));
        ASSERT_FALSE(is_dtensor(y));
        const at::Tensor columns = piece(y_ref.detach(), 1, rank, world);
        const at::Tensor want = local ? piece(columns, 0, rank, world) : columns;
        ASSERT_TRUE(matches(y, want, kTol)) << "use_local_input " << local;
      });
    }
  }
}

// SequenceParallel().use_local_output(true): the output is this rank's sequence shard, plain.
TEST(TpStyleBoundary, SequenceParallelUseLocalOutput) {
  for (int world : {1, 2, 3}) {
    torch::manual_seed(31);
    torch::nn::LayerNorm ref(torch::nn::LayerNormOptions({6}));
    const at::Tensor x = test::randn({2, 2 * world + 1, 6}, 32);
    at::Tensor y_ref = ref(x);
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      auto m = clone_of(ref);
      parallelize_module(m, mesh, SequenceParallel().use_local_output(true));
      at::Tensor y = m(piece(x, 1, rank, world));
      ASSERT_FALSE(is_dtensor(y));
      ASSERT_TRUE(matches(y, piece(y_ref.detach(), 1, rank, world), kTol));
    });
  }
}

// shard_sizes on Colwise and Rowwise: the parameters' shards follow the given table (an empty
// shard included) and the pair equals one device, forward and backward. Ignored, the weights
// would take torch.chunk's layout.
TEST(TpStyleBoundary, ShardSizesLayOutTheGivenFeatures) {
  for (const ShardTable& table : {ShardTable{2, 5}, ShardTable{4, 0, 3}}) {
    const int world = static_cast<int>(table.size());
    torch::manual_seed(33);
    torch::nn::Sequential ref(torch::nn::Linear(8, 7), torch::nn::Linear(7, 5));
    const at::Tensor x = test::randn({4, 8}, 34);
    at::Tensor y_ref = ref->forward(x);
    y_ref.pow(2).sum().backward();
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      auto m = clone_of(ref);
      parallelize_module(m, mesh,
                         {{"0", ColwiseParallel().shard_sizes(table)},
                          {"1", RowwiseParallel().shard_sizes(table)}});
      auto first = m[0]->as<torch::nn::Linear>(), second = m[1]->as<torch::nn::Linear>();
      const int64_t mine = table[static_cast<size_t>(rank)];
      EXPECT_EQ(to_local(first->weight).size(0), mine);
      EXPECT_EQ(to_local(second->weight).size(1), mine);
      at::Tensor y = m->forward(x);
      ASSERT_TRUE(matches(y, y_ref.detach(), kTol));
      y.pow(2).sum().backward();
      auto ref0 = ref[0]->as<torch::nn::Linear>(), ref1 = ref[1]->as<torch::nn::Linear>();
      ASSERT_TRUE(full_matches(first->weight.grad(), ref0->weight.grad(), kTol));
      ASSERT_TRUE(full_matches(second->weight.grad(), ref1->weight.grad(), kTol));
    });
  }
}
