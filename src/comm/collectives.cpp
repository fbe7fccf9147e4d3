#include "tessera/comm/collectives.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include "tessera/comm/device.h"
#include "wait.h"

namespace tessera::comm {

namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

c10d::ReduceOp to_c10d(PartialOp op) {
  switch (op) {
    case PartialOp::Sum:
    case PartialOp::Avg: return c10d::ReduceOp::SUM;
    case PartialOp::Max: return c10d::ReduceOp::MAX;
    case PartialOp::Min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// Contiguous bytes of x, as a 1-D uint8 tensor (data movement is dtype-agnostic; this also
// carries dtypes a backend does not reduce, such as bool).
at::Tensor as_bytes(const at::Tensor& x) {
  auto c = x.contiguous().view({-1});
  // A contiguous tensor of at most one element may carry any stride; dtype views need 1.
  if (c.numel() <= 1 && c.stride(0) != 1) c = c.as_strided({c.numel()}, {1});
  return c.view(at::kByte);
}

bool all_equal(const std::vector<int64_t>& sizes) {
  return std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == sizes[0]; });
}

bool leading_dims_trivial(const std::vector<int64_t>& shape, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d)
    if (shape[d] != 1) return false;
  return true;
}

// Blocks received back to back in one buffer, concatenated along a dim with only size-1 dims
// before it, already form the result: view the buffer instead of copying.
at::Tensor contiguous_concat(const std::vector<at::Tensor>& blocks, int64_t dim) {
  auto shape = blocks[0].sizes().vec();
  shape[dim] = 0;
  for (auto& b : blocks) shape[dim] += b.size(dim);
  const auto* base = static_cast<const char*>(blocks[0].storage().data());
  int64_t expect = blocks[0].storage_offset() * blocks[0].element_size();
  for (auto& b : blocks) {
    if (b.storage().data() != base || b.storage_offset() * b.element_size() != expect ||
        !b.is_contiguous())
      return at::cat(blocks, dim);
    expect += b.numel() * b.element_size();
  }
  return blocks[0].as_strided(shape, c10::contiguous_strides(shape));
}

// Padded blocks gathered back to back (`largest` rows each, its shard's rows first) along a
// dim with only size-1 dims before it, moved left in their own buffer until they touch: each
// block's new place ends before the next block's old one begins, so moving them in order
// overwrites nothing unread. The result views the buffer (its padding's bytes stay allocated
// at its end; callers keep that under 1/8), saving the new allocation a concatenation makes,
// whose pages the kernel would fault in and zero (BENCHMARKS.md, "Uneven all-gathers").
at::Tensor compact_in_place(const at::Tensor& all, const std::vector<int64_t>& sizes,
                            int64_t largest, const std::vector<int64_t>& shape) {
  TORCH_INTERNAL_ASSERT(all.is_contiguous());
  const int64_t n = static_cast<int64_t>(sizes.size());
  const int64_t row = nbytes(all) / (n * largest);
  auto* base = static_cast<char*>(all.data_ptr());
  int64_t at_row = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (sizes[i] > 0 && at_row != i * largest)
      std::memmove(base + at_row * row, base + i * largest * row,
                   static_cast<size_t>(sizes[i] * row));
    at_row += sizes[i];
  }
  return all.as_strided(shape, c10::contiguous_strides(shape), all.storage_offset());
}

// The one all-to-all-v: member j gets send[j] (contiguous blocks of one dtype); returns the
// received blocks, shaped by recv_shapes. `flat_in` may pass the already packed input.
std::vector<at::Tensor> exchange(const Group& pg, const std::vector<at::Tensor>& send,
                                 const std::vector<std::vector<int64_t>>& recv_shapes,
                                 const at::TensorOptions& opts, at::Tensor flat_in,
                                 CollectiveKind kind) {
  const int n = pg->getSize();
  const int me = pg->getRank();
  const int64_t item =
      static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(opts.dtype())));
  std::vector<int64_t> in_splits(n), out_splits(n);
  int64_t sent = 0, recvd = 0, total_in = 0, total_out = 0;
  for (int j = 0; j < n; ++j) {
    in_splits[j] = send[j].numel() * item;
    out_splits[j] = numel_of(recv_shapes[j]) * item;
    total_in += in_splits[j];
    total_out += out_splits[j];
    if (j != me) {
      sent += in_splits[j];
      recvd += out_splits[j];
    }
  }
  record({kind, sent, recvd, n});
  if (!flat_in.defined()) {
    // Pack with one copy per element: each block lands straight in its slot.
    flat_in = at::empty({total_in}, opts.dtype(at::kByte));
    int64_t off = 0;
    for (int j = 0; j < n; ++j) {
      if (in_splits[j] > 0) {
        flat_in.narrow(0, off, in_splits[j])
            .view(send[j].scalar_type())
            .view(send[j].sizes())
            .copy_(send[j]);
      }
      off += in_splits[j];
    }
  }
  auto flat_out = at::empty({total_out}, opts.dtype(at::kByte));
  if (n == 1) {
    flat_out.copy_(flat_in);
  } else {
    // The backend takes the split vectors by reference and may consume them: pass copies.
    auto out_arg = out_splits;
    auto in_arg = in_splits;
    detail::wait(pg->alltoall_base(flat_out, flat_in, out_arg, in_arg), "all_to_all");
  }
  std::vector<at::Tensor> out;
  int64_t off = 0;
  for (int i = 0; i < n; ++i) {
    out.push_back(flat_out.narrow(0, off, out_splits[i])
                      .view(c10::typeMetaToScalarType(opts.dtype()))
                      .view(recv_shapes[i]));
    off += out_splits[i];
  }
  return out;
}

// Flat-buffer collectives: _allgather_base gathers every shard into one buffer and
// _reduce_scatter_base reduces from one, with no per-block copies. LibTorch 2.x's Gloo has
// both; 1.13's throws before communicating, identically on every rank. Which one a backend
// has is learnt on its first call and remembered per backend name.
enum class FlatOp : uint8_t { AllGather, ReduceScatter };

template <class Run>
bool try_flat(const Group& pg, FlatOp op, Run&& run) {
  static std::mutex mu;
  static std::map<std::pair<std::string, FlatOp>, bool> known;
  const auto key = std::make_pair(pg->getBackendName(), op);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = known.find(key);
    if (it != known.end() && !it->second) return false;
  }
  try {
    run();
  } catch (const c10::Error& e) {
    // Only "does not support" / "no support for" means the op is missing; anything else is a
    // real failure, and so is any failure after the op once worked.
    const bool missing =
        std::string(e.what_without_backtrace()).find("support") != std::string::npos;
    std::lock_guard<std::mutex> lock(mu);
    auto it = known.find(key);
    if (!missing || (it != known.end() && it->second)) throw;
    known[key] = false;
    return false;
  }
  std::lock_guard<std::mutex> lock(mu);
  known[key] = true;
  return true;
}

// Gloo (LibTorch 1.13's) reduces no bfloat16 in all_reduce: such buffers are reduced in
// float32 and rounded once, as one device accumulates a bfloat16 sum in float32.
bool reduces_as_float(const Group& pg, const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 && pg->getBackendName() == "gloo";
}

// Gloo reduces these dtypes in _reduce_scatter_base; others take the all-to-all path.
bool flat_reducible(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kInt || t == at::kLong;
}

}  // namespace

int group_rank(const Group& pg) { return pg->getRank(); }
int group_size(const Group& pg) { return pg->getSize(); }

namespace {

at::Tensor all_gather_wire(const Group& pg, const at::Tensor& x, int64_t dim,
                           const std::vector<int64_t>& sizes) {
  const int n = pg->getSize();
  const int me = pg->getRank();
  TORCH_INTERNAL_ASSERT(static_cast<int>(sizes.size()) == n && sizes[me] == x.size(dim));
  std::vector<int64_t> shape = x.sizes().vec();
  const int64_t row = nbytes(x) / std::max<int64_t>(sizes[me], 1);
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  shape[dim] = total;
  if (n == 1) return x;
  const bool even = all_equal(sizes);
  if (total == 0 || numel_of(shape) == 0) {
    record({CollectiveKind::AllGather, 0, 0, n});
    return at::empty(shape, x.options());
  }
  if (even) {
    int64_t recvd = 0;
    for (int i = 0; i < n; ++i) recvd += i == me ? 0 : sizes[i] * row;
    record({CollectiveKind::AllGather, (n - 1) * nbytes(x), recvd, n});
    if (leading_dims_trivial(shape, dim)) {
      // Shards gathered back to back along the first non-trivial dim are the result.
      auto in = as_bytes(x);
      auto flat = at::empty({n * in.numel()}, in.options());
      if (try_flat(pg, FlatOp::AllGather,
                   [&] { detail::wait(pg->_allgather_base(flat, in), "all_gather"); }))
        return flat.view(x.scalar_type()).view(shape);
    }
    std::vector<at::Tensor> in{as_bytes(x)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int i = 0; i < n; ++i) out[0].push_back(at::empty_like(in[0]));
    detail::wait(pg->allgather(out, in), "all_gather");
    std::vector<at::Tensor> blocks;
    auto block_shape = x.sizes().vec();
    for (auto& b : out[0]) blocks.push_back(b.view(x.scalar_type()).view(block_shape));
    return at::cat(blocks, dim);
  }
  // Uneven. Shards close in size: padded to the largest, one flat all-gather, the padding cut
  // off (as DTensor does): one collective that moves at most half again the bytes, faster than
  // the all-to-all-v's per-peer messages (BENCHMARKS.md, "Uneven all-gathers"); CommDebugMode
  // records the padded bytes, which is what moves.
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  if (2 * n * largest <= 3 * total) {
    auto padded_shape = x.sizes().vec();
    padded_shape[dim] = largest;
    at::Tensor padded = x;
    if (sizes[me] != largest) {
      padded = at::empty(padded_shape, x.options());
      padded.narrow(dim, 0, sizes[me]).copy_(x);
    }
    const at::Tensor all =
        all_gather_wire(pg, padded, dim, std::vector<int64_t>(static_cast<size_t>(n), largest));
    if (leading_dims_trivial(shape, dim) && all.is_cpu() && 8 * (n * largest - total) <= total)
      return compact_in_place(all, sizes, largest, shape);
    std::vector<at::Tensor> blocks;
    for (int i = 0; i < n; ++i) blocks.push_back(all.narrow(dim, i * largest, sizes[i]));
    if (leading_dims_trivial(shape, dim)) return contiguous_concat(blocks, dim);
    return at::cat(blocks, dim);
  }
  // Far apart (an empty shard among full ones): one all-to-all-v where every member sends its
  // whole shard to everyone.
  std::vector<at::Tensor> send(n, x.contiguous());
  std::vector<std::vector<int64_t>> recv_shapes(n, x.sizes().vec());
  for (int i = 0; i < n; ++i) recv_shapes[i][dim] = sizes[i];
  auto blocks = exchange(pg, send, recv_shapes, x.options(), {}, CollectiveKind::AllGather);
  if (leading_dims_trivial(shape, dim)) return contiguous_concat(blocks, dim);
  return at::cat(blocks, dim);
}

at::Tensor all_reduce_wire(const Group& pg, const at::Tensor& x, PartialOp op) {
  const int n = pg->getSize();
  const int64_t b = nbytes(x);
  const int64_t ring = 2 * (n - 1) * b / n;
  record({CollectiveKind::AllReduce, ring, ring, n});
  if (n == 1 || x.numel() == 0) return x;
  const bool as_float = reduces_as_float(pg, x);
  // (Row-major on every rank: the sum is elementwise over the buffers' memory.)
  std::vector<at::Tensor> buf{as_float ? x.contiguous().to(at::kFloat) : x.contiguous().clone()};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  detail::wait(pg->allreduce(buf, opts), "all_reduce");
  if (op == PartialOp::Avg) {
    if (at::isIntegralType(buf[0].scalar_type(), /*includeBool=*/true))
      return buf[0].div(n, "floor");
    buf[0].div_(n);
  }
  return as_float ? buf[0].to(x.scalar_type()) : buf[0];
}

// Where a transport reads: device memory for NCCL, host memory for Gloo.
c10::Device wire_device(const Group& pg) {
  return staged(pg) ? c10::Device(c10::DeviceType::CPU) : home_device(pg);
}

// The input of a collective on its wire (a host copy on cuda:gloo), after the home check.
at::Tensor to_wire(const Group& pg, const at::Tensor& x, const char* site) {
  check_home(pg, x, site);
  return staged(pg) ? x.cpu() : x;
}

at::Tensor to_home(const at::Tensor& wire, const at::Tensor& like) {
  return wire.device() == like.device() ? wire : wire.to(like.device());
}

}  // namespace

std::vector<at::Tensor> all_to_all_blocks(const Group& pg, const std::vector<at::Tensor>& send,
                                          const std::vector<std::vector<int64_t>>& recv_shapes,
                                          const at::TensorOptions& options, CollectiveKind kind) {
  // Received blocks are made on the wire and handed back on the home device, whatever
  // device `options` names.
  const auto wire = options.device(wire_device(pg));
  if (!staged(pg)) {
    for (const auto& t : send) check_home(pg, t, "all_to_all_blocks");
    return exchange(pg, send, recv_shapes, wire, {}, kind);
  }
  std::vector<at::Tensor> host;
  for (const auto& t : send) host.push_back(to_wire(pg, t, "all_to_all_blocks"));
  auto blocks = exchange(pg, host, recv_shapes, wire, {}, kind);
  for (auto& b : blocks) b = b.to(home_device(pg));
  return blocks;
}

at::Tensor all_gather(const Group& pg, const at::Tensor& x, int64_t dim,
                      const std::vector<int64_t>& sizes) {
  return to_home(all_gather_wire(pg, to_wire(pg, x, "all_gather"), dim, sizes), x);
}

at::Tensor all_reduce(const Group& pg, const at::Tensor& x, PartialOp op) {
  return to_home(all_reduce_wire(pg, to_wire(pg, x, "all_reduce"), op), x);
}

PendingAllReduce all_reduce_start(const Group& pg, at::Tensor buffer, PartialOp op) {
  TORCH_INTERNAL_ASSERT(buffer.is_contiguous());
  const int n = pg->getSize();
  const int64_t ring = 2 * (n - 1) * nbytes(buffer) / n;
  record({CollectiveKind::AllReduce, ring, ring, n});
  // What the transport writes: the buffer itself, or its host copy (cuda:gloo).
  at::Tensor wire = to_wire(pg, buffer, "all_reduce_start");
  if (n == 1 || wire.numel() == 0) return PendingAllReduce::ready(buffer);
  if (reduces_as_float(pg, wire)) wire = wire.to(at::kFloat);
  std::vector<at::Tensor> buf{wire};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  auto work = pg->allreduce(buf, opts);
  return PendingAllReduce([work, wire, home = std::move(buffer), op, n]() {
    detail::wait(work, "all_reduce");
    if (op == PartialOp::Avg) wire.div_(n);
    if (!wire.is_same(home)) home.copy_(wire);  // staged through the host
    return home;
  });
}

PendingAllGather all_gather_start(const Group& pg, const at::Tensor& home_x,
                                  const std::vector<int64_t>& sizes) {
  const at::Tensor x = to_wire(pg, home_x, "all_gather_start");
  const int n = pg->getSize();
  const int me = pg->getRank();
  TORCH_INTERNAL_ASSERT(x.dim() == 1 && static_cast<int>(sizes.size()) == n &&
                        sizes[me] == x.numel());
  const int64_t most = *std::max_element(sizes.begin(), sizes.end());
  const int64_t block = most * static_cast<int64_t>(x.element_size());
  if (n > 1) record({CollectiveKind::AllGather, (n - 1) * block, (n - 1) * block, n});
  if (n == 1 || most == 0) {
    std::vector<at::Tensor> blocks(n, at::empty({0}, home_x.options()));
    blocks[me] = home_x;
    return PendingAllGather::ready(std::move(blocks));
  }
  at::Tensor mine = x;
  if (x.numel() < most) {
    mine = at::zeros({most}, x.options());  // zeros: no uninitialised bytes on the wire
    mine.narrow(0, 0, x.numel()).copy_(x);
  }
  std::vector<at::Tensor> in{mine.contiguous()};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < n; ++i) out[0].push_back(at::empty({most}, x.options()));
  auto work = pg->allgather(out, in);
  return PendingAllGather([work, in, blocks = std::move(out[0]), sizes, home = home_x.device()]() {
    detail::wait(work, "all_gather");
    std::vector<at::Tensor> pieces;
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto b = blocks[i].narrow(0, 0, sizes[i]);
      pieces.push_back(b.device() == home ? b : b.to(home));  // staged through the host
    }
    return pieces;
  });
}

namespace {

at::Tensor reduce_scatter_wire(const Group& pg, const at::Tensor& x, int64_t dim,
                               const std::vector<int64_t>& sizes, PartialOp op) {
  const int n = pg->getSize();
  const int me = pg->getRank();
  TORCH_INTERNAL_ASSERT(static_cast<int>(sizes.size()) == n);
  if (n == 1) return x;
  const bool even = all_equal(sizes);
  if (even && x.numel() > 0 && leading_dims_trivial(x.sizes().vec(), dim) &&
      flat_reducible(x.scalar_type()) && op == PartialOp::Sum) {
    // 1-D buffers: Gloo splits along dim 0 (and checks it with a fatal assertion); with only
    // size-1 dims before `dim`, the flat split is the split along `dim`. Sum only: Gloo's
    // flat reduce-scatter is not relied on for min/max.
    auto mine = x.sizes().vec();
    mine[dim] = sizes[me];
    auto in = x.contiguous().view({-1});
    auto out = at::empty({in.numel() / n}, x.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    const int64_t b = nbytes(x);
    bool done = try_flat(pg, FlatOp::ReduceScatter, [&] {
      detail::wait(pg->_reduce_scatter_base(out, in, opts), "reduce_scatter");
    });
    if (done) {
      record({CollectiveKind::ReduceScatter, b - b / n, b - b / n, n});
      return out.view(mine);
    }
  }
  std::vector<at::Tensor> send;
  int64_t off = 0;
  for (int j = 0; j < n; ++j) {
    send.push_back(x.narrow(dim, off, sizes[j]));
    off += sizes[j];
  }
  auto mine = x.sizes().vec();
  mine[dim] = sizes[me];
  std::vector<std::vector<int64_t>> recv_shapes(n, mine);
  at::Tensor flat_in;
  if (leading_dims_trivial(x.sizes().vec(), dim)) flat_in = as_bytes(x);
  auto blocks =
      exchange(pg, send, recv_shapes, x.options(), flat_in, CollectiveKind::ReduceScatter);
  auto stacked = at::stack(blocks);
  switch (op) {
    case PartialOp::Sum: return stacked.sum(0);
    case PartialOp::Avg:
      return at::isIntegralType(x.scalar_type(), true) ? stacked.sum(0).div(n, "floor")
                                                       : stacked.sum(0).div_(n);
    case PartialOp::Max: return std::get<0>(stacked.max(0));
    case PartialOp::Min: return std::get<0>(stacked.min(0));
  }
  return stacked.sum(0);
}

at::Tensor all_to_all_wire(const Group& pg, const at::Tensor& x, int64_t split_dim,
                           const std::vector<Range>& send, int64_t cat_dim,
                           const std::vector<std::vector<int64_t>>& recv_shapes) {
  const int n = pg->getSize();
  TORCH_INTERNAL_ASSERT(static_cast<int>(send.size()) == n &&
                        static_cast<int>(recv_shapes.size()) == n);
  std::vector<at::Tensor> blocks;
  bool tiles = leading_dims_trivial(x.sizes().vec(), split_dim) && send[0].offset == 0;
  int64_t next = 0;
  for (int j = 0; j < n; ++j) {
    blocks.push_back(x.narrow(split_dim, send[j].offset, send[j].length));
    tiles = tiles && send[j].offset == next;
    next = send[j].offset + send[j].length;
  }
  tiles = tiles && next == x.size(split_dim);
  auto recvd = exchange(pg, blocks, recv_shapes, x.options(), tiles ? as_bytes(x) : at::Tensor(),
                        CollectiveKind::AllToAll);
  if (n == 1) return recvd[0];
  if (leading_dims_trivial(recv_shapes[0], cat_dim)) return contiguous_concat(recvd, cat_dim);
  return at::cat(recvd, cat_dim);
}

at::Tensor broadcast_wire(const Group& pg, const at::Tensor& x, int root) {
  const int n = pg->getSize();
  const int64_t b = nbytes(x);
  record({CollectiveKind::Broadcast, pg->getRank() == root ? (n - 1) * b : 0,
          pg->getRank() == root ? 0 : b, n});
  if (n == 1 || x.numel() == 0) return x;
  std::vector<at::Tensor> buf{as_bytes(x).clone()};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  detail::wait(pg->broadcast(buf, opts), "broadcast");
  return buf[0].view(x.scalar_type()).view(x.sizes());
}

}  // namespace

PendingReduceScatter reduce_scatter_start(const Group& pg, at::Tensor blocks) {
  const int n = pg->getSize();
  const int me = pg->getRank();
  TORCH_INTERNAL_ASSERT(blocks.dim() == 1 && blocks.is_contiguous() && blocks.numel() % n == 0);
  const int64_t block = blocks.numel() / n;
  if (n == 1 || block == 0) return PendingReduceScatter::ready(blocks.narrow(0, me * block, block));
  at::Tensor wire = to_wire(pg, blocks, "reduce_scatter_start");
  if (flat_reducible(wire.scalar_type())) {
    auto out = at::empty({block}, wire.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    decltype(pg->_reduce_scatter_base(out, wire, opts)) work;
    if (try_flat(pg, FlatOp::ReduceScatter,
                 [&] { work = pg->_reduce_scatter_base(out, wire, opts); })) {
      const int64_t b = nbytes(out);
      record({CollectiveKind::ReduceScatter, (n - 1) * b, (n - 1) * b, n});
      // The work holds `wire` (the backend reads it until done) and `out`.
      return PendingReduceScatter([work, out, home = blocks.device()]() {
        detail::wait(work, "reduce_scatter");
        return out.device() == home ? out : out.to(home);
      });
    }
  }
  return PendingReduceScatter::ready(
      reduce_scatter(pg, blocks, 0, std::vector<int64_t>(n, block), PartialOp::Sum));
}

at::Tensor reduce_scatter(const Group& pg, const at::Tensor& x, int64_t dim,
                          const std::vector<int64_t>& sizes, PartialOp op) {
  return to_home(reduce_scatter_wire(pg, to_wire(pg, x, "reduce_scatter"), dim, sizes, op), x);
}

at::Tensor all_to_all(const Group& pg, const at::Tensor& x, int64_t split_dim,
                      const std::vector<Range>& send, int64_t cat_dim,
                      const std::vector<std::vector<int64_t>>& recv_shapes) {
  return to_home(
      all_to_all_wire(pg, to_wire(pg, x, "all_to_all"), split_dim, send, cat_dim, recv_shapes), x);
}

at::Tensor broadcast(const Group& pg, const at::Tensor& x, int root) {
  return to_home(broadcast_wire(pg, to_wire(pg, x, "broadcast"), root), x);
}

// Metadata travels as host vectors; on NCCL it crosses as a device tensor (one copy each way).
std::vector<std::vector<int64_t>> all_gather_ints(const Group& pg, const std::vector<int64_t>& v) {
  const int n = pg->getSize();
  const int64_t b = static_cast<int64_t>(v.size() * sizeof(int64_t));
  record({CollectiveKind::Metadata, (n - 1) * b, (n - 1) * b, n});
  if (n == 1) return {v};
  auto t = at::tensor(v.empty() ? std::vector<int64_t>{0} : v, at::kLong).to(wire_device(pg));
  std::vector<at::Tensor> in{t};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < n; ++i) out[0].push_back(at::empty_like(t));
  detail::wait(pg->allgather(out, in), "all_gather (shapes and checks)");
  std::vector<std::vector<int64_t>> res;
  for (auto& wire : out[0]) {
    const at::Tensor o = wire.cpu();
    auto p = o.data_ptr<int64_t>();
    res.emplace_back(p, p + v.size());
  }
  return res;
}

std::vector<std::string> all_gather_strings(const Group& pg, const std::string& s) {
  auto heads = all_gather_ints(pg, {static_cast<int64_t>(s.size())});
  std::vector<int64_t> lens;
  for (auto& h : heads) lens.push_back(h[0]);
  auto bytes = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(bytes.data_ptr(), s.data(), s.size());
  auto all = all_gather_wire(pg, bytes.to(wire_device(pg)), 0, lens).cpu();
  std::vector<std::string> out;
  int64_t off = 0;
  for (auto len : lens) {
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + off, len);
    off += len;
  }
  return out;
}

}  // namespace tessera::comm
