#include "tessera/tensor/random.h"

#include <ATen/CPUGeneratorImpl.h>

namespace tessera {

namespace {
thread_local c10::optional<at::Generator> t_generator;
}

void manual_seed(uint64_t seed) { t_generator = at::make_generator<at::CPUGeneratorImpl>(seed); }
void clear_manual_seed() { t_generator.reset(); }
c10::optional<at::Generator> thread_generator() { return t_generator; }

}  // namespace tessera
