#pragma once
// The fused attention pair on queries whose sequence is sharded along one or more mesh dims
// (nested), with the K/V blocks brought over inside the kernel by a ring (NOTE: [Ring
// attention]). src/ops/attention.cpp's rule chooses between it and its K/V all-gather plan,
// and hands these kernels the local tensors, the sequence split and the group of the ring's
// members (a mesh dim's, the mesh's, or a slice's over those dims: ring_group there).
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "tessera/comm/collectives.h"
#include "ops/accumulate_type.h"
#include "tessera/ops/attention.h"

namespace tessera::ops::attention {

// NOTE: [Ring attention]
// With the query's rows split over P members, each member's queries need every member's keys.
// Two ways bring them, moving the same bytes forward ((P-1)/P of K and of V per member):
//  - all-gather (the rule's plan): K and V gathered whole, one fused call; backward sends the
//    whole dK / dV home as Partial(sum). Few messages; K and V whole on every member.
//  - ring: P steps. At step s a member attends its queries to member (me - s)'s K/V block,
//    fetched straight from its owner while step s - 1 computes; the partial outputs merge by
//    their log-sum-exp (in float32, or float64 for double). Backward walks the blocks again,
//    with the global output and log-sum-exp, and sends each block's dK / dV home while the
//    next step computes. At most two K/V blocks are held at a time, never the whole sequence; the
//    price is that backward fetches the blocks again.
// Causal: a block wholly after a member's last query row is neither fetched nor computed; on
// the block that straddles the diagonal only the rows that see one of its keys take part.
// Where a block's first row and first key are the same position (a member's own block when
// the query and K/V splits match), the kernel's is_causal makes the cut: no explicit mask,
// whose rows x keys would grow as L^2 / P^2.
// The choice (public: set_context_parallel_method, include/tessera/ops/attention.h): `kAuto`
// takes the ring when the gathered K and V would exceed 16 MiB per member, where holding them
// whole costs more than P - 1 message latencies; below that, the all-gather.
using KVMethod = ContextParallelMethod;
// The method a call with these sizes takes (kAuto resolved). Rules call it: a plan is cached
// per thread, so a change reaches threads (ranks) started after it.
KVMethod kv_method_for(int64_t gathered_kv_bytes, int64_t members);

// Whether a causal self-attention ring of `length` rows over `members` members deals them out
// head-tail (NOTE: [Load-balanced causal ring] in attention_ring.cpp): the public switch on,
// and under `kAuto` at least 2,048 rows per member (below, the dealing costs more than the
// balance saves; a forced `kRing` balances at any size).
bool balances(int64_t length, int64_t members);

// The start values read from TESSERA_CP_METHOD (auto, ring, allgather; unset: auto) and
// TESSERA_CP_LOAD_BALANCE (0 / off / false, 1 / on / true; unset: on). Any other value
// raises, naming the variable and the choices.
KVMethod method_from(const char* value);
bool load_balance_from(const char* value);

// Query-key pairs the ring's forward calls on this thread have scored so far (a rank's share
// of the causal work; tests compare ranks with it).
int64_t scores_this_thread();

// The sequence rows of the group's members: member m's queries are rows
// [q_offset(m), q_offset(m) + q_sizes[m]) of the whole query, its keys / values rows
// [kv_offset(m), ...) of the whole K / V.
struct SeqSplit {
  std::vector<int64_t> q_sizes, kv_sizes;
  int64_t me = 0;
  // q, k, v (and in backward out, logsumexp, the output gradient) are in the head-tail order
  // already (HeadTailShard): the ring walks them as stored, nothing dealt or sent home.
  bool stored = false;
  int64_t q_offset(int64_t m) const;
  int64_t kv_offset(int64_t m) const;
  int64_t kv_total() const;
};

// The fused op's arguments, local ([b, h, rows, E]; the mask split with the query's rows and
// whole along the keys, or undefined). k and v may have fewer heads than q (grouped-query:
// q's heads a multiple of theirs, query head h served by K/V head h / groups): every call
// below takes them so, moves only them, and returns dk / dv with their heads.
struct Args {
  at::Tensor q, k, v, mask;
  bool causal = false;
  c10::optional<double> scale;
};

// [B, H, L, E] with each head repeated `groups` times in a row (head h of the result is
// head h / groups of t), as LibTorch's repeat_interleave over heads; t itself when groups is 1.
at::Tensor repeat_heads(const at::Tensor& t, int64_t groups);
// Query heads per K/V head of q [B, H, ...] and k [B, H_kv, ...] (1 where they match or k
// has none); and dK / dV of repeated heads [B, H_kv x groups, ...] summed back per group.
int64_t groups_of(const at::Tensor& q, const at::Tensor& k);
at::Tensor sum_groups(const at::Tensor& t, int64_t groups);

// NOTE: [Block kernels]
// Every call below computes its blocks with one of three kernels, all with the fused CPU
// kernel's conventions (log-sum-exp in float32, float64 for double; a row hidden from every
// key gives out 0 and log-sum-exp 0):
//  - LibTorch's fused CPU pair (CPU tensors);
//  - LibTorch's memory-efficient pair (attention_efficient.cpp), where it takes the block:
//    float32 / float16 / bfloat16, head dim a multiple of 16 bytes, no mask;
//  - matrix products (products_forward / products_backward: any device, any dtype, any mask).
// The choice, process-wide (set_block_kernel returns the previous; TESSERA_ATTENTION_BLOCKS
// sets the start value):
//  - kFusedOnCpu (`auto`, the default): the CPU pair on CPU, the products elsewhere;
//  - kProducts (`products`): the products everywhere (CPU tests of the other devices' route);
//  - kFused (`fused`): the CPU pair on CPU, the memory-efficient pair elsewhere where it takes
//    the block, else the products. Not yet the default: that waits on a run of the GPU tier;
//  - kEfficient (`efficient`): the memory-efficient pair on every device where it takes the
//    block (CPU tests register a stand-in kernel for it with CUDA's conventions).
enum class BlockKernel { kFusedOnCpu, kProducts, kFused, kEfficient };
BlockKernel set_block_kernel(BlockKernel kernel);
// Whether calls that the fused op pair does not take run LibTorch's math path on q's
// arguments (scaled_dot_product_attention's entry): off the CPU, where the composite's backend
// choice would pick CUDA kernels that have no sharding rules; and under kProducts, so that CPU
// tests see that route.
bool composite_by_math(const at::Tensor& q);
// The start value read from TESSERA_ATTENTION_BLOCKS (auto, products, fused, efficient; unset:
// auto). Any other value raises, naming the variable and the choices.
BlockKernel block_kernel_from(const char* value);

// The products walk a block in tiles of rows and keys holding at most `scores` scores over
// the batch and heads (default 2^24: 64 MiB in float32), so their memory is bounded as the
// fused kernels' is; tests make the tiles tiny. Process-wide; returns the previous.
int64_t set_products_tile(int64_t scores);

// out / lse (rows of a query, lse without the last dim) merged in place with another set of
// keys' (o, l) by log-sum-exp, in out's and lse's dtype; a row that neither has seen a key yet
// (lse -inf on both sides) stays out 0, lse -inf.
void merge_lse(at::Tensor out, at::Tensor lse, at::Tensor o, at::Tensor l);

// One block by the products: q [B, H, rows, E], k and v [B, H_kv, keys, E] with H a
// multiple of H_kv (grouped-query heads taken as they are, never repeated).
std::tuple<at::Tensor, at::Tensor> products_forward(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& mask,
                                                    bool causal, c10::optional<double> scale);
// Its backward: dq with q's heads, dk and dv with H_kv heads (summed over each group).
std::tuple<at::Tensor, at::Tensor, at::Tensor> products_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask, bool causal,
    c10::optional<double> scale);

// One block by the memory-efficient pair (efficient_takes: whether it takes these arguments);
// log-sum-exp [B, H, rows] in float32. Grouped K/V heads are repeated for the call and dK /
// dV summed back per group. efficient_calls counts the calls (tests check the route with it).
bool efficient_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask);
std::tuple<at::Tensor, at::Tensor> efficient_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, bool causal,
                                                     c10::optional<double> scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> efficient_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, bool causal, c10::optional<double> scale);
int64_t efficient_calls();

// The fused pair on these local tensors as they are (is_causal top-left on them).
std::tuple<at::Tensor, at::Tensor> forward(const Args& a);
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const Args& a, const at::Tensor& grad_out,
                                                        const at::Tensor& out,
                                                        const at::Tensor& lse);

// (out, logsumexp) of this member's queries against every member's keys.
std::tuple<at::Tensor, at::Tensor> ring_forward(const comm::Group& pg, const SeqSplit& split,
                                                const Args& a);
// (dq, dk, dv): dk / dv of this member's own K/V rows, summed over every member's queries.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(const comm::Group& pg,
                                                             const SeqSplit& split, const Args& a,
                                                             const at::Tensor& grad_out,
                                                             const at::Tensor& out,
                                                             const at::Tensor& lse);

// The all-gather's causal call on split rows: this member's queries, rows [q_lo, q_lo + n) of
// the whole, against the whole K/V, as two fused calls merged by log-sum-exp: the keys before
// q_lo (seen by every row, no mask) and the keys from q_lo on (the kernel's own is_causal).
// One device's result without an (n x S) causal mask.
std::tuple<at::Tensor, at::Tensor> causal_forward(const Args& a, int64_t q_lo);
// (dq, dk, dv), dk / dv over the whole K/V (this member's share of their sum).
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_backward(const Args& a, int64_t q_lo,
                                                               const at::Tensor& grad_out,
                                                               const at::Tensor& out,
                                                               const at::Tensor& lse);

}  // namespace tessera::ops::attention
