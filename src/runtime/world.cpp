#include "tessera/runtime/world.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef TESSERA_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "tessera/comm/device.h"
#include "tessera/compat.h"
#include "tessera/runtime/env.h"

namespace tessera::detail {
void install_failure_context();  // stuck_report.cpp
}

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

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) items.push_back(item);
  return items;
}

// The local address the kernel would send from to reach `host`: the interface peers on other
// hosts reach this one by. A UDP "connect" sends nothing; it only picks the route.
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return "";
  std::string address;
  for (addrinfo* ai = found; ai && address.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char text[NI_MAXHOST];
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof text, nullptr, 0,
                      NI_NUMERICHOST) == 0)
      address = text;
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return address;
}

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
    return c10_error->what_without_backtrace();
  return e.what();
}

std::chrono::milliseconds timeout_from_env(std::chrono::milliseconds fallback) {
  const char* text = std::getenv("TESSERA_TIMEOUT");
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  TORCH_CHECK(end && *end == '\0' && seconds > 0, "tessera: TESSERA_TIMEOUT=\"", text,
              "\" is not a positive number of seconds");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

std::vector<std::shared_ptr<::gloo::transport::Device>> gloo_devices(const World& w) {
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  const std::string what = !w.gloo_interfaces().empty() ? "interface"
                           : !w.gloo_hostname().empty() ? "address"
                                                        : "loopback address";
  const std::string where = !w.gloo_interfaces().empty() ? w.gloo_interfaces()
                            : !w.gloo_hostname().empty() ? w.gloo_hostname()
                                                         : "127.0.0.1";
  try {
    if (!w.gloo_interfaces().empty()) {
      for (const auto& name : split_list(w.gloo_interfaces()))
        devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    } else {
      devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(where));
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "tessera: rank ", w.rank(), " cannot listen for Gloo connections on ", what,
                " \"", where, "\": ", message_of(e), ". Name an interface this host has with ",
                "GLOO_SOCKET_IFNAME (see `ip -brief address`), or an address with ",
                "TESSERA_GLOO_HOSTNAME");
  }
  return devices;
}
std::string cuda_transport_of(const InitOptions& options) {
  std::string b = options.backend;
  if (const char* v = std::getenv("TESSERA_BACKEND"); v && *v) b = v;
  if (b == "auto" || b == "nccl" || b == "cuda:nccl" || b == "cpu:gloo,cuda:nccl") return "nccl";
  if (b == "gloo" || b == "cuda:gloo" || b == "cpu:gloo,cuda:gloo") return "gloo";
  TORCH_CHECK(false, "tessera: init_process_group: unknown backend \"", b,
              "\"; use \"auto\", \"nccl\" or \"cuda:gloo\" (InitOptions::backend or ",
              "TESSERA_BACKEND)");
}

}  // namespace

void World::set_gloo_address(std::string interfaces, std::string hostname) {
  gloo_interfaces_ = std::move(interfaces);
  gloo_hostname_ = std::move(hostname);
}

World::World(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
             std::chrono::milliseconds timeout, int local_rank)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      local_rank_(local_rank < 0 ? rank : local_rank),
      timeout_(timeout) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "tessera: invalid world: rank ", rank, " of ",
              size);
  detail::install_failure_context();  // before any collective can fail
}

void World::set_cuda_transport(std::string transport) {
  TORCH_CHECK(transport == "nccl" || transport == "gloo", "tessera: unknown transport \"",
              transport, "\" for CUDA meshes; use \"nccl\" or \"gloo\"");
  cuda_transport_ = std::move(transport);
}

int World::select_cuda_device() const {
  TORCH_CHECK(at::hasCUDA(), "tessera: a \"cuda\" mesh needs a CUDA device, but this LibTorch ",
              at::globalContext().hasCUDA() ? "sees none" : "was built without CUDA",
              "; use device_type \"cpu\"");
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const int count = static_cast<int>(impl->deviceCount());
  TORCH_CHECK(count > 0, "tessera: a \"cuda\" mesh needs a CUDA device; none is visible ",
              "(check CUDA_VISIBLE_DEVICES)");
  const int current = impl->getDevice().index();
  // Device 0 is also what a program that chose nothing sees: only then pick by local rank.
  if (current != 0) return current;
  const int wanted = local_rank_ % count;
  if (wanted != current)
    impl->setDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(wanted)));
  return wanted;
}

int64_t World::next_mesh_id() {
  std::lock_guard<std::mutex> lock(mu_);
  return mesh_seq_++;
}

compat::BackendPtr World::new_group(const std::vector<int>& ranks, const std::string& tag,
                                    c10::DeviceType device, const std::string& transport) const {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  TORCH_INTERNAL_ASSERT(it != ranks.end(), "new_group called by a non-member");
  const int group_rank = static_cast<int>(it - ranks.begin());
  const int group_size = static_cast<int>(ranks.size());
  auto prefixed =
      c10::make_intrusive<c10d::PrefixStore>("tessera/" + tag + "/[" + join(ranks) + "]", store_);
  if (transport == "nccl") {
    TORCH_CHECK(device == c10::DeviceType::CUDA, "tessera: NCCL carries CUDA tensors only; ",
                "use Gloo for a cpu mesh");
#ifdef TESSERA_WITH_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout_;
    compat::BackendPtr pg =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, group_rank, group_size, opts);
    comm::set_home(pg, device);
    return pg;
#else
    TORCH_CHECK(false,
                "tessera: a CUDA mesh needs NCCL, but this build of Tessera has none; "
                "rebuild against a LibTorch with CUDA or use device_type \"cpu\"");
#endif
  }
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout_);
  opts->devices = gloo_devices(*this);
  opts->threads = 1;
  compat::BackendPtr pg =
      c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, group_rank, group_size, opts);
  comm::set_home(pg, device);
  // Gloo's constructor returns once this member's side of the full mesh is connected; a peer
  // may still be finishing its handshake with us. One barrier makes the group complete on
  // every member, so a member that errors right away (and closes the group) cannot break a
  // peer's construction.
  if (group_size > 1) pg->barrier()->wait();
  return pg;
}

void init_process_group(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_world_mu);
  TORCH_CHECK(!g_world,
              "tessera: init_process_group() called twice; call "
              "destroy_process_group() first");
  auto info = runtime::rendezvous_from_env();
  const auto timeout = timeout_from_env(options.timeout);
  if (!info) {
    // No launcher: a world of one, so single-process programs need no set-up.
    g_world = std::make_shared<World>(c10::make_intrusive<c10d::HashStore>(), 0, 1, timeout);
    g_world->set_cuda_transport(cuda_transport_of(options));
    return;
  }
  c10d::TCPStoreOptions sopts;
  sopts.port = static_cast<uint16_t>(info->master_port);
  sopts.isServer = info->rank == 0;
  sopts.numWorkers = info->world_size;
  sopts.waitWorkers = true;
  sopts.timeout = timeout;
  // USE_LIBUV=0 (PyTorch's switch) asks for the classic server; otherwise LibTorch's default is
  // tried first, and the classic server taken where LibTorch was built without libuv.
  const char* use_libuv = std::getenv("USE_LIBUV");
  if (use_libuv && std::string(use_libuv) == "0") compat::set_tcp_store_libuv(sopts, false, 0);
  c10::intrusive_ptr<c10d::TCPStore> store;
  const auto connect = [&] {
    store = c10::make_intrusive<c10d::TCPStore>(info->master_addr, sopts);
  };
  try {
    try {
      connect();
    } catch (const c10::Error& e) {
      const bool no_libuv = std::string(e.what()).find("without libuv") != std::string::npos;
      if (!no_libuv || !compat::set_tcp_store_libuv(sopts, false, 0)) throw;
      connect();
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "tessera: init_process_group: rank ", info->rank, " of ", info->world_size,
                (info->rank == 0 ? " could not serve" : " could not reach"),
                " the rendezvous store at ", info->master_addr, ":", info->master_port, " within ",
                timeout.count() / 1000.0, " s (", info->source, " variables): ", message_of(e),
                ". Check MASTER_ADDR and MASTER_PORT, that rank 0 ",
                "has started and that the port is open between the hosts; TESSERA_TIMEOUT ",
                "(seconds) sets how long to wait");
  }
  g_world = std::make_shared<World>(store, info->rank, info->world_size, timeout, info->local_rank);
  g_world->set_cuda_transport(cuda_transport_of(options));
  // Ranks all on this host talk over loopback; across hosts, over the interface that routes
  // to the master unless the user names one.
  std::string interfaces, hostname;
  if (const char* v = std::getenv("GLOO_SOCKET_IFNAME")) interfaces = v;
  if (const char* v = std::getenv("TESSERA_GLOO_HOSTNAME")) hostname = v;
  if (interfaces.empty() && hostname.empty() && info->local_world_size < info->world_size) {
    hostname = local_address_towards(info->master_addr, info->master_port);
    if (hostname.empty()) {
      char name[256] = {};
      ::gethostname(name, sizeof name - 1);
      hostname = name;
    }
  }
  g_world->set_gloo_address(interfaces, hostname);
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
  TORCH_CHECK(g_world,
              "tessera: no process group; call tessera::init_process_group() first "
              "(or run ranks with tessera::testing::run_ranks)");
  return g_world;
}

int get_rank() { return current_world()->rank(); }
int get_local_rank() { return current_world()->local_rank(); }
int get_world_size() { return current_world()->size(); }

ScopedWorld::ScopedWorld(std::shared_ptr<World> world) : previous_(std::move(t_world)) {
  t_world = std::move(world);
}
ScopedWorld::~ScopedWorld() { t_world = std::move(previous_); }

bool detail::thread_scoped_world() { return t_world != nullptr; }

}  // namespace tessera
