// NOTE: [Re-seeding]
// Random ops on distributed tensors draw from a generator of their own (src/tensor/random.cpp),
// which starts as a copy of ATen's default generator. On one device, at::manual_seed(s) at any
// point restarts every later draw; for the copy to follow, Tessera must know when the default
// generator is re-seeded. at::manual_seed reaches the default CPU generator through its virtual
// set_current_seed (CUDA generators are seeded in the same call, after it), so the default CPU
// generator is replaced, once, before main, by one that counts those calls and otherwise is
// ATen's CPU generator in the same state. The count is kept per process and per thread: ranks
// run as threads share one default generator but each seeds it from its own thread.
//
// Not done when a Python interpreter is already running in the process: Python's
// torch.default_generator holds the original generator and would no longer be the one ATen's
// kernels draw from. Then random.cpp falls back to noticing a changed current_seed().
#include "reseed_watch.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

namespace tessera::detail {

namespace {

std::atomic<uint64_t> g_process_reseeds{0};
thread_local uint64_t t_thread_reseeds = 0;

void count() {
  g_process_reseeds.fetch_add(1, std::memory_order_relaxed);
  ++t_thread_reseeds;
}

struct WatchedCPUGenerator final : at::CPUGeneratorImpl {
  void set_current_seed(uint64_t seed) override {
    at::CPUGeneratorImpl::set_current_seed(seed);
    count();
  }
  // Restoring a saved state (at::Generator::set_state) restarts the stream as a seed does.
  void set_state(const c10::TensorImpl& state) override {
    at::CPUGeneratorImpl::set_state(state);
    count();
  }
  void copy_state_from(const c10::TensorImpl& state) { at::CPUGeneratorImpl::set_state(state); }
};

bool python_running() {
  using Fn = int (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
  return fn != nullptr && fn() != 0;
}

bool install() {
  if (python_running()) return false;
  // getDefaultCPUGenerator() returns a reference to a non-const function-local static; the
  // const is the API's, so assigning through it is well defined.
  auto& def = const_cast<at::Generator&>(at::detail::getDefaultCPUGenerator());
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(def.mutex());
    state = def.get_state();
  }
  at::Generator watched = at::make_generator<WatchedCPUGenerator>();
  watched.get<WatchedCPUGenerator>()->copy_state_from(*state.unsafeGetTensorImpl());
  def = watched;
  return true;
}

// Before main: no thread draws from the default generator while it is replaced.
const bool g_installed = install();

}  // namespace

uint64_t process_reseeds() { return g_process_reseeds.load(std::memory_order_relaxed); }
uint64_t thread_reseeds() { return t_thread_reseeds; }
bool reseed_watch_installed() { return g_installed; }

}  // namespace tessera::detail
