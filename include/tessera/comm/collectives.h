#pragma once
// Blocking collectives over one c10d process group, including the uneven ("-v") variants
// Gloo lacks, composed without extra bytes on the wire. Each documents what it moves per
// rank (n = group size, B = bytes of the local input); each reports to comm::record.
//
// Tensors given and returned live on the group's home device (NOTE: [Devices on the wire]).
//
// Every caller passes sizes that all members agree on (they come from replicated specs), so
// members take the same branches (e.g. skip an all-empty collective) without talking.
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tessera/comm/accounting.h"
#include "tessera/comm/device.h"
#include "tessera/comm/pending.h"
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include "tessera/compat.h"
#include "tessera/comm/reduce_op.h"

namespace tessera::comm {

using Group = compat::BackendPtr;

// Concatenation along `dim` of every member's `x`; member i's x has size sizes[i] along dim.
// Even sizes use the backend's all-gather: sends (n-1)*B, receives the other members' bytes.
// Uneven sizes within half again of their mean travel padded to the largest in one flat
// all-gather ((n-1)*max moved, accounted as such); sizes further apart (an empty shard among
// full ones) go by one all-to-all-v that moves exactly the other members' bytes.
at::Tensor all_gather(const Group& pg, const at::Tensor& x, int64_t dim,
                      const std::vector<int64_t>& sizes);

// op over every member's x (same shape everywhere). Accounted as the bandwidth-optimal
// ring: 2*(n-1)*B/n sent and received. Avg = sum / n.
at::Tensor all_reduce(const Group& pg, const at::Tensor& x, PartialOp op);

// The same all-reduce, in place on `buffer` (contiguous), left running on the backend's own
// threads so the caller can go on computing (gradient buckets in backward). wait() finishes
// it and returns the buffer. Accounted when started.
using PendingAllReduce = Pending<at::Tensor>;
PendingAllReduce all_reduce_start(const Group& pg, at::Tensor buffer, PartialOp op);

// Every member's 1-D `x` (member i's has sizes[i] elements), left running on the backend's own
// threads; wait() returns the n pieces in member order (fully_shard's prefetch: the next
// group's parameters arrive while this one computes). Uneven pieces travel padded to the
// largest, as the backend's all-gather wants equal blocks: sends (n-1)*max, receives
// (n-1)*max elements (fully_shard's pieces differ by at most a row per parameter). Accounted
// when started.
using PendingAllGather = Pending<std::vector<at::Tensor>>;
PendingAllGather all_gather_start(const Group& pg, const at::Tensor& x,
                                  const std::vector<int64_t>& sizes);

// The sum over members of `blocks`, 1-D and contiguous, n equal blocks (block i goes to member
// i; pad uneven pieces with zeros), left running on the backend's own threads; wait() returns
// this member's block (fully_shard's gradients: one group's reduction runs while the next
// group's backward computes). Sends and receives (n-1) blocks, accounted when started.
// Backends without a flat reduce-scatter (LibTorch 1.13's Gloo) reduce before returning.
using PendingReduceScatter = Pending<at::Tensor>;
PendingReduceScatter reduce_scatter_start(const Group& pg, at::Tensor blocks);

// Member i gets piece i (sizes[i] along `dim`) of op over every member's x.
// Sends B - own piece; receives (n-1) * own piece. One all-to-all-v + a local reduction.
at::Tensor reduce_scatter(const Group& pg, const at::Tensor& x, int64_t dim,
                          const std::vector<int64_t>& sizes, PartialOp op);

struct Range {
  int64_t offset;
  int64_t length;
};
// Member j receives x.narrow(split_dim, send[j]); the blocks received from member i have
// shape recv_shapes[i]; the result concatenates them along cat_dim in member order.
// Sends/receives exactly the blocks of other members (own block is a local copy).
at::Tensor all_to_all(const Group& pg, const at::Tensor& x, int64_t split_dim,
                      const std::vector<Range>& send, int64_t cat_dim,
                      const std::vector<std::vector<int64_t>>& recv_shapes);

// The general all-to-all-v: member j receives send[j] (any shapes, one dtype); returns the
// blocks received from each member, shaped by recv_shapes. Sends/receives the blocks of
// other members exactly. Every member must call it, even with nothing to send or receive.
std::vector<at::Tensor> all_to_all_blocks(const Group& pg, const std::vector<at::Tensor>& send,
                                          const std::vector<std::vector<int64_t>>& recv_shapes,
                                          const at::TensorOptions& options,
                                          CollectiveKind kind = CollectiveKind::AllToAll);

// Root's x to every member (others pass a tensor of the right shape/dtype).
at::Tensor broadcast(const Group& pg, const at::Tensor& x, int root);

// Small metadata exchanges (accounted as Metadata): every member's vector, equal lengths.
std::vector<std::vector<int64_t>> all_gather_ints(const Group& pg, const std::vector<int64_t>& v);

// Every member's string, in member order (one length exchange, then the bytes).
std::vector<std::string> all_gather_strings(const Group& pg, const std::string& s);

int group_rank(const Group& pg);
int group_size(const Group& pg);

}  // namespace tessera::comm
