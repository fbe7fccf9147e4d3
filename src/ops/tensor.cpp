// Slicing and joining ops: slice/narrow/select, split/chunk/unbind, cat/stack, and the
// backward ops autograd emits for them (slice_backward, select_backward; the others decompose
// into ops listed here). Gathers, scatters and embedding are in index.cpp.
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
// Backward ops do not see the forward input's layout (only its global sizes): the gradient's
// shardings are mirrored through the op (slice_backward picks an input table whose cut is the
// gradient's table, select_backward inserts an unsharded dim), and a Replicate gradient gives
// a Replicate result.
#include <algorithm>
#include <limits>

#include <ATen/ceil_div.h>

#include "tensor_layout.h"

namespace tessera::ops {

namespace {

using namespace layout;

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

// Per piece of `table`, the run [k0, k1) of selected elements it holds.
struct Run {
  int64_t k0, k1;
};
std::vector<Run> selected_runs(const ShardTable& table, const Selection& s) {
  // The number of selected elements before global position x (the ceiling of a division;
  // positions before the selection's start hold none).
  auto before = [&](int64_t x) { return at::ceil_div(std::max<int64_t>(x - s.start, 0), s.step); };
  std::vector<Run> out;
  int64_t o = 0;
  for (auto n : table) {
    const int64_t k0 = std::clamp<int64_t>(before(o), 0, s.len);
    const int64_t k1 = std::clamp<int64_t>(before(o + n), k0, s.len);
    out.push_back({k0, k1});
    o += n;
  }
  return out;
}

ShardTable run_lengths(const std::vector<Run>& runs) {
  ShardTable t;
  for (auto& r : runs) t.push_back(r.k1 - r.k0);
  return t;
}

// This rank's run of the selection along tensor dim t, in local coordinates (start within
// its piece, count).
struct LocalCut {
  int64_t start = 0, len = 0;
  // The exclusive end of a slice that takes this run with `step`.
  int64_t end(int64_t step) const { return len ? start + (len - 1) * step + 1 : start; }
};
LocalCut local_cut(const DTensorSpec& s, int64_t t, const Selection& sel) {
  const auto dims = s.mesh_dims_sharding(t);
  if (dims.empty()) return {sel.start, sel.len};
  const auto runs = selected_runs(s.shard_table(t), sel);
  const auto& r = runs.at(tessera::detail::table_index(s.mesh(), dims, s.mesh().coordinate()));
  if (r.k1 == r.k0) return {0, 0};
  return {sel.at(r.k0) - s.local_offsets()[t], r.k1 - r.k0};
}

// The layout of selecting `sel` along d: same placements; a sharded d gets the cut table.
SpecPtr sliced_spec(const DTensorSpec& in, int64_t d, const Selection& sel) {
  auto sizes = in.sizes();
  sizes[d] = sel.len;
  auto tables = in.shard_tables();
  if (!tables[d].empty()) tables[d] = run_lengths(selected_runs(tables[d], sel));
  return std::make_shared<DTensorSpec>(in.mesh(), in.placements(), sizes, in.dtype(), tables);
}

// slice.Tensor(self, dim, start, end, step): see NOTE: [Slicing a sharded dim].
OpPlan slice_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  const int64_t d = dim_arg(call, in.ndim());
  const int64_t step = call.arg<int64_t>("step");
  const auto sel = slice_selection(in.sizes()[d], call.arg<c10::optional<int64_t>>("start"),
                                   call.arg<c10::optional<int64_t>>("end"), step);
  OpPlan plan(call);
  plan.output(sliced_spec(in, d, sel));
  // The whole dim (rope_cos[:S] with S its length): every shard whole, the call's own bounds
  // clamp to it; no place is read, so a head-tail dim keeps its order.
  const bool whole = sel.start == 0 && sel.step == 1 && sel.len == in.sizes()[d];
  if (in.mesh_dims_sharding(d).empty() || whole) return plan;
  const auto mine = local_cut(in, d, sel);
  plan.local_kernel = [mine, step](KernelCall& k) {
    k.set("start", mine.start);
    k.set("end", mine.end(step));
    k.call_op();
  };
  plan.place_dims = std::vector<int64_t>{d};  // the cut along d only
  return plan;
}

// narrow_copy(self, dim, start, length).
OpPlan narrow_copy_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  const int64_t d = dim_arg(call, in.ndim());
  int64_t start = call.arg<int64_t>("start");
  if (start < 0) start += in.sizes()[d];
  const Selection sel{start, 1, call.arg<int64_t>("length")};
  TORCH_CHECK(start >= 0 && sel.len >= 0 && start + sel.len <= in.sizes()[d],
              "tessera: ", call.describe(), ": narrow range out of bounds");
  OpPlan plan(call);
  plan.output(sliced_spec(in, d, sel));
  if (in.mesh_dims_sharding(d).empty()) return plan;
  const auto mine = local_cut(in, d, sel);
  plan.local_kernel = [mine](KernelCall& k) {
    k.set("start", mine.start);
    k.set("length", mine.len);
    k.call_op();
  };
  return plan;
}

// slice_backward(grad_output, input_sizes, dim, start, end, step): zeros of input_sizes with
// the gradient written into the slice. A gradient sharded on dim needs an input table whose
// cut is the gradient's table: piece j must start after the last selected element of piece
// j-1 and at or before its own first one; within those bounds the chunk boundaries are taken
// (so the chunk layout comes back exactly where the forward input had it).
OpPlan slice_backward_rule(const OpCall& call) {
  const auto& g = *call.spec("grad_output");
  auto in_sizes = call.arg<std::vector<int64_t>>("input_sizes");
  const int64_t d = dim_arg(call, static_cast<int64_t>(in_sizes.size()));
  const int64_t step = call.arg<int64_t>("step");
  const auto sel =
      slice_selection(in_sizes[d], call.arg<int64_t>("start"), call.arg<int64_t>("end"), step);
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
    TORCH_CHECK(run_lengths(selected_runs(t, sel)) == gt, "tessera: ", call.describe(),
                ": no input table reproduces the gradient's (rule bug)");
    tables[d] = t;
  }
  auto out = std::make_shared<DTensorSpec>(g.mesh(), g.placements(), in_sizes, g.dtype(), tables);
  OpPlan plan(call);
  plan.output(out);
  const c10::IValue local(out->local_sizes());
  const auto mine = local_cut(*out, d, sel);
  plan.local_kernel = [local, mine, step](KernelCall& k) {
    k.set("input_sizes", local);
    k.set("start", mine.start);
    k.set("end", mine.end(step));
    k.call_op();
  };
  plan.place_dims = std::vector<int64_t>{d};  // the cut along d; other dims are local sizes
  return plan;
}

// select.int(self, dim, index).
OpPlan select_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  const int64_t d = dim_arg(call, in.ndim());
  const int64_t size = in.sizes()[d];
  int64_t index = call.arg<int64_t>("index");
  TORCH_CHECK(index >= -size && index < size, "tessera: ", call.describe(), ": index ", index,
              " out of range for size ", size);
  if (index < 0) index += size;
  const auto dims = in.mesh_dims_sharding(d);
  const bool partial = !dims.empty() && in.dtype() != at::kBool && only_sum_partials(in);
  SpecPtr target;
  if (!partial && !dims.empty())
    target = std::make_shared<DTensorSpec>(
        in.replicate_where([d](int64_t, const Placement& x) { return x.is_shard(d); }));
  const auto& src = target ? *target : in;
  Placements p = src.placements();
  auto tables = src.shard_tables();
  auto sizes = src.sizes();
  drop_dim(p, tables, d, Partial());
  sizes.erase(sizes.begin() + d);
  auto out = std::make_shared<DTensorSpec>(in.mesh(), p, sizes, in.dtype(), tables);
  OpPlan plan(call);
  plan.input("self", target).output(out);
  if (!partial) return plan;
  const int64_t off = in.local_offsets()[d], n = in.local_sizes()[d];
  const auto local = out->local_sizes();
  plan.local_kernel = [off, n, index, local](KernelCall& k) {
    if (index >= off && index < off + n) {
      k.set("index", index - off);
      k.call_op();
      return;
    }
    k.finish({at::zeros(local, k.tensor("self").options())});
  };
  return plan;
}

// select_backward(grad_output, input_sizes, dim, index): the gradient's layout with dim
// inserted.
OpPlan select_backward_rule(const OpCall& call) {
  const auto& g = *call.spec("grad_output");
  auto in_sizes = call.arg<std::vector<int64_t>>("input_sizes");
  const int64_t d = dim_arg(call, static_cast<int64_t>(in_sizes.size()));
  Placements p = g.placements();
  auto tables = g.shard_tables();
  insert_dim(p, tables, d);
  auto out = std::make_shared<DTensorSpec>(g.mesh(), p, in_sizes, g.dtype(), tables);
  OpPlan plan(call);
  plan.output(out);
  const c10::IValue local(out->local_sizes());
  plan.local_kernel = [local](KernelCall& k) {
    k.set("input_sizes", local);
    k.call_op();
  };
  return plan;
}

// ---- split / unbind ------------------------------------------------------------------------

OpPlan split_pieces(const OpCall& call, int64_t d, const std::vector<int64_t>& pieces) {
  const auto& in = *call.spec("self");
  OpPlan plan(call);
  std::vector<int64_t> local;
  int64_t start = 0;
  for (auto len : pieces) {
    const Selection sel{start, 1, len};
    plan.output(sliced_spec(in, d, sel));
    local.push_back(local_cut(in, d, sel).len);
    start += len;
  }
  TORCH_CHECK(start == in.sizes()[d], "tessera: ", call.describe(), ": split sizes sum to ", start,
              ", not ", in.sizes()[d]);
  if (in.mesh_dims_sharding(d).empty()) return plan;
  const bool unsafe = call.name().find("unsafe") != std::string::npos;
  plan.local_kernel = [local, d, unsafe](KernelCall& k) {
    const at::Tensor x = k.tensor("self");
    k.finish(
        {unsafe ? at::unsafe_split_with_sizes(x, local, d) : at::split_with_sizes(x, local, d)});
  };
  return plan;
}

// split.Tensor / unsafe_split.Tensor(self, split_size, dim).
OpPlan split_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  const int64_t d = dim_arg(call, in.ndim());
  const int64_t size = in.sizes()[d], split = call.arg<int64_t>("split_size");
  TORCH_CHECK(split > 0 || size == 0, "tessera: ", call.describe(),
              ": split_size must be positive, got ", split);
  const int64_t n = split > 0 ? std::max<int64_t>((size + split - 1) / split, 1) : 1;
  std::vector<int64_t> pieces(n, split);
  pieces.back() = size - split * (n - 1);
  return split_pieces(call, d, pieces);
}

// split_with_sizes / unsafe_split_with_sizes(self, split_sizes, dim).
OpPlan split_with_sizes_rule(const OpCall& call) {
  const int64_t d = dim_arg(call, call.spec("self")->ndim());
  return split_pieces(call, d, call.arg<std::vector<int64_t>>("split_sizes"));
}

// unbind.int(self, dim): every row is a result, so a sharded dim is replicated first.
OpPlan unbind_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  const int64_t d = dim_arg(call, in.ndim());
  SpecPtr target;
  if (!in.mesh_dims_sharding(d).empty())
    target = std::make_shared<DTensorSpec>(
        in.replicate_where([d](int64_t, const Placement& x) { return x.is_shard(d); }));
  const auto& src = target ? *target : in;
  Placements p = src.placements();
  auto tables = src.shard_tables();
  auto sizes = src.sizes();
  drop_dim(p, tables, d, Replicate());
  sizes.erase(sizes.begin() + d);
  auto out = std::make_shared<DTensorSpec>(in.mesh(), p, sizes, in.dtype(), tables);
  OpPlan plan(call);
  plan.input("self", target);
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

// The plan's per-element layouts of the `tensors` list argument (cat, stack).
std::vector<SpecPtr>& tensors_inputs(const OpCall& call, OpPlan& plan) {
  plan.list_inputs.resize(call.args.size());
  return plan.list_inputs[call.index("tensors")];
}

// cat(tensors, dim): see NOTE: [Slicing a sharded dim]. Other dims take the first
// distributed element's layout.
OpPlan cat_rule(const OpCall& call) {
  const auto& specs = call.list_specs.at(call.index("tensors"));
  // Legacy: 1-d empty tensors are skipped by cat whatever the others' shape.
  auto legacy_empty = [](const DTensorSpec* s) { return s->ndim() == 1 && s->sizes()[0] == 0; };
  const DTensorSpec* first = &call.first();
  for (const auto* s : specs)
    if (legacy_empty(first) && s && !legacy_empty(s)) first = s;
  const auto& ref = *first;
  const auto& mesh = ref.mesh();
  const int64_t nd = ref.ndim();
  const int64_t d = dim_arg(call, nd);
  auto skipped = [&](const DTensorSpec* s) { return !s || (nd != 1 && legacy_empty(s)); };
  std::vector<int64_t> begin(specs.size(), 0);
  int64_t total = 0;
  std::vector<const DTensorSpec*> joined;
  for (size_t k = 0; k < specs.size(); ++k) {
    begin[k] = total;
    if (skipped(specs[k])) continue;
    TORCH_CHECK(specs[k]->ndim() == nd, "tessera: ", call.describe(),
                ": tensors with different numbers of dims (", nd, " and ", specs[k]->ndim(), ")");
    total += specs[k]->sizes()[d];
    joined.push_back(specs[k]);
  }
  const Placements p = join_placements(ref, joined);
  auto out_sizes = ref.sizes();
  out_sizes[d] = total;
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t)
    if (t != d) tables[t] = fit_table(mesh, p, t, out_sizes[t], ref.shard_table(t));
  const auto dims = shard_mesh_dims(p, d);
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
      consistent = run_lengths(selected_runs(acc, range)) == specs[k]->shard_table(d);
    }
    tables[d] = consistent && !acc.empty() ? acc : chunk_table(mesh, p, d, total);
  }
  OpPlan plan(call);
  auto& elements = tensors_inputs(call, plan);
  for (size_t k = 0; k < specs.size(); ++k) {
    const auto* s = specs[k];
    if (!s) {
      elements.push_back(nullptr);
      continue;
    }
    if (skipped(s)) {
      elements.push_back(replicated(*s));
      continue;
    }
    auto tk = tables;
    if (!dims.empty()) tk[d] = run_lengths(selected_runs(tables[d], {begin[k], 1, s->sizes()[d]}));
    elements.push_back(std::make_shared<DTensorSpec>(mesh, p, s->sizes(), s->dtype(), tk));
  }
  plan.output(std::make_shared<DTensorSpec>(mesh, p, out_sizes, ref.dtype(), tables));
  return plan;
}

// stack(tensors, dim): every element in the first distributed element's layout; the new dim
// is unsharded and shard dims after it shift.
OpPlan stack_rule(const OpCall& call) {
  const auto& ref = call.first();
  const auto& mesh = ref.mesh();
  const auto& specs = call.list_specs.at(call.index("tensors"));
  const int64_t nd = ref.ndim();
  const int64_t d = dim_arg(call, nd + 1);
  Placements p = join_placements(ref, specs);
  std::vector<ShardTable> tables(nd);
  for (int64_t t = 0; t < nd; ++t)
    tables[t] = fit_table(mesh, p, t, ref.sizes()[t], ref.shard_table(t));
  OpPlan plan(call);
  auto& elements = tensors_inputs(call, plan);
  for (const auto* s : specs) {
    TORCH_CHECK(!s || s->sizes() == ref.sizes(), "tessera: ", call.describe(),
                ": stack needs equal shapes");
    elements.push_back(s ? std::make_shared<DTensorSpec>(mesh, p, s->sizes(), s->dtype(), tables)
                         : nullptr);
  }
  auto out_sizes = ref.sizes();
  out_sizes.insert(out_sizes.begin() + d, static_cast<int64_t>(specs.size()));
  insert_dim(p, tables, d);
  plan.output(std::make_shared<DTensorSpec>(mesh, p, out_sizes, ref.dtype(), tables));
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
}};

}  // namespace

}  // namespace tessera::ops
