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
#include "reseed_watch.h"

namespace tessera {

namespace {

struct DeviceRng {
  at::Generator gen;
  bool agreed = false;  // holds world rank 0's state (or was synced); false after a reset
};

// One rank's generators. `epoch` counts resets (manual_seed, clear_manual_seed); every rank
// makes the same resets in the same order, so (epoch, device type) names the same state in the
// store on all ranks.
struct RankRng {
  std::mutex mu;
  c10::optional<uint64_t> seed;
  int64_t epoch = 0;
  std::map<c10::DeviceType, DeviceRng> devices;
  // Re-seeds of ATen's default generator already acted on (NOTE: [Re-seeding]): counted by
  // this rank's thread when ranks are threads, else by the process; without the watch, the
  // default generator's seed last seen.
  bool thread_scoped = false;
  uint64_t reseeds_seen = 0;
  uint64_t seed_seen = 0;
};

// Per World (a process's world, or each rank thread's), keyed by address and checked against
// a weak reference, so a World at a freed address does not inherit its predecessor's state.
struct Entry {
  std::weak_ptr<World> world;
  std::shared_ptr<RankRng> rng;
};
std::mutex g_mu;
std::map<const World*, Entry> g_ranks;

uint64_t default_seed() {
  at::Generator def = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(def.mutex());
  return def.current_seed();
}

// Whether ATen's default generator was re-seeded since the rank last looked; either way the
// rank has now seen it.
bool absorb_reseeds(RankRng& rng) {
  if (detail::reseed_watch_installed()) {
    const uint64_t n = rng.thread_scoped ? detail::thread_reseeds() : detail::process_reseeds();
    const bool changed = n != rng.reseeds_seen;
    rng.reseeds_seen = n;
    return changed;
  }
  const uint64_t s = default_seed();  // misses a re-seed with the same seed (docs/random.md)
  const bool changed = s != rng.seed_seen;
  rng.seed_seen = s;
  return changed;
}

std::shared_ptr<RankRng> rank_rng(const std::shared_ptr<World>& world) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_ranks.find(world.get());
  if (it != g_ranks.end() && it->second.world.lock() == world) return it->second.rng;
  for (auto i = g_ranks.begin(); i != g_ranks.end();) {
    if (i->second.world.expired())
      i = g_ranks.erase(i);
    else
      ++i;
  }
  auto rng = std::make_shared<RankRng>();
  rng->thread_scoped = detail::thread_scoped_world();
  absorb_reseeds(*rng);
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
  if (type == c10::DeviceType::CPU) {
    // A fresh generator given the default's state, not def.clone(): LibTorch 1.13's
    // GeneratorImpl::clone() takes a strong reference to the copy but not the weak one, so
    // the copy is never freed (LeakSanitizer, scripts/sanitize.sh).
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(def.mutex());
      state = def.get_state();
    }
    g = at::make_generator<at::CPUGeneratorImpl>();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  } else {
    std::lock_guard<std::mutex> lock(def.mutex());
    g = def.clone();
  }
  if (seed) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(*seed);
  }
  return g;
}

std::string agreement_key(const RankRng& rng, c10::DeviceType type) {
  return "tessera/random/" + std::to_string(rng.epoch) + "/" +
         c10::DeviceTypeName(type, /*lower_case=*/true);
}

at::Tensor get_state(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// What rank 0 writes: a seeded state as its seed (9 bytes, enough to rebuild it), any other
// state (a copy of the default generator) whole.
constexpr uint8_t kSeed = 'S', kState = 'T';

// A rank's generator for `type` got a new state (it was made, or reset). World rank 0's new
// state is the one all ranks agree on: rank 0 writes it into the world's store at once
// (one-sided: rank 0 never waits for anyone), and the other ranks take it at their next random
// op on a distributed tensor (agree).
void settle(const World& world, const RankRng& rng, c10::DeviceType type, DeviceRng& dev) {
  dev.agreed = world.size() == 1 || world.rank() == 0;
  if (world.size() == 1 || world.rank() != 0) return;
  std::vector<uint8_t> value;
  if (rng.seed) {
    value.resize(1 + sizeof(uint64_t));
    value[0] = kSeed;
    std::memcpy(value.data() + 1, &*rng.seed, sizeof(uint64_t));
  } else {
    const at::Tensor state = get_state(dev.gen).contiguous();
    const auto* p = state.data_ptr<uint8_t>();
    value.push_back(kState);
    value.insert(value.end(), p, p + state.numel());
  }
  world.store()->set(agreement_key(rng, type), value);
  comm::record(
      {comm::CollectiveKind::Metadata, static_cast<int64_t>(value.size()), 0, world.size()});
}

// A rank other than world rank 0 waits for rank 0's state of the same reset and takes it.
void agree(const World& world, const RankRng& rng, c10::DeviceType type, DeviceRng& dev) {
  std::vector<uint8_t> value;
  try {
    value = world.store()->get(agreement_key(rng, type));
  } catch (const std::exception& e) {
    TORCH_CHECK(false,
                "tessera: a random op on a distributed tensor waited for world rank 0's "
                "generator state (",
                c10::DeviceTypeName(type), ", after reset ", rng.epoch, ") and failed: ", e.what(),
                "\nEvery rank must call tessera::manual_seed / "
                "clear_manual_seed at the same points; a rank 0 that runs no random op on "
                "distributed tensors must still call them (or, without any, sync the ranks that "
                "draw with tessera::sync_random_state(mesh)); see docs/random.md");
  }
  TORCH_INTERNAL_ASSERT(!value.empty() &&
                        (value[0] == kState || (value[0] == kSeed && value.size() == 9)));
  at::Tensor state;
  if (value[0] == kSeed) {
    uint64_t seed;
    std::memcpy(&seed, value.data() + 1, sizeof(seed));
    state = get_state(initial_generator(type, seed));
  } else {
    state = at::empty({static_cast<int64_t>(value.size()) - 1}, at::kByte);
    std::memcpy(state.data_ptr<uint8_t>(), value.data() + 1, value.size() - 1);
  }
  set_state(dev.gen, state);
  comm::record(
      {comm::CollectiveKind::Metadata, 0, static_cast<int64_t>(value.size()), world.size()});
  dev.agreed = true;
}

DeviceRng& device_rng(const World& world, RankRng& rng, c10::DeviceType type) {
  auto it = rng.devices.find(type);
  if (it == rng.devices.end()) {
    it = rng.devices.emplace(type, DeviceRng{initial_generator(type, rng.seed), false}).first;
    settle(world, rng, type, it->second);
  }
  return it->second;
}

// A reset makes the CPU generator if there is none yet, so that rank 0 publishes it right away.
void reset(const World& world, RankRng& rng, c10::optional<uint64_t> seed) {
  rng.seed = seed;
  ++rng.epoch;
  for (auto& [type, dev] : rng.devices) {
    set_state(dev.gen, get_state(initial_generator(type, seed)));
    settle(world, rng, type, dev);
  }
  device_rng(world, rng, c10::DeviceType::CPU);
}

// at::manual_seed since the rank last looked is a reset that forgets tessera::manual_seed, as
// clear_manual_seed: the next draws start from a copy of the re-seeded default generator, as
// on one device (NOTE: [Re-seeding] in reseed_watch.cpp).
void follow_reseeds(const World& world, RankRng& rng) {
  if (absorb_reseeds(rng)) reset(world, rng, c10::nullopt);
}

}  // namespace

void manual_seed(uint64_t seed) {
  auto world = current_world();
  auto rng = rank_rng(world);
  std::lock_guard<std::mutex> lock(rng->mu);
  absorb_reseeds(*rng);  // this reset supersedes earlier re-seeds of the default generator
  reset(*world, *rng, seed);
}

void clear_manual_seed() {
  auto world = current_world();
  auto rng = rank_rng(world);
  std::lock_guard<std::mutex> lock(rng->mu);
  absorb_reseeds(*rng);
  reset(*world, *rng, c10::nullopt);
}

at::Generator random_generator(c10::DeviceType device) {
  auto world = current_world();
  auto rng = rank_rng(world);
  std::lock_guard<std::mutex> lock(rng->mu);
  follow_reseeds(*world, *rng);
  return device_rng(*world, *rng, device).gen;
}

c10::optional<at::Generator> thread_generator() { return random_generator(); }

void sync_random_state(const DeviceMesh& mesh, int src) {
  if (!mesh.contains_this_rank()) return;
  TORCH_CHECK(src >= 0 && src < mesh.size(), "tessera: sync_random_state: src ", src,
              " is not a rank of ", mesh.str(), " (mesh-local ranks 0..", mesh.size() - 1, ")");
  const c10::DeviceType type = mesh.device_kind();
  auto world = current_world();
  auto rng = rank_rng(world);
  std::lock_guard<std::mutex> lock(rng->mu);
  follow_reseeds(*world, *rng);
  DeviceRng& dev = device_rng(*world, *rng, type);
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
  follow_reseeds(*world, *rng);
  DeviceRng& dev = device_rng(*world, *rng, device);
  if (!dev.agreed) agree(*world, *rng, device, dev);
  return dev.gen;
}

}  // namespace detail

}  // namespace tessera
