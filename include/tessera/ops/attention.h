#pragma once
// Attention on distributed tensors: how scaled_dot_product_attention on queries whose
// sequence is sharded brings the keys and values over (docs/context_parallel.md; NOTE:
// [Ring attention] in src/ops/attention_ring.h).

namespace tessera {

// kRing: K/V blocks go round the ranks that split the sequence, at most two held at a time;
// kAllGather: K and V gathered whole, one fused call; kAuto (the default): the ring once the
// gathered K and V would pass 16 MiB per rank. TESSERA_CP_METHOD=auto|ring|allgather sets
// the value a process starts with.
enum class ContextParallelMethod { kAuto, kRing, kAllGather };

// Process-wide, and every rank must set the same (ranks that differ plan different
// exchanges). Plans are cached per rank thread: a change reaches rank threads started after
// it. Returns the previous method.
ContextParallelMethod set_context_parallel_method(ContextParallelMethod method);
ContextParallelMethod context_parallel_method();

}  // namespace tessera
