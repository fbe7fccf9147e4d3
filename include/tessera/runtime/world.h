#pragma once
// The set of ranks Tessera runs on: a c10d Store for rendezvous plus this rank's identity.
// A process normally has one World (init_process_group). The test harness runs ranks as
// threads, so the "current" world is looked up thread-locally first.
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "tessera/compat.h"

namespace tessera {

class World {
 public:
  World(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
        std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // A process group over `ranks` (global ranks, sorted, this rank a member), keyed by `tag`
  // in the store. Gloo for CPU, NCCL for CUDA (where LibTorch was built with it). Every member
  // must call with the same tag at the same point of the program.
  compat::BackendPtr new_group(const std::vector<int>& ranks, const std::string& tag,
                               c10::DeviceType device) const;

  // Meshes are created collectively, in the same order on every rank, so a per-world counter
  // names them identically everywhere.
  int64_t next_mesh_id();

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  int64_t mesh_seq_ = 0;
};

struct InitOptions {
  // "auto": NCCL when the default device is CUDA and NCCL was compiled in, else Gloo.
  std::string backend = "auto";
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// Reads the launcher's variables (torchrun, mpirun, Slurm), rendezvous over a TCPStore on the
// master, and installs the process-wide world. A process without launcher variables becomes
// a single-rank world.
void init_process_group(const InitOptions& options = {});
void destroy_process_group();
bool is_initialized();
int get_rank();
int get_world_size();

// The world of the calling thread: the thread's ScopedWorld if any, else the process-wide
// one. Throws with a hint when neither exists.
std::shared_ptr<World> current_world();

// Installs `world` for the calling thread for the guard's lifetime (used by run_ranks).
class ScopedWorld {
 public:
  explicit ScopedWorld(std::shared_ptr<World> world);
  ~ScopedWorld();
  ScopedWorld(const ScopedWorld&) = delete;
  ScopedWorld& operator=(const ScopedWorld&) = delete;

 private:
  std::shared_ptr<World> previous_;
};

}  // namespace tessera
