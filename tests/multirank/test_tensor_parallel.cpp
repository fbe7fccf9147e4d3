// Tensor-parallel styles on unchanged torch::nn modules against one device: each style alone
// (Linear, Embedding, LayerNorm; even and uneven; 1-4 ranks), forward and backward, the
// collective counts of PyTorch's own style tests on even shapes, plans with wildcards, a
// PrepareModuleInput on a composite, a style of the user's own, and bad plans (errors on
// every rank, before any collective).
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include "helpers.h"

using namespace tessera;
using tessera::test::clone_of;
namespace nn = torch::nn;
using tessera::test::full_matches;
using tessera::test::matches;

namespace {

// Rank r's piece of `full` along `dim` over `parts` ranks: torch.chunk's, or a given table.
at::Tensor piece(const at::Tensor& full, int64_t dim, int64_t r, int64_t parts,
                 const std::optional<ShardTable>& table = std::nullopt) {
  const auto sizes = table ? *table : chunk_sizes(full.size(dim), parts);
  int64_t off = 0;
  for (int64_t i = 0; i < r; ++i) off += sizes[static_cast<size_t>(i)];
  return full.narrow(dim, off, sizes[static_cast<size_t>(r)]);
}

const test::Tolerance kTol{1e-5, 1e-5};

int64_t count(const CommDebugMode& m, const char* kind) {
  auto c = m.get_comm_counts();
  auto it = c.find(kind);
  return it == c.end() ? 0 : it->second;
}

}  // namespace

// ColwiseParallel on Linear: a replicated (plain) input, local output columns; the input's
// gradient is all-reduced in backward. Uneven output features (10 over 3 or 4 ranks).
TEST(TensorParallel, ColwiseLinear) {
  for (int world : {1, 2, 3, 4}) {
    for (int64_t out : {16, 10}) {
      torch::manual_seed(out);
      torch::nn::Linear ref(16, out);
      const at::Tensor x = test::randn({8, 16}, 1);
      at::Tensor xr = x.clone().requires_grad_();
      at::Tensor y_ref = ref(xr);
      y_ref.pow(2).sum().backward();
      tessera::testing::run_ranks(world, [&](int rank) {
        auto mesh = init_device_mesh("cpu", {world});
        auto m = clone_of(ref);
        parallelize_module(m, mesh, ColwiseParallel());
        at::Tensor xi = x.clone().requires_grad_();
        CommDebugMode fwd;
        at::Tensor y = m(xi);
        const int64_t fwd_calls = fwd.get_total_counts();
        ASSERT_FALSE(is_dtensor(y));
        ASSERT_TRUE(matches(y, piece(y_ref.detach(), 1, rank, world), kTol));
        CommDebugMode bwd;
        y.pow(2).sum().backward();
        const int64_t bwd_all_reduces = count(bwd, "all_reduce");
        bwd.reset();
        ASSERT_TRUE(matches(xi.grad(), xr.grad(), kTol)) << "input gradient";
        ASSERT_TRUE(full_matches(m->weight.grad(), ref->weight.grad(), kTol));
        ASSERT_TRUE(full_matches(m->bias.grad(), ref->bias.grad(), kTol));
        if (out % world == 0 && world > 1) {  // PyTorch's test_colwise_parallel_style counts
          EXPECT_EQ(fwd_calls, 0);
          EXPECT_EQ(bwd_all_reduces, 1);
        }
      });
    }
  }
}

// input_layouts(Shard(0)): local rows are all-gathered forward, the gradient reduce-scattered.
TEST(TensorParallel, ColwiseLinearShardedRows) {
  for (int world : {2, 3, 4}) {
    torch::manual_seed(3);
    torch::nn::Linear ref(16, 16);
    const at::Tensor x = test::randn({8 * world - 1, 16}, 2);  // uneven rows
    at::Tensor xr = x.clone().requires_grad_();
    at::Tensor y_ref = ref(xr);
    y_ref.pow(2).sum().backward();
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      auto m = clone_of(ref);
      parallelize_module(m, mesh, ColwiseParallel().input_layouts(Shard(0)));
      at::Tensor xi = piece(x, 0, rank, world).clone().requires_grad_();
      at::Tensor y;
      {
        CommDebugMode fwd;
        y = m(xi);
        EXPECT_EQ(count(fwd, "all_gather"), 1) << fwd.table();
      }
      ASSERT_TRUE(matches(y, piece(y_ref.detach(), 1, rank, world), kTol));
      {
        CommDebugMode bwd;
        y.pow(2).sum().backward();
        EXPECT_EQ(count(bwd, "reduce_scatter"), 1) << bwd.table();
      }
      ASSERT_TRUE(matches(xi.grad(), piece(xr.grad(), 0, rank, world), kTol));
      ASSERT_TRUE(full_matches(m->weight.grad(), ref->weight.grad(), kTol));
    });
  }
}

// RowwiseParallel on Linear: local input features (plain, read with the weight's own split),
// Replicate output after one all-reduce; Shard(0) output after one reduce-scatter.
TEST(TensorParallel, RowwiseLinear) {
  for (int world : {1, 2, 3, 4}) {
    for (int64_t in : {16, 10}) {
      for (bool shard_out : {false, true}) {
        torch::manual_seed(in);
        torch::nn::Linear ref(in, 16);
        const at::Tensor x = test::randn({8, in}, 4);
        at::Tensor xr = x.clone().requires_grad_();
        at::Tensor y_ref = ref(xr);
        y_ref.pow(2).sum().backward();
        tessera::testing::run_ranks(world, [&](int rank) {
          auto mesh = init_device_mesh("cpu", {world});
          auto m = clone_of(ref);
          auto style = RowwiseParallel();
          if (shard_out) style.output_layouts(Shard(0));
          parallelize_module(m, mesh, style);
          at::Tensor xi = piece(x, 1, rank, world).clone().requires_grad_();
          CommDebugMode fwd;
          at::Tensor y = m(xi);
          ASSERT_FALSE(is_dtensor(y));
          const at::Tensor want =
              shard_out ? piece(y_ref.detach(), 0, rank, world) : y_ref.detach();
          ASSERT_TRUE(matches(y, want, kTol));
          const int64_t fwd_calls = fwd.get_total_counts();
          const auto fwd_counts = fwd.get_comm_counts();
          fwd.reset();
          CommDebugMode bwd;
          // A replicated local output: every rank takes the same loss (PyTorch's semantics);
          // sharded rows: each rank its part, which sum to the whole.
          y.pow(2).sum().backward();
          const auto bwd_counts = bwd.get_comm_counts();
          const int64_t bwd_calls = bwd.get_total_counts();
          ASSERT_TRUE(matches(xi.grad(), piece(xr.grad(), 1, rank, world), kTol));
          ASSERT_TRUE(full_matches(m->weight.grad(), ref->weight.grad(), kTol));
          ASSERT_TRUE(full_matches(m->bias.grad(), ref->bias.grad(), kTol));
          if (in % world == 0 && world > 1) {  // PyTorch's test_rowwise_parallel_style counts
            EXPECT_EQ(fwd_calls, 1);
            EXPECT_EQ(fwd_counts.count(shard_out ? "reduce_scatter" : "all_reduce"), 1u);
            EXPECT_EQ(bwd_calls, shard_out ? 1 : 0);
            if (shard_out) {
              EXPECT_EQ(bwd_counts.count("all_gather"), 1u);
            }
          }
        });
      }
    }
  }
}

// Embedding: Colwise shards the embedding dim (no communication); Rowwise shards the
// vocabulary (4N+1 rows: uneven) and all-reduces the looked-up rows.
TEST(TensorParallel, Embeddings) {
  for (int world : {1, 2, 3, 4}) {
    for (bool rowwise : {false, true}) {
      const int64_t vocab = 4 * world + 1;
      torch::manual_seed(world);
      torch::nn::Embedding ref(vocab, 16);
      const at::Tensor idx = at::randint(vocab, {4, 3}, test::generator(5), at::kLong);
      at::Tensor y_ref = ref(idx);
      y_ref.pow(2).sum().backward();
      tessera::testing::run_ranks(world, [&](int rank) {
        auto mesh = init_device_mesh("cpu", {world});
        auto m = clone_of(ref);
        if (rowwise)
          parallelize_module(m, mesh, RowwiseParallel());
        else
          parallelize_module(m, mesh, ColwiseParallel());
        int64_t fwd_calls = 0, bwd_calls = 0;
        at::Tensor y;
        {
          CommDebugMode fwd;
          y = m(idx);
          fwd_calls = fwd.get_total_counts();
        }
        ASSERT_FALSE(is_dtensor(y));
        ASSERT_TRUE(
            matches(y, rowwise ? y_ref.detach() : piece(y_ref.detach(), 2, rank, world), kTol));
        {
          CommDebugMode bwd;
          y.pow(2).sum().backward();
          bwd_calls = bwd.get_total_counts();
        }
        ASSERT_TRUE(full_matches(m->weight.grad(), ref->weight.grad(), kTol));
        if (world > 1) {
          EXPECT_EQ(fwd_calls, rowwise ? 1 : 0);
          EXPECT_EQ(bwd_calls, 0);
        }
      });
    }
  }
}

// Whole heads per rank: 6 heads of 4 features on 4 ranks as 2/2/1/1 heads, with
// distributed activations between the two Linears (no local shapes in model code).
TEST(TensorParallel, UnevenHeadsStayWhole) {
  const int world = 4;
  const int64_t heads = 6, hd = 4, dim = heads * hd;
  torch::manual_seed(7);
  torch::nn::Linear wq_ref(dim, dim), wo_ref(dim, dim);
  const at::Tensor x = test::randn({2, 5, dim}, 8);
  at::Tensor xr = x.clone().requires_grad_();
  auto attn = [&](torch::nn::Linear wq, torch::nn::Linear wo, const at::Tensor& in) {
    at::Tensor q = wq(in).view({2, 5, heads, hd}).softmax(-1);
    return wo(q.reshape({2, 5, dim}));
  };
  at::Tensor y_ref = attn(wq_ref, wo_ref, xr);
  y_ref.pow(2).sum().backward();
  tessera::testing::run_ranks(world, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {world});
    auto wq = clone_of(wq_ref), wo = clone_of(wo_ref);
    parallelize_module(wq, mesh, ColwiseParallel().shard_unit(hd).use_local_output(false));
    parallelize_module(wo, mesh, RowwiseParallel().shard_unit(hd).use_local_output(false));
    EXPECT_EQ(spec(wq->weight).shard_table(0), (ShardTable{8, 8, 4, 4}));
    at::Tensor xi = x.clone().requires_grad_();
    at::Tensor y = attn(wq, wo, xi);
    ASSERT_TRUE(is_dtensor(y));
    ASSERT_TRUE(full_matches(y, y_ref.detach(), kTol));
    at::Tensor loss = y.pow(2).sum();
    loss.backward();
    ASSERT_TRUE(matches(xi.grad(), xr.grad(), kTol));
    ASSERT_TRUE(full_matches(wq->weight.grad(), wq_ref->weight.grad(), kTol));
    ASSERT_TRUE(full_matches(wo->weight.grad(), wo_ref->weight.grad(), kTol));
  });
}

// SequenceParallel on LayerNorm: sequence shards in (plain local, uneven; or distributed),
// no communication, output distributed Shard(1), weight gradients equal one device.
TEST(TensorParallel, SequenceParallelLayerNorm) {
  for (int world : {1, 2, 3}) {
    for (bool plain : {true, false}) {
      torch::manual_seed(11);
      torch::nn::LayerNorm ref(torch::nn::LayerNormOptions({12}));
      const at::Tensor x = test::randn({3, 4 * world + 1, 12}, 12);
      at::Tensor xr = x.clone().requires_grad_();
      at::Tensor y_ref = ref(xr);
      y_ref.pow(3).sum().backward();
      tessera::testing::run_ranks(world, [&](int rank) {
        auto mesh = init_device_mesh("cpu", {world});
        auto m = clone_of(ref);
        parallelize_module(m, mesh, SequenceParallel());
        at::Tensor xi = piece(x, 1, rank, world).clone().requires_grad_();
        at::Tensor in = plain ? xi : from_local(xi, mesh, {Shard(1)}, {ShardSizes::Infer()});
        CommDebugMode comm;
        at::Tensor y = m(in);
        ASSERT_TRUE(is_dtensor(y));
        EXPECT_EQ(placements(y), (Placements{Shard(1)}));
        ASSERT_TRUE(full_matches(y, y_ref.detach(), kTol));
        y.pow(3).sum().backward();
        ASSERT_TRUE(matches(xi.grad(), piece(xr.grad(), 1, rank, world), kTol));
        ASSERT_TRUE(full_matches(m->weight.grad(), ref->weight.grad(), kTol));
        ASSERT_TRUE(full_matches(m->bias.grad(), ref->bias.grad(), kTol));
      });
    }
  }
}

// The Megatron MLP through a plan with wildcards, trained with SGD: one all-reduce forward,
// one backward (PyTorch's test_mlp_training), equal to one device.
TEST(TensorParallel, MlpPlanTrainsLikeOneDevice) {
  for (int world : {2, 3, 4}) {
    torch::manual_seed(5);
    torch::nn::Sequential ref(torch::nn::Linear(10, 16), torch::nn::ReLU(),
                              torch::nn::Linear(16, 10));
    const at::Tensor x = test::randn({8, 10}, 6), t = test::randn({8, 10}, 7);
    std::vector<double> losses_ref;
    auto train = [&](torch::nn::Sequential model, std::vector<double>& losses,
                     const DeviceMesh* mesh, std::vector<std::map<std::string, int64_t>>* comms) {
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.25));
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        CommDebugMode mode;
        at::Tensor loss = at::mse_loss(model->forward(x), t);
        loss.backward();
        if (comms) comms->push_back(mode.get_comm_counts());
        opt.step();
        losses.push_back(loss.item<double>());
      }
    };
    auto model_ref = clone_of(ref);
    train(model_ref, losses_ref, nullptr, nullptr);
    tessera::testing::run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", {world});
      auto m = clone_of(ref);
      parallelize_module(m, mesh, {{"[0]", ColwiseParallel()}, {"[!01]", RowwiseParallel()}});
      std::vector<double> losses;
      std::vector<std::map<std::string, int64_t>> comms;
      train(m, losses, &mesh, &comms);
      for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], losses_ref[s], 1e-5);
      for (const auto& item : model_ref->named_parameters())
        ASSERT_TRUE(
            full_matches(*m->named_parameters().find(item.key()), item.value().detach(), kTol))
            << item.key();
      // One all-reduce forward; none backward, the input needing no gradient (PyTorch: 1).
      if (16 % world == 0) {
        EXPECT_EQ(comms[1], (std::map<std::string, int64_t>{{"all_reduce", 1}}));
      }
    });
  }
}

namespace {
// forward(x, y) = linear(x) + y, as PyTorch's test_prepare_module_input_multiple_inputs.
struct TwoInputsImpl : torch::nn::Cloneable<TwoInputsImpl> {
  torch::nn::Linear linear{nullptr};
  TwoInputsImpl() { reset(); }
  void reset() override { linear = register_module("linear", torch::nn::Linear(8, 8)); }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) { return linear(x) + y; }
};
TORCH_MODULE(TwoInputs);
}  // namespace

// PrepareModuleInput on a composite: its input (local rows) is gathered once at the Linear
// inside it, which Colwise then shards by columns.
TEST(TensorParallel, PrepareModuleInputOnComposite) {
  for (int world : {1, 2, 3}) {
    torch::manual_seed(9);
    TwoInputs ref;
    const at::Tensor x = test::randn({2 * world, 8}, 10), y = test::randn({2 * world, 8}, 11);
    at::Tensor out_ref = ref(x, y);
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      auto m = clone_of(ref);
      parallelize_module(m, mesh,
                         {{"", PrepareModuleInput()
                                   .input_layouts({Shard(0), std::nullopt})
                                   .desired_input_layouts({Replicate(), std::nullopt})},
                          {"linear", ColwiseParallel()}});
      at::Tensor out = m(piece(x, 0, rank, world), piece(y, 1, rank, world));
      ASSERT_TRUE(matches(out, piece(out_ref.detach(), 1, rank, world), kTol));
    });
  }
}

namespace {
// A style of the user's own: keeps every parameter replicated (torchtitan's NoParallel).
struct Replicated : ParallelStyle {
  void apply(torch::nn::Module& module, const DeviceMesh& mesh) const override {
    for (const auto& p : module.named_parameters(/*recurse=*/false))
      tp::distribute_parameter(*this, module, p.key(), mesh, Replicate());
  }
  std::string name() const override { return "Replicated"; }
};
}  // namespace

TEST(TensorParallel, UserStyle) {
  tessera::testing::run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    torch::manual_seed(1);
    torch::nn::Sequential m(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4));
    parallelize_module(m, mesh, {{"0", Replicated()}, {"2", ColwiseParallel()}});
    EXPECT_EQ(placements(m[0]->as<torch::nn::Linear>()->weight), (Placements{Replicate()}));
    EXPECT_EQ(placements(m[2]->as<torch::nn::Linear>()->weight), (Placements{Shard(0)}));
  });
}

// Plans Tessera cannot honour fail at parallelize time on every rank, naming the path.
TEST(TensorParallel, BadPlansAreErrors) {
  auto expect_error = [](const std::function<void(const DeviceMesh&)>& f, const std::string& text) {
    tessera::testing::run_ranks(2, [&](int) {
      auto mesh = init_device_mesh("cpu", {2});
      try {
        f(mesh);
        ADD_FAILURE() << "no error; expected one mentioning: " << text;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      }
    });
  };
  auto mlp = [] {
    return torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::ReLU(),
                                 torch::nn::Linear(4, 4));
  };
  expect_error(
      [&](const DeviceMesh& mesh) {
        auto m = mlp();
        parallelize_module(m, mesh, {{"0", ColwiseParallel()}, {"net3", RowwiseParallel()}});
      },
      "'net3' matches no submodule");
  expect_error(
      [&](const DeviceMesh& mesh) {
        auto m = mlp();
        parallelize_module(m, mesh, {{"1", ColwiseParallel()}});
      },
      "ColwiseParallel applies to Linear and Embedding");
  expect_error(
      [&](const DeviceMesh& mesh) {
        auto m = mlp();
        parallelize_module(m, mesh, {{"0", ColwiseParallel()}, {"0", RowwiseParallel()}});
      },
      "one parameter style");
  expect_error(
      [&](const DeviceMesh& mesh) {
        auto m = mlp();
        parallelize_module(m, mesh,
                           {{"", PrepareModuleOutput()
                                     .output_layouts({Shard(0)})
                                     .desired_output_layouts({Replicate()})},
                            {"0", ColwiseParallel()}});
      },
      "PrepareModuleOutput on '<root>'");
  expect_error(
      [&](const DeviceMesh& mesh) {
        auto m = mlp();
        parallelize_module(m, mesh,
                           {{"", PrepareModuleInput()
                                     .input_layouts({Shard(0)})
                                     .desired_input_layouts({Replicate()})}});
      },
      "cannot see its input");
  expect_error(
      [&](const DeviceMesh& mesh) {
        auto m = mlp();
        parallelize_module(m, mesh, {{"1", SequenceParallel()}});
      },
      "has no parameters");
  expect_error(
      [&](const DeviceMesh& mesh) {
        auto m = mlp();
        parallelize_module(m, mesh, {{"0", PrepareModuleInput().input_layouts({Shard(0)})}});
      },
      "desired_input_layouts must be");
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    try {
      auto m = mlp();
      parallelize_module(m, mesh, {{"0", ColwiseParallel()}});
      ADD_FAILURE() << "a 2-D mesh was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("1-D mesh"), std::string::npos) << e.what();
    }
  });
}

// Dropout inside a tensor-parallel region on distributed activations (sharded after the
// Colwise Linear, replicated after the Rowwise one) equals one device, although every rank
// was seeded differently: distributed random ops agree on world rank 0's state.
TEST(TensorParallel, DropoutEqualsOneDeviceWhateverEachRanksSeed) {
  for (int world : {2, 3}) {
    torch::manual_seed(21);
    torch::nn::Linear up_ref(8, 12), down_ref(12, 8);
    const at::Tensor x = test::randn({5, 8}, 22);
    auto run = [&](torch::nn::Linear up, torch::nn::Linear down, const at::Tensor& in) {
      at::Tensor h = torch::nn::functional::dropout(
          up(in).relu(), torch::nn::functional::DropoutFuncOptions().p(0.4));
      return torch::nn::functional::dropout(down(h),
                                            torch::nn::functional::DropoutFuncOptions().p(0.3));
    };
    torch::manual_seed(1000);  // one device, seeded like rank 0 below (no rank threads yet)
    at::Tensor xr = x.clone().requires_grad_();
    at::Tensor y_ref = run(up_ref, down_ref, xr);
    y_ref.sum().backward();
    tessera::testing::run_ranks(world, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {world});
      tessera::manual_seed(1000 + 17 * rank);  // rank-dependent seeds
      auto up = clone_of(up_ref), down = clone_of(down_ref);
      parallelize_module(up, mesh, ColwiseParallel().use_local_output(false));
      parallelize_module(down, mesh, RowwiseParallel().use_local_output(false));
      at::Tensor xi = x.clone().requires_grad_();
      at::Tensor y = run(up, down, xi);
      ASSERT_TRUE(full_matches(y, y_ref.detach(), kTol));
      y.sum().backward();
      ASSERT_TRUE(matches(xi.grad(), xr.grad(), kTol));
      ASSERT_TRUE(full_matches(up->weight.grad(), up_ref->weight.grad(), kTol));
      tessera::clear_manual_seed();
    });
  }
}

// TP on the middle dim of a 3-D mesh (2 x 2 x 1, "dp" x "tp" x "cp"): parameters live on the
// root mesh, replicated over "dp" and "cp"; the batch is sharded over "dp" (uneven: 5 rows as
// 3 + 2). Three SGD steps equal one device.
TEST(TensorParallel, SliceOfThreeDimensionalMesh) {
  torch::manual_seed(9);
  torch::nn::Sequential ref(torch::nn::Linear(6, 10), torch::nn::Tanh(), torch::nn::Linear(10, 6));
  const at::Tensor x = test::randn({5, 6}, 10), t = test::randn({5, 6}, 11);
  auto model_ref = clone_of(ref);
  std::vector<double> losses_ref;
  {
    torch::optim::SGD opt(model_ref->parameters(), torch::optim::SGDOptions(0.2));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      at::Tensor loss = at::mse_loss(model_ref->forward(x), t);
      loss.backward();
      opt.step();
      losses_ref.push_back(loss.item<double>());
    }
  }
  tessera::testing::run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2, 1}, {"dp", "tp", "cp"});
    auto m = clone_of(ref);
    parallelize_module(m, mesh["tp"],
                       {{"0", ColwiseParallel().use_local_output(false)},
                        {"2", RowwiseParallel().use_local_output(false)}});
    const Placements batch = {Shard(0), Replicate(), Replicate()};
    const auto xd = distribute_tensor(x, mesh, batch, std::nullopt, ShardSizes::Given(0, {3, 2}));
    const auto td = distribute_tensor(t, mesh, batch, std::nullopt, ShardSizes::Given(0, {3, 2}));
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.2));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      at::Tensor loss = at::mse_loss(m->forward(xd), td);
      loss.backward();
      opt.step();
      EXPECT_NEAR(full_tensor(loss).item<double>(), losses_ref[step], 1e-5) << "step " << step;
    }
    const auto params = m->named_parameters();
    for (const auto& item : model_ref->named_parameters()) {
      const at::Tensor& p = *params.find(item.key());
      ASSERT_TRUE(is_dtensor(p)) << item.key();
      EXPECT_EQ(spec(p).mesh().ndim(), 3) << item.key() << " " << spec(p).str();
      ASSERT_TRUE(full_matches(p, item.value().detach(), kTol)) << item.key();
    }
  });
}
