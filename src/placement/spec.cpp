#include <algorithm>
#include "tessera/placement/spec.h"

#include <functional>
#include <numeric>

#include <c10/util/Exception.h>

namespace tessera {

std::string shape_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts) {
  const int64_t chunk = parts > 0 ? (n + parts - 1) / parts : 0;
  std::vector<int64_t> out(parts);
  int64_t left = n;
  for (auto& s : out) {
    s = std::min(chunk, left);
    left -= s;
  }
  return out;
}

ShardTable chunk_table(const DeviceMesh& mesh, const Placements& placements, int64_t t,
                       int64_t size) {
  ShardTable table;
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard(t)) continue;
    // A head-tail split is the outermost (the spec checks it); its table is fixed.
    if (placements[m].is_head_tail()) {
      table = detail::head_tail_windows(size, mesh.size(m)).table();
      continue;
    }
    if (table.empty()) {
      table = chunk_sizes(size, mesh.size(m));
      continue;
    }
    ShardTable next;
    for (auto piece : table)
      for (auto s : chunk_sizes(piece, mesh.size(m))) next.push_back(s);
    table = std::move(next);
  }
  return table;
}

detail::HeadTailWindows detail::head_tail_windows(int64_t length, int64_t members) {
  const int64_t parts = 2 * members, base = length / parts, extra = length % parts;
  std::vector<int64_t> start(parts + 1, 0);
  for (int64_t c = 0; c < parts; ++c) start[c + 1] = start[c] + base + (c < extra ? 1 : 0);
  // On an even split member k holds chunks 2k and 2k + 1: the front half keeps its first,
  // the back half its second (the middle member of an odd count holds a pair already), so
  // members k and n - 1 - k swap one chunk each.
  std::vector<int64_t> low(members, 0);
  for (int64_t k = 0; k < members / 2; ++k) {
    low[k] = 2 * k;
    low[members - 1 - k] = 2 * k + 1;
  }
  if (members % 2 == 1) low[members / 2] = members - 1;
  HeadTailWindows w;
  w.low = low;
  for (int64_t k = 0; k < members; ++k) {
    const int64_t a = low[k], b = parts - 1 - a;
    w.head.emplace_back(start[a], start[a + 1]);
    w.tail.emplace_back(start[b], start[b + 1]);
  }
  return w;
}

std::vector<int64_t> detail::HeadTailWindows::table() const {
  std::vector<int64_t> out;
  for (size_t k = 0; k < head.size(); ++k)
    out.push_back(head[k].second - head[k].first + tail[k].second - tail[k].first);
  return out;
}

int64_t detail::table_index(const DeviceMesh& mesh, const std::vector<int64_t>& sharding_dims,
                            const std::vector<int64_t>& coord) {
  int64_t idx = 0;
  for (auto m : sharding_dims) idx = idx * mesh.size(m) + coord.at(m);
  return idx;
}

ShardTable detail::marginalize(const ShardTable& table, const std::vector<int64_t>& level_sizes,
                               size_t keep_levels) {
  int64_t inner = 1;
  for (size_t i = keep_levels; i < level_sizes.size(); ++i) inner *= level_sizes[i];
  ShardTable out(table.size() / inner, 0);
  for (size_t i = 0; i < table.size(); ++i) out[i / inner] += table[i];
  return out;
}

DTensorSpec::DTensorSpec(DeviceMesh mesh, Placements placements, std::vector<int64_t> global_sizes,
                         c10::ScalarType dtype, std::vector<ShardTable> tables)
    : mesh_(std::move(mesh)), sizes_(std::move(global_sizes)), dtype_(dtype) {
  TORCH_CHECK(mesh_.defined(), "tessera: a distributed tensor needs a defined DeviceMesh");
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh_.ndim(), "tessera: placements ",
              to_string(placements), " has ", placements.size(), " entries but ", mesh_.str(),
              " has ", mesh_.ndim(), " dims; give one placement per mesh dim");
  const int64_t nd = static_cast<int64_t>(sizes_.size());
  for (auto& p : placements) {
    TORCH_CHECK(!p.is_shard() || nd > 0, "tessera: ", p.str(),
                " cannot shard a 0-dim tensor (global shape []); use Replicate()");
    placements_.push_back(p.normalized(nd));
  }
  for (auto s : sizes_) TORCH_CHECK(s >= 0, "tessera: negative global size in ", shape_str(sizes_));
  TORCH_CHECK(static_cast<int64_t>(tables.size()) <= nd, "tessera: ", tables.size(),
              " shard tables given for a ", nd, "-dim tensor (global shape ", shape_str(sizes_),
              ")");
  tables.resize(nd);  // tensor dims without a table get the chunk layout
  tables_.resize(nd);
  for (int64_t t = 0; t < nd; ++t) {
    auto dims = mesh_dims_sharding(t);
    for (size_t i = 0; i < dims.size(); ++i) {
      if (!placements_[dims[i]].is_head_tail()) continue;
      head_tail_ = true;
      // Outermost, so every member's stored rows are one run that inner Shard(t)s cut.
      TORCH_CHECK(i == 0, "tessera: ", to_string(placements_), " splits tensor dim ", t,
                  " over mesh dims ", shape_str(dims), " with ", placements_[dims[i]].str(),
                  " on mesh dim ", dims[i], "; a head-tail split must be its dim's outermost (",
                  "the lowest mesh dim that splits it), with Shard(", t, ") on the others");
    }
    if (dims.empty()) {
      TORCH_CHECK(tables[t].empty(), "tessera: a shard table was given for ", "tensor dim ", t,
                  ", which ", to_string(placements_), " does not shard");
      continue;
    }
    if (tables[t].empty()) {
      tables_[t] = chunk_table(mesh_, placements_, t, sizes_[t]);
      continue;
    }
    int64_t expected = 1;
    for (auto m : dims) expected *= mesh_.size(m);
    auto& tab = tables[t];
    TORCH_CHECK(static_cast<int64_t>(tab.size()) == expected,
                "tessera: shard sizes for tensor dim ", t, " have ", tab.size(), " entries but ",
                to_string(placements_), " on ", mesh_.str(), " makes ", expected, " shards");
    int64_t total = 0;
    for (auto s : tab) {
      TORCH_CHECK(s >= 0, "tessera: negative shard size in ", shape_str(tab));
      total += s;
    }
    TORCH_CHECK(total == sizes_[t], "tessera: shard sizes ", shape_str(tab), " along tensor dim ",
                t, " sum to ", total, " but the global size is ", sizes_[t], " (global shape ",
                shape_str(sizes_), ", placements ", to_string(placements_), ")");
    if (placements_[dims[0]].is_head_tail()) {
      const auto fixed = detail::head_tail_windows(sizes_[t], mesh_.size(dims[0])).table();
      std::vector<int64_t> levels;
      for (auto m : dims) levels.push_back(mesh_.size(m));
      const auto outer = dims.size() == 1 ? tab : detail::marginalize(tab, levels, 1);
      TORCH_CHECK(outer == fixed, "tessera: ", placements_[dims[0]].str(), " on ", mesh_.str(),
                  " fixes tensor dim ", t, "'s shard sizes over mesh dim ", dims[0], " to ",
                  shape_str(fixed), " for length ", sizes_[t], ", but ", shape_str(tab),
                  " was given; pass no table (or from_local shards of those sizes)");
    }
    tables_[t] = std::move(tab);
  }
  // The same on every rank (the mesh by its shape, not its address): redistribute's agreement
  // ledger keys on it (NOTE: [Agreed signatures]); caches compare the meshes on a hit.
  size_t h = 0;
  for (auto m : mesh_.shape()) h = detail::hash_mix(h, static_cast<size_t>(m));
  for (auto& p : placements_)
    h = detail::hash_mix(
        h, (static_cast<size_t>(p.kind()) << 16) ^ (static_cast<size_t>(p.is_head_tail()) << 12) ^
               (static_cast<size_t>(p.dim()) << 4) ^ static_cast<size_t>(p.reduce_op()));
  for (auto s : sizes_) h = detail::hash_mix(h, static_cast<size_t>(s));
  for (auto& tab : tables_) {
    h = detail::hash_mix(h, tab.size());
    for (auto s : tab) h = detail::hash_mix(h, static_cast<size_t>(s));
  }
  hash_ = detail::hash_mix(h, static_cast<size_t>(dtype_));
}

int64_t DTensorSpec::numel() const {
  return std::accumulate(sizes_.begin(), sizes_.end(), int64_t{1}, std::multiplies<>());
}

std::vector<int64_t> DTensorSpec::mesh_dims_sharding(int64_t t) const {
  std::vector<int64_t> out;
  for (size_t m = 0; m < placements_.size(); ++m)
    if (placements_[m].is_shard(t)) out.push_back(static_cast<int64_t>(m));
  return out;
}

std::vector<int64_t> DTensorSpec::shard_sizes(int64_t mesh_dim,
                                              const std::vector<int64_t>& coord) const {
  const auto& p = placements_.at(mesh_dim);
  TORCH_CHECK(p.is_shard(), "tessera: mesh dim ", mesh_dim, " is ", p.str(), ", not a Shard");
  auto dims = mesh_dims_sharding(p.dim());
  std::vector<int64_t> c = coord;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < mesh_.size(mesh_dim); ++i) {
    c[mesh_dim] = i;
    // Entries of a level: marginalize the deeper levels away first.
    std::vector<int64_t> levels;
    for (auto m : dims) levels.push_back(mesh_.size(m));
    size_t level = std::find(dims.begin(), dims.end(), mesh_dim) - dims.begin();
    auto marg = detail::marginalize(tables_[p.dim()], levels, level + 1);
    std::vector<int64_t> prefix(dims.begin(), dims.begin() + level + 1);
    out.push_back(marg[detail::table_index(mesh_, prefix, c)]);
  }
  return out;
}

std::vector<int64_t> DTensorSpec::shard_sizes(int64_t mesh_dim) const {
  return shard_sizes(mesh_dim, mesh_.coordinate());
}

std::vector<int64_t> DTensorSpec::local_sizes(const std::vector<int64_t>& coord) const {
  std::vector<int64_t> out = sizes_;
  for (int64_t t = 0; t < ndim(); ++t) {
    if (tables_[t].empty()) continue;
    out[t] = tables_[t][detail::table_index(mesh_, mesh_dims_sharding(t), coord)];
  }
  return out;
}

std::vector<int64_t> DTensorSpec::local_offsets(const std::vector<int64_t>& coord) const {
  // Every rank refuses alike (whatever it holds), so a collective caller cannot hang.
  TORCH_CHECK(!head_tail_, "tessera: ", str(),
              ": a head-tail shard is two ranges, not one offset; redistribute to the natural "
              "order first (natural_spec()), or read local_ranges()");
  std::vector<int64_t> out(sizes_.size(), 0);
  for (int64_t t = 0; t < ndim(); ++t) {
    if (tables_[t].empty()) continue;
    const int64_t idx = detail::table_index(mesh_, mesh_dims_sharding(t), coord);
    out[t] = std::accumulate(tables_[t].begin(), tables_[t].begin() + idx, int64_t{0});
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> DTensorSpec::local_ranges(
    int64_t t, const std::vector<int64_t>& coord) const {
  const auto dims = mesh_dims_sharding(t);
  if (tables_[t].empty()) return {{0, sizes_[t]}};
  const int64_t idx = detail::table_index(mesh_, dims, coord);
  const int64_t off = std::accumulate(tables_[t].begin(), tables_[t].begin() + idx, int64_t{0});
  if (!placements_[dims[0]].is_head_tail()) return {{off, off + tables_[t][idx]}};
  const auto w = detail::head_tail_windows(sizes_[t], mesh_.size(dims[0]));
  const int64_t k = coord.at(dims[0]);
  if (dims.size() == 1) return {w.head[k], w.tail[k]};
  // Inner splits cut the member's stored run (its head chunk, then its tail chunk) at
  // [from, to): up to one range of each chunk, or one empty range.
  int64_t inner = 1;
  for (size_t i = 1; i < dims.size(); ++i) inner *= mesh_.size(dims[i]);
  const int64_t first =
      std::accumulate(tables_[t].begin(), tables_[t].begin() + k * inner, int64_t{0});
  const int64_t from = off - first, to = from + tables_[t][idx];
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;  // where the chunk starts in the stored run
  for (auto [lo, hi] : {w.head[k], w.tail[k]}) {
    const int64_t a = std::max(from, at), b = std::min(to, at + hi - lo);
    if (a < b) out.emplace_back(lo + a - at, lo + b - at);
    at += hi - lo;
  }
  if (out.empty()) out.emplace_back(w.head[k].first, w.head[k].first);
  return out;
}

DTensorSpec DTensorSpec::natural_spec() const {
  if (!head_tail_) return *this;
  Placements p;
  for (const auto& x : placements_) p.push_back(x.natural());
  return DTensorSpec(mesh_, std::move(p), sizes_, dtype_, tables_);
}

bool DTensorSpec::has_partial() const {
  for (auto& p : placements_)
    if (p.is_partial()) return true;
  return false;
}
bool DTensorSpec::is_replicated() const {
  for (auto& p : placements_)
    if (!p.is_replicate()) return false;
  return true;
}
bool DTensorSpec::is_sharded() const {
  for (auto& p : placements_)
    if (p.is_shard()) return true;
  return false;
}

bool DTensorSpec::operator==(const DTensorSpec& o) const {
  return hash_ == o.hash_ && mesh_ == o.mesh_ && dtype_ == o.dtype_ &&
         placements_ == o.placements_ && sizes_ == o.sizes_ && tables_ == o.tables_;
}

DTensorSpec DTensorSpec::with_placements(Placements placements,
                                         std::vector<ShardTable> tables) const {
  return DTensorSpec(mesh_, std::move(placements), sizes_, dtype_, std::move(tables));
}

DTensorSpec DTensorSpec::partial_as_replicate() const {
  Placements p = placements_;
  for (auto& x : p)
    if (x.is_partial()) x = Replicate();
  return with_placements(std::move(p), tables_);
}

DTensorSpec DTensorSpec::replicate_where(
    const std::function<bool(int64_t, const Placement&)>& pred) const {
  Placements p = placements_;
  for (int64_t m = 0; m < static_cast<int64_t>(p.size()); ++m)
    if (pred(m, p[m])) p[m] = Replicate();
  auto tables = tables_;
  for (int64_t t = 0; t < ndim(); ++t) {
    if (tables[t].empty()) continue;
    const auto before = mesh_dims_sharding(t);
    std::vector<int64_t> after;
    for (int64_t m : before)
      if (p[m].is_shard(t)) after.push_back(m);
    if (after.size() == before.size()) continue;
    if (after.empty() || !std::equal(after.begin(), after.end(), before.begin())) {
      tables[t].clear();  // unsharded, or not a prefix of the nesting: chunk layout
      continue;
    }
    std::vector<int64_t> level_sizes;
    for (int64_t m : before) level_sizes.push_back(mesh_.size(m));
    tables[t] = detail::marginalize(tables[t], level_sizes, after.size());
  }
  return with_placements(std::move(p), std::move(tables));
}

std::string DTensorSpec::str() const {
  std::string s = to_string(placements_) + " on mesh" + shape_str(mesh_.shape()) + " global " +
                  shape_str(sizes_);
  std::string tabs;
  for (int64_t t = 0; t < ndim(); ++t) {
    if (tables_[t].empty()) continue;
    // Only worth printing when it is not the default layout.
    if (tables_[t] == chunk_table(mesh_, placements_, t, sizes_[t])) continue;
    tabs += (tabs.empty() ? "" : ", ") + std::to_string(t) + ": " + shape_str(tables_[t]);
  }
  if (!tabs.empty()) s += " shards {" + tabs + "}";
  return s;
}

}  // namespace tessera
