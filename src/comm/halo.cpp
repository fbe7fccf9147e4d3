#include "tessera/comm/halo.h"

#include <numeric>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace tessera::comm {

namespace {

// One contiguous run of halo rows: `count` rows starting at global row `global` (already
// wrapped into the domain), placed at row `slot` of the extended shard.
struct Run {
  int64_t slot, global, count;
};

// The halo rows member `m` needs, as runs of in-domain global rows (rows outside a
// non-periodic domain are left out: they stay zero).
std::vector<Run> needed_by(int64_t m, const std::vector<int64_t>& offsets,
                           const std::vector<int64_t>& sizes, int64_t total, int64_t before,
                           int64_t after, HaloBoundary boundary) {
  std::vector<Run> runs;
  auto add = [&](int64_t slot, int64_t first, int64_t count) {
    for (int64_t k = 0; k < count; ++k) {
      int64_t g = first + k;
      if (boundary == HaloBoundary::Periodic) {
        if (total == 0) continue;
        g = ((g % total) + total) % total;
      } else if (g < 0 || g >= total) {
        continue;
      }
      if (!runs.empty() && runs.back().slot + runs.back().count == slot + k &&
          runs.back().global + runs.back().count == g)
        ++runs.back().count;
      else
        runs.push_back({slot + k, g, 1});
    }
  };
  add(0, offsets[m] - before, before);
  add(before + sizes[m], offsets[m] + sizes[m], after);
  return runs;
}

int64_t owner_of(int64_t g, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  for (size_t i = 0; i < sizes.size(); ++i)
    if (g >= offsets[i] && g < offsets[i] + sizes[i]) return static_cast<int64_t>(i);
  TORCH_INTERNAL_ASSERT(false, "row ", g, " has no owner");
}

// Pieces of `run` split by owner: (owner, slot, local row in the owner's shard, count).
struct Piece {
  int64_t owner, slot, local, count;
};
std::vector<Piece> pieces_of(const Run& run, const std::vector<int64_t>& offsets,
                             const std::vector<int64_t>& sizes) {
  std::vector<Piece> out;
  int64_t done = 0;
  while (done < run.count) {
    const int64_t g = run.global + done;
    const int64_t o = owner_of(g, offsets, sizes);
    const int64_t n = std::min(run.count - done, offsets[o] + sizes[o] - g);
    out.push_back({o, run.slot + done, g - offsets[o], n});
    done += n;
  }
  return out;
}

struct Plan {
  std::vector<std::vector<Piece>> send;  // per member: my rows it needs (slot = its slot)
  std::vector<std::vector<Piece>> recv;  // per member: the rows I need from it
};

Plan plan_for(int64_t me, const std::vector<int64_t>& sizes, int64_t before, int64_t after,
              HaloBoundary boundary) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> offsets(n, 0);
  for (int64_t i = 1; i < n; ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  const int64_t total = offsets.back() + sizes.back();
  Plan plan{std::vector<std::vector<Piece>>(n), std::vector<std::vector<Piece>>(n)};
  for (int64_t m = 0; m < n; ++m) {
    for (const auto& run : needed_by(m, offsets, sizes, total, before, after, boundary)) {
      for (const auto& p : pieces_of(run, offsets, sizes)) {
        if (p.owner == me) plan.send[m].push_back(p);
        if (m == me) plan.recv[p.owner].push_back(p);
      }
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
  for (auto& p : ps) r += p.count;
  return r;
}

// Sends each member m the rows of `src` listed in outgoing[m] (starting at row_of(piece))
// and hands every received run to place(piece, rows), in the order of incoming[m].
template <class RowOf, class Place>
void exchange_rows(const Group& pg, const at::Tensor& src, int64_t dim,
                   const std::vector<std::vector<Piece>>& outgoing,
                   const std::vector<std::vector<Piece>>& incoming, RowOf row_of, Place place) {
  const size_t n = outgoing.size();
  std::vector<at::Tensor> send;
  std::vector<std::vector<int64_t>> recv_shapes;
  for (size_t m = 0; m < n; ++m) {
    std::vector<at::Tensor> parts;
    for (const auto& p : outgoing[m]) parts.push_back(src.narrow(dim, row_of(p), p.count));
    send.push_back(parts.empty() ? at::empty(with_dim(src, dim, 0), src.options())
                                 : at::cat(parts, dim).contiguous());
    recv_shapes.push_back(with_dim(src, dim, rows(incoming[m])));
  }
  auto blocks = all_to_all_blocks(pg, send, recv_shapes, src.options(), CollectiveKind::SendRecv);
  for (size_t m = 0; m < n; ++m) {
    int64_t at_row = 0;
    for (const auto& p : incoming[m]) {
      place(p, blocks[m].narrow(dim, at_row, p.count));
      at_row += p.count;
    }
  }
}

}  // namespace

at::Tensor halo_exchange(const Group& pg, const at::Tensor& x, int64_t dim,
                         const std::vector<int64_t>& sizes, int64_t before, int64_t after,
                         HaloBoundary boundary) {
  TORCH_CHECK(before >= 0 && after >= 0, "tessera: halo_exchange: negative halo");
  const auto plan = plan_for(group_rank(pg), sizes, before, after, boundary);
  at::Tensor out = at::zeros(with_dim(x, dim, before + x.size(dim) + after), x.options());
  out.narrow(dim, before, x.size(dim)).copy_(x);
  exchange_rows(pg, x, dim, plan.send, plan.recv, [](const Piece& p) { return p.local; },
                [&](const Piece& p, const at::Tensor& r) { out.narrow(dim, p.slot, p.count).copy_(r); });
  return out;
}

at::Tensor halo_exchange_backward(const Group& pg, const at::Tensor& grad_extended, int64_t dim,
                                  const std::vector<int64_t>& sizes, int64_t before,
                                  int64_t after, HaloBoundary boundary) {
  const auto plan = plan_for(group_rank(pg), sizes, before, after, boundary);
  const int64_t local = grad_extended.size(dim) - before - after;
  // Each halo row's gradient goes back to the rank the row came from and is added there.
  at::Tensor grad = grad_extended.narrow(dim, before, local).clone();
  exchange_rows(pg, grad_extended, dim, plan.recv, plan.send, [](const Piece& p) { return p.slot; },
                [&](const Piece& p, const at::Tensor& r) { grad.narrow(dim, p.local, p.count).add_(r); });
  return grad;
}

}  // namespace tessera::comm
