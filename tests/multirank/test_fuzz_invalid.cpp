// Seeded fuzzing of the layout entry points (distribute_tensor, scatter_tensor, from_local,
// redistribute) with valid and invalid requests, including arguments that differ between
// ranks. An invalid request must raise a c10::Error on every rank whose message names the
// function and the problem; no rank may return normally or be left waiting in a collective.
// A valid request must match one device, forward and (where cheap) backward.
// Rank-dependent arguments are fuzzed only where the entry point communicates (NOTE:
// [Agreeing on arguments] in src/tensor/api.cpp): from_local without a check and
// distribute_tensor without a source rank never talk, so they cannot see other ranks' inputs.
// A failure prints the command that replays its case (support/property.h).
#include "helpers.h"

using namespace tessera;
using tessera::test::Rng;

namespace {

using Shape = std::vector<int64_t>;
using Tables = std::vector<ShardTable>;

enum class Op {
  Distribute,       // distribute_tensor with a source rank (collective)
  DistributeLocal,  // distribute_tensor without one (no communication)
  Scatter,
  FromLocal,         // no communication
  FromLocalChecked,  // run_check
  FromLocalInfer,
  Redistribute,      // to placements
  RedistributeSpec,  // to a whole target spec
};

const char* op_name(Op op) {
  switch (op) {
    case Op::Distribute:
    case Op::DistributeLocal: return "distribute_tensor";
    case Op::Scatter: return "scatter_tensor";
    case Op::FromLocal:
    case Op::FromLocalChecked:
    case Op::FromLocalInfer: return "from_local";
    case Op::Redistribute:
    case Op::RedistributeSpec: return "redistribute";
  }
  return "?";
}

const char* op_str(Op op) {
  switch (op) {
    case Op::Distribute: return "distribute_tensor(src)";
    case Op::DistributeLocal: return "distribute_tensor(nullopt)";
    case Op::Scatter: return "scatter_tensor";
    case Op::FromLocal: return "from_local";
    case Op::FromLocalChecked: return "from_local(run_check)";
    case Op::FromLocalInfer: return "from_local(Infer)";
    case Op::Redistribute: return "redistribute(placements)";
    case Op::RedistributeSpec: return "redistribute(spec)";
  }
  return "?";
}

enum class Sizes { Chunk, Given, Infer };

// One rank's arguments. The case describes what every rank passes; `per_rank` may then
// change one rank's copy.
struct Request {
  Op op = Op::Distribute;
  Shape shape;
  at::ScalarType dtype = at::kFloat;
  uint64_t data_seed = 0;
  bool undefined = false;         // pass an undefined tensor
  bool others_undefined = false;  // scatter: non-source ranks pass nothing
  // The true layout: of the source tensor (redistribute) or of the local shards (from_local).
  Placements layout;
  Tables layout_tables;
  // The arguments.
  Placements placements;
  Sizes sizes = Sizes::Chunk;
  Tables tables;
  int src = 0;
  // from_local: how this rank's local tensor departs from its block.
  int64_t grow_dim = -1;
  bool extra_dim = false;
  std::optional<at::ScalarType> local_dtype;
  // redistribute(spec): the target's mesh, shape and dtype when they differ from the tensor's.
  const DeviceMesh* target_mesh = nullptr;
  std::optional<Shape> target_shape;
  std::optional<at::ScalarType> target_dtype;
};

struct Case {
  std::string kind;
  Request req;
  std::function<void(int64_t rank, Request&)> per_rank;  // rank = flat mesh index
  std::vector<std::string> needles;                      // empty: the request is valid
};

std::string tables_str(const Tables& t) {
  std::string s;
  for (size_t i = 0; i < t.size(); ++i)
    if (!t[i].empty()) s += (s.empty() ? "" : " ") + std::to_string(i) + ":" + shape_str(t[i]);
  return "{" + s + "}";
}

std::string describe(const Case& c, const DeviceMesh& mesh) {
  const auto& r = c.req;
  std::string s = c.kind + ": " + op_str(r.op) + " on mesh" + shape_str(mesh.shape()) + " global " +
                  shape_str(r.shape) + " " + c10::toString(r.dtype);
  if (r.op == Op::Redistribute || r.op == Op::RedistributeSpec || r.op == Op::FromLocal ||
      r.op == Op::FromLocalChecked || r.op == Op::FromLocalInfer)
    s += " layout " + to_string(r.layout) + tables_str(r.layout_tables);
  s += " args " + to_string(r.placements) +
       (r.sizes == Sizes::Given   ? " given " + tables_str(r.tables)
        : r.sizes == Sizes::Infer ? " infer"
                                  : "");
  if (r.op == Op::Distribute || r.op == Op::Scatter) s += " src " + std::to_string(r.src);
  return s;
}

Placements normalized(const Placements& p, int64_t ndim) {
  Placements out;
  for (auto& x : p) out.push_back(x.normalized(ndim));
  return out;
}

// Shard (negative dims too) or Replicate; Partial only when asked.
Placement random_placement(Rng& rng, int64_t ndim, bool partial) {
  const int64_t k = rng.uniform(0, partial ? 4 : 3);
  if (k <= 1 && ndim > 0) return Shard(rng.uniform(-ndim, ndim - 1));
  if (k == 4) {
    static const PartialOp ops[] = {PartialOp::Sum, PartialOp::Avg, PartialOp::Max, PartialOp::Min};
    return Partial(ops[rng.uniform(0, 3)]);
  }
  return Replicate();
}

Placements random_placements(Rng& rng, const DeviceMesh& mesh, int64_t ndim, bool partial) {
  Placements p;
  for (int64_t d = 0; d < mesh.ndim(); ++d) p.push_back(random_placement(rng, ndim, partial));
  return p;
}

Tables layout_tables_for(Rng& rng, const DeviceMesh& mesh, const Placements& p,
                         const Shape& shape) {
  return tessera::test::random_tables(rng, mesh, normalized(p, static_cast<int64_t>(shape.size())),
                                      shape);
}

// The complete tables of a layout (chunk entries filled in).
Tables full_tables(const DeviceMesh& mesh, const Placements& p, const Shape& shape,
                   const Tables& t) {
  return DTensorSpec(mesh, p, shape, at::kFloat, t).shard_tables();
}

// Tensor dims that `p` shards, and the number of pieces of each.
std::vector<int64_t> sharded_dims(const Placements& p, int64_t ndim) {
  std::vector<int64_t> out;
  for (int64_t t = 0; t < ndim; ++t)
    for (auto& x : p)
      if (x.is_shard() && x.normalized(ndim).dim() == t) {
        out.push_back(t);
        break;
      }
  return out;
}
int64_t pieces(const DeviceMesh& mesh, const Placements& p, int64_t ndim, int64_t t) {
  int64_t n = 1;
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_shard() && p[m].normalized(ndim).dim() == t) n *= mesh.size(m);
  return n;
}

// Makes some mesh dim of size >= 2 (any, if none) shard a dim of size >= 2; returns that dim.
int64_t force_shard(Rng& rng, const DeviceMesh& mesh, Request& r) {
  const int64_t ndim = static_cast<int64_t>(r.shape.size());
  int64_t m = rng.uniform(0, mesh.ndim() - 1);
  for (int64_t d = 0; d < mesh.ndim(); ++d)
    if (mesh.size(d) >= 2) m = d;
  const int64_t t = rng.uniform(0, ndim - 1);
  r.placements[m] = Shard(t);
  r.shape[t] = std::max<int64_t>(r.shape[t], 2);
  r.layout_tables = {};  // they were for the old shape
  return t;
}

Shape random_shape(Rng& rng) {
  Shape s;
  const int64_t ndim = rng.uniform(1, 3);
  for (int64_t i = 0; i < ndim; ++i) s.push_back(rng.uniform(0, 5));
  return s;
}

// A valid request for `op`.
Request valid_request(Rng& rng, const DeviceMesh& mesh, Op op) {
  Request r;
  r.op = op;
  r.shape = random_shape(rng);
  const int64_t ndim = static_cast<int64_t>(r.shape.size());
  const bool redist = op == Op::Redistribute || op == Op::RedistributeSpec;
  // Integer Partial terms do not average exactly; keep partial sources floating.
  r.dtype = !redist && rng.coin(0.2) ? at::kLong : rng.coin(0.3) ? at::kDouble : at::kFloat;
  r.data_seed = rng.bits();
  r.src = static_cast<int>(rng.uniform(0, mesh.size() - 1));
  r.others_undefined = rng.coin();
  switch (op) {
    case Op::Distribute:
    case Op::DistributeLocal:
    case Op::Scatter:
      r.placements = random_placements(rng, mesh, ndim, false);
      if (rng.coin()) {
        r.sizes = Sizes::Given;
        r.tables = layout_tables_for(rng, mesh, r.placements, r.shape);
      }
      break;
    case Op::FromLocal:
    case Op::FromLocalChecked:
    case Op::FromLocalInfer:
      r.layout = random_placements(rng, mesh, ndim, false);
      r.layout_tables = rng.coin() ? layout_tables_for(rng, mesh, r.layout, r.shape) : Tables{};
      r.placements = r.layout;
      // Without Infer, uneven shards need their tables (the chunk rule works from one shard).
      if (op == Op::FromLocalInfer) {
        r.sizes = Sizes::Infer;
      } else {
        r.sizes = Sizes::Given;
        r.tables = full_tables(mesh, r.layout, r.shape, r.layout_tables);
      }
      break;
    case Op::Redistribute:
    case Op::RedistributeSpec:
      r.layout = random_placements(rng, mesh, ndim, true);
      r.layout_tables = rng.coin() ? layout_tables_for(rng, mesh, r.layout, r.shape) : Tables{};
      r.placements = random_placements(rng, mesh, ndim, false);
      if (op == Op::RedistributeSpec || rng.coin()) {
        r.sizes = Sizes::Given;
        r.tables = layout_tables_for(rng, mesh, r.placements, r.shape);
      }
      break;
  }
  return r;
}

const std::vector<Op> kAllOps = {Op::Distribute,   Op::DistributeLocal,  Op::Scatter,
                                 Op::FromLocal,    Op::FromLocalChecked, Op::FromLocalInfer,
                                 Op::Redistribute, Op::RedistributeSpec};

// The value every rank's tensor holds (rank-dependent shape and dtype included).
at::Tensor full_value(const Request& r) {
  return tessera::test::randn(r.shape, r.data_seed, r.dtype);
}

ShardSizes sizes_of(const Request& r) {
  switch (r.sizes) {
    case Sizes::Chunk: return ShardSizes::Chunk();
    case Sizes::Given: return ShardSizes::Given(r.tables);
    case Sizes::Infer: return ShardSizes::Infer();
  }
  return ShardSizes::Chunk();
}

// Runs one rank's request. `input` receives the plain or distributed input (for gradients).
at::Tensor execute(const Request& r, const DeviceMesh& mesh, int64_t rank, bool grad,
                   at::Tensor* input) {
  at::Tensor full = full_value(r);
  if (grad) full.requires_grad_();
  if (input) *input = full;
  switch (r.op) {
    case Op::Distribute:
      return distribute_tensor(r.undefined ? at::Tensor() : full, mesh, r.placements, r.src,
                               sizes_of(r));
    case Op::DistributeLocal:
      return distribute_tensor(r.undefined ? at::Tensor() : full, mesh, r.placements, std::nullopt,
                               sizes_of(r));
    case Op::Scatter:
      return scatter_tensor(rank == r.src || !r.others_undefined ? full : at::Tensor(), r.src, mesh,
                            r.placements, sizes_of(r));
    case Op::FromLocal:
    case Op::FromLocalChecked:
    case Op::FromLocalInfer: {
      DTensorSpec layout(mesh, r.layout, r.shape, r.dtype, r.layout_tables);
      at::Tensor local = tessera::test::local_block(full.detach(), layout).clone();
      if (r.grow_dim >= 0) {
        auto s = local.sizes().vec();
        s[r.grow_dim] += 1;
        local = at::zeros(s, local.options());
      }
      if (r.extra_dim) local = local.unsqueeze(-1);
      if (r.local_dtype) local = local.to(*r.local_dtype);
      if (r.undefined) local = at::Tensor();
      FromLocalOptions o{sizes_of(r), r.op == Op::FromLocalChecked};
      return from_local(local, mesh, r.placements, o);
    }
    case Op::Redistribute:
    case Op::RedistributeSpec: {
      auto x =
          tessera::test::make_dtensor_from_full(full.detach(), mesh, r.layout, r.layout_tables);
      if (grad) x = x.detach().requires_grad_();
      if (input) *input = x;
      if (r.op == Op::Redistribute) return redistribute(x, r.placements, sizes_of(r));
      auto target = std::make_shared<DTensorSpec>(r.target_mesh ? *r.target_mesh : mesh,
                                                  r.placements, r.target_shape.value_or(r.shape),
                                                  r.target_dtype.value_or(r.dtype), r.tables);
      return redistribute(x, target);
    }
  }
  return {};
}

int64_t flat_rank(const DeviceMesh& mesh) {
  int64_t f = 0;
  for (int64_t d = 0; d < mesh.ndim(); ++d) f = f * mesh.size(d) + mesh.coordinate()[d];
  return f;
}

// Checks one case on this rank. A case that fails here leaves the ranks' collectives out of
// step, so failures are fatal and stop the sweep.
void check_case(const Case& c, const DeviceMesh& mesh, const std::string& ctx) {
  const int64_t rank = flat_rank(mesh);
  Request r = c.req;
  if (c.per_rank) c.per_rank(rank, r);
  const std::string where = ctx + " [rank " + std::to_string(rank) + "]";
  if (c.needles.empty()) {
    // Gradients only through float layouts that differentiate to the full gradient.
    const bool grad =
        at::isFloatingType(r.dtype) && (r.op == Op::DistributeLocal || r.op == Op::Distribute ||
                                        r.op == Op::Redistribute || r.op == Op::RedistributeSpec);
    at::Tensor input;
    at::Tensor out = execute(r, mesh, rank, grad, &input);
    const at::Tensor full = full_value(r);
    ASSERT_TRUE(tessera::test::shard_matches(out, full)) << where;
    ASSERT_TRUE(tessera::test::full_matches(out, full)) << where << " (full_tensor)";
    if (!grad) return;
    const at::Tensor g = tessera::test::randn(r.shape, r.data_seed + 1, r.dtype);
    to_local(out).backward(tessera::test::local_block(g, spec(out)));
    if (r.op == Op::Redistribute || r.op == Op::RedistributeSpec) {
      ASSERT_TRUE(tessera::test::full_matches(input.grad(), g)) << where << " (backward)";
    } else {
      // With a source rank, only its tensor fed the result.
      const bool gets = r.op == Op::DistributeLocal || rank == r.src;
      ASSERT_TRUE(tessera::test::matches(input.grad(), gets ? g : at::zeros_like(g)))
          << where << " (backward)";
    }
    return;
  }
  std::string msg;
  bool threw = false;
  try {
    execute(r, mesh, rank, false, nullptr);
  } catch (const c10::Error& e) {
    threw = true;
    msg = e.what_without_backtrace();
  }
  ASSERT_TRUE(threw) << where << ": returned normally";
  // A peer's timeout or closed connection is a hang seen from this rank, not an answer.
  for (const char* symptom : {"Timed out", "Connection closed", "Connection reset"})
    ASSERT_EQ(msg.find(symptom), std::string::npos) << where << ": " << msg;
  for (const auto& n : c.needles)
    ASSERT_NE(msg.find(n), std::string::npos)
        << where << ": the message lacks \"" << n << "\": " << msg;
}

// ---- invalid requests the same on every rank ----

Op pick(Rng& rng, const std::vector<Op>& ops) { return rng.pick(ops); }

const std::vector<Op> kCreate = {Op::Distribute, Op::DistributeLocal, Op::Scatter};
const std::vector<Op> kGivenOps = {Op::Distribute, Op::DistributeLocal, Op::Scatter, Op::FromLocal,
                                   Op::Redistribute};

// Tables for the argument placements (the layout's for from_local).
void give_valid_tables(Rng& rng, const DeviceMesh& mesh, Request& r) {
  r.sizes = Sizes::Given;
  r.tables =
      full_tables(mesh, r.placements, r.shape, layout_tables_for(rng, mesh, r.placements, r.shape));
}

// The from_local layout follows the arguments when a case changes them.
void sync_layout(Request& r) {
  if (r.op == Op::FromLocal || r.op == Op::FromLocalChecked || r.op == Op::FromLocalInfer) {
    r.layout = r.placements;
    r.layout_tables = r.sizes == Sizes::Given ? r.tables : Tables{};
  }
}

Case same_everywhere(Rng& rng, const DeviceMesh& mesh) {
  static const std::vector<std::string> kinds = {
      "shard_dim",       "placement_count", "table_sum",  "table_negative", "table_length",
      "table_unsharded", "too_many_tables", "partial",    "undefined",      "infer_elsewhere",
      "src_not_in_mesh", "spec_mesh",       "spec_shape", "spec_dtype"};
  Case c;
  c.kind = rng.pick(kinds);
  auto& r = c.req;
  if (c.kind == "shard_dim") {
    r = valid_request(rng, mesh,
                      pick(rng, {Op::Distribute, Op::DistributeLocal, Op::Scatter, Op::FromLocal,
                                 Op::FromLocalChecked, Op::FromLocalInfer, Op::Redistribute}));
    const int64_t ndim = static_cast<int64_t>(r.shape.size());
    const int64_t d = rng.coin() ? ndim + rng.uniform(0, 2) : -ndim - 1 - rng.uniform(0, 2);
    r.placements[rng.uniform(0, mesh.ndim() - 1)] = Shard(d);
    if (r.sizes == Sizes::Given) r.sizes = Sizes::Chunk;
    c.needles = {op_name(r.op), "Shard(" + std::to_string(d) + ")", "out of range"};
  } else if (c.kind == "placement_count") {
    r = valid_request(rng, mesh,
                      pick(rng, {Op::Distribute, Op::DistributeLocal, Op::Scatter, Op::FromLocal,
                                 Op::FromLocalChecked, Op::FromLocalInfer, Op::Redistribute}));
    if (rng.coin())
      r.placements.push_back(rng.coin() ? Replicate() : Shard(0));
    else
      r.placements.pop_back();
    if (r.sizes == Sizes::Given) r.sizes = Sizes::Chunk;
    c.needles = {op_name(r.op), std::to_string(r.placements.size()) + " entries",
                 std::to_string(mesh.ndim()) + " dims"};
  } else if (c.kind == "table_sum" || c.kind == "table_negative" || c.kind == "table_length") {
    // A sum that is off cannot be seen by from_local: its tables define the global size.
    r = valid_request(rng, mesh,
                      c.kind == "table_sum" ? pick(rng, {Op::Distribute, Op::DistributeLocal,
                                                         Op::Scatter, Op::Redistribute})
                                            : pick(rng, kGivenOps));
    const int64_t t = force_shard(rng, mesh, r);
    give_valid_tables(rng, mesh, r);
    sync_layout(r);
    const int64_t n = pieces(mesh, r.placements, static_cast<int64_t>(r.shape.size()), t);
    auto& tab = r.tables[t];
    if (c.kind == "table_sum") {
      tab[rng.index(tab.size())] += rng.uniform(1, 3) * (rng.coin() ? 1 : -1);
      if (std::any_of(tab.begin(), tab.end(), [](int64_t s) { return s < 0; }))
        tab = tessera::test::random_table(rng, r.shape[t] + 1, n);
      c.needles = {op_name(r.op), "sum to", "global size is " + std::to_string(r.shape[t])};
    } else if (c.kind == "table_negative") {
      const int64_t k = rng.uniform(1, 3);
      tab[0] -= k + tab[0];
      if (tab.size() > 1) tab[1] += k;  // still the right sum
      c.needles = {op_name(r.op), "negative shard size"};
    } else {
      const int64_t len = rng.coin() || n == 1 ? n + rng.uniform(1, 2) : n - 1;
      tab = tessera::test::random_table(rng, r.shape[t], len);
      c.needles = {op_name(r.op), std::to_string(len) + " entries", std::to_string(n) + " shards"};
    }
    if (r.op == Op::FromLocal) r.layout_tables = {};  // the local blocks: any valid layout
  } else if (c.kind == "table_unsharded") {
    r = valid_request(rng, mesh, pick(rng, kGivenOps));
    const int64_t ndim = static_cast<int64_t>(r.shape.size());
    auto dims = sharded_dims(r.placements, ndim);
    if (static_cast<int64_t>(dims.size()) == ndim) {
      r.placements[0] = Replicate();
      dims = sharded_dims(r.placements, ndim);
    }
    int64_t t = 0;
    while (std::find(dims.begin(), dims.end(), t) != dims.end()) ++t;
    if (t >= ndim) {  // every dim still sharded by other mesh dims: replicate them all
      for (auto& p : r.placements) p = Replicate();
      t = 0;
    }
    r.sizes = Sizes::Given;
    r.tables = full_tables(mesh, r.placements, r.shape, {});
    r.tables[t] = {r.shape[t]};
    if (r.op == Op::FromLocal) {
      r.layout = r.placements;
      r.layout_tables = {};
    }
    c.needles = {op_name(r.op), "tensor dim " + std::to_string(t), "does not shard"};
  } else if (c.kind == "too_many_tables") {
    r = valid_request(rng, mesh, pick(rng, kGivenOps));
    give_valid_tables(rng, mesh, r);
    sync_layout(r);
    r.tables.resize(r.shape.size() + rng.uniform(1, 2));
    r.tables.back() = {1};
    c.needles = {op_name(r.op), std::to_string(r.tables.size()) + " tables"};
  } else if (c.kind == "partial") {
    r = valid_request(
        rng, mesh, pick(rng, {Op::Distribute, Op::DistributeLocal, Op::Scatter, Op::Redistribute}));
    const int64_t m = rng.uniform(0, mesh.ndim() - 1);
    static const PartialOp ops[] = {PartialOp::Sum, PartialOp::Avg, PartialOp::Max, PartialOp::Min};
    const Placement p = Partial(ops[rng.uniform(0, 3)]);
    // Keeping a source's own Partial is allowed; changing to another one is not.
    if (r.op == Op::Redistribute && r.layout[m] == p) {
      r.layout[m] = Replicate();
      r.layout_tables = {};
    }
    r.placements[m] = p;
    r.sizes = Sizes::Chunk;
    c.needles = {op_name(r.op), "Partial"};
  } else if (c.kind == "undefined") {
    r = valid_request(rng, mesh,
                      pick(rng, {Op::Distribute, Op::DistributeLocal, Op::FromLocal,
                                 Op::FromLocalChecked, Op::FromLocalInfer}));
    r.undefined = true;
    c.needles = {op_name(r.op), "defined"};
  } else if (c.kind == "infer_elsewhere") {
    r = valid_request(
        rng, mesh, pick(rng, {Op::Distribute, Op::DistributeLocal, Op::Scatter, Op::Redistribute}));
    r.sizes = Sizes::Infer;
    c.needles = {op_name(r.op), "Infer", "from_local"};
  } else if (c.kind == "src_not_in_mesh") {
    r = valid_request(rng, mesh, pick(rng, {Op::Distribute, Op::Scatter}));
    r.src = rng.coin() ? static_cast<int>(mesh.size() + rng.uniform(0, 3))
                       : static_cast<int>(-rng.uniform(1, 3));
    r.others_undefined = false;
    c.needles = {op_name(r.op), "source rank " + std::to_string(r.src), "is not in"};
  } else {
    r = valid_request(rng, mesh, Op::RedistributeSpec);
    if (c.kind == "spec_mesh") {
      r.target_mesh = nullptr;  // set by the sweep: another mesh over the same ranks
      c.needles = {"redistribute", "target is on"};
    } else if (c.kind == "spec_shape") {
      Shape s = r.shape;
      s[rng.index(s.size())] += rng.uniform(1, 2);
      r.target_shape = s;
      r.sizes = Sizes::Chunk;
      r.tables.clear();
      c.needles = {"redistribute", "global shapes differ", shape_str(s)};
    } else {
      r.target_dtype = r.dtype == at::kFloat ? at::kDouble : at::kFloat;
      c.needles = {"redistribute", "dtype"};
    }
  }
  return c;
}

// ---- invalid requests where ranks disagree ----

Case rank_dependent(Rng& rng, const DeviceMesh& mesh) {
  static const std::vector<std::string> kinds = {
      "rank_shape",   "rank_ndim",      "rank_dtype",   "rank_placements",
      "rank_invalid", "rank_count",     "rank_tables",  "rank_bad_table",
      "rank_src",     "rank_undefined", "rank_partial", "rank_source_layout"};
  Case c;
  c.kind = rng.pick(kinds);
  auto& r = c.req;
  const int64_t bad = rng.uniform(0, mesh.size() - 1);
  const std::vector<Op> collective_creation = {Op::Distribute, Op::Scatter, Op::FromLocalChecked,
                                               Op::FromLocalInfer};
  if (c.kind == "rank_shape" || c.kind == "rank_ndim") {
    r = valid_request(rng, mesh,
                      pick(rng, {Op::Distribute, Op::FromLocalChecked, Op::FromLocalInfer}));
    const int64_t ndim = static_cast<int64_t>(r.shape.size());
    const auto dims = sharded_dims(r.layout, ndim);
    int64_t t = 0;
    while (std::find(dims.begin(), dims.end(), t) != dims.end()) ++t;
    const bool extra = c.kind == "rank_ndim" || (r.op != Op::Distribute && t >= ndim);
    if (r.op == Op::Distribute) {
      r.sizes = Sizes::Chunk;  // tables would fail first on the bad rank's shape
      const int64_t grow = rng.index(r.shape.size());
      c.per_rank = [=](int64_t rank, Request& q) {
        if (rank != bad) return;
        if (extra)
          q.shape.push_back(2);
        else
          q.shape[grow] += 1;
      };
      c.needles = {"distribute_tensor", extra ? "-d" : "shape"};
    } else {
      // A replicated extent (or the number of dims) that differs: never a valid layout.
      c.per_rank = [=](int64_t rank, Request& q) {
        if (rank != bad) return;
        if (extra)
          q.extra_dim = true;
        else
          q.grow_dim = t;
      };
      c.needles = {"from_local", extra ? "number of dims" : "shapes"};
    }
  } else if (c.kind == "rank_dtype") {
    r = valid_request(rng, mesh,
                      pick(rng, {Op::Distribute, Op::FromLocalChecked, Op::FromLocalInfer}));
    r.dtype = at::kFloat;
    c.per_rank = [=](int64_t rank, Request& q) {
      if (rank != bad) return;
      if (q.op == Op::Distribute)
        q.dtype = at::kDouble;
      else
        q.local_dtype = at::kDouble;
    };
    c.needles = {op_name(r.op), "Double", "Float"};
  } else if (c.kind == "rank_placements" || c.kind == "rank_invalid" || c.kind == "rank_count") {
    std::vector<Op> ops = collective_creation;
    ops.push_back(Op::Redistribute);
    r = valid_request(rng, mesh, rng.pick(ops));
    const int64_t ndim = static_cast<int64_t>(r.shape.size());
    if (r.sizes == Sizes::Given && r.op != Op::FromLocalChecked) r.sizes = Sizes::Chunk;
    if (r.op == Op::FromLocalChecked) {
      r.sizes = Sizes::Chunk;
      r.layout_tables = {};
    }
    Placements other = r.placements;
    if (c.kind == "rank_placements") {
      for (int tries = 0; tries < 20 && normalized(other, ndim) == normalized(r.placements, ndim);
           ++tries)
        other = random_placements(rng, mesh, ndim, false);
      if (normalized(other, ndim) == normalized(r.placements, ndim))  // unlucky draws
        other[0] = other[0].is_replicate() ? Shard(0) : Replicate();
      c.needles = {op_name(r.op), "disagree", to_string(other)};
    } else if (c.kind == "rank_invalid") {
      const int64_t d = rng.coin() ? ndim + rng.uniform(0, 1) : -ndim - 1;
      other[rng.uniform(0, mesh.ndim() - 1)] = Shard(d);
      c.needles = {op_name(r.op), "Shard(" + std::to_string(d) + ")", "out of range"};
      // scatter_tensor checks dims against the source's shape, after the arguments agree.
      if (r.op == Op::Scatter) c.needles = {op_name(r.op), "disagree", to_string(other)};
    } else {
      other.push_back(Replicate());
      c.needles = {op_name(r.op), std::to_string(other.size()) + " entries"};
    }
    c.per_rank = [=](int64_t rank, Request& q) {
      if (rank == bad) q.placements = other;
    };
  } else if (c.kind == "rank_tables" || c.kind == "rank_bad_table") {
    r = valid_request(
        rng, mesh,
        pick(rng, {Op::Distribute, Op::Scatter, Op::FromLocalChecked, Op::Redistribute}));
    const int64_t t = force_shard(rng, mesh, r);
    give_valid_tables(rng, mesh, r);
    sync_layout(r);
    ShardTable other = r.tables[t];
    if (c.kind == "rank_tables") {
      // Move one row to another piece: still valid, but not what the other ranks pass.
      size_t from = 0;
      while (other[from] == 0) ++from;
      other[from] -= 1;
      other[(from + 1 + rng.index(other.size() - 1)) % other.size()] += 1;
      c.needles = {op_name(r.op), "disagree", shape_str(other)};
    } else {
      other[rng.index(other.size())] += rng.uniform(1, 3);
      c.needles = {op_name(r.op), "sum to"};
      // These check sizes only after the arguments agree.
      if (r.op == Op::FromLocalChecked || r.op == Op::Scatter)
        c.needles = {op_name(r.op), "disagree", shape_str(other)};
    }
    c.per_rank = [=](int64_t rank, Request& q) {
      if (rank == bad) q.tables[t] = other;
    };
  } else if (c.kind == "rank_src") {
    r = valid_request(rng, mesh, pick(rng, {Op::Distribute, Op::Scatter}));
    r.others_undefined = false;
    const int other = static_cast<int>((r.src + 1 + rng.uniform(0, mesh.size() - 2)) % mesh.size());
    c.per_rank = [=](int64_t rank, Request& q) {
      if (rank == bad) q.src = other;
    };
    c.needles = {op_name(r.op), "disagree"};
  } else if (c.kind == "rank_undefined") {
    r = valid_request(rng, mesh,
                      pick(rng, {Op::Distribute, Op::FromLocalChecked, Op::FromLocalInfer}));
    c.per_rank = [=](int64_t rank, Request& q) {
      if (rank == bad) q.undefined = true;
    };
    c.needles = {op_name(r.op), "defined"};
  } else if (c.kind == "rank_partial") {
    r = valid_request(rng, mesh, Op::Redistribute);
    const int64_t m = rng.uniform(0, mesh.ndim() - 1);
    r.layout[m] = Replicate();
    r.layout_tables = {};
    r.sizes = Sizes::Chunk;
    c.per_rank = [=](int64_t rank, Request& q) {
      if (rank == bad) q.placements[m] = Partial();
    };
    c.needles = {"redistribute", "Partial"};
  } else {
    // The tensor itself was declared differently on one rank (from_local without a check
    // cannot see it): the next redistribute must not hang on it.
    r = valid_request(rng, mesh, Op::Redistribute);
    const int64_t ndim = static_cast<int64_t>(r.shape.size());
    r.layout = random_placements(rng, mesh, ndim, false);
    r.layout_tables = {};
    Placements other = r.layout;
    for (int tries = 0; tries < 20 && normalized(other, ndim) == normalized(r.layout, ndim);
         ++tries)
      other = random_placements(rng, mesh, ndim, false);
    if (normalized(other, ndim) == normalized(r.layout, ndim))
      other[0] = other[0].is_replicate() ? Shard(0) : Replicate();
    r.sizes = Sizes::Chunk;
    c.per_rank = [=](int64_t rank, Request& q) {
      if (rank == bad) q.layout = other;
    };
    c.needles = {"redistribute", "disagree"};
  }
  return c;
}

// ---- the sweeps ----

class FuzzLayout : public ::testing::TestWithParam<std::vector<int64_t>> {};

tessera::testing::RunOptions quick() {
  // A rank left in a collective fails in seconds (and names the stuck rank).
  tessera::testing::RunOptions o;
  o.collective_timeout = std::chrono::seconds(5);
  o.timeout = std::chrono::seconds(90);
  return o;
}

template <class Make>
void sweep(const std::vector<int64_t>& shape, int64_t count, const Make& make) {
  tessera::test::Sweep s;
  const auto cases = s.cases(count);
  if (!cases.any()) return;
  tessera::testing::run_ranks(
      tessera::test::mesh_world(shape),
      [&](int) {
        auto mesh = init_device_mesh("cpu", shape);
        // The same shape again: a mesh the tensors are not on.
        auto other = init_device_mesh("cpu", shape);
        cases.run([&](Rng& rng, int64_t c) {
          Case k = make(rng, mesh);
          if (k.kind == "spec_mesh") k.req.target_mesh = &other;
          check_case(k, mesh, s.label(c) + " " + describe(k, mesh));
        });
      },
      quick());
}

}  // namespace

TEST_P(FuzzLayout, ValidMatchesOneDevice) {
  sweep(GetParam(), 60, [](Rng& rng, const DeviceMesh& mesh) {
    Case c;
    c.kind = "valid";
    c.req = valid_request(rng, mesh, rng.pick(kAllOps));
    return c;
  });
}

TEST_P(FuzzLayout, InvalidFailsOnEveryRank) { sweep(GetParam(), 60, same_everywhere); }

TEST_P(FuzzLayout, RankDependentFailsOnEveryRank) {
  if (tessera::test::mesh_world(GetParam()) < 2) {
    GTEST_SKIP() << "needs two ranks";
  }
  sweep(GetParam(), 60, rank_dependent);
}

INSTANTIATE_TEST_SUITE_P(Fuzz, FuzzLayout,
                         ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{2},
                                           std::vector<int64_t>{3}, std::vector<int64_t>{2, 2},
                                           std::vector<int64_t>{1, 2},
                                           std::vector<int64_t>{2, 1, 2}),
                         [](const auto& info) { return tessera::test::mesh_name(info.param); });

// redistribute exchanges its arguments once per signature and at least every
// TESSERA_CHECK_ARGUMENTS-th call (NOTE: [Agreed signatures] in src/tensor/api.cpp); 0 never
// exchanges, 1 on every call. The results are the same.
TEST(FuzzLayoutAgreement, OneExchangePerSignature) {
  const auto full = tessera::test::randn({7, 4}, 3);
  // Six calls: S(0), S(0), S(1), S(0), S(1), S(0); the exchanges each makes, per setting.
  const std::vector<std::pair<const char*, std::vector<int64_t>>> modes = {
      {nullptr, {1, 0, 1, 0, 0, 0}},
      {"0", {0, 0, 0, 0, 0, 0}},
      {"1", {1, 1, 1, 1, 1, 1}},
      {"3", {1, 0, 1, 0, 0, 1}}};
  for (const auto& [env, expected] : modes) {
    if (env) ::setenv("TESSERA_CHECK_ARGUMENTS", env, 1);  // before any rank thread starts
    for (int world : {2, 3}) {
      tessera::testing::run_ranks(world, [&](int) {
        auto mesh = init_device_mesh("cpu", {world});
        auto x = distribute_tensor(full, mesh, {Replicate()}, std::nullopt);
        for (size_t i = 0; i < expected.size(); ++i) {
          const int64_t dim = i == 2 || i == 4 ? 1 : 0;
          CommDebugMode comm;
          auto y = redistribute(x, {Shard(dim)});
          const std::string what = std::string("TESSERA_CHECK_ARGUMENTS=") + (env ? env : "") +
                                   ", call " + std::to_string(i);
          EXPECT_EQ(comm.stats(comm::CollectiveKind::Metadata).calls, expected[i]) << what << "\n"
                                                                                   << comm.table();
          EXPECT_EQ(comm.get_total_counts(), 0) << what;  // R -> S is a local slice
          EXPECT_TRUE(at::equal(full_tensor(y), full)) << what;
        }
      });
    }
    ::unsetenv("TESSERA_CHECK_ARGUMENTS");
  }
}

// Ranks that pass different signatures, each agreed before, are trusted without an exchange;
// the next exchange compares what they took on trust and raises on every rank.
TEST(FuzzLayoutAgreement, TrustedCallsThatDifferFailAtTheNextExchange) {
  const auto full = tessera::test::randn({6, 5}, 4);
  ::setenv("TESSERA_CHECK_ARGUMENTS", "4", 1);
  tessera::test::expect_error_everywhere(
      2,
      [&](int rank) {
        auto mesh = init_device_mesh("cpu", {2});
        auto x = distribute_tensor(full, mesh, {Replicate()}, std::nullopt);
        (void)redistribute(x, {Shard(0)});
        (void)redistribute(x, {Shard(1)});                  // both signatures agreed
        (void)redistribute(x, {Shard(rank == 0 ? 0 : 1)});  // the slip: trusted, unseen
        (void)redistribute(x, {Shard(0)});
        (void)redistribute(x, {Shard(0)});
        (void)redistribute(x, {Shard(0)});  // the 4th call: exchanged, and the digests differ
      },
      {"redistribute", "disagree", "3 calls taken on trust"});
  ::unsetenv("TESSERA_CHECK_ARGUMENTS");
}
