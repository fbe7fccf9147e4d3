// Checkpoint throughput per rank: tessera::checkpoint save / load of a model-sized state
// (float32 tensors, Shard(0) over the ranks, as fully_shard lays parameters out) against
// writing and reading the same shards with plain torch::save / torch::load, one file per
// rank. Both sides fsync what they write (torch::save alone would leave it in the page
// cache). Also a resharding load: into tables whose boundaries all moved, so every rank
// reads parts of two saved chunks.
//
//   tessera-run -n N ./build/bench/bench_checkpoint [--mb 256] [--reps 3] [--dir /tmp]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/serialize.h>

#include "tessera/tessera.h"

using namespace tessera;
namespace ckpt = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void fsync_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// The slowest rank's time of fn (every rank runs it between two barriers).
double timed(const comm::Group& world, const std::function<void()>& fn) {
  comm::all_gather_ints(world, {0});
  const double t0 = now();
  fn();
  const double mine = now() - t0;
  const auto all = comm::all_gather_ints(world, {static_cast<int64_t>(mine * 1e9)});
  int64_t slowest = 0;
  for (const auto& v : all) slowest = std::max(slowest, v[0]);
  return static_cast<double>(slowest) * 1e-9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tessera::checkpoint save/load throughput vs torch::save/load of each rank's shards"};
  int64_t mb = 256;
  int reps = 3;
  std::string base = fs::temp_directory_path().string();
  app.add_option("--mb", mb, "state size, MiB (float32, 16 tensors)")->capture_default_str();
  app.add_option("--reps", reps, "repetitions (median)")->capture_default_str();
  app.add_option("--dir", base, "where to write")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  init_process_group();
  const int rank = get_rank(), world = get_world_size();
  auto mesh = init_device_mesh("cpu", {world});
  const auto group = mesh.group(0);
  constexpr int kTensors = 16;
  const int64_t cols = 1024;
  const int64_t rows = std::max<int64_t>(1, mb * (1 << 20) / 4 / kTensors / cols);
  ckpt::StateDict state, target, moved;
  // Every boundary moved by a third of a shard: each rank's new box spans two saved chunks.
  ShardTable shifted = chunk_sizes(rows, world);
  if (world > 1) {
    const int64_t d = shifted[0] / 3;
    shifted.front() -= d;
    shifted.back() += d;
  }
  for (int i = 0; i < kTensors; ++i) {
    const std::string name = "layer" + std::to_string(i) + ".weight";
    at::Tensor local = at::rand({chunk_sizes(rows, world)[rank], cols});
    state.insert(name, from_local(local, mesh, {Shard(0)}));
    target.insert(name, distribute_tensor(at::zeros({rows, cols}), mesh, {Shard(0)}, std::nullopt));
    moved.insert(name, from_local(at::zeros({shifted[rank], cols}), mesh, {Shard(0)},
                                  {ShardSizes::Given(0, shifted)}));
  }
  const double my_mb =
      static_cast<double>(chunk_sizes(rows, world)[rank] * cols * 4 * kTensors) / (1 << 20);
  const std::string root = base + "/tessera-bench-ckpt-" + std::to_string(world);
  if (rank == 0) fs::remove_all(root), fs::create_directories(root);
  comm::all_gather_ints(group, {0});
  std::vector<double> save_t, load_t, reshard_t, tsave_t, tload_t;
  for (int r = 0; r < reps; ++r) {
    const std::string dir = root + "/c" + std::to_string(r);
    save_t.push_back(timed(group, [&] { ckpt::save(state, dir); }));
    load_t.push_back(timed(group, [&] { ckpt::load(target, dir); }));
    reshard_t.push_back(timed(group, [&] { ckpt::load(moved, dir); }));
    const std::string file =
        root + "/torch-" + std::to_string(r) + "-rank" + std::to_string(rank) + ".pt";
    std::vector<at::Tensor> locals;
    for (const auto& [name, v] : state.items()) locals.push_back(to_local(std::get<at::Tensor>(v)));
    tsave_t.push_back(timed(group, [&] {
      torch::save(locals, file);
      fsync_file(file);
    }));
    tload_t.push_back(timed(group, [&] {
      std::vector<at::Tensor> back;
      torch::load(back, file);
    }));
  }
  bool ok = true;
  for (const auto& [name, v] : state.items())
    ok = ok && at::equal(to_local(std::get<at::Tensor>(v)), to_local(target.tensor(name)));
  if (rank == 0) {
    const double s = median(save_t), l = median(load_t), rs = median(reshard_t);
    const double ts = median(tsave_t), tl = median(tload_t);
    std::printf(
        "%d rank(s), %lld MiB state (%d float32 tensors of [%lld, %lld], Shard(0)), %.1f MiB "
        "per rank, median of %d, slowest rank; files in %s\n",
        world, (long long)mb, kTensors, (long long)rows, (long long)cols, my_mb, reps,
        root.c_str());
    std::printf("%-44s %10s %12s\n", "", "seconds", "MB/s / rank");
    auto row = [&](const char* what, double t) {
      std::printf("%-44s %10.3f %12.0f\n", what, t, my_mb * 1.048576 / t);
    };
    row("checkpoint::save (fsync, metadata, rename)", s);
    row("torch::save of the local shards + fsync", ts);
    row("checkpoint::load, same layout", l);
    row("checkpoint::load, every boundary moved", rs);
    row("torch::load of the local shards", tl);
    std::printf("save / torch::save %.2fx time; load / torch::load %.2fx time; loaded values %s\n",
                s / ts, l / tl, ok ? "equal" : "DIFFER");
  }
  comm::all_gather_ints(group, {0});
  if (rank == 0) fs::remove_all(root);
  return ok ? 0 : 1;
}
