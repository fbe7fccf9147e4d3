// Indexing and joining ops: slice/narrow/select, split/chunk/unbind, cat/stack,
// index_select/index_add, gather/scatter, embedding, and the backward ops autograd emits for
// them (slice_backward, select_backward, embedding_dense_backward; the others decompose into
// ops listed here).
//
// NOTE: [Slicing a sharded dim]
// Shard tables may be arbitrary (NOTE: [Shard tables]), so slicing never communicates: the
// pieces of a sharded dim are consecutive ranges, and the elements start, start+step, ...
// that fall into each piece are a consecutive run of the result. Every rank computes every
// piece's count from the spec, and that is the result's table (uneven, possibly with empty
// pieces); each rank slices its own piece with translated bounds. A full-range slice gives
// the input's table back. split/chunk are slices, so their pieces keep the sharding too, and
// cat along a sharded dim cuts its output table (the inputs' table sum when they came from
// such a split, else the chunk layout) into each input's range: inputs that already have
// those tables (cat of split pieces, slice_backward of a slice) move nothing, others are
// re-cut by one all-to-all, never gathered. The price is balance: x[:2] lands on the first
// shard(s) only; an op that wants another layout re-cuts it later. Results are views of the
// local shards, so writes through a slice reach the input.
//
// Ops that drop a sharded dim:
//   select(d, i)  the owner of row i selects, the other shards give zeros: Partial(sum) on the
//                 mesh dims that sharded d, so only the selected slice is ever reduced (bool
//                 tensors, and inputs with non-sum partials, replicate d first instead).
//                 Not a view on the other shards: writes through it do not reach the input.
//   unbind(d)     every row is needed: d is replicated first (one all-gather).
//
// Gathers and scatters (index_select, gather, scatter, index_add): a sharded indexed dim is
// replicated first, except where the local form is exact: index_add into a self sharded on
// the indexed dim adds only the index entries in its own range; scatter_add with the index
// sharded on the scattered dim gives Partial(sum); index_select/gather keep the index's
// sharding in the result. Other dims shard alike on self, index and source where their sizes
// agree. Indices are never partial. Slices and gathers commute with elementwise reductions,
// so any Partial input passes through them; index_add and scatter(_add) are linear in self
// and source together, so Partial(sum) passes (a Replicate partner becomes Partial locally).
//
// embedding(weight [V, D], indices):
//   weight S(1)  output sharded on its last dim, no communication.
//   weight S(0)  vocab-parallel: each shard looks up the indices in its own range, zero rows
//                elsewhere; the output is Partial(sum).
//   weight R     the output follows the indices' sharding.
//
// Backward ops do not see the forward input's layout (only its global sizes). Shardings of
// the incoming gradient are mirrored through the op; where the gradient is Replicate the
// result stays Replicate (local, and free to slice into any layout later), except
// embedding_dense_backward, whose result is as large as the whole table: there Replicate
// mesh dims give Shard(0) in the chunk layout, each rank accumulating only its vocab range.
#include <algorithm>
#include <limits>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "tessera/ops/rule.h"

namespace tessera::ops {

namespace {

using torch::jit::Stack;

int64_t wrap_dim(int64_t d, int64_t ndim) {
  TORCH_CHECK(d >= -ndim && d < ndim, "tessera: dim ", d, " out of range for a tensor with ",
              ndim, " dims");
  return d < 0 ? d + ndim : d;
}

std::vector<int64_t> sharding(const Placements& p, int64_t t) {
  std::vector<int64_t> out;
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_shard(t)) out.push_back(static_cast<int64_t>(m));
  return out;
}

int64_t sum(const ShardTable& t) {
  int64_t s = 0;
  for (auto x : t) s += x;
  return s;
}

// The table of tensor dim t under placements p: `want` where it has the right number of
// pieces and total, else the chunk layout (empty where p does not shard t).
ShardTable fit(const DeviceMesh& mesh, const Placements& p, int64_t t, int64_t size,
               const ShardTable& want) {
  auto dims = sharding(p, t);
  if (dims.empty()) return {};
  int64_t parts = 1;
  for (auto m : dims) parts *= mesh.size(m);
  if (static_cast<int64_t>(want.size()) == parts && sum(want) == size) return want;
  return chunk_table(mesh, p, t, size);
}

// The table of a tensor dim shared by several operands (self, index, source): the first
// candidate sharding it over exactly the target's mesh dims, else the chunk layout.
ShardTable shared_table(const DeviceMesh& mesh, const Placements& p, int64_t t, int64_t size,
                        std::initializer_list<const DTensorSpec*> candidates) {
  auto dims = sharding(p, t);
  if (dims.empty()) return {};
  for (const auto* c : candidates)
    if (c && t < c->ndim() && c->sizes()[t] == size && c->mesh_dims_sharding(t) == dims)
      return c->shard_table(t);
  return chunk_table(mesh, p, t, size);
}

SpecPtr make(const DeviceMesh& mesh, const Placements& p, const std::vector<int64_t>& sizes,
             c10::ScalarType dtype, std::vector<ShardTable> tables) {
  tables.resize(sizes.size());
  for (int64_t t = 0; t < static_cast<int64_t>(sizes.size()); ++t)
    tables[t] = fit(mesh, p, t, sizes[t], tables[t]);
  return std::make_shared<DTensorSpec>(mesh, p, sizes, dtype, std::move(tables));
}

// The same spec with every mesh dim in `dims` turned into Replicate.
SpecPtr replicate_on(const DTensorSpec& s, const std::vector<int64_t>& dims) {
  Placements p = s.placements();
  for (auto m : dims) p[m] = Replicate();
  return make(s.mesh(), p, s.sizes(), s.dtype(), s.shard_tables());
}

bool only_sum_partials(const DTensorSpec& s) {
  for (const auto& p : s.placements())
    if (p.is_partial() && p.reduce_op() != PartialOp::Sum) return false;
  return true;
}

// Tensor dim d removed: S(d) becomes `replacement`, S(t > d) shifts down.
void drop_dim(Placements& p, std::vector<ShardTable>& tables, int64_t d, Placement replacement) {
  for (auto& x : p) {
    if (x.is_shard(d)) x = replacement;
    else if (x.is_shard() && x.dim() > d) x = Shard(x.dim() - 1);
  }
  tables.erase(tables.begin() + d);
}

// A new tensor dim at d (unsharded): S(t >= d) shifts up.
void insert_dim(Placements& p, std::vector<ShardTable>& tables, int64_t d) {
  for (auto& x : p)
    if (x.is_shard() && x.dim() >= d) x = Shard(x.dim() + 1);
  tables.insert(tables.begin() + d, ShardTable{});
}

// ---- slicing -------------------------------------------------------------------------------

// The elements start, start + step, ... (len of them) of a dim.
struct Selection {
  int64_t start = 0, step = 1, len = 0;
  int64_t at(int64_t k) const { return start + k * step; }
};

// ATen's slice normalisation: negative bounds count from the end, then clamp.
Selection slice_selection(int64_t size, c10::optional<int64_t> start_opt,
                          c10::optional<int64_t> end_opt, int64_t step) {
  TORCH_CHECK(step > 0, "tessera: slice step must be positive");
  int64_t start = start_opt.value_or(0);
  int64_t end = end_opt.value_or(std::numeric_limits<int64_t>::max());
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  return {start, step, (end - start + step - 1) / step};
}

int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

// Per piece of `table`, the run [k0, k1) of selected elements it holds.
struct Run {
  int64_t k0, k1;
};
std::vector<Run> cut(const ShardTable& table, const Selection& s) {
  std::vector<Run> out;
  int64_t o = 0;
  for (auto n : table) {
    const int64_t k0 = std::clamp<int64_t>(ceil_div(o - s.start, s.step), 0, s.len);
    const int64_t k1 = std::clamp<int64_t>(ceil_div(o + n - s.start, s.step), k0, s.len);
    out.push_back({k0, k1});
    o += n;
  }
  return out;
}

ShardTable counts(const std::vector<Run>& runs) {
  ShardTable t;
  for (auto& r : runs) t.push_back(r.k1 - r.k0);
  return t;
}

// This rank's run of the selection along tensor dim t, in local coordinates (start within
// its piece, count).
struct LocalCut {
  int64_t start = 0, len = 0;
};
LocalCut local_cut(const DTensorSpec& s, int64_t t, const Selection& sel) {
  const auto dims = s.mesh_dims_sharding(t);
  if (dims.empty()) return {sel.start, sel.len};
  const auto runs = cut(s.shard_table(t), sel);
  const auto& r = runs.at(table_index(s.mesh(), dims, s.mesh().coordinate()));
  if (r.k1 == r.k0) return {0, 0};
  return {sel.at(r.k0) - s.local_offsets()[t], r.k1 - r.k0};
}

// The layout of selecting `sel` along d: same placements; a sharded d gets the cut table.
SpecPtr sliced_spec(const DTensorSpec& in, int64_t d, const Selection& sel) {
  auto sizes = in.sizes();
  sizes[d] = sel.len;
  auto tables = in.shard_tables();
  if (!tables[d].empty()) tables[d] = counts(cut(tables[d], sel));
  return std::make_shared<DTensorSpec>(in.mesh(), in.placements(), sizes, in.dtype(), tables);
}

c10::optional<int64_t> opt_int(const c10::IValue& v) {
  return v.isNone() ? c10::nullopt : c10::optional<int64_t>(v.toInt());
}

OpPlan one_output(const OpCall& call, SpecPtr input, SpecPtr output) {
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = std::move(input);
  plan.outputs.push_back(std::move(output));
  return plan;
}

// slice.Tensor(self, dim, start, end, step): see NOTE: [Slicing a sharded dim].
OpPlan slice_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  const int64_t d = wrap_dim(call.args[1].toInt(), in.ndim());
  const int64_t step = call.args[4].toInt();
  const auto sel =
      slice_selection(in.sizes()[d], opt_int(call.args[2]), opt_int(call.args[3]), step);
  auto plan = one_output(call, nullptr, sliced_spec(in, d, sel));
  if (in.mesh_dims_sharding(d).empty()) return plan;
  const auto mine = local_cut(in, d, sel);
  c10::OperatorHandle op = call.op;
  plan.local_kernel = [op, mine, step](Stack& stack) {
    stack[2] = mine.start;
    stack[3] = mine.len ? mine.start + (mine.len - 1) * step + 1 : mine.start;
    op.callBoxed(&stack);
  };
  return plan;
}

// narrow_copy(self, dim, start, length).
OpPlan narrow_copy_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  const int64_t d = wrap_dim(call.args[1].toInt(), in.ndim());
  int64_t start = call.args[2].toInt();
  if (start < 0) start += in.sizes()[d];
  const Selection sel{start, 1, call.args[3].toInt()};
  TORCH_CHECK(start >= 0 && sel.len >= 0 && start + sel.len <= in.sizes()[d], "tessera: ",
              call.describe(), ": narrow range out of bounds");
  auto plan = one_output(call, nullptr, sliced_spec(in, d, sel));
  if (in.mesh_dims_sharding(d).empty()) return plan;
  const auto mine = local_cut(in, d, sel);
  c10::OperatorHandle op = call.op;
  plan.local_kernel = [op, mine](Stack& stack) {
    stack[2] = mine.start;
    stack[3] = mine.len;
    op.callBoxed(&stack);
  };
  return plan;
}

// slice_backward(grad, input_sizes, dim, start, end, step): zeros of input_sizes with the
// gradient written into the slice. A gradient sharded on dim needs an input table whose cut
// is the gradient's table: piece j must start after the last selected element of piece j-1
// and at or before its own first one; within those bounds the chunk boundaries are taken
// (so the chunk layout comes back exactly where the forward input had it).
OpPlan slice_backward_rule(const OpCall& call) {
  const auto& g = *call.specs[0];
  auto in_sizes = call.args[1].toIntVector();
  const int64_t d = wrap_dim(call.args[2].toInt(), static_cast<int64_t>(in_sizes.size()));
  const int64_t step = call.args[5].toInt();
  const auto sel = slice_selection(in_sizes[d], call.args[3].toInt(), call.args[4].toInt(), step);
  TORCH_CHECK(sel.len == g.sizes()[d], "tessera: ", call.describe(),
              ": the gradient does not match the slice");
  auto tables = g.shard_tables();
  if (!tables[d].empty()) {
    const auto& gt = tables[d];
    const auto chunk = chunk_table(g.mesh(), g.placements(), d, in_sizes[d]);
    ShardTable t(gt.size(), 0);
    int64_t prev = 0, k = 0, c = 0;
    for (size_t j = 0; j < gt.size(); ++j) {
      if (j > 0) {
        const int64_t lo = k == 0 ? 0 : sel.at(k - 1) + 1;
        const int64_t hi = k == sel.len ? in_sizes[d] : sel.at(k);
        const int64_t b = std::clamp<int64_t>(c, lo, hi);
        t[j - 1] = b - prev;
        prev = b;
      }
      k += gt[j];
      c += chunk[j];
    }
    t.back() = in_sizes[d] - prev;
    TORCH_CHECK(counts(cut(t, sel)) == gt, "tessera: ", call.describe(),
                ": no input table reproduces the gradient's (rule bug)");
    tables[d] = t;
  }
  auto out = std::make_shared<DTensorSpec>(g.mesh(), g.placements(), in_sizes, g.dtype(), tables);
  auto plan = one_output(call, nullptr, out);
  const auto local = out->local_sizes();
  const auto mine = local_cut(*out, d, sel);
  c10::OperatorHandle op = call.op;
  plan.local_kernel = [op, local, mine, step](Stack& stack) {
    stack[1] = c10::IValue(local);
    stack[3] = mine.start;
    stack[4] = mine.len ? mine.start + (mine.len - 1) * step + 1 : mine.start;
    op.callBoxed(&stack);
  };
  return plan;
}

// select.int(self, dim, index).
OpPlan select_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  const int64_t d = wrap_dim(call.args[1].toInt(), in.ndim());
  const int64_t size = in.sizes()[d];
  int64_t index = call.args[2].toInt();
  TORCH_CHECK(index >= -size && index < size, "tessera: ", call.describe(), ": index ", index,
              " out of range for size ", size);
  if (index < 0) index += size;
  const auto dims = in.mesh_dims_sharding(d);
  const bool partial = !dims.empty() && in.dtype() != at::kBool && only_sum_partials(in);
  SpecPtr target = partial || dims.empty() ? nullptr : replicate_on(in, dims);
  const auto& src = target ? *target : in;
  Placements p = src.placements();
  auto tables = src.shard_tables();
  auto sizes = src.sizes();
  drop_dim(p, tables, d, Partial());
  sizes.erase(sizes.begin() + d);
  auto out = std::make_shared<DTensorSpec>(in.mesh(), p, sizes, in.dtype(), tables);
  auto plan = one_output(call, target, out);
  if (!partial) return plan;
  const int64_t off = in.local_offsets()[d], n = in.local_sizes()[d];
  const auto local = out->local_sizes();
  c10::OperatorHandle op = call.op;
  plan.local_kernel = [op, off, n, index, local](Stack& stack) {
    if (index >= off && index < off + n) {
      stack[2] = index - off;
      op.callBoxed(&stack);
      return;
    }
    auto x = stack[0].toTensor();
    stack.clear();
    stack.emplace_back(at::zeros(local, x.options()));
  };
  return plan;
}

// select_backward(grad, input_sizes, dim, index): the gradient's layout with dim inserted.
OpPlan select_backward_rule(const OpCall& call) {
  const auto& g = *call.specs[0];
  auto in_sizes = call.args[1].toIntVector();
  const int64_t d = wrap_dim(call.args[2].toInt(), static_cast<int64_t>(in_sizes.size()));
  Placements p = g.placements();
  auto tables = g.shard_tables();
  insert_dim(p, tables, d);
  auto out = std::make_shared<DTensorSpec>(g.mesh(), p, in_sizes, g.dtype(), tables);
  auto plan = one_output(call, nullptr, out);
  const auto local = out->local_sizes();
  c10::OperatorHandle op = call.op;
  plan.local_kernel = [op, local](Stack& stack) {
    stack[1] = c10::IValue(local);
    op.callBoxed(&stack);
  };
  return plan;
}

// ---- split / unbind ------------------------------------------------------------------------

OpPlan split_pieces(const OpCall& call, int64_t d, const std::vector<int64_t>& pieces) {
  const auto& in = *call.specs[0];
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  std::vector<int64_t> local;
  int64_t start = 0;
  for (auto len : pieces) {
    const Selection sel{start, 1, len};
    plan.outputs.push_back(sliced_spec(in, d, sel));
    local.push_back(local_cut(in, d, sel).len);
    start += len;
  }
  TORCH_CHECK(start == in.sizes()[d], "tessera: ", call.describe(), ": split sizes sum to ",
              start, ", not ", in.sizes()[d]);
  if (in.mesh_dims_sharding(d).empty()) return plan;
  const bool unsafe = call.name().find("unsafe") != std::string::npos;
  plan.local_kernel = [local, d, unsafe](Stack& stack) {
    auto x = stack[0].toTensor();
    stack.clear();
    stack.emplace_back(unsafe ? at::unsafe_split_with_sizes(x, local, d)
                              : at::split_with_sizes(x, local, d));
  };
  return plan;
}

// split.Tensor / unsafe_split.Tensor(self, split_size, dim).
OpPlan split_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  const int64_t d = wrap_dim(call.args[2].toInt(), in.ndim());
  const int64_t size = in.sizes()[d], split = call.args[1].toInt();
  TORCH_CHECK(split > 0 || size == 0, "tessera: ", call.describe(),
              ": split_size must be positive");
  const int64_t n = split > 0 ? std::max<int64_t>((size + split - 1) / split, 1) : 1;
  std::vector<int64_t> pieces(n, split);
  pieces.back() = size - split * (n - 1);
  return split_pieces(call, d, pieces);
}

// split_with_sizes / unsafe_split_with_sizes(self, split_sizes, dim).
OpPlan split_with_sizes_rule(const OpCall& call) {
  const int64_t d = wrap_dim(call.args[2].toInt(), call.specs[0]->ndim());
  return split_pieces(call, d, call.args[1].toIntVector());
}

// unbind.int(self, dim): every row is a result, so a sharded dim is replicated first.
OpPlan unbind_rule(const OpCall& call) {
  const auto& in = *call.specs[0];
  const int64_t d = wrap_dim(call.args[1].toInt(), in.ndim());
  const auto dims = in.mesh_dims_sharding(d);
  SpecPtr target = dims.empty() ? nullptr : replicate_on(in, dims);
  const auto& src = target ? *target : in;
  Placements p = src.placements();
  auto tables = src.shard_tables();
  auto sizes = src.sizes();
  drop_dim(p, tables, d, Replicate());
  sizes.erase(sizes.begin() + d);
  auto out = std::make_shared<DTensorSpec>(in.mesh(), p, sizes, in.dtype(), tables);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = target;
  plan.outputs.assign(in.sizes()[d], out);
  return plan;
}

// ---- cat / stack ---------------------------------------------------------------------------

// The reference's placements for joining `specs`: a Partial mesh dim stays only where every
// element has the same one (or, for sum, is Replicate); otherwise it is replicated.
Placements join_placements(const DTensorSpec& ref, const std::vector<const DTensorSpec*>& specs) {
  Placements p = ref.placements();
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_partial()) continue;
    for (const auto* s : specs) {
      if (!s) continue;
      const auto& q = s->placement(static_cast<int64_t>(m));
      const bool joins = q == p[m] || (q.is_replicate() && p[m].reduce_op() == PartialOp::Sum);
      if (!joins) p[m] = Replicate();
    }
  }
  return p;
}

// cat(tensors, dim): see NOTE: [Slicing a sharded dim]. Other dims take the first
// distributed element's layout.
OpPlan cat_rule(const OpCall& call) {
  const auto& specs = call.list_specs.at(0);
  // Legacy: 1-d empty tensors are skipped by cat whatever the others' shape.
  auto legacy_empty = [](const DTensorSpec* s) { return s->ndim() == 1 && s->sizes()[0] == 0; };
  const DTensorSpec* first = &call.first();
  for (const auto* s : specs)
    if (legacy_empty(first) && s && !legacy_empty(s)) first = s;
  const auto& ref = *first;
  const auto& mesh = ref.mesh();
  const int64_t nd = ref.ndim();
  const int64_t d = wrap_dim(call.args[1].toInt(), nd);
  auto skipped = [&](const DTensorSpec* s) { return !s || (nd != 1 && legacy_empty(s)); };
  std::vector<int64_t> begin(specs.size(), 0);
  int64_t total = 0;
  std::vector<const DTensorSpec*> joined;
  for (size_t k = 0; k < specs.size(); ++k) {
    begin[k] = total;
    if (skipped(specs[k])) continue;
    TORCH_CHECK(specs[k]->ndim() == nd, "tessera: ", call.describe(), ": ranks differ");
    total += specs[k]->sizes()[d];
    joined.push_back(specs[k]);
  }
  const Placements p = join_placements(ref, joined);
  auto out_sizes = ref.sizes();
  out_sizes[d] = total;
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t)
    if (t != d) tables[t] = fit(mesh, p, t, out_sizes[t], ref.shard_table(t));
  const auto dims = sharding(p, d);
  if (!dims.empty()) {
    // Inputs that are consecutive cuts of one table (split pieces) keep their shards.
    ShardTable acc;
    bool consistent = true;
    for (const auto* s : joined) {
      if (s->mesh_dims_sharding(d) != dims) {
        consistent = false;
        break;
      }
      const auto& st = s->shard_table(d);
      if (acc.empty()) acc.assign(st.size(), 0);
      for (size_t j = 0; j < st.size(); ++j) acc[j] += st[j];
    }
    for (size_t k = 0; consistent && k < specs.size(); ++k) {
      if (skipped(specs[k])) continue;
      const Selection range{begin[k], 1, specs[k]->sizes()[d]};
      consistent = counts(cut(acc, range)) == specs[k]->shard_table(d);
    }
    tables[d] = consistent && !acc.empty() ? acc : chunk_table(mesh, p, d, total);
  }
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.list_inputs.resize(call.args.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    const auto* s = specs[k];
    if (!s) {
      plan.list_inputs[0].push_back(nullptr);
      continue;
    }
    if (skipped(s)) {
      plan.list_inputs[0].push_back(replicated(*s));
      continue;
    }
    auto tk = tables;
    if (!dims.empty()) tk[d] = counts(cut(tables[d], {begin[k], 1, s->sizes()[d]}));
    plan.list_inputs[0].push_back(
        std::make_shared<DTensorSpec>(mesh, p, s->sizes(), s->dtype(), tk));
  }
  plan.outputs.push_back(std::make_shared<DTensorSpec>(mesh, p, out_sizes, ref.dtype(), tables));
  return plan;
}

// stack(tensors, dim): every element in the first distributed element's layout; the new dim
// is unsharded and shard dims after it shift.
OpPlan stack_rule(const OpCall& call) {
  const auto& ref = call.first();
  const auto& mesh = ref.mesh();
  const auto& specs = call.list_specs.at(0);
  const int64_t nd = ref.ndim();
  const int64_t d = wrap_dim(call.args[1].toInt(), nd + 1);
  Placements p = join_placements(ref, specs);
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t) tables[t] = fit(mesh, p, t, ref.sizes()[t], ref.shard_table(t));
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.list_inputs.resize(call.args.size());
  for (const auto* s : specs) {
    TORCH_CHECK(!s || s->sizes() == ref.sizes(), "tessera: ", call.describe(),
                ": stack needs equal shapes");
    plan.list_inputs[0].push_back(
        s ? std::make_shared<DTensorSpec>(mesh, p, s->sizes(), s->dtype(), tables) : nullptr);
  }
  auto out_sizes = ref.sizes();
  out_sizes.insert(out_sizes.begin() + d, static_cast<int64_t>(specs.size()));
  insert_dim(p, tables, d);
  plan.outputs.push_back(std::make_shared<DTensorSpec>(mesh, p, out_sizes, ref.dtype(), tables));
  return plan;
}

// ---- gathers and scatters ------------------------------------------------------------------

// index_select(self, dim, index): the indexed dim is replicated; an index sharded on a mesh
// dim where self is replicated shards the result's dim alike.
OpPlan index_select_rule(const OpCall& call) {
  const auto& self = *call.specs[0];
  const auto& mesh = self.mesh();
  const int64_t d = wrap_dim(call.args[1].toInt(), self.ndim());
  const DTensorSpec* idx = call.specs[2];
  Placements ps = self.placements(), pi(mesh.ndim(), Replicate());
  for (size_t m = 0; m < ps.size(); ++m) {
    if (ps[m].is_shard(d)) ps[m] = Replicate();
    if (idx && idx->placement(m).is_shard(0) && ps[m].is_replicate()) pi[m] = Shard(0);
  }
  auto self_t = make(mesh, ps, self.sizes(), self.dtype(), self.shard_tables());
  SpecPtr idx_t = idx ? make(mesh, pi, idx->sizes(), idx->dtype(), idx->shard_tables()) : nullptr;
  auto out_sizes = self.sizes();
  out_sizes[d] = idx ? idx->numel() : 1;
  Placements po = ps;
  for (size_t m = 0; m < po.size(); ++m)
    if (pi[m].is_shard()) po[m] = Shard(d);
  auto tables = self_t->shard_tables();
  if (idx_t && !idx_t->shard_table(0).empty()) tables[d] = idx_t->shard_table(0);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = self_t;
  plan.inputs[2] = idx_t;
  plan.outputs.push_back(std::make_shared<DTensorSpec>(mesh, po, out_sizes, self.dtype(), tables));
  return plan;
}

// Keeps only the index entries in [off, off + n) (shifted to local) and the matching slices of
// `source` along d.
void keep_local_entries(Stack& stack, size_t index_arg, size_t source_arg, int64_t d,
                        int64_t off, int64_t n) {
  auto idx = stack[index_arg].toTensor().reshape(-1);
  auto keep = ((idx >= off) & (idx < off + n)).nonzero().squeeze(1);
  stack[index_arg] = idx.index_select(0, keep) - off;
  if (stack[source_arg].isTensor()) {
    auto src = stack[source_arg].toTensor();
    if (src.dim() > d) stack[source_arg] = src.index_select(d, keep);
  }
}

// index_add(self, dim, index, source, alpha) and index_add_. The index is replicated. A self
// sharded on dim keeps its shards: each adds the entries that land in its range.
OpPlan index_add_rule(const OpCall& call) {
  const auto& self = *call.specs[0];
  const auto& mesh = self.mesh();
  const int64_t d = wrap_dim(call.args[1].toInt(), self.ndim());
  const DTensorSpec* src = call.specs[3];
  const bool summable = self.dtype() != at::kBool;
  auto same = [&](int64_t t) {
    return !src || (t < src->ndim() && src->sizes()[t] == self.sizes()[t]);
  };
  Placements ps(mesh.ndim(), Replicate()), pr = ps;
  bool masked = false;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = self.placement(m);
    const auto b = src ? src->placement(m) : Replicate();
    if (a.is_shard(d)) {
      ps[m] = a;
      masked = true;
    } else if (b.is_shard() && b.dim() != d && same(b.dim())) {
      ps[m] = pr[m] = b;
    } else if (a.is_shard() && same(a.dim())) {
      ps[m] = pr[m] = a;
    } else if (summable && (a == Partial() || b == Partial())) {
      ps[m] = pr[m] = Partial();
    }
  }
  std::vector<ShardTable> ts(self.ndim()), tr(src ? src->ndim() : 0);
  for (int64_t t = 0; t < self.ndim(); ++t) {
    if (t == d) {
      ts[t] = fit(mesh, ps, t, self.sizes()[t], self.shard_table(t));
    } else {
      ts[t] = shared_table(mesh, ps, t, self.sizes()[t], {src, &self});
      if (t < static_cast<int64_t>(tr.size())) tr[t] = ts[t];
    }
  }
  auto self_t = std::make_shared<DTensorSpec>(mesh, ps, self.sizes(), self.dtype(), ts);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = self_t;
  if (call.specs[2]) plan.inputs[2] = replicated(*call.specs[2]);
  if (src) plan.inputs[3] = make(mesh, pr, src->sizes(), src->dtype(), tr);
  plan.outputs.push_back(self_t);
  if (!masked) return plan;
  const int64_t off = self_t->local_offsets()[d], n = self_t->local_sizes()[d];
  c10::OperatorHandle op = call.op;
  plan.local_kernel = [op, d, off, n](Stack& stack) {
    keep_local_entries(stack, 2, 3, d, off, n);
    op.callBoxed(&stack);
  };
  return plan;
}

// gather(self, dim, index, sparse_grad): the result has the index's shape and layout. Self
// is replicated on the gathered dim; other dims shard alike where self and index agree in size.
OpPlan gather_rule(const OpCall& call) {
  const auto& self = *call.specs[0];
  const auto& mesh = self.mesh();
  const int64_t d = wrap_dim(call.args[1].toInt(), self.ndim());
  TORCH_CHECK(call.specs[2], "tessera: ", call.describe(), ": gather needs a tensor index");
  const auto& idx = *call.specs[2];
  auto same = [&](int64_t t) { return t < self.ndim() && self.sizes()[t] == idx.sizes()[t]; };
  Placements ps(mesh.ndim(), Replicate()), pi = ps, po = ps;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = self.placement(m);
    const auto& b = idx.placement(m);
    if (b.is_shard()) {
      if (b.dim() == d) pi[m] = po[m] = b;
      else if (same(b.dim())) ps[m] = pi[m] = po[m] = b;
    } else if (a.is_shard()) {
      if (a.dim() != d && same(a.dim())) ps[m] = pi[m] = po[m] = a;
    } else if (a.is_partial()) {
      ps[m] = po[m] = a;
    }
  }
  std::vector<ShardTable> ts(self.ndim()), ti(idx.ndim());
  for (int64_t t = 0; t < idx.ndim(); ++t) {
    if (t == d) ti[t] = fit(mesh, pi, t, idx.sizes()[t], idx.shard_table(t));
    else ti[t] = ts[t] = shared_table(mesh, pi, t, idx.sizes()[t], {&idx, &self});
  }
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = std::make_shared<DTensorSpec>(mesh, ps, self.sizes(), self.dtype(), ts);
  plan.inputs[2] = std::make_shared<DTensorSpec>(mesh, pi, idx.sizes(), idx.dtype(), ti);
  plan.outputs.push_back(std::make_shared<DTensorSpec>(mesh, po, idx.sizes(), self.dtype(), ti));
  return plan;
}

enum class ScatterKind { Assign, Value, Add };

// scatter(self, dim, index, src|value) and scatter_add: the result has self's shape. Dims
// other than dim shard alike on self, index and src where all three agree in size; an index
// sharded on dim gives Partial(sum) for scatter_add (each shard adds its own entries).
OpPlan scatter_rule(const OpCall& call, ScatterKind kind) {
  const auto& self = *call.specs[0];
  const auto& mesh = self.mesh();
  const int64_t d = wrap_dim(call.args[1].toInt(), self.ndim());
  TORCH_CHECK(call.specs[2], "tessera: ", call.describe(), ": scatter needs a tensor index");
  const auto& idx = *call.specs[2];
  const DTensorSpec* src = kind == ScatterKind::Value ? nullptr : call.specs[3];
  const bool summable = kind != ScatterKind::Value && self.dtype() != at::kBool;
  auto same = [&](int64_t t) {
    return t != d && self.sizes()[t] == idx.sizes()[t] &&
           (!src || src->sizes()[t] == idx.sizes()[t]);
  };
  Placements ps(mesh.ndim(), Replicate()), pi = ps, pr = ps;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = self.placement(m);
    const auto& b = idx.placement(m);
    const auto c = src ? src->placement(m) : Replicate();
    if (b.is_shard() && same(b.dim())) {
      ps[m] = pi[m] = pr[m] = b;
    } else if (b.is_shard(d) && kind == ScatterKind::Add && summable &&
               (!src || src->sizes()[d] == idx.sizes()[d])) {
      pi[m] = pr[m] = b;
      ps[m] = Partial();
    } else if (b.is_shard()) {
      continue;  // replicate all three
    } else if (a.is_shard() && same(a.dim())) {
      ps[m] = pi[m] = pr[m] = a;
    } else if (c.is_shard() && same(c.dim())) {
      ps[m] = pi[m] = pr[m] = c;
    } else if (summable && (a == Partial() || c == Partial())) {
      ps[m] = pr[m] = Partial();
    }
  }
  std::vector<ShardTable> ts(self.ndim()), ti(idx.ndim());
  for (int64_t t = 0; t < idx.ndim(); ++t) {
    if (t == d) ti[t] = fit(mesh, pi, t, idx.sizes()[t], idx.shard_table(t));
    else ti[t] = ts[t] = shared_table(mesh, pi, t, idx.sizes()[t], {&idx, &self, src});
  }
  for (int64_t t = 0; t < self.ndim(); ++t) ts[t] = fit(mesh, ps, t, self.sizes()[t], ts[t]);
  auto self_t = std::make_shared<DTensorSpec>(mesh, ps, self.sizes(), self.dtype(), ts);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = self_t;
  plan.inputs[2] = std::make_shared<DTensorSpec>(mesh, pi, idx.sizes(), idx.dtype(), ti);
  if (src) plan.inputs[3] = make(mesh, pr, src->sizes(), src->dtype(), ti);
  plan.outputs.push_back(self_t);
  return plan;
}

OpPlan scatter_src_rule(const OpCall& call) { return scatter_rule(call, ScatterKind::Assign); }
OpPlan scatter_value_rule(const OpCall& call) { return scatter_rule(call, ScatterKind::Value); }
OpPlan scatter_add_rule(const OpCall& call) { return scatter_rule(call, ScatterKind::Add); }

// ---- embedding -----------------------------------------------------------------------------

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse).
OpPlan embedding_rule(const OpCall& call) {
  TORCH_CHECK(call.specs[0], "tessera: ", call.describe(), ": the weight must be distributed");
  const auto& w = *call.specs[0];
  const auto& mesh = w.mesh();
  const DTensorSpec* idx = call.specs[1];
  const auto idx_sizes = idx ? idx->sizes() : std::vector<int64_t>{};
  const int64_t last = static_cast<int64_t>(idx_sizes.size());
  const bool vocab_ok = only_sum_partials(w);
  Placements pw(mesh.ndim(), Replicate()), pi = pw, po = pw;
  bool masked = false;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = w.placement(m);
    const auto b = idx ? idx->placement(m) : Replicate();
    if (a.is_shard(1)) {
      pw[m] = a;
      po[m] = Shard(last);
    } else if (a.is_shard(0) && vocab_ok) {
      pw[m] = a;
      po[m] = Partial();
      masked = true;
    } else if (a.is_partial()) {
      pw[m] = po[m] = a;
    } else if (b.is_shard()) {
      pi[m] = po[m] = b;
    }
  }
  auto w_t = make(mesh, pw, w.sizes(), w.dtype(), w.shard_tables());
  SpecPtr idx_t = idx ? make(mesh, pi, idx_sizes, idx->dtype(), idx->shard_tables()) : nullptr;
  auto out_sizes = idx_sizes;
  out_sizes.push_back(w.sizes()[1]);
  auto tables = idx_t ? idx_t->shard_tables() : std::vector<ShardTable>{};
  tables.push_back(w_t->shard_table(1));
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = w_t;
  plan.inputs[1] = idx_t;
  auto out = std::make_shared<DTensorSpec>(mesh, po, out_sizes, w.dtype(), tables);
  plan.outputs.push_back(out);
  if (!masked) return plan;
  // Vocab-parallel: look up the indices in this shard's range, zero rows for the rest.
  const int64_t off = w_t->local_offsets()[0], n = w_t->local_sizes()[0];
  const auto local = out->local_sizes();
  plan.local_kernel = [off, n, local](Stack& stack) {
    auto weight = stack[0].toTensor();
    auto indices = stack[1].toTensor();
    stack.clear();
    if (n == 0) {
      stack.emplace_back(at::zeros(local, weight.options()));
      return;
    }
    auto in_range = (indices >= off) & (indices < off + n);
    auto rows = at::embedding(weight, (indices - off).masked_fill(~in_range, 0));
    stack.emplace_back(rows.masked_fill_(~in_range.unsqueeze(-1), 0));
  };
  return plan;
}

// embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq).
//   grad S(last)          -> S(1), indices replicated
//   grad S(t), t < last   -> Partial(sum): indices sharded alike (data parallel)
//   grad P(sum)           -> P(sum)
//   grad R                -> S(0) chunk layout: each rank accumulates its own vocab rows
OpPlan embedding_backward_rule(const OpCall& call) {
  const auto& g = *call.specs[0];
  const auto& mesh = g.mesh();
  const DTensorSpec* idx = call.specs[1];
  const int64_t last = g.ndim() - 1;
  const int64_t num_weights = call.args[2].toInt();
  const auto idx_sizes = idx ? idx->sizes() : std::vector<int64_t>{};
  Placements pg(mesh.ndim(), Replicate()), pi = pg, po = pg;
  bool masked = false;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const auto& a = g.placement(m);
    if (a.is_shard(last)) {
      pg[m] = a;
      po[m] = Shard(1);
    } else if (a.is_shard() && idx) {
      pg[m] = pi[m] = a;
      po[m] = Partial();
    } else if (a == Partial()) {
      pg[m] = po[m] = a;
    } else {
      po[m] = Shard(0);
      masked = true;
    }
  }
  std::vector<ShardTable> tg(g.ndim()), ti(idx_sizes.size());
  for (int64_t t = 0; t < g.ndim(); ++t) {
    if (t == last) tg[t] = fit(mesh, pg, t, g.sizes()[t], g.shard_table(t));
    else ti[t] = tg[t] = shared_table(mesh, pg, t, g.sizes()[t], {&g, idx});
  }
  std::vector<ShardTable> to = {ShardTable{}, tg[last]};
  auto out = make(mesh, po, {num_weights, g.sizes()[last]}, g.dtype(), to);
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.inputs[0] = std::make_shared<DTensorSpec>(mesh, pg, g.sizes(), g.dtype(), tg);
  if (idx) plan.inputs[1] = std::make_shared<DTensorSpec>(mesh, pi, idx_sizes, idx->dtype(), ti);
  plan.outputs.push_back(out);
  const int64_t off = out->local_offsets()[0], n = out->local_sizes()[0];
  c10::OperatorHandle op = call.op;
  plan.local_kernel = [op, masked, off, n](Stack& stack) {
    if (masked) {
      auto grad = stack[0].toTensor();
      stack[0] = grad.reshape({stack[1].toTensor().numel(), grad.size(-1)});
      keep_local_entries(stack, 1, 0, 0, off, n);
      const int64_t pad = stack[3].toInt();
      stack[3] = pad >= off && pad < off + n ? pad - off : int64_t{-1};
    }
    stack[2] = n;
    op.callBoxed(&stack);
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::slice.Tensor", slice_rule);
  register_rule("aten::narrow_copy", narrow_copy_rule);
  register_rule("aten::slice_backward", slice_backward_rule);
  register_rule("aten::select.int", select_rule);
  register_rule("aten::select_backward", select_backward_rule);
  register_rule("aten::split.Tensor", split_rule);
  register_rule("aten::unsafe_split.Tensor", split_rule);
  register_rule("aten::split_with_sizes", split_with_sizes_rule);
  register_rule("aten::unsafe_split_with_sizes", split_with_sizes_rule);
  register_rule("aten::unbind.int", unbind_rule);
  register_rule("aten::cat", cat_rule);
  register_rule("aten::stack", stack_rule);
  register_rule("aten::index_select", index_select_rule);
  register_rule("aten::index_add", index_add_rule);
  register_rule("aten::index_add_", index_add_rule);
  register_rule("aten::gather", gather_rule);
  register_rule("aten::scatter.src", scatter_src_rule);
  register_rule("aten::scatter_.src", scatter_src_rule);
  register_rule("aten::scatter.value", scatter_value_rule);
  register_rule("aten::scatter_.value", scatter_value_rule);
  register_rule("aten::scatter_add", scatter_add_rule);
  register_rule("aten::scatter_add_", scatter_add_rule);
  register_rule("aten::embedding", embedding_rule);
  register_rule("aten::embedding_dense_backward", embedding_backward_rule);
}};

}  // namespace

}  // namespace tessera::ops
