#include "tessera/runtime/world.h"

#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef TESSERA_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "tessera/compat.h"
#include "tessera/runtime/env.h"

namespace tessera {

namespace {
std::mutex g_world_mu;
std::shared_ptr<World> g_world;
thread_local std::shared_ptr<World> t_world;

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}
}  // namespace

World::World(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
              std::chrono::milliseconds timeout)
    : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "tessera: invalid world: rank ", rank,
              " of ", size);
}

int64_t World::next_mesh_id() {
  std::lock_guard<std::mutex> lock(mu_);
  return mesh_seq_++;
}

compat::BackendPtr World::new_group(const std::vector<int>& ranks, const std::string& tag,
                                    c10::DeviceType device) const {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  TORCH_INTERNAL_ASSERT(it != ranks.end(), "new_group called by a non-member");
  const int group_rank = static_cast<int>(it - ranks.begin());
  const int group_size = static_cast<int>(ranks.size());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
      "tessera/" + tag + "/[" + join(ranks) + "]", store_);
  if (device == c10::DeviceType::CUDA) {
#ifdef TESSERA_WITH_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout_;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, group_rank, group_size, opts);
#else
    TORCH_CHECK(false, "tessera: a CUDA mesh needs NCCL, but this build of Tessera has none; "
                "rebuild against a LibTorch with CUDA or use device_type \"cpu\"");
#endif
  }
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout_);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  if (const char* ifname = std::getenv("TESSERA_GLOO_HOSTNAME")) {
    opts->devices.back() = c10d::ProcessGroupGloo::createDeviceForHostname(ifname);
  }
  opts->threads = 1;
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, group_rank, group_size, opts);
  // Gloo's constructor returns once this member's side of the full mesh is connected; a peer
  // may still be finishing its handshake with us. One barrier makes the group complete on
  // every member, so a member that errors right away (and closes the group) cannot break a
  // peer's construction.
  if (group_size > 1) pg->barrier()->wait();
  return pg;
}

void init_process_group(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_world_mu);
  TORCH_CHECK(!g_world, "tessera: init_process_group() called twice; call "
              "destroy_process_group() first");
  auto info = runtime::rendezvous_from_env();
  if (!info) {
    // No launcher: a world of one, so single-process programs need no set-up.
    g_world = std::make_shared<World>(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                      options.timeout);
    return;
  }
  c10d::TCPStoreOptions sopts;
  sopts.port = static_cast<uint16_t>(info->master_port);
  sopts.isServer = info->rank == 0;
  sopts.numWorkers = info->world_size;
  sopts.waitWorkers = true;
  sopts.timeout = options.timeout;
  // USE_LIBUV=0 (PyTorch's switch) asks for the classic server; otherwise LibTorch's default is
  // tried first, and the classic server taken where LibTorch was built without libuv.
  const char* use_libuv = std::getenv("USE_LIBUV");
  if (use_libuv && std::string(use_libuv) == "0") compat::set_tcp_store_libuv(sopts, false, 0);
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(info->master_addr, sopts);
  } catch (const c10::Error& e) {
    const bool no_libuv = std::string(e.what()).find("without libuv") != std::string::npos;
    if (!no_libuv || !compat::set_tcp_store_libuv(sopts, false, 0)) throw;
    store = c10::make_intrusive<c10d::TCPStore>(info->master_addr, sopts);
  }
  g_world = std::make_shared<World>(store, info->rank, info->world_size, options.timeout);
}

void destroy_process_group() {
  std::lock_guard<std::mutex> lock(g_world_mu);
  g_world.reset();
}

bool is_initialized() {
  if (t_world) return true;
  std::lock_guard<std::mutex> lock(g_world_mu);
  return g_world != nullptr;
}

std::shared_ptr<World> current_world() {
  if (t_world) return t_world;
  std::lock_guard<std::mutex> lock(g_world_mu);
  TORCH_CHECK(g_world, "tessera: no process group; call tessera::init_process_group() first "
              "(or run ranks with tessera::testing::run_ranks)");
  return g_world;
}

int get_rank() { return current_world()->rank(); }
int get_world_size() { return current_world()->size(); }

ScopedWorld::ScopedWorld(std::shared_ptr<World> world) : previous_(std::move(t_world)) {
  t_world = std::move(world);
}
ScopedWorld::~ScopedWorld() { t_world = std::move(previous_); }

}  // namespace tessera
