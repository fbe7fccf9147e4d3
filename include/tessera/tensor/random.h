#pragma once
// Random numbers for distributed tensors (see NOTE: [Random numbers] in ops/random.cpp).
#include <cstdint>

#include <ATen/core/Generator.h>
#include <c10/util/Optional.h>

namespace tessera {

// Seeds a generator private to the calling thread, used by random fills on distributed
// tensors whose op has no explicit generator. Processes as ranks may use at::manual_seed
// instead; ranks as threads must use this (they share ATen's default generator).
void manual_seed(uint64_t seed);
void clear_manual_seed();
c10::optional<at::Generator> thread_generator();

}  // namespace tessera
