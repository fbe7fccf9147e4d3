// Tensor parallelism on the GPU against one GPU: the Llama-style model of
// examples/llama_model.h on a 2x2 data x tensor parallel mesh (the batch a distributed
// tensor over "dp", torchtitan's plan on "tp", 6 heads and a vocabulary of 65 split unevenly),
// alone and with replicate or fully_shard over "dp", 3 AdamW steps; and loss_parallel's
// cross entropy on class-sharded logits (uneven, 1-D and 2x2), value and gradient.
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "gpu_helpers.h"
#include "llama_plan.h"

using namespace tessera;
using gpu_test::GpuMesh;
using llama::LlamaConfig;
using llama::Transformer;

namespace {

constexpr int kSteps = 3;

LlamaConfig config() {
  LlamaConfig c;
  c.vocab_size = 4 * 16 + 1;
  c.dim = 48;
  c.n_layers = 2;
  c.n_heads = 6;
  c.ffn_hidden = 94;
  c.max_seq_len = 16;
  return c;
}

void register_rmsnorm_member() {
  static const bool once = [] {
    register_member_accessor<llama::RMSNormImpl>(
        [](llama::RMSNormImpl& m, const std::string& name) -> at::Tensor* {
          return name == "weight" ? &m.weight : nullptr;
        });
    return true;
  }();
  (void)once;
}

// A copy of `proto` in float64 on `device`.
Transformer copy_of(const Transformer& proto, at::Device device) {
  Transformer m(proto->config);
  m->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    const auto src = proto->named_parameters();
    for (auto& item : m->named_parameters()) item.value().copy_(src[item.key()]);
  }
  m->to(device);
  return m;
}

std::vector<double> train(Transformer model, const at::Tensor& tokens, const at::Tensor& targets) {
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    const auto logits = model->forward(tokens);
    const at::Tensor loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, model->config.vocab_size}), targets.reshape({-1}));
    loss.backward();
    opt.step();
    losses.push_back(is_dtensor(loss) ? full_tensor(loss).item<double>() : loss.item<double>());
  }
  return losses;
}

void expect_same(const std::vector<double>& losses, const std::vector<double>& expected,
                 const Transformer& model, const Transformer& ref, const DeviceMesh& mesh,
                 const std::string& what) {
  ASSERT_EQ(losses.size(), expected.size());
  for (size_t s = 0; s < losses.size(); ++s)
    ASSERT_NEAR(losses[s], expected[s], 1e-9 * (1 + std::abs(expected[s])))
        << what << " step " << s;
  ASSERT_TRUE(gpu_test::parameters_on_mesh_device(*model, mesh)) << what;
  const auto want = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    const at::Tensor e = want[item.key()].detach();
    ASSERT_TRUE(is_dtensor(p) ? test::full_matches(p, e, {1e-8, 1e-10})
                              : test::matches(p.detach(), e, {1e-8, 1e-10}))
        << what << " parameter " << item.key();
  }
}

}  // namespace

class GpuLlama : public ::testing::TestWithParam<GpuMesh> {};

TEST_P(GpuLlama, DataTimesTensorParallelTrainsLikeOneDevice) {
  const GpuMesh m{GetParam().type, {2, 2}, {"dp", "tp"}};
  TESSERA_REQUIRE_GPU_MESH(m);
  register_rmsnorm_member();
  const auto c = config();
  // Next-token prediction on arithmetic sequences (3 rows: 2 + 1 over "dp"; 7 positions).
  auto g = test::generator(6);
  const auto start = at::randint(0, c.vocab_size, {3, 1}, g, at::kLong);
  const auto stride = at::randint(1, 5, {3, 1}, g, at::kLong);
  const auto walk =
      at::remainder(start + stride * at::arange(8, at::kLong).view({1, -1}), c.vocab_size);
  const at::Tensor tokens = walk.narrow(1, 0, 7).contiguous().to(gpu_test::cuda());
  const at::Tensor targets = walk.narrow(1, 1, 7).contiguous().to(gpu_test::cuda());
  torch::manual_seed(23);  // on the test thread, before any rank exists
  const Transformer proto(c);
  const Transformer ref = copy_of(proto, gpu_test::cuda());
  const auto expected = train(ref, tokens, targets);
  for (bool sp : {false, true}) {
    gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
      llama::PlanOptions o;
      o.sequence_parallel = sp;
      o.local_output = false;
      o.head_dim = c.head_dim();
      const Placements batch = {Shard(0), Replicate()};
      const auto dt = distribute_tensor(tokens, mesh, batch, std::nullopt);
      const auto dy = distribute_tensor(targets, mesh, batch, std::nullopt);
      const std::string what = m.name() + (sp ? " dp x tp+sp" : " dp x tp");
      // Tensor parallel over "tp"; parameters replicated over "dp" (gradients summed there).
      auto tp = copy_of(proto, mesh.device());
      parallelize_module(tp, mesh["tp"], llama::tensor_parallel_plan(o));
      expect_same(train(tp, dt, dy), expected, tp, ref, mesh, what);
      // With replicate over "dp": the data-parallel sums go through buckets.
      auto bucketed = copy_of(proto, mesh.device());
      parallelize_module(bucketed, mesh["tp"], llama::tensor_parallel_plan(o));
      auto ddp = replicate(bucketed, mesh["dp"]);
      expect_same(train(bucketed, dt, dy), expected, bucketed, ref, mesh, what + " replicate");
      // With fully_shard over "dp" on every block and the root.
      auto sharded = copy_of(proto, mesh.device());
      parallelize_module(sharded, mesh["tp"], llama::tensor_parallel_plan(o));
      for (const auto& layer : *sharded->layers) fully_shard(*layer, mesh["dp"]);
      fully_shard(*sharded, mesh["dp"]);
      expect_same(train(sharded, dt, dy), expected, sharded, ref, mesh, what + " fully_shard");
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuLlama,
                         ::testing::Values(GpuMesh{"cuda:gloo", {2, 2}}, GpuMesh{"cuda", {2, 2}}),
                         gpu_test::mesh_param_name);

// ---- loss_parallel ------------------------------------------------------------------------

namespace {

struct LossCase {
  std::vector<int64_t> shape;  // [N, C] or [N, C, L]
  bool two_d;                  // 2x2 mesh: rows over dim 0, classes over dim 1
  ShardTable class_table, row_table;
  bool target_distributed;
  int64_t reduction;
  double smoothing;
};

void check_loss(const DeviceMesh& mesh, const LossCase& c, uint64_t seed) {
  const at::Device dev = mesh.device();
  const int64_t C = c.shape[1];
  const at::Tensor logits = gpu_test::randn(c.shape, seed, dev) * 2;
  std::vector<int64_t> rows = c.shape;
  rows.erase(rows.begin() + 1);
  at::Tensor target = at::randint(0, C, rows, test::generator(seed + 1), at::kLong);
  target.view({-1}).slice(0, 1, c10::nullopt, 3).fill_(-100);  // every third ignored
  target = target.to(dev);
  const at::Tensor weight =
      (at::rand({C}, test::generator(seed + 2)) + 0.5).to(at::kDouble).to(dev);

  const at::Tensor ref_x = logits.clone().requires_grad_();
  const at::Tensor ref =
      at::cross_entropy_loss(ref_x, target, weight, c.reduction, -100, c.smoothing);

  const bool split = mesh.size() > 1;
  const Placements lp = c.two_d ? Placements{Shard(0), Shard(1)} : Placements{Shard(1)};
  std::vector<ShardTable> lt(c.shape.size());
  if (split) lt[1] = c.class_table;
  if (split && c.two_d) lt[0] = c.row_table;
  const at::Tensor dx = distribute_tensor(logits, mesh, lp, std::nullopt, ShardSizes::Given(lt))
                            .detach()
                            .requires_grad_();
  // A distributed target is sharded like the logits' rows; a plain one is whole everywhere.
  at::Tensor dt = target;
  if (c.target_distributed) {
    Placements tp(mesh.ndim(), Replicate());
    std::vector<ShardTable> tt(rows.size());
    if (c.two_d) tp[0] = Shard(0), tt[0] = split ? c.row_table : ShardTable{};
    dt = distribute_tensor(target, mesh, tp, std::nullopt, ShardSizes::Given(tt));
  }
  const at::Tensor dw =
      distribute_tensor(weight, mesh, Placements(mesh.ndim(), Replicate()), std::nullopt);
  at::Tensor got;
  {
    LossParallel scope;
    got = at::cross_entropy_loss(dx, dt, dw, c.reduction, -100, c.smoothing);
  }
  const std::string what = mesh.str() + " logits " + shape_str(c.shape) + " reduction " +
                           std::to_string(c.reduction) + " smoothing " +
                           std::to_string(c.smoothing);
  ASSERT_TRUE(is_dtensor(got)) << what;
  ASSERT_TRUE(gpu_test::on_mesh_device(got, mesh)) << what;
  ASSERT_TRUE(test::full_matches(got, ref, gpu_test::kTol)) << what << " (forward)";
  const at::Tensor g = gpu_test::randn(ref.sizes(), seed + 3, dev);
  ref.backward(g);
  got.backward(gpu_test::grad_like(g, got));  // backward may run outside the scope
  ASSERT_TRUE(gpu_test::on_mesh_device(dx.grad(), mesh)) << what;
  ASSERT_TRUE(test::full_matches(dx.grad(), ref_x.grad(), gpu_test::kTol)) << what << " (gradient)";
}

}  // namespace

class GpuLossParallel : public ::testing::TestWithParam<GpuMesh> {};

TEST_P(GpuLossParallel, ClassShardedCrossEntropyMatchesOneDevice) {
  const GpuMesh m = GetParam();
  TESSERA_REQUIRE_GPU_MESH(m);
  const bool two_d = m.shape.size() == 2;
  const ShardTable classes = two_d || m.world() == 2 ? ShardTable{9, 2} : ShardTable{6, 0, 5};
  const std::vector<LossCase> cases = {
      {{6, 11}, two_d, classes, {4, 2}, false, at::Reduction::Mean, 0.0},
      {{6, 11}, two_d, classes, {1, 5}, true, at::Reduction::Sum, 0.1},
      {{5, 11, 3}, two_d, classes, {0, 5}, true, at::Reduction::Mean, 0.2},
      {{6, 11}, two_d, classes, {3, 3}, two_d, at::Reduction::None, 0.0},
  };
  gpu_test::on_gpu_mesh(m, [&](const DeviceMesh& mesh) {
    uint64_t seed = 400;
    for (const auto& c : cases) check_loss(mesh, c, seed += 10);
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, GpuLossParallel,
                         ::testing::Values(GpuMesh{"cuda:gloo", {2}}, GpuMesh{"cuda:gloo", {3}},
                                           GpuMesh{"cuda:gloo", {2, 2}}, GpuMesh{"cuda", {1}},
                                           GpuMesh{"cuda", {2, 2}}),
                         gpu_test::mesh_param_name);
