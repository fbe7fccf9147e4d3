// distribute_tensor / scatter_tensor / from_local / to_local / full_tensor / redistribute,
// each with its backward as an autograd Node (NOTE: [Backward of layout changes]).
#include "tessera/tensor/api.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "../comm/wait.h"
#include "tessera/compat_autograd.h"
#include "tessera/comm/collectives.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

using torch::autograd::Node;
using torch::autograd::variable_list;

ShardSizes ShardSizes::Given(int64_t dim, ShardTable sizes) {
  TORCH_CHECK(dim >= 0, "tessera: ShardSizes::Given(dim, sizes) needs a non-negative dim");
  std::vector<ShardTable> tables(dim + 1);
  tables[dim] = std::move(sizes);
  return Given(std::move(tables));
}

namespace {

bool needs_grad(const at::Tensor& t) { return t.requires_grad() && at::GradMode::is_enabled(); }

void connect(const compat::NodePtr<Node>& node, const at::Tensor& input, at::Tensor& out) {
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(out, node);
}

// Target tables: explicit ones win; tensor dims sharded by the same mesh dims keep theirs.
std::vector<ShardTable> target_tables(const char* what, const DTensorSpec* src,
                                      const DeviceMesh& mesh, const Placements& p,
                                      const std::vector<int64_t>& sizes, const ShardSizes& given) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t) {
    if (given.mode() == ShardSizes::Mode::Given &&
        t < static_cast<int64_t>(given.tables().size()) && !given.tables()[t].empty()) {
      tables[t] = given.tables()[t];
      continue;
    }
    if (!src) continue;
    std::vector<int64_t> dims;
    for (size_t m = 0; m < p.size(); ++m)
      if (p[m].normalized(nd).is_shard(t)) dims.push_back(static_cast<int64_t>(m));
    // Keep the source's cut where the target's nesting is a prefix of the source's (e.g.
    // (S(0), S(0)) -> (S(0), R) keeps the outer boundaries); otherwise chunk layout.
    const auto src_dims = src->mesh_dims_sharding(t);
    if (!dims.empty() && dims.size() <= src_dims.size() &&
        std::equal(dims.begin(), dims.end(), src_dims.begin())) {
      std::vector<int64_t> levels;
      for (auto m : src_dims) levels.push_back(mesh.size(m));
      tables[t] = marginalize(src->shard_table(t), levels, dims.size());
    }
  }
  if (given.mode() == ShardSizes::Mode::Given)
    TORCH_CHECK(static_cast<int64_t>(given.tables().size()) <= nd, "tessera: ", what, "(",
                to_string(p), ", global shape ", shape_str(sizes), "): ShardSizes::Given has ",
                given.tables().size(), " tables for a ", nd, "-dim tensor");
  return tables;
}

// NOTE: [Backward of layout changes]
// The gradient of a layout change is the reverse layout change, except that a Partial
// source becomes Replicate: a gradient is never split into partial terms (dividing it would
// be wrong, seed 001), and a replicated gradient is the correct gradient of each term.
SpecPtr grad_spec_for(const DTensorSpec& s) {
  return std::make_shared<DTensorSpec>(s.partial_as_replicate());
}

// Incoming gradients may be plain (e.g. autograd's zeros of the global shape).
at::Tensor as_dtensor_grad(const at::Tensor& g, const DTensorSpec& like) {
  if (is_dtensor(g)) return g;
  Placements r(like.mesh().ndim(), Replicate());
  return make_dtensor(
      g, std::make_shared<DTensorSpec>(like.mesh(), r, g.sizes().vec(), g.scalar_type()));
}

SpecPtr with_dtype(const SpecPtr& s, c10::ScalarType dt) {
  if (s->dtype() == dt) return s;
  return std::make_shared<DTensorSpec>(s->mesh(), s->placements(), s->sizes(), dt,
                                       s->shard_tables());
}

at::Tensor redistribute_to(const at::Tensor& x, const SpecPtr& target);
at::Tensor wrap_local(const at::Tensor& local, const SpecPtr& spec);

struct RedistributeBackward : Node {
  SpecPtr from;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    auto g = as_dtensor_grad(grads[0], *from);
    return {redistribute_to(g, with_dtype(grad_spec_for(*from), g.scalar_type()))};
  }
  std::string name() const override { return "tessera::RedistributeBackward"; }
};

struct ToLocalBackward : Node {
  SpecPtr grad_spec;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    at::Tensor g = grads[0];
    // The local tensor met distributed ones, which admitted it as replicated: its gradient
    // came back distributed, and the local gradient is its whole value.
    if (is_dtensor(g)) g = full_tensor(g);
    return {wrap_local(g, with_dtype(grad_spec, g.scalar_type()))};
  }
  std::string name() const override { return "tessera::ToLocalBackward"; }
};

struct FromLocalBackward : Node {
  SpecPtr spec;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    auto g = as_dtensor_grad(grads[0], *spec);
    return {to_local(redistribute_to(g, with_dtype(grad_spec_for(*spec), g.scalar_type())))};
  }
  std::string name() const override { return "tessera::FromLocalBackward"; }
};

// Only the source rank's data reached the output, so only it gets a gradient.
struct ScatterBackward : Node {
  SpecPtr spec;
  bool is_src = false;
  std::vector<int64_t> input_sizes;
  at::TensorOptions input_options;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    auto full = full_tensor(as_dtensor_grad(grads[0], *spec));
    if (is_src) return {full};
    return {input_sizes.empty() && !input_options.has_dtype()
                ? at::Tensor()
                : at::zeros(input_sizes, input_options)};
  }
  std::string name() const override { return "tessera::ScatterBackward"; }
};

at::Tensor redistribute_to(const at::Tensor& x, const SpecPtr& target) {
  auto* d = dtensor_impl(x, "redistribute's input");
  TORCH_CHECK(d->spec().mesh() == target->mesh(), "tessera: redistribute: tensor is on ",
              d->spec().mesh().str(), " but the target is on ", target->mesh().str());
  if (d->spec() == *target && !needs_grad(x)) return x;
  at::Tensor out = make_dtensor(redistribute_local(d->local(), d->spec_ptr(), target), target);
  if (needs_grad(x)) {
    auto node = compat::make_node<RedistributeBackward>();
    node->from = d->spec_ptr();
    connect(node, x, out);
  }
  return out;
}

at::Tensor wrap_local(const at::Tensor& local, const SpecPtr& spec) {
  at::Tensor out = make_dtensor(local.detach(), spec);
  if (needs_grad(local)) {
    auto node = compat::make_node<FromLocalBackward>();
    node->spec = spec;
    connect(node, local, out);
  }
  return out;
}

// Errors from the spec name the public function and its arguments.
std::string strip_prefix(const std::string& m) {
  const std::string p = "tessera: ";
  return m.rfind(p, 0) == 0 ? m.substr(p.size()) : m;
}

SpecPtr make_spec(const char* what, const DeviceMesh& mesh, const Placements& placements,
                  const std::vector<int64_t>& sizes, c10::ScalarType dtype,
                  std::vector<ShardTable> tables = {}) {
  try {
    return std::make_shared<DTensorSpec>(mesh, placements, sizes, dtype, std::move(tables));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "tessera: ", what, "(", to_string(placements), ", global shape ",
                shape_str(sizes), "): ", strip_prefix(e.msg()));
  }
}

// Checks that need nothing but the arguments: the same verdict on every rank.
void check_placement_count(const char* what, const DeviceMesh& mesh, const Placements& placements) {
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "tessera: ", what, "(",
              to_string(placements), "): placements ", to_string(placements), " has ",
              placements.size(), " entries but ", mesh.str(), " has ", mesh.ndim(),
              " dims; give one placement per mesh dim");
}

void check_placements(const char* what, const DeviceMesh& mesh, const Placements& placements,
                      const std::vector<int64_t>& shape) {
  check_placement_count(what, mesh, placements);
  const int64_t ndim = static_cast<int64_t>(shape.size());
  for (auto& p : placements) {
    TORCH_CHECK(!p.is_shard() || (ndim > 0 && p.dim() >= -ndim && p.dim() < ndim),
                "tessera: ", what, "(", to_string(placements), "): Shard(", p.dim(),
                ") is out of range for a tensor with ", ndim, " dims (shape ", shape_str(shape),
                "); use a dim in [", -ndim, ", ", ndim - 1, "]");
  }
}

// NOTE: [Agreeing on arguments]
// Arguments are per rank, so a check on them can fail on some ranks only; a rank that throws
// alone leaves the others waiting in the next collective. The collective entry points
// (distribute_tensor with a source rank, scatter_tensor, from_local with run_check or Infer,
// redistribute to placements) therefore run their local checks without throwing, then
// exchange one small message: each rank's verdict, a digest of its arguments and a few ints
// the entry point needs anyway (its tensor's rank and dtype, ...). A failed check or arguments
// that differ are then raised on every rank, before any rank starts the real collectives.

// Ranks with the same text, for messages: "ranks 0, 2".
std::string ranks_str(const DeviceMesh& mesh, const std::vector<size_t>& members) {
  std::string s = members.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < members.size(); ++i)
    s += (i ? ", " : "") + std::to_string(mesh.ranks()[members[i]]);
  return s;
}

std::vector<std::pair<std::string, std::vector<size_t>>> group_texts(
    const std::vector<std::string>& texts, const std::vector<bool>& include) {
  std::vector<std::pair<std::string, std::vector<size_t>>> groups;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (!include[i]) continue;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == texts[i]; });
    if (it == groups.end())
      groups.push_back({texts[i], {i}});
    else
      it->second.push_back(i);
  }
  return groups;
}

// Every mesh rank's `ints` once every rank passed its local checks (`error` empty) and all
// passed the same `args` (a description, compared by digest); otherwise the same error on
// every rank. `check` sees the gathered ints after the arguments are known to agree.
using IntsCheck = std::function<void(const std::vector<std::vector<int64_t>>&)>;
std::vector<std::vector<int64_t>> agree(const char* what, const DeviceMesh& mesh,
                                        const std::string& error, const std::string& args,
                                        const std::vector<int64_t>& ints,
                                        const IntsCheck& check = {}) {
  // Alone, or outside the mesh (no group to talk on): this rank's verdict is the verdict.
  if (mesh.size() == 1 || !mesh.contains_this_rank()) TORCH_CHECK(error.empty(), error);
  if (mesh.size() == 1 && mesh.contains_this_rank()) {
    std::vector<std::vector<int64_t>> one{ints};
    if (check) check(one);
    return one;
  }
  auto pg = mesh.mesh_group();
  std::vector<int64_t> mine{error.empty() ? 1 : 0,
                            static_cast<int64_t>(std::hash<std::string>()(args))};
  mine.insert(mine.end(), ints.begin(), ints.end());
  auto all = comm::all_gather_ints(pg, mine);
  bool ok = true, same = true;
  std::vector<std::vector<int64_t>> out;
  for (auto& v : all) {
    ok = ok && v[0] == 1;
    same = same && v[1] == all[0][1];
    out.emplace_back(v.begin() + 2, v.end());
  }
  if (ok && same) {
    if (check) check(out);
    return out;
  }
  // The rare path: every rank learns why the others failed, or what they passed.
  auto texts = comm::all_gather_strings(pg, error.empty() ? args : error);
  const size_t n = all.size();
  std::vector<bool> failed(n);
  for (size_t i = 0; i < n; ++i) failed[i] = all[i][0] == 0;
  if (!ok) {
    auto groups = group_texts(texts, failed);
    size_t count = 0;
    for (auto& g : groups) count += g.second.size();
    // Every rank failed the same check: the error as one rank alone would raise it.
    TORCH_CHECK(!(groups.size() == 1 && count == n), groups[0].first);
    std::string msg;
    for (auto& g : groups)
      msg += (msg.empty() ? "" : "; ") + g.first + " [on " + ranks_str(mesh, g.second) + "]";
    TORCH_CHECK(
        false, msg,
        count < n ? " (the other ranks of " + mesh.str() + " passed these checks)" : std::string());
  }
  std::string msg;
  for (auto& g : group_texts(texts, std::vector<bool>(n, true)))
    msg += (msg.empty() ? "" : "; ") + ranks_str(mesh, g.second) + " passed " + g.first;
  TORCH_CHECK(false, "tessera: ", what, ": the ranks of ", mesh.str(),
              " disagree on the arguments, which must be the same on every rank: ", msg);
}

std::string sizes_str(const ShardSizes& sizes) {
  switch (sizes.mode()) {
    case ShardSizes::Mode::Chunk: return "";
    case ShardSizes::Mode::Infer: return ", ShardSizes::Infer()";
    case ShardSizes::Mode::Given: break;
  }
  std::string s;
  for (size_t t = 0; t < sizes.tables().size(); ++t)
    if (!sizes.tables()[t].empty())
      s += (s.empty() ? "" : ", ") + std::to_string(t) + ": " + shape_str(sizes.tables()[t]);
  return ", shard sizes {" + s + "}";
}

// Local checks whose failure `agree` reports: the error's text, or "" when they pass.
template <class F>
std::string error_of(F&& checks) {
  try {
    checks();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return {};
}

struct SourceMeta {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
  bool requires_grad;
};

// The source rank's shape, dtype and requires_grad, agreed by every rank (two small
// all-gathers). With every_rank_has_data, every rank's tensor must match the source's; any
// mismatch raises the same error on every rank.
// `error` and `args`: this rank's local checks and arguments (NOTE: [Agreeing on arguments]).
SourceMeta agree_with_source(const char* what, const DeviceMesh& mesh, const at::Tensor& t,
                             int src_flat, bool every_rank_has_data, const std::string& error,
                             const std::string& args) {
  const bool def = t.defined();
  const int src_rank = src_flat >= 0 ? mesh.ranks()[src_flat] : -1;
  auto heads = agree(
      what, mesh, error, args,
      {def, def ? t.dim() : -1, def ? static_cast<int64_t>(t.scalar_type()) : -1,
       def && t.requires_grad()},
      [&](const std::vector<std::vector<int64_t>>& heads) {
        const auto& src = heads[src_flat];
        TORCH_CHECK(src[0] == 1, "tessera: ", what, ": the source rank ", src_rank,
                    " passed an undefined tensor");
        for (size_t r = 0; every_rank_has_data && r < heads.size(); ++r) {
          TORCH_CHECK(heads[r][0] == 1 && heads[r][1] == src[1] && heads[r][2] == src[2],
                      "tessera: ", what, ": rank ", mesh.ranks()[r], " passed ",
                      heads[r][0] ? std::to_string(heads[r][1]) + "-d " +
                                        c10::toString(static_cast<c10::ScalarType>(heads[r][2]))
                                  : std::string("an undefined tensor"),
                      " but the source rank ", src_rank, " has a ", src[1], "-d ",
                      c10::toString(static_cast<c10::ScalarType>(src[2])),
                      " tensor; every rank must pass a tensor of the global shape");
        }
      });
  const auto& src = heads[src_flat];
  const auto dtype = static_cast<c10::ScalarType>(src[2]);
  auto pg = mesh.mesh_group();
  std::vector<int64_t> mine(src[1], -1);
  if (def && t.dim() == src[1]) mine = t.sizes().vec();
  auto shapes = comm::all_gather_ints(pg, mine);
  for (size_t r = 0; every_rank_has_data && r < shapes.size(); ++r) {
    TORCH_CHECK(shapes[r] == shapes[src_flat], "tessera: ", what, ": rank ", mesh.ranks()[r],
                " passed shape ", shape_str(shapes[r]), " but the source rank ", src_rank, " has ",
                shape_str(shapes[src_flat]), "; every rank must pass the global shape");
  }
  return {shapes[src_flat], dtype, src[3] == 1};
}

// `error` and `args` as for agree_with_source.
SpecPtr infer_spec(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                   const std::string& error, const std::string& args,
                   std::vector<std::vector<int64_t>>* shapes_out = nullptr) {
  const bool def = local.defined();
  // The local shape rides in the agreement's own exchange when it has at most kInline dims
  // (every tensor in practice): one metadata all-gather per call. Longer shapes take a second.
  constexpr int64_t kInline = 8;
  std::vector<int64_t> head{def ? local.dim() : -1,
                            def ? static_cast<int64_t>(local.scalar_type()) : -1};
  for (int64_t i = 0; i < kInline; ++i) head.push_back(def && i < local.dim() ? local.size(i) : -1);
  auto heads = agree(
      "from_local", mesh, error, args, head, [&](const std::vector<std::vector<int64_t>>& heads) {
        for (size_t r = 1; r < heads.size(); ++r) {
          TORCH_CHECK(heads[r][0] == heads[0][0] && heads[r][1] == heads[0][1],
                      "tessera: from_local(", to_string(placements), "): mesh ranks ",
                      mesh.ranks()[0], " and ", mesh.ranks()[r], " disagree on the local tensor's ",
                      heads[r][0] != heads[0][0] ? "number of dims" : "dtype", " (", heads[0][0],
                      "-d ", c10::toString(static_cast<c10::ScalarType>(heads[0][1])), " vs ",
                      heads[r][0], "-d ", c10::toString(static_cast<c10::ScalarType>(heads[r][1])),
                      ")");
        }
      });
  // Every rank passed the same placements and a tensor of the same rank, and checked them.
  const int64_t nd = local.dim();
  std::vector<std::vector<int64_t>> shapes;
  if (nd <= kInline) {
    for (const auto& h : heads) shapes.emplace_back(h.begin() + 2, h.begin() + 2 + nd);
  } else {
    shapes = comm::all_gather_ints(mesh.mesh_group(), local.sizes().vec());
  }
  if (shapes_out) *shapes_out = shapes;
  std::vector<int64_t> global(nd);
  std::vector<ShardTable> tables(nd);
  std::vector<int64_t> coord(mesh.ndim());
  for (int64_t t = 0; t < nd; ++t) {
    std::vector<int64_t> dims;
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].normalized(nd).is_shard(t)) dims.push_back(static_cast<int64_t>(m));
    int64_t entries = 1;
    for (auto m : dims) entries *= mesh.size(m);
    std::vector<int64_t> table(entries, -1), owner(entries, -1);
    for (size_t f = 0; f < shapes.size(); ++f) {
      int64_t rem = static_cast<int64_t>(f);
      for (int64_t m = mesh.ndim() - 1; m >= 0; --m) {
        coord[m] = rem % mesh.size(m);
        rem /= mesh.size(m);
      }
      const int64_t idx = table_index(mesh, dims, coord);
      if (table[idx] < 0) {
        table[idx] = shapes[f][t];
        owner[idx] = static_cast<int64_t>(f);
        continue;
      }
      TORCH_CHECK(table[idx] == shapes[f][t], "tessera: from_local(", to_string(placements),
                  "): ranks ", mesh.ranks()[owner[idx]], " and ", mesh.ranks()[f],
                  " hold the same ", dims.empty() ? "replicated extent" : "shard",
                  " of tensor dim ", t, " but their local shapes ", shape_str(shapes[owner[idx]]),
                  " and ", shape_str(shapes[f]), " differ there");
    }
    global[t] = dims.empty() ? table[0] : 0;
    if (!dims.empty()) {
      for (auto s : table) global[t] += s;
      tables[t] = std::move(table);
    }
  }
  return std::make_shared<DTensorSpec>(mesh, placements, global, local.scalar_type(), tables);
}

// The global shape implied by `local` under the chunk/given layout at this rank (no comm).
SpecPtr declared_spec(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                      const ShardSizes& sizes) {
  const int64_t nd = local.dim();
  std::vector<int64_t> global = local.sizes().vec();
  auto tables = target_tables("from_local", nullptr, mesh, placements, global, sizes);
  for (int64_t t = 0; t < nd; ++t) {
    int64_t shards = 1;
    bool sharded = false;
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].normalized(nd).is_shard(t)) shards *= mesh.size(m), sharded = true;
    if (!sharded) continue;
    if (!tables[t].empty()) {
      // The given sizes define the global size here: a negative one must be named as such.
      for (auto s : tables[t])
        TORCH_CHECK(s >= 0, "tessera: from_local(", to_string(placements),
                    "): negative shard size in ", shape_str(tables[t]), " along tensor dim ", t);
      global[t] = 0;
      for (auto s : tables[t]) global[t] += s;
    } else {
      // Chunk layout from one shard: torch's rule, local * shards (exact for even shards;
      // pass ShardSizes::Infer() or run_check for anything else).
      global[t] = local.size(t) * shards;
    }
  }
  return make_spec("from_local", mesh, placements, global, local.scalar_type(), tables);
}

// Each rank's block of the global tensor, cut out by the spec.
at::Tensor block_of(const at::Tensor& full, const DTensorSpec& s,
                    const std::vector<int64_t>& coord) {
  auto off = s.local_offsets(coord);
  auto len = s.local_sizes(coord);
  at::Tensor b = full;
  for (int64_t t = 0; t < s.ndim(); ++t)
    if (len[t] != full.size(t)) b = b.narrow(t, off[t], len[t]);
  return b;
}

std::vector<int64_t> coord_of(const DeviceMesh& mesh, int64_t flat) {
  std::vector<int64_t> c(mesh.ndim());
  for (int64_t m = mesh.ndim() - 1; m >= 0; --m) {
    c[m] = flat % mesh.size(m);
    flat /= mesh.size(m);
  }
  return c;
}

int src_index(const DeviceMesh& mesh, int src, const char* what) {
  const auto& r = mesh.ranks();
  auto it = std::find(r.begin(), r.end(), src);
  TORCH_CHECK(it != r.end(), "tessera: ", what, ": source rank ", src, " is not in ", mesh.str());
  return static_cast<int>(it - r.begin());
}

// Rank `src` sends every rank its block in one all-to-all-v (nothing else moves).
// Every rank gets a backward node when the source's tensor requires grad: the backward
// gathers the gradient, a collective every rank must join.
at::Tensor scatter_impl(const at::Tensor& full, int src_flat, const SpecPtr& spec,
                        bool requires_grad) {
  const auto& mesh = spec->mesh();
  auto pg = mesh.mesh_group();
  const int64_t n = mesh.size();
  const bool is_src = comm::group_rank(pg) == src_flat;
  auto opts =
      at::TensorOptions().dtype(spec->dtype()).device(is_src ? full.device() : mesh.device());
  std::vector<at::Tensor> send;
  std::vector<std::vector<int64_t>> recv_shapes;
  for (int64_t f = 0; f < n; ++f) {
    send.push_back(is_src ? block_of(full, *spec, coord_of(mesh, f)).contiguous()
                          : at::empty({0}, opts));
    recv_shapes.push_back(f == src_flat ? spec->local_sizes() : std::vector<int64_t>{0});
  }
  auto blocks = comm::all_to_all_blocks(pg, send, recv_shapes, opts, comm::CollectiveKind::Scatter);
  at::Tensor out = make_dtensor(blocks[src_flat], spec);
  if (requires_grad && at::GradMode::is_enabled()) {
    auto node = compat::make_node<ScatterBackward>();
    node->spec = spec;
    node->is_src = is_src;
    if (full.defined()) {
      node->input_sizes = full.sizes().vec();
      node->input_options = full.options();
    }
    node->set_next_edges(torch::autograd::collect_next_edges(full));
    torch::autograd::set_history(out, node);
  }
  return out;
}

// As PyTorch: a tensor handed to a mesh moves to the mesh's device (differentiably; a no-op
// when it is there already), so shards always live where the mesh's collectives expect them.
at::Tensor on_mesh_device(const at::Tensor& t, const DeviceMesh& mesh) {
  if (!t.defined() || !mesh.defined() || is_dtensor(t) || t.device().type() == mesh.device_kind())
    return t;
  return t.to(mesh.device());
}

void reject_partial(const Placements& p, const char* what) {
  for (auto& x : p)
    TORCH_CHECK(!x.is_partial(), "tessera: ", what, "(", to_string(p), "): Partial is not a ",
                "placement a full tensor can be split into; use from_local to declare partial ",
                "values");
}

}  // namespace

at::Tensor distribute_tensor(const at::Tensor& given, const DeviceMesh& mesh,
                             const Placements& placements, std::optional<int> src_data_rank,
                             const ShardSizes& sizes) {
  const at::Tensor tensor = on_mesh_device(given, mesh);
  const char* what = "distribute_tensor";
  SpecPtr spec;
  int src_flat = -1;
  auto checks = [&] {
    TORCH_CHECK(tensor.defined(), "tessera: distribute_tensor needs a defined tensor");
    TORCH_CHECK(!is_dtensor(tensor), "tessera: distribute_tensor: the tensor is already ",
                "distributed; use redistribute");
    reject_partial(placements, what);
    check_placements(what, mesh, placements, tensor.sizes().vec());
    TORCH_CHECK(sizes.mode() != ShardSizes::Mode::Infer,
                "tessera: distribute_tensor: ShardSizes::Infer() only applies to from_local");
    auto global = tensor.sizes().vec();
    spec = make_spec(what, mesh, placements, global, tensor.scalar_type(),
                     target_tables(what, nullptr, mesh, placements, global, sizes));
    if (src_data_rank && mesh.contains_this_rank())
      src_flat = src_index(mesh, *src_data_rank, what);
  };
  if (!src_data_rank || !mesh.contains_this_rank()) {
    checks();  // no communication: each rank decides alone
    if (!mesh.contains_this_rank()) return make_dtensor(tensor, spec);
    // Every rank holds the full value: replicated from_local, then local slicing (no comm).
    Placements rep(mesh.ndim(), Replicate());
    auto full = wrap_local(tensor, std::make_shared<DTensorSpec>(mesh, rep, tensor.sizes().vec(),
                                                                 tensor.scalar_type()));
    return redistribute_to(full, spec);
  }
  // A collective: decide together (NOTE: [Agreeing on arguments]).
  const std::string error = error_of(checks);
  const std::string args = "placements " + to_string(placements) + sizes_str(sizes) +
                           ", source rank " + std::to_string(*src_data_rank);
  auto meta = agree_with_source(what, mesh, tensor, src_flat, true, error, args);
  return scatter_impl(tensor, src_flat, spec, meta.requires_grad);
}

at::Tensor scatter_tensor(const at::Tensor& given, int src, const DeviceMesh& mesh,
                          const Placements& placements, const ShardSizes& sizes) {
  const at::Tensor full_on_src = on_mesh_device(given, mesh);
  int src_flat = -1;
  // Checks of the arguments alone; the rest needs the source's shape.
  const std::string error = error_of([&] {
    reject_partial(placements, "scatter_tensor");
    TORCH_CHECK(sizes.mode() != ShardSizes::Mode::Infer,
                "tessera: scatter_tensor: ShardSizes::Infer() only applies to from_local");
    check_placement_count("scatter_tensor", mesh, placements);
    src_flat = src_index(mesh, src, "scatter_tensor");
  });
  const std::string args = "placements " + to_string(placements) + sizes_str(sizes) +
                           ", source rank " + std::to_string(src);
  // Shape and dtype travel from the source (other ranks may pass nothing).
  auto meta = agree_with_source("scatter_tensor", mesh, full_on_src, src_flat, false, error, args);
  // Arguments and the source's shape are the same everywhere now: one verdict.
  check_placements("scatter_tensor", mesh, placements, meta.sizes);
  auto spec =
      make_spec("scatter_tensor", mesh, placements, meta.sizes, meta.dtype,
                target_tables("scatter_tensor", nullptr, mesh, placements, meta.sizes, sizes));
  return scatter_impl(full_on_src, src_flat, spec, meta.requires_grad);
}

at::Tensor from_local(const at::Tensor& given, const DeviceMesh& mesh, const Placements& placements,
                      const FromLocalOptions& options) {
  const at::Tensor local = on_mesh_device(given, mesh);
  auto checks = [&] {
    TORCH_CHECK(local.defined(), "tessera: from_local needs a defined local tensor");
    TORCH_CHECK(!is_dtensor(local), "tessera: from_local: the tensor is already distributed");
    check_placement_count("from_local", mesh, placements);
    check_placements("from_local", mesh, placements, local.sizes().vec());
  };
  // Unset sizes: exchanged where a placement shards (never silently wrong on uneven local
  // batches); PyTorch's chunk assumption only when asked for.
  bool shards = false;
  for (const auto& p : placements) shards = shards || p.is_shard();
  const ShardSizes sizes = options.sizes ? *options.sizes
                           : shards      ? ShardSizes::Infer()
                                         : ShardSizes::Chunk();
  const auto mode = sizes.mode();
  if (mode != ShardSizes::Mode::Infer && !options.run_check) {
    checks();  // no communication: each rank decides alone
    return wrap_local(local, declared_spec(local, mesh, placements, sizes));
  }
  // Gather every rank's shape once: infer the layout, or check the declared one against it.
  // Every rank sees the same shapes and arguments, so every rank reaches the same verdict.
  const std::string error = error_of(checks);
  const std::string args = "placements " + to_string(placements) + sizes_str(sizes);
  std::vector<std::vector<int64_t>> shapes;
  SpecPtr inferred = infer_spec(local, mesh, placements, error, args, &shapes);
  if (mode == ShardSizes::Mode::Infer) return wrap_local(local, inferred);
  const auto& global = inferred->sizes();
  auto tables = target_tables("from_local", nullptr, mesh, placements, global, sizes);
  for (int64_t t = 0; t < inferred->ndim(); ++t) {
    auto dims = inferred->mesh_dims_sharding(t);
    if (dims.empty()) continue;
    auto table =
        tables[t].empty() ? chunk_table(mesh, inferred->placements(), t, global[t]) : tables[t];
    int64_t entries = 1;
    for (auto m : dims) entries *= mesh.size(m);
    if (static_cast<int64_t>(table.size()) != entries) continue;  // make_spec says why
    for (size_t f = 0; f < shapes.size(); ++f) {
      const int64_t want = table[table_index(mesh, dims, coord_of(mesh, static_cast<int64_t>(f)))];
      if (want == shapes[f][t]) continue;
      auto expected = shapes[f];
      expected[t] = want;
      TORCH_CHECK(false, "tessera: from_local(", to_string(placements), ", run_check): rank ",
                  mesh.ranks()[f], " has local shape ", shape_str(shapes[f]), " but the declared ",
                  mode == ShardSizes::Mode::Chunk ? "chunk" : "given", " layout (shard sizes ",
                  shape_str(table), " along tensor dim ", t, ") gives it ", shape_str(expected),
                  "; pass the true sizes with ShardSizes::Given or use ShardSizes::Infer()");
    }
  }
  auto declared = make_spec("from_local", mesh, placements, global, local.scalar_type(), tables);
  return wrap_local(local, declared);
}

at::Tensor to_local(const at::Tensor& dtensor, const std::optional<Placements>& grad_placements) {
  auto* d = dtensor_impl(dtensor, "to_local's input");
  at::Tensor out = d->local().detach();
  if (needs_grad(dtensor)) {
    auto node = compat::make_node<ToLocalBackward>();
    node->grad_spec = grad_placements ? std::make_shared<DTensorSpec>(d->spec().with_placements(
                                            *grad_placements, d->spec().shard_tables()))
                                      : grad_spec_for(d->spec());
    connect(node, dtensor, out);
  }
  return out;
}

at::Tensor full_tensor(const at::Tensor& dtensor) {
  comm::detail::CallerScope caller("full_tensor");  // named if its collective fails
  const auto& s = spec(dtensor);
  return to_local(redistribute_to(dtensor, std::make_shared<DTensorSpec>(s.with_placements(
                                               Placements(s.mesh().ndim(), Replicate())))));
}

// TESSERA_CHECK_ARGUMENTS=0 trusts every rank to pass the same arguments to redistribute and
// skips its agreement round trip (for a hot loop known to be consistent). Read on every call,
// so a program may set it around such a loop.
bool redistribute_agreement_wanted() {
  const char* v = std::getenv("TESSERA_CHECK_ARGUMENTS");
  return !(v && std::string(v) == "0");
}

at::Tensor redistribute(const at::Tensor& dtensor, const Placements& placements,
                        const ShardSizes& sizes) {
  comm::detail::CallerScope caller("redistribute");
  const auto& s = spec(dtensor);
  SpecPtr target;
  auto checks = [&] {
    for (size_t m = 0; m < placements.size(); ++m) {
      TORCH_CHECK(!placements[m].is_partial() ||
                      (m < s.placements().size() && s.placements()[m] == placements[m]),
                  "tessera: redistribute ", to_string(s.placements()), " -> ",
                  to_string(placements), ": Partial targets are internal; keep the source's ",
                  "Partial or choose Replicate/Shard");
    }
    TORCH_CHECK(sizes.mode() != ShardSizes::Mode::Infer,
                "tessera: redistribute: ShardSizes::Infer() only applies to from_local");
    check_placements("redistribute", s.mesh(), placements, s.sizes());
    target = make_spec("redistribute", s.mesh(), placements, s.sizes(), s.dtype(),
                       target_tables("redistribute", &s, s.mesh(), placements, s.sizes(), sizes));
  };
  if (s.mesh().size() == 1 || !s.mesh().contains_this_rank() || !redistribute_agreement_wanted()) {
    checks();
    return redistribute_to(dtensor, target);
  }
  // Ranks asking for different targets (or holding differently declared tensors) would run
  // different collectives: one small exchange first (NOTE: [Agreeing on arguments]).
  const std::string error = error_of(checks);
  agree("redistribute", s.mesh(), error,
        "source " + s.str() + " " + c10::toString(s.dtype()) + " -> placements " +
            to_string(placements) + sizes_str(sizes),
        {});
  return redistribute_to(dtensor, target);
}

at::Tensor redistribute(const at::Tensor& dtensor, const SpecPtr& target) {
  return redistribute_to(dtensor, target);
}

const DTensorSpec& spec(const at::Tensor& dtensor) { return dtensor_impl(dtensor)->spec(); }
const Placements& placements(const at::Tensor& dtensor) { return spec(dtensor).placements(); }
const DeviceMesh& device_mesh(const at::Tensor& dtensor) { return spec(dtensor).mesh(); }

std::string to_string(const at::Tensor& t) {
  std::ostringstream os;
  if (!is_dtensor(t)) {
    os << t;
    return os.str();
  }
  auto* d = dtensor_impl(t);
  const auto& s = d->spec();
  os << "DTensor(placements=" << to_string(s.placements()) << ", mesh=" << s.mesh().str()
     << ", global=" << shape_str(s.sizes()) << ", local=" << shape_str(d->local().sizes().vec())
     << ", dtype=" << s.dtype();
  std::string tabs;
  for (int64_t i = 0; i < s.ndim(); ++i)
    if (!s.shard_table(i).empty())
      tabs += (tabs.empty() ? "" : ", ") + std::to_string(i) + ": " + shape_str(s.shard_table(i));
  if (!tabs.empty()) os << ", shards={" << tabs << "}";
  if (s.mesh().contains_this_rank()) os << ", coordinate=" << shape_str(s.mesh().coordinate());
  os << ")\nlocal values:\n" << d->local();
  return os.str();
}

}  // namespace tessera
