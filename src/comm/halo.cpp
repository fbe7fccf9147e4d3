#include "tessera/comm/halo.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "wait.h"

namespace tessera::comm {

namespace {

// Rows of one window that come from one owner: `count` rows placed from `slot` on in the
// window, read from the owner's local rows starting at `local`.
struct Piece {
  int64_t owner, slot, local, count;
};

// The in-domain row that global row g reads, or -1 (a fill row).
int64_t map_row(int64_t g, int64_t total, HaloBoundary boundary) {
  if (g >= 0 && g < total) return g;
  if (total == 0) return -1;
  switch (boundary) {
    case HaloBoundary::Zeros: return -1;
    case HaloBoundary::Periodic: return ((g % total) + total) % total;
    case HaloBoundary::Replicate: return g < 0 ? 0 : total - 1;
    case HaloBoundary::Reflect: {
      if (total == 1) return 0;
      const int64_t period = 2 * (total - 1);
      int64_t r = ((g % period) + period) % period;
      return r < total ? r : period - r;
    }
  }
  return -1;
}

struct Plan {
  std::vector<std::vector<Piece>> send;  // per member: my rows it needs (slot: in its window)
  std::vector<std::vector<Piece>> recv;  // per member: the rows I need from it
  std::vector<Piece> local;              // my rows I need myself
  std::vector<Window> fill;              // slots of my window outside the domain
  bool identity = false;                 // my window is exactly my shard
};

Plan plan_for(int64_t me, const std::vector<int64_t>& sizes, const std::vector<Window>& windows,
              HaloBoundary boundary) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == n,
              "tessera: halo exchange: one window per member expected");
  std::vector<int64_t> ends(n);  // ends[i] = first global row after member i's shard
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) ends[i] = total += sizes[i];
  Plan plan{std::vector<std::vector<Piece>>(n), std::vector<std::vector<Piece>>(n), {}, {}, false};
  plan.identity = windows[me].lo == ends[me] - sizes[me] && windows[me].hi == ends[me];
  for (int64_t m = 0; m < n; ++m) {
    const Window w = windows[m];
    std::vector<Piece> pieces;
    for (int64_t slot = 0; slot < w.size(); ++slot) {
      const int64_t g = map_row(w.lo + slot, total, boundary);
      if (g < 0) {
        if (m == me) {
          if (!plan.fill.empty() && plan.fill.back().hi == slot)
            ++plan.fill.back().hi;
          else
            plan.fill.push_back({slot, slot + 1});
        }
        continue;
      }
      // The owner is the first member whose shard ends after g (empty shards never own).
      const int64_t o = std::upper_bound(ends.begin(), ends.end(), g) - ends.begin();
      const int64_t local = g - (ends[o] - sizes[o]);
      if (!pieces.empty()) {
        auto& last = pieces.back();
        if (last.owner == o && last.slot + last.count == slot && last.local + last.count == local) {
          ++last.count;
          continue;
        }
      }
      pieces.push_back({o, slot, local, 1});
    }
    for (const auto& p : pieces) {
      if (m == me && p.owner == me)
        plan.local.push_back(p);
      else if (m == me)
        plan.recv[p.owner].push_back(p);
      else if (p.owner == me)
        plan.send[m].push_back(p);
    }
  }
  return plan;
}

std::vector<int64_t> with_dim(const at::Tensor& x, int64_t dim, int64_t size) {
  auto s = x.sizes().vec();
  s[dim] = size;
  return s;
}

int64_t rows(const std::vector<Piece>& ps) {
  int64_t r = 0;
  for (const auto& p : ps) r += p.count;
  return r;
}

bool use_point_to_point(const Group& pg) {
  static const bool forced_alltoall = [] {
    const char* v = std::getenv("TESSERA_HALO");
    return v && std::strcmp(v, "alltoall") == 0;
  }();
  // NCCL point-to-point needs grouped launches to avoid ordering deadlocks; its all-to-all
  // already is one.
  return !forced_alltoall && pg->getBackendName() == "gloo";
}

// Rows in flight: received blocks (valid once the pending work has finished).
struct InFlight {
  std::vector<at::Tensor> blocks;
  std::vector<std::function<void()>> waits;
  c10::Device home = c10::Device(c10::DeviceType::CPU);  // where the received rows go
};

// Starts sending member m the rows of `src` listed in outgoing[m] (starting at
// row_of(piece)) and receiving the runs listed in incoming[m] into blocks[m].
template <class RowOf>
InFlight start_rows(const Group& pg, const at::Tensor& src, int64_t dim,
                    const std::vector<std::vector<Piece>>& outgoing,
                    const std::vector<std::vector<Piece>>& incoming, RowOf row_of, int tag) {
  InFlight f;
  if (!pg) return f;  // a group of one: everything is local
  const int64_t n = static_cast<int64_t>(outgoing.size());
  std::vector<at::Tensor> send(n);
  std::vector<std::vector<int64_t>> recv_shapes(n);
  // (From the other dims: a member whose own part is empty still receives whole rows.)
  int64_t row_bytes = static_cast<int64_t>(src.element_size());
  for (int64_t d = 0; d < src.dim(); ++d)
    if (d != dim) row_bytes *= src.size(d);
  int64_t sent = 0, received = 0;
  for (int64_t m = 0; m < n; ++m) {
    std::vector<at::Tensor> parts;
    for (const auto& p : outgoing[m]) parts.push_back(src.narrow(dim, row_of(p), p.count));
    send[m] = parts.empty() ? at::empty(with_dim(src, dim, 0), src.options())
                            : (parts.size() == 1 ? parts[0] : at::cat(parts, dim)).contiguous();
    recv_shapes[m] = with_dim(src, dim, rows(incoming[m]));
    sent += rows(outgoing[m]) * row_bytes;
    received += rows(incoming[m]) * row_bytes;
  }
  if (!use_point_to_point(pg)) {
    f.blocks = all_to_all_blocks(pg, send, recv_shapes, src.options(), CollectiveKind::SendRecv);
    return f;
  }
  record({CollectiveKind::SendRecv, sent, received, n});
  // Gloo's point-to-point reads and writes host memory: on cuda:gloo the rows travel through
  // host copies (NOTE: [Devices on the wire]).
  check_home(pg, src, "halo exchange");
  const bool host = staged(pg);
  f.home = src.device();
  f.blocks.resize(n);
  for (int64_t m = 0; m < n; ++m) {
    if (send[m].numel() == 0) continue;
    if (host) send[m] = send[m].cpu();
    std::vector<at::Tensor> t{send[m]};
    auto work = pg->send(t, static_cast<int>(m), tag);
    f.waits.emplace_back([work, keep = send[m]]() mutable { detail::wait(work, "halo send"); });
  }
  for (int64_t m = 0; m < n; ++m) {
    f.blocks[m] = at::empty(recv_shapes[m], host ? src.options().device(at::kCPU) : src.options());
    if (f.blocks[m].numel() == 0) continue;
    std::vector<at::Tensor> t{f.blocks[m]};
    auto work = pg->recv(t, static_cast<int>(m), tag);
    f.waits.emplace_back([work]() mutable { detail::wait(work, "halo recv"); });
  }
  return f;
}

// Waits, then hands each run received from member m to place(piece, rows).
template <class Place>
void finish_rows(InFlight& f, int64_t dim, const std::vector<std::vector<Piece>>& incoming,
                 Place place) {
  for (auto& w : f.waits) w();
  f.waits.clear();
  for (size_t m = 0; m < f.blocks.size(); ++m) {
    if (f.blocks[m].defined() && f.blocks[m].device() != f.home)
      f.blocks[m] = f.blocks[m].to(f.home);
    int64_t at_row = 0;
    for (const auto& p : incoming[m]) {
      place(p, f.blocks[m].narrow(dim, at_row, p.count));
      at_row += p.count;
    }
  }
}

constexpr int kHaloTag = 0x4a10;

// The member whose one run of rows is all `want` rows that arrive, in order from row 0 of
// the result (at(piece): where the run lands): its received block is the answer as it is.
// -1 otherwise. (The caller checks that nothing of its own or of fill is needed.)
template <class At>
int64_t sole_sender(const std::vector<std::vector<Piece>>& incoming, int64_t want, At at) {
  int64_t from = -1, pieces = 0;
  for (size_t m = 0; m < incoming.size(); ++m) {
    pieces += static_cast<int64_t>(incoming[m].size());
    if (incoming[m].size() == 1 && at(incoming[m][0]) == 0 && incoming[m][0].count == want)
      from = static_cast<int64_t>(m);
  }
  return want > 0 && pieces == 1 ? from : -1;
}

// Waits for a sole sender's block (see sole_sender) and returns it.
at::Tensor sole_block(InFlight& f, int64_t dim, const std::vector<std::vector<Piece>>& incoming) {
  at::Tensor got;
  finish_rows(f, dim, incoming, [&](const Piece&, const at::Tensor& r) { got = r; });
  return got;
}

template <class RowOf, class Place>
void exchange_rows(const Group& pg, const at::Tensor& src, int64_t dim,
                   const std::vector<std::vector<Piece>>& outgoing,
                   const std::vector<std::vector<Piece>>& incoming, RowOf row_of, Place place) {
  InFlight f = start_rows(pg, src, dim, outgoing, incoming, row_of, kHaloTag);
  finish_rows(f, dim, incoming, place);
}

std::vector<Window> uniform_windows(const std::vector<int64_t>& sizes, int64_t before,
                                    int64_t after) {
  TORCH_CHECK(before >= 0 && after >= 0, "tessera: halo_exchange: negative halo");
  std::vector<Window> w;
  int64_t offset = 0;
  for (auto s : sizes) {
    w.push_back({offset - before, offset + s + after});
    offset += s;
  }
  return w;
}

}  // namespace

PendingWindow fetch_window_async(const Group& pg, const at::Tensor& x, int64_t dim,
                                 const std::vector<int64_t>& sizes,
                                 const std::vector<Window>& windows, HaloBoundary boundary,
                                 double fill, int tag) {
  const int64_t me = pg ? group_rank(pg) : 0;
  TORCH_INTERNAL_ASSERT(sizes[me] == x.size(dim), "fetch_window: local extent ", x.size(dim),
                        " != table entry ", sizes[me]);
  auto plan = plan_for(me, sizes, windows, boundary);
  auto flight = std::make_shared<InFlight>(start_rows(
      pg, x, dim, plan.send, plan.recv, [](const Piece& p) { return p.local; },
      kHaloTag + 1 + tag));
  if (pg && plan.local.empty() && plan.fill.empty() &&
      sole_sender(plan.recv, windows[me].size(), [](const Piece& p) { return p.slot; }) >=
          0) {  // (a ring step: no copy)
    return PendingWindow([flight, dim, incoming = std::move(plan.recv)]() {
      return sole_block(*flight, dim, incoming);
    });
  }
  const bool identity = plan.identity && plan.fill.empty();
  at::Tensor out = identity ? x : at::empty(with_dim(x, dim, windows[me].size()), x.options());
  if (!identity) {
    for (const auto& f : plan.fill) out.narrow(dim, f.lo, f.size()).fill_(fill);
    for (const auto& p : plan.local)
      out.narrow(dim, p.slot, p.count).copy_(x.narrow(dim, p.local, p.count));
  }
  return PendingWindow([flight, out, dim, incoming = std::move(plan.recv)]() {
    finish_rows(*flight, dim, incoming, [&](const Piece& p, const at::Tensor& r) {
      out.narrow(dim, p.slot, p.count).copy_(r);
    });
    return out;
  });
}

at::Tensor fetch_window(const Group& pg, const at::Tensor& x, int64_t dim,
                        const std::vector<int64_t>& sizes, const std::vector<Window>& windows,
                        HaloBoundary boundary, double fill) {
  const int64_t me = pg ? group_rank(pg) : 0;
  TORCH_INTERNAL_ASSERT(sizes[me] == x.size(dim), "fetch_window: local extent ", x.size(dim),
                        " != table entry ", sizes[me]);
  const auto plan = plan_for(me, sizes, windows, boundary);
  const auto shape = with_dim(x, dim, windows[me].size());
  // My own shard as it is: no copy (others may still need rows of it).
  const bool identity = plan.identity && plan.fill.empty();
  at::Tensor out = identity ? x : at::empty(shape, x.options());
  if (!identity) {
    for (const auto& f : plan.fill) out.narrow(dim, f.lo, f.size()).fill_(fill);
    for (const auto& p : plan.local)
      out.narrow(dim, p.slot, p.count).copy_(x.narrow(dim, p.local, p.count));
  }
  exchange_rows(
      pg, x, dim, plan.send, plan.recv, [](const Piece& p) { return p.local; },
      [&](const Piece& p, const at::Tensor& r) { out.narrow(dim, p.slot, p.count).copy_(r); });
  return out;
}

PendingWindow fetch_window_backward_async(const Group& pg, const at::Tensor& grad_window,
                                          int64_t dim, const std::vector<int64_t>& sizes,
                                          const std::vector<Window>& windows, HaloBoundary boundary,
                                          int tag) {
  const int64_t me = pg ? group_rank(pg) : 0;
  TORCH_INTERNAL_ASSERT(grad_window.size(dim) == windows[me].size());
  auto plan = plan_for(me, sizes, windows, boundary);
  // The roles swap: what I received forward, I send back; what I sent, I get back and add.
  auto flight = std::make_shared<InFlight>(start_rows(
      pg, grad_window, dim, plan.recv, plan.send, [](const Piece& p) { return p.slot; },
      kHaloTag + 1 + tag));
  if (pg && !plan.identity && plan.local.empty() &&
      sole_sender(plan.send, sizes[me], [](const Piece& p) { return p.local; }) >= 0) {
    return PendingWindow([flight, dim, incoming = std::move(plan.send)]() {
      return sole_block(*flight, dim, incoming);
    });
  }
  at::Tensor grad;
  if (plan.identity) {
    grad = grad_window.clone();  // received halo gradients are added in place on wait()
  } else {
    grad = at::zeros(with_dim(grad_window, dim, sizes[me]), grad_window.options());
    for (const auto& p : plan.local)
      grad.narrow(dim, p.local, p.count).add_(grad_window.narrow(dim, p.slot, p.count));
  }
  return PendingWindow([flight, grad, dim, incoming = std::move(plan.send)]() {
    finish_rows(*flight, dim, incoming, [&](const Piece& p, const at::Tensor& r) {
      grad.narrow(dim, p.local, p.count).add_(r);
    });
    return grad;
  });
}

at::Tensor fetch_window_backward(const Group& pg, const at::Tensor& grad_window, int64_t dim,
                                 const std::vector<int64_t>& sizes,
                                 const std::vector<Window>& windows, HaloBoundary boundary) {
  return fetch_window_backward_async(pg, grad_window, dim, sizes, windows, boundary, -1).wait();
}

at::Tensor halo_exchange(const Group& pg, const at::Tensor& x, int64_t dim,
                         const std::vector<int64_t>& sizes, int64_t before, int64_t after,
                         HaloBoundary boundary) {
  return fetch_window(pg, x, dim, sizes, uniform_windows(sizes, before, after), boundary);
}

at::Tensor halo_exchange_backward(const Group& pg, const at::Tensor& grad_extended, int64_t dim,
                                  const std::vector<int64_t>& sizes, int64_t before, int64_t after,
                                  HaloBoundary boundary) {
  return fetch_window_backward(pg, grad_extended, dim, sizes, uniform_windows(sizes, before, after),
                               boundary);
}

int64_t halo_rows_received(int64_t me, const std::vector<int64_t>& sizes,
                           const std::vector<Window>& windows, HaloBoundary boundary) {
  const auto plan = plan_for(me, sizes, windows, boundary);
  int64_t r = 0;
  for (const auto& ps : plan.recv) r += rows(ps);
  return r;
}

}  // namespace tessera::comm
