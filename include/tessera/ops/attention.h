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

// Causal self-attention on the ring deals every rank two chunks of the sequence, one from
// each end, for the time of the call, so that all ranks score the same number of keys
// (without it the last rank does about 2P - 1 times the first's work). Tensors keep their
// layout outside the call. On by default; TESSERA_CP_LOAD_BALANCE=0 sets the start value off.
// Process-wide, the same on every rank. Returns the previous setting.
bool set_context_parallel_load_balance(bool on);
bool context_parallel_load_balance();

}  // namespace tessera
