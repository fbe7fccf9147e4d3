// A rank killed in the middle of a checkpoint save (checkpoint_kill.sh drives it):
//   checkpoint_kill save DIR    saves DIR/good, then starts DIR/partial and rank 1 kills
//                               itself with SIGKILL after writing its first chunk;
//   checkpoint_kill verify DIR  (any number of ranks) DIR/good loads intact, DIR/partial
//                               does not exist and loading it is an error on every rank.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>

#include "tessera/tessera.h"

namespace ckpt = tessera::checkpoint;

namespace {

constexpr int kEntries = 6;

at::Tensor value(int i) { return at::arange(256 * 64, at::kFloat).view({256, 64}) + i; }

ckpt::StateDict state_on(const tessera::DeviceMesh& mesh, bool zeros) {
  ckpt::StateDict s;
  for (int i = 0; i < kEntries; ++i)
    s.insert("w" + std::to_string(i),
             tessera::distribute_tensor(zeros ? at::zeros({256, 64}) : value(i), mesh,
                                        {tessera::Shard(0)}, std::nullopt));
  s.insert("step", int64_t{7});
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: checkpoint_kill save|verify DIR\n");
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  tessera::init_process_group();
  const int rank = tessera::get_rank();
  auto mesh = tessera::init_device_mesh("cpu", {tessera::get_world_size()});
  if (mode == "save") {
    ckpt::save(state_on(mesh, false), dir + "/good");
    ckpt::SaveOptions o;
    o.on_progress = [rank](int64_t) {
      if (rank == 1) std::raise(SIGKILL);  // mid-save: its first chunk is written, fsync not
    };
    ckpt::save(state_on(mesh, false), dir + "/partial", o);
    std::fprintf(stderr, "rank %d: the save finished although rank 1 was killed\n", rank);
    return 3;
  }
  auto state = state_on(mesh, true);
  state.at("step") = int64_t{0};
  ckpt::load(state, dir + "/good");
  bool ok = state.integer("step") == 7;
  for (int i = 0; i < kEntries; ++i)
    ok = ok && at::equal(tessera::full_tensor(state.tensor("w" + std::to_string(i))), value(i));
  bool rejected = false;
  try {
    auto again = state_on(mesh, true);
    ckpt::load(again, dir + "/partial");
  } catch (const c10::Error& e) {
    rejected = std::string(e.what()).find("no checkpoint at") != std::string::npos;
  }
  const bool invisible = !std::filesystem::exists(dir + "/partial");
  std::printf("rank %d: previous checkpoint %s; partial one %s and %s\n", rank,
              ok ? "intact" : "DAMAGED", invisible ? "invisible" : "VISIBLE",
              rejected ? "rejected" : "NOT REJECTED");
  return ok && invisible && rejected ? 0 : 1;
}
