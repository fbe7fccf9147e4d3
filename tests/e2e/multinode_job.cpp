// A 4-rank job meant to span hosts (multinode.sh starts it with one tessera-run per network
// namespace, 2 ranks each) on a 2 x 2 mesh whose "dp" dim crosses the hosts: redistribute
// chains, three SGD steps of a dp x tp MLP, and a halo conv2d over uneven tiles, each
// compared with the same computation on the full tensor in this process.
#include <cmath>
#include <cstdio>
#include <string>

#include <torch/optim/sgd.h>

#include "tessera/tessera.h"

using namespace tessera;

namespace {

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randn(shape, g, at::TensorOptions().dtype(at::kDouble));
}

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("rank %d: %-46s %s\n", get_rank(), what.c_str(), ok ? "ok" : "MISMATCH");
  if (!ok) ++failures;
}

bool close(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::allclose(a, b, 1e-9, 1e-11);
}

void redistribute_chains(const DeviceMesh& mesh) {
  const auto full = randn({13, 10}, 1);
  // Uneven: dim 0 cut 7 | 6 over "dp", dim 1 cut 1 | 9 over "tp".
  auto x = distribute_tensor(full, mesh, {Shard(0), Shard(1)}, std::nullopt,
                             ShardSizes::Given({{7, 6}, {1, 9}}));
  const std::vector<Placements> chain = {{Shard(1), Shard(0)},
                                         {Replicate(), Shard(0)},
                                         {Shard(0), Shard(0)},
                                         {Shard(1), Replicate()},
                                         {Replicate(), Replicate()}};
  at::Tensor y = x;
  bool ok = true;
  for (const auto& p : chain) {
    y = redistribute(y, p);
    ok = ok && close(full_tensor(y), full);
  }
  check(ok, "redistribute chain of 5");
  // Partial sums across hosts: each rank's local term, reduced.
  auto part = from_local(full * (get_rank() + 1), mesh, {Partial(), Partial()});
  check(close(full_tensor(part), full * 10), "Partial(sum) over both mesh dims");
}

void training_steps(const DeviceMesh& mesh) {
  const auto w1 = randn({16, 8}, 11) * 0.3, b1 = randn({16}, 12) * 0.1;
  const auto w2 = randn({4, 16}, 13) * 0.3, b2 = randn({4}, 14) * 0.1;
  const auto x = randn({10, 8}, 21), y = randn({10, 4}, 22);
  auto train = [](std::vector<at::Tensor> p, const at::Tensor& x, const at::Tensor& y) {
    for (auto& t : p) t = t.detach().clone().requires_grad_();
    torch::optim::SGD opt(p, torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      at::mse_loss(at::linear(at::linear(x, p[0], p[1]).relu(), p[2], p[3]), y).backward();
      opt.step();
    }
    return p;
  };
  auto ref = train({w1, b1, w2, b2}, x, y);
  // Megatron MLP over "tp", the batch (7 | 3 rows) over "dp".
  auto dist = train({distribute_tensor(w1, mesh, {Replicate(), Shard(0)}, std::nullopt),
                     distribute_tensor(b1, mesh, {Replicate(), Shard(0)}, std::nullopt),
                     distribute_tensor(w2, mesh, {Replicate(), Shard(1)}, std::nullopt),
                     distribute_tensor(b2, mesh, {Replicate(), Replicate()}, std::nullopt)},
                    distribute_tensor(x, mesh, {Shard(0), Replicate()}, std::nullopt,
                                      ShardSizes::Given(0, {7, 3})),
                    distribute_tensor(y, mesh, {Shard(0), Replicate()}, std::nullopt,
                                      ShardSizes::Given(0, {7, 3})));
  bool ok = true;
  for (size_t i = 0; i < ref.size(); ++i) ok = ok && close(full_tensor(dist[i]), ref[i].detach());
  check(ok, "3 SGD steps of a dp x tp MLP");
}

void halo_conv(const DeviceMesh& mesh) {
  const auto x = randn({2, 3, 11, 9}, 31), w = randn({4, 3, 3, 3}, 32), b = randn({4}, 33);
  auto ref_x = x.clone().requires_grad_(), ref_w = w.clone().requires_grad_();
  auto ref = at::conv2d(ref_x, ref_w, b, 1, 1);
  ref.pow(2).sum().backward();
  // Rows 8 | 3 over "dp" (across hosts), columns 4 | 5 over "tp".
  auto dx = distribute_tensor(x, mesh, {Shard(2), Shard(3)}, std::nullopt,
                              ShardSizes::Given({{}, {}, {8, 3}, {4, 5}}))
                .requires_grad_();
  auto dw = distribute_tensor(w, mesh, {Replicate(), Replicate()}, std::nullopt).requires_grad_();
  auto db = distribute_tensor(b, mesh, {Replicate(), Replicate()}, std::nullopt);
  auto out = at::conv2d(dx, dw, db, 1, 1);
  out.pow(2).sum().backward();
  check(close(full_tensor(out), ref.detach()), "halo conv2d forward, 2x2 uneven tiles");
  check(close(full_tensor(dx.grad()), ref_x.grad()) && close(full_tensor(dw.grad()), ref_w.grad()),
        "halo conv2d backward (input and weight)");
}

}  // namespace

int main() {
  init_process_group();
  TORCH_CHECK(get_world_size() == 4, "multinode_job runs on 4 ranks, not ", get_world_size());
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  std::printf("rank %d: gloo on %s\n", get_rank(), current_world()->gloo_hostname().c_str());
  redistribute_chains(mesh);
  training_steps(mesh);
  halo_conv(mesh);
  std::printf("rank %d: %s\n", get_rank(), failures == 0 ? "ALL OK" : "FAILED");
  return failures == 0 ? 0 : 1;
}
