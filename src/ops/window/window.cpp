#include "window_internal.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace tessera::ops::spatial {

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

std::vector<int64_t> trailing_dims(int64_t ndim, size_t n) {
  std::vector<int64_t> d;
  for (int64_t i = ndim - static_cast<int64_t>(n); i < ndim; ++i) d.push_back(i);
  return d;
}

std::vector<int64_t> per_dim(std::vector<int64_t> v, size_t n, std::vector<int64_t> if_empty) {
  if (v.empty()) v = std::move(if_empty);
  if (v.size() == 1 && n > 1) v.assign(n, v[0]);
  return v;
}

Axis Axis::stencil(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad,
                   int64_t dilation) {
  Axis a;
  a.kind = Kind::Stencil;
  a.in = in, a.out = out, a.kernel = kernel, a.stride = stride, a.pad = pad, a.dilation = dilation;
  return a;
}

Axis Axis::transposed(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad,
                      int64_t dilation) {
  Axis a = stencil(in, out, kernel, stride, pad, dilation);
  a.kind = Kind::Transposed;
  return a;
}

Axis Axis::nearest(int64_t in, int64_t out, double scale) {
  Axis a;
  a.kind = Kind::Nearest;
  a.in = in, a.out = out, a.scale = scale;
  return a;
}

Axis Axis::linear(int64_t in, int64_t out, bool align_corners, double scale) {
  Axis a;
  a.kind = Kind::Linear;
  a.in = in, a.out = out, a.align_corners = align_corners, a.scale = scale;
  return a;
}

Axis Axis::custom(int64_t in, int64_t out, std::shared_ptr<const AxisMap> map) {
  TORCH_CHECK(map, "tessera: Axis::custom needs a map");
  Axis a;
  a.kind = Kind::Custom;
  a.in = in, a.out = out, a.map = std::move(map);
  return a;
}

namespace {

// ATen's nearest source index (float arithmetic, with the exact 1x and 2x cases).
int64_t nearest_source(int64_t o, int64_t in, int64_t out, double scale) {
  if (out == in) return o;
  if (out == 2 * in) return o >> 1;
  const float s = scale > 0 ? static_cast<float>(1.0 / scale) : static_cast<float>(in) / out;
  return std::min(static_cast<int64_t>(std::floor(o * s)), in - 1);
}

// ATen's linear source coordinate (area_pixel_compute_source_index, non-cubic).
double linear_source(int64_t o, int64_t in, int64_t out, bool align_corners, double scale) {
  if (align_corners) {
    const double s = out > 1 ? static_cast<double>(in - 1) / (out - 1) : 0.0;
    return s * o;
  }
  const double s = scale > 0 ? 1.0 / scale : static_cast<double>(in) / out;
  return std::max(s * (o + 0.5) - 0.5, 0.0);
}

}  // namespace

Axis::Taps Axis::taps(int64_t o) const {
  if (kind == Kind::Nearest) {
    const int64_t i = nearest_source(o, in, out, scale);
    return {i, i, 1.0, 0.0};
  }
  const double src = linear_source(o, in, out, align_corners, scale);
  const int64_t i0 = std::min(static_cast<int64_t>(src), in - 1);
  const double l1 = std::min(std::max(src - static_cast<double>(i0), 0.0), 1.0);
  const int64_t i1 = i0 < in - 1 ? i0 + 1 : i0;
  return {i0, i1, 1.0 - l1, l1};
}

int64_t Axis::source_row(int64_t o) const {
  switch (kind) {
    case Kind::Stencil: return o * stride - pad + dilation * (kernel - 1) / 2;
    case Kind::Transposed: return floor_div(o + pad - dilation * (kernel - 1) / 2, stride);
    case Kind::Nearest: return nearest_source(o, in, out, scale);
    case Kind::Linear:
      return static_cast<int64_t>(
          std::floor(linear_source(o, in, out, align_corners, scale) + 0.5));
    case Kind::Custom: return map->source_row(o);
  }
  return 0;
}

Window Axis::reads(int64_t lo, int64_t hi) const {
  if (hi <= lo) return {0, 0};
  switch (kind) {
    case Kind::Stencil:
      return {lo * stride - pad, (hi - 1) * stride - pad + dilation * (kernel - 1) + 1};
    case Kind::Transposed: {
      // Inputs i with i*stride - pad + dilation*j in [lo, hi) for some j < kernel; inputs
      // outside the domain contribute nothing, so the window stays inside it.
      const int64_t first =
          std::max<int64_t>(ceil_div(lo + pad - dilation * (kernel - 1), stride), 0);
      const int64_t last = std::min<int64_t>(floor_div(hi - 1 + pad, stride), in - 1);
      return last >= first ? Window{first, last + 1} : Window{0, 0};
    }
    case Kind::Nearest:
    case Kind::Linear: {
      // Source rows are monotone in o.
      const auto a = taps(lo), b = taps(hi - 1);
      return {std::min(a.i0, a.i1), std::max(b.i0, b.i1) + 1};
    }
    case Kind::Custom: return map->reads(lo, hi);
  }
  return {0, 0};
}

std::string Axis::str() const {
  if (kind == Kind::Custom) return map->str();
  std::ostringstream os;
  static const char* names[] = {"stencil", "transposed", "nearest", "linear"};
  os << names[static_cast<int>(kind)] << "(in " << in << ", out " << out;
  if (kind == Kind::Stencil || kind == Kind::Transposed)
    os << ", kernel " << kernel << ", stride " << stride << ", pad " << pad << ", dilation "
       << dilation;
  os << ")";
  return os.str();
}

std::vector<int64_t> output_sizes(const Axis& axis, const std::vector<int64_t>& in_sizes) {
  const int64_t n = static_cast<int64_t>(in_sizes.size());
  std::vector<int64_t> ends(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) ends[i] = total += in_sizes[i];
  std::vector<int64_t> out(n, 0);
  if (total == 0) {
    out[0] = axis.out;  // no input anywhere: outputs (if any) stay with the first member
    return out;
  }
  for (int64_t o = 0; o < axis.out; ++o) {
    const int64_t r = std::clamp<int64_t>(axis.source_row(o), 0, total - 1);
    ++out[std::upper_bound(ends.begin(), ends.end(), r) - ends.begin()];
  }
  return out;
}

std::vector<int64_t> input_sizes_for(const Axis& axis, const std::vector<int64_t>& out_sizes) {
  // Member m's inputs start where the first output after the previous members points.
  const int64_t n = static_cast<int64_t>(out_sizes.size());
  std::vector<int64_t> in(n, 0);
  int64_t out_start = 0, prev = 0;
  for (int64_t m = 0; m < n; ++m) {
    const int64_t out_end = out_start + out_sizes[m];
    int64_t end = axis.in;
    // The next member's first output reads row source_row clamped into the domain, as in
    // output_sizes: that row must be the next member's.
    if (m + 1 < n && out_end < axis.out)
      end = std::max(prev, std::min(axis.source_row(out_end), axis.in - 1));
    in[m] = end - prev;
    prev = end;
    out_start = out_end;
  }
  if (output_sizes(axis, in) != out_sizes) return {};
  return in;
}

std::vector<Window> read_windows(const Axis& axis, const std::vector<int64_t>& out_sizes) {
  std::vector<Window> w;
  int64_t offset = 0;
  for (auto s : out_sizes) {
    w.push_back(axis.reads(offset, offset + s));
    offset += s;
  }
  return w;
}

int64_t DimCut::in_offset(int64_t m) const {
  int64_t o = 0;
  for (int64_t i = 0; i < m; ++i) o += in_sizes[i];
  return o;
}
int64_t DimCut::out_offset(int64_t m) const {
  int64_t o = 0;
  for (int64_t i = 0; i < m; ++i) o += out_sizes[i];
  return o;
}

SpecPtr window_layout(const DTensorSpec& s, const std::vector<int64_t>& window_dims,
                      bool keep_others) {
  auto is_window = [&](int64_t d) {
    return std::find(window_dims.begin(), window_dims.end(), d) != window_dims.end();
  };
  // A window dim keeps its outermost mesh dim (and that level of its nested table).
  return std::make_shared<DTensorSpec>(s.replicate_where([&](int64_t m, const Placement& p) {
    if (!p.is_shard()) return true;
    const int64_t d = p.dim();
    if (is_window(d)) return m != s.mesh_dims_sharding(d).front();
    return !(keep_others || d == 0);
  }));
}

bool any_window_dim_sharded(const DTensorSpec& s, const std::vector<int64_t>& window_dims) {
  for (auto d : window_dims)
    if (!s.mesh_dims_sharding(d).empty()) return true;
  return false;
}

std::vector<DimCut> make_cuts(const DTensorSpec& layout, const std::vector<int64_t>& window_dims,
                              const std::vector<Axis>& axes) {
  std::vector<DimCut> cuts;
  const auto& coord = layout.mesh().coordinate();
  for (size_t k = 0; k < window_dims.size(); ++k) {
    DimCut c;
    c.dim = window_dims[k];
    c.axis = axes[k];
    const auto md = layout.mesh_dims_sharding(c.dim);
    TORCH_INTERNAL_ASSERT(md.size() <= 1, "window dim sharded over several mesh dims");
    if (md.empty()) {
      c.in_sizes = {layout.sizes()[c.dim]};
    } else {
      c.mesh_dim = md[0];
      c.in_sizes = layout.shard_table(c.dim);
      c.me = coord.empty() ? 0 : coord[md[0]];
    }
    c.out_sizes = output_sizes(c.axis, c.in_sizes);
    cuts.push_back(std::move(c));
  }
  return cuts;
}

SpecPtr output_spec(const DTensorSpec& layout, const std::vector<DimCut>& cuts,
                    c10::ScalarType dtype, int64_t channels) {
  auto sizes = layout.sizes();
  auto tables = layout.shard_tables();
  tables.resize(sizes.size());
  if (channels >= 0) sizes[1] = channels;
  for (const auto& c : cuts) {
    sizes[c.dim] = c.axis.out;
    if (c.cut()) tables[c.dim] = c.out_sizes;
  }
  return std::make_shared<DTensorSpec>(layout.mesh(), layout.placements(), sizes, dtype, tables);
}

namespace {

comm::Group group_of(const DeviceMesh& mesh, const DimCut& c) {
  return c.cut() ? mesh.group(c.mesh_dim) : comm::Group();
}

// The slots of window w that lie inside a domain of `total` rows.
Window in_domain(Window w, int64_t total) {
  const int64_t lo = std::max<int64_t>(0, -w.lo);
  const int64_t hi = std::max(lo, std::min(w.size(), total - w.lo));
  return {lo, hi};
}

// Cut dims first: uncut dims only pad, locally, and padding fetched before a cut dim would
// travel with it.
std::vector<size_t> fetch_order(const std::vector<DimCut>& cuts) {
  std::vector<size_t> order;
  for (size_t k = 0; k < cuts.size(); ++k)
    if (cuts[k].cut()) order.push_back(k);
  for (size_t k = 0; k < cuts.size(); ++k)
    if (!cuts[k].cut()) order.push_back(k);
  return order;
}

// Fetches the windows dim after dim. Under a fill boundary only the in-domain part of the
// dims already fetched travels: fill cells beyond a domain edge (padding next to a corner)
// are made by the receiver, so ranks on an edge move exactly their halo too.
at::Tensor fetch_dims(const DeviceMesh& mesh, const at::Tensor& x, const std::vector<DimCut>& cuts,
                      const std::vector<std::vector<int64_t>>& sizes,
                      const std::vector<std::vector<Window>>& windows, HaloBoundary boundary,
                      double fill) {
  at::Tensor y = x;
  std::vector<std::pair<int64_t, Window>> trims;  // earlier dims with fill slots
  for (size_t k : fetch_order(cuts)) {
    const auto& c = cuts[k];
    const auto group = group_of(mesh, c);
    if (!c.cut() || trims.empty() || boundary != HaloBoundary::Zeros) {
      y = comm::fetch_window(group, y, c.dim, sizes[k], windows[k], boundary, fill);
    } else {
      at::Tensor core = y;
      for (const auto& [d, slots] : trims) core = core.narrow(d, slots.lo, slots.size());
      at::Tensor got = comm::fetch_window(group, core, c.dim, sizes[k], windows[k], boundary, fill);
      auto shape = y.sizes().vec();
      shape[c.dim] = windows[k][c.me].size();
      at::Tensor full = at::full(shape, fill, y.options());
      at::Tensor inner = full;
      for (const auto& [d, slots] : trims) inner = inner.narrow(d, slots.lo, slots.size());
      inner.copy_(got);
      y = full;
    }
    int64_t total = 0;
    for (auto n : sizes[k]) total += n;
    const Window w = windows[k][c.me];
    const Window slots = in_domain(w, total);
    if (slots.lo > 0 || slots.hi < w.size()) trims.emplace_back(c.dim, slots);
  }
  return y;
}

}  // namespace

at::Tensor fetch(const DeviceMesh& mesh, const at::Tensor& x, const std::vector<DimCut>& cuts,
                 HaloBoundary boundary, double fill) {
  std::vector<std::vector<int64_t>> sizes;
  std::vector<std::vector<Window>> windows;
  for (const auto& c : cuts) {
    sizes.push_back(c.in_sizes);
    windows.push_back(read_windows(c.axis, c.out_sizes));
  }
  return fetch_dims(mesh, x, cuts, sizes, windows, boundary, fill);
}

at::Tensor fetch_backward(const DeviceMesh& mesh, const at::Tensor& grad_window,
                          const std::vector<DimCut>& cuts, HaloBoundary boundary) {
  // Under a fill boundary the fill slots' gradients drop out: cut them off first (a view),
  // then send back with windows clipped to the domain, so they never travel.
  at::Tensor g = grad_window;
  std::vector<std::vector<Window>> windows;
  for (const auto& c : cuts) {
    auto w = read_windows(c.axis, c.out_sizes);
    if (boundary == HaloBoundary::Zeros) {
      const int64_t total = c.axis.in;
      const Window slots = in_domain(w[c.me], total);
      g = g.narrow(c.dim, slots.lo, slots.size());
      for (auto& m : w) {
        const Window s = in_domain(m, total);
        m = s.size() ? Window{m.lo + s.lo, m.lo + s.hi} : Window{0, 0};
      }
    }
    windows.push_back(std::move(w));
  }
  const auto order = fetch_order(cuts);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const auto& c = cuts[*it];
    g = comm::fetch_window_backward(group_of(mesh, c), g, c.dim, c.in_sizes, windows[*it],
                                    boundary);
  }
  return g;
}

at::Tensor fetch_ranges(const DeviceMesh& mesh, const at::Tensor& x,
                        const std::vector<DimCut>& cuts,
                        const std::vector<std::vector<int64_t>>& sizes,
                        const std::vector<std::vector<Window>>& windows) {
  return fetch_dims(mesh, x, cuts, sizes, windows, HaloBoundary::Zeros, 0.0);
}

at::Tensor place(const at::Tensor& x, int64_t dim, Window from, Window to) {
  TORCH_INTERNAL_ASSERT(x.size(dim) == from.size());
  if (from.lo == to.lo && from.hi == to.hi) return x;
  if (from.lo <= to.lo && to.hi <= from.hi)
    return x.narrow(dim, to.lo - from.lo, to.size());  // a view
  auto shape = x.sizes().vec();
  shape[dim] = to.size();
  at::Tensor out = at::zeros(shape, x.options());
  const int64_t lo = std::max(from.lo, to.lo), hi = std::min(from.hi, to.hi);
  if (hi > lo) out.narrow(dim, lo - to.lo, hi - lo).copy_(x.narrow(dim, lo - from.lo, hi - lo));
  return out;
}

}  // namespace tessera::ops::spatial
