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
        std::chrono::milliseconds timeout, int local_rank = -1);

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }  // among the ranks on this host
  std::chrono::milliseconds timeout() const { return timeout_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // A process group over `ranks` (global ranks, sorted, this rank a member), keyed by `tag`
  // in the store, whose tensors live on `device` and travel over `transport` ("gloo" or
  // "nccl"; NCCL only for CUDA and where LibTorch was built with it). Every member must call
  // with the same tag at the same point of the program.
  compat::BackendPtr new_group(const std::vector<int>& ranks, const std::string& tag,
                               c10::DeviceType device, const std::string& transport) const;

  // The transport of a "cuda" mesh that names none: "nccl", or "gloo" after
  // InitOptions::backend = "cuda:gloo" (CUDA tensors staged through host memory).
  const std::string& cuda_transport() const { return cuda_transport_; }
  void set_cuda_transport(std::string transport);

  // Makes the calling thread's current CUDA device local_rank % device_count, as PyTorch's
  // init_device_mesh("cuda") does, unless the program already chose a device other than 0.
  // Returns the device index in use.
  int select_cuda_device() const;

  // Meshes are created collectively, in the same order on every rank, so a per-world counter
  // names them identically everywhere.
  int64_t next_mesh_id();

  // Where this rank's Gloo connections listen. An interface list ("eth0" or "eth0,eth1": one
  // Gloo device each) wins over a host name or address; both empty means the loopback
  // interface (every rank on one host). init_process_group chooses (see InitOptions).
  void set_gloo_address(std::string interfaces, std::string hostname);
  const std::string& gloo_interfaces() const { return gloo_interfaces_; }
  const std::string& gloo_hostname() const { return gloo_hostname_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  int local_rank_;
  std::string cuda_transport_ = "nccl";
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  int64_t mesh_seq_ = 0;
  std::string gloo_interfaces_;
  std::string gloo_hostname_;
};

struct InitOptions {
  // How CUDA meshes communicate: "auto" or "nccl" (NCCL; CPU meshes always use Gloo), or
  // "cuda:gloo" (CUDA tensors over Gloo, staged through host memory: several ranks sharing
  // one GPU, which NCCL refuses). A mesh can also name it: init_device_mesh("cuda:gloo", ...).
  // TESSERA_BACKEND in the environment overrides it.
  std::string backend = "auto";
  // How long a collective (and the rendezvous) may wait for a peer before it fails with an
  // error naming the ranks that did not arrive. TESSERA_TIMEOUT=<seconds> in the environment
  // overrides it, so a job's launcher can set it without rebuilding the program.
  std::chrono::milliseconds timeout = std::chrono::minutes(3);
};

// Reads the launcher's variables (torchrun, mpirun, Slurm), rendezvous over a TCPStore on the
// master, and installs the process-wide world. A process without launcher variables becomes
// a single-rank world.
//
// Gloo listens on, in order of precedence: the interfaces in GLOO_SOCKET_IFNAME (PyTorch's
// variable; comma-separated), the host or address in TESSERA_GLOO_HOSTNAME, the loopback
// interface when every rank runs on this host, else the local address of the route to
// MASTER_ADDR (the interface peers on other hosts can reach this one by).
void init_process_group(const InitOptions& options = {});
void destroy_process_group();
bool is_initialized();
int get_rank();
int get_world_size();
// This rank's index among the ranks on its host (LOCAL_RANK under torchrun / tessera-run).
int get_local_rank();

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

namespace detail {
// Whether the calling thread runs under a ScopedWorld (a rank thread of run_ranks).
bool thread_scoped_world();
}  // namespace detail

}  // namespace tessera
