// The generators of random ops on distributed tensors, one set per rank, and their agreement
// over the world (include/tessera/tensor/random.h, docs/random.md).
#include "tessera/tensor/random.h"

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "tessera/comm/accounting.h"
#include "tessera/comm/collectives.h"
#include "tessera/mesh/device_mesh.h"
#include "tessera/runtime/world.h"

namespace tessera {

namespace {

struct DeviceRng {
  at::Generator gen;
  bool agreed = false;  // holds world rank 0's state (or was synced); false after a reset
};

// One rank's generators. `epoch` counts resets (manual_seed, clear_manual_seed); every rank
// makes the same resets in the same order, so (epoch, device type) names one agreement in the
// store on all ranks.
struct RankRng {
  std::mutex mu;
  c10::optional<uint64_t> seed;
  int64_t epoch = 0;
  std::map<c10::DeviceType, DeviceRng> devices;
};

// Per World (a process's world, or each rank thread's), keyed by address and checked against
// a weak reference, so a World at a freed address does not inherit its predecessor's state.
struct Entry {
  std::weak_ptr<World> world;
  std::shared_ptr<RankRng> rng;
};
std::mutex g_mu;
std::map<const World*, Entry> g_ranks;

std::shared_ptr<RankRng> rank_rng(const std::shared_ptr<World>& world) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_ranks.find(world.get());
  if (it != g_ranks.end() && it->second.world.lock() == world) return it->second.rng;
  for (auto i = g_ranks.begin(); i != g_ranks.end();) {
    if (i->second.world.expired()) i = g_ranks.erase(i);
    else ++i;
  }
  auto rng = std::make_shared<RankRng>();
  g_ranks[world.get()] = Entry{world, rng};
  return rng;
}

// A generator in the state a reset gives: seeded, or a copy of ATen's default generator.
at::Generator initial_generator(c10::DeviceType type, c10::optional<uint64_t> seed) {
  if (type == c10::DeviceType::CPU && seed) return at::make_generator<at::CPUGeneratorImpl>(*seed);
  at::Generator def = type == c10::DeviceType::CPU
                          ? at::detail::getDefaultCPUGenerator()
                          : at::globalContext().defaultGenerator(c10::Device(type));
  at::Generator g;
  {
    std::lock_guard<std::mutex> lock(def.mutex());
    g = def.clone();
  }
  if (seed) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(*seed);
  }
  return g;
}

DeviceRng& device_rng(RankRng& rng, c10::DeviceType type) {
  auto it = rng.devices.find(type);
  if (it == rng.devices.end())
    it = rng.devices.emplace(type, DeviceRng{initial_generator(type, rng.seed), false}).first;
  return it->second;
}

at::Tensor get_state(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

void reset(RankRng& rng, c10::optional<uint64_t> seed) {
  rng.seed = seed;
  ++rng.epoch;
  for (auto& [type, dev] : rng.devices) {
    set_state(dev.gen, get_state(initial_generator(type, seed)));
    dev.agreed = false;
  }
}

// World rank 0 publishes its state under the agreement's key; the others wait for it and take
// it. One-sided: rank 0 never waits, and ranks that run no random op never take part.
void agree(const World& world, RankRng& rng, c10::DeviceType type, DeviceRng& dev) {
  if (world.size() > 1) {
    const std::string key = "tessera/random/" + std::to_string(rng.epoch) + "/" +
                            c10::DeviceTypeName(type, /*lower_case=*/true);
    if (world.rank() == 0) {
      const at::Tensor state = get_state(dev.gen).contiguous();
      const auto* p = state.data_ptr<uint8_t>();
      world.store()->set(key, std::vector<uint8_t>(p, p + state.numel()));
      comm::record({comm::CollectiveKind::Metadata, state.numel(), 0, world.size()});
    } else {
      std::vector<uint8_t> bytes;
      try {
        bytes = world.store()->get(key);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "tessera: a random op on a distributed tensor waited for world rank "
                    "0's generator state (agreement ", rng.epoch, ", ",
                    c10::DeviceTypeName(type), ") and failed: ", e.what(), "\nEvery rank must "
                    "run the same random ops on distributed tensors, and call "
                    "tessera::manual_seed / clear_manual_seed at the same points; on a mesh "
                    "without world rank 0, call tessera::sync_random_state(mesh) first "
                    "(docs/random.md)");
      }
      at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
      std::memcpy(state.data_ptr<uint8_t>(), bytes.data(), bytes.size());
      set_state(dev.gen, state);
      comm::record({comm::CollectiveKind::Metadata, 0, state.numel(), world.size()});
    }
  }
  dev.agreed = true;
}

}  // namespace

void manual_seed(uint64_t seed) {
  auto rng = rank_rng(current_world());
  std::lock_guard<std::mutex> lock(rng->mu);
  reset(*rng, seed);
}

void clear_manual_seed() {
  auto rng = rank_rng(current_world());
  std::lock_guard<std::mutex> lock(rng->mu);
  reset(*rng, c10::nullopt);
}

at::Generator random_generator(c10::DeviceType device) {
  auto rng = rank_rng(current_world());
  std::lock_guard<std::mutex> lock(rng->mu);
  return device_rng(*rng, device).gen;
}

c10::optional<at::Generator> thread_generator() { return random_generator(); }

void sync_random_state(const DeviceMesh& mesh, int src) {
  if (!mesh.contains_this_rank()) return;
  TORCH_CHECK(src >= 0 && src < mesh.size(), "tessera: sync_random_state: src ", src,
              " is not a rank of ", mesh.str(), " (mesh-local ranks 0..", mesh.size() - 1, ")");
  const c10::DeviceType type = mesh.device_kind();
  auto rng = rank_rng(current_world());
  std::lock_guard<std::mutex> lock(rng->mu);
  DeviceRng& dev = device_rng(*rng, type);
  if (mesh.size() > 1) {
    at::Tensor state = get_state(dev.gen);
    if (type != c10::DeviceType::CPU) state = state.to(c10::Device(type));
    state = comm::broadcast(mesh.mesh_group(), state, src);
    set_state(dev.gen, state.cpu());
  }
  dev.agreed = true;
}

namespace detail {

at::Generator agreed_generator(c10::DeviceType device) {
  auto world = current_world();
  auto rng = rank_rng(world);
  std::lock_guard<std::mutex> lock(rng->mu);
  DeviceRng& dev = device_rng(*rng, device);
  if (!dev.agreed) agree(*world, *rng, device, dev);
  return dev.gen;
}

}  // namespace detail

}  // namespace tessera
