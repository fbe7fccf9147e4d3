// View-like ops: the output's sharding follows the input's through a dim map.
//
// NOTE: [View dim map]
// view/_unsafe_view split the shapes into blocks whose sizes multiply to the same number.
// A sharded input dim keeps its sharding iff it is the outermost non-trivial dim of its block
// (its shards are contiguous ranges of the block's flattened index) and every shard's range
// starts and ends on a row of the block's outermost non-trivial output dim; the shard table
// is rescaled by the inner sizes. Anything else is replicated first on that mesh dim. Views
// are linear, so Partial passes through. The local op runs with local sizes.
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/InferSize.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#include "tensor/out_form.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

struct Block {
  size_t in_lo, in_hi, out_lo, out_hi;  // [lo, hi) dim ranges
};

std::vector<Block> blocks_of(const std::vector<int64_t>& in, const std::vector<int64_t>& out) {
  std::vector<Block> blocks;
  const size_t ni = in.size(), no = out.size();
  size_t i = 0, o = 0;
  while (i < ni || o < no) {
    Block b{i, i, o, o};
    int64_t pi = i < ni ? in[i++] : 1;
    int64_t po = o < no ? out[o++] : 1;
    while (pi != po && (i < ni || o < no)) {
      if ((pi < po && i < ni) || o >= no)
        pi *= in[i++];
      else
        po *= out[o++];
    }
    b.in_hi = i;
    b.out_hi = o;
    blocks.push_back(b);
  }
  return blocks;
}

size_t outermost_nontrivial(const std::vector<int64_t>& s, size_t lo, size_t hi) {
  for (size_t d = lo; d < hi; ++d)
    if (s[d] != 1) return d;
  return lo;
}

struct ViewLayout {
  SpecPtr input;
  SpecPtr output;
};

ViewLayout view_layout(const DTensorSpec& in, const std::vector<int64_t>& out_sizes) {
  const auto& is = in.sizes();
  if (in.numel() == 0 && is != out_sizes) {
    // Nothing to keep in place: an empty tensor changes shape replicated.
    auto r = std::make_shared<DTensorSpec>(
        in.partial_as_replicate().with_placements(Placements(in.mesh().ndim(), Replicate())));
    return {r, std::make_shared<DTensorSpec>(in.mesh(), r->placements(), out_sizes, in.dtype())};
  }
  auto blocks = blocks_of(is, out_sizes);
  Placements in_p = in.placements(), out_p = in.placements();
  std::vector<ShardTable> out_tables(out_sizes.size());
  // Tensor dims can be sharded by several mesh dims; decide per tensor dim.
  for (int64_t t = 0; t < in.ndim(); ++t) {
    auto dims = in.mesh_dims_sharding(t);
    if (dims.empty()) continue;
    const Block* blk = nullptr;
    for (auto& b : blocks)
      if (static_cast<size_t>(t) >= b.in_lo && static_cast<size_t>(t) < b.in_hi) blk = &b;
    bool ok = blk && outermost_nontrivial(is, blk->in_lo, blk->in_hi) == static_cast<size_t>(t) &&
              blk->out_hi > blk->out_lo;
    size_t o = 0;
    ShardTable table;
    if (ok) {
      o = outermost_nontrivial(out_sizes, blk->out_lo, blk->out_hi);
      const int64_t inner_in = c10::multiply_integers(is.begin() + t + 1, is.begin() + blk->in_hi);
      const int64_t inner_out =
          c10::multiply_integers(out_sizes.begin() + o + 1, out_sizes.begin() + blk->out_hi);
      for (auto s : in.shard_table(t)) {
        const int64_t elems = s * inner_in;
        if (inner_out == 0 || elems % inner_out != 0)
          ok = false;
        else
          table.push_back(elems / inner_out);
      }
    }
    for (auto m : dims) {
      if (ok) {
        out_p[m] = Shard(static_cast<int64_t>(o));
      } else {
        in_p[m] = Replicate();
        out_p[m] = Replicate();
      }
    }
    if (ok) out_tables[o] = table;
  }
  std::vector<ShardTable> in_tables = in.shard_tables();
  for (int64_t t = 0; t < in.ndim(); ++t) {
    bool still = false;
    for (auto& x : in_p) still = still || x.is_shard(t);
    if (!still) in_tables[t].clear();
  }
  auto input = std::make_shared<DTensorSpec>(in.mesh(), in_p, in.sizes(), in.dtype(), in_tables);
  auto output = std::make_shared<DTensorSpec>(in.mesh(), out_p, out_sizes, in.dtype(), out_tables);
  return {input, output};
}

// The local op gets the output's local sizes for its `size` argument.
OpPlan with_local_size_arg(const OpCall& call, const ViewLayout& layout) {
  OpPlan plan(call);
  plan.input("self", layout.input).output(layout.output);
  plan.local_arg("size", c10::IValue(layout.output->local_sizes()));
  return plan;
}

// The global shape asked for by the `size` argument (one dim may be -1).
std::vector<int64_t> requested_size(const OpCall& call, const DTensorSpec& in) {
  return at::infer_size(call.arg<std::vector<int64_t>>("size"), in.numel());
}

OpPlan view_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  return with_local_size_arg(call, view_layout(in, requested_size(call, in)));
}

// The op's local form is a reshape to the output's local sizes: _reshape_alias (its stride
// argument is a global one) and squeeze (a shard may be size 1 where the global is not, so
// the local op could drop the wrong dims). A view when the shard allows, else a copy.
OpPlan reshaped_locally(const OpCall& call, const ViewLayout& layout) {
  OpPlan plan(call);
  plan.input("self", layout.input).output(layout.output);
  auto local = layout.output->local_sizes();
  plan.local_kernel = [local](KernelCall& k) { k.finish({k.tensor("self").reshape(local)}); };
  plan.place_dims.emplace();  // a row-major reshape of the shard: no place used
  return plan;
}

// _unsafe_view (matmul's and reshape's copy-then-view) reaches us without the typed view
// kernel's contiguity check (NOTE: [view of a strided shard]), so it reshapes locally.
OpPlan unsafe_view_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  return reshaped_locally(call, view_layout(in, requested_size(call, in)));
}

OpPlan reshape_alias_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  return reshaped_locally(call, view_layout(in, requested_size(call, in)));
}

// expand: new leading dims and size-1 dims broadcast; broadcast dims cannot stay sharded.
OpPlan expand_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  auto size = call.arg<std::vector<int64_t>>("size");
  const int64_t lead = static_cast<int64_t>(size.size()) - in.ndim();
  std::vector<int64_t> out(size.size());
  for (size_t d = 0; d < size.size(); ++d) {
    const int64_t t = static_cast<int64_t>(d) - lead;
    out[d] = (t >= 0 && size[d] == -1) ? in.sizes()[t] : size[d];
  }
  Placements in_p = in.placements(), out_p = in.placements();
  std::vector<ShardTable> in_tables = in.shard_tables(), out_tables(out.size());
  for (size_t m = 0; m < in_p.size(); ++m) {
    if (!in_p[m].is_shard()) continue;
    const int64_t t = in_p[m].dim();
    if (in.sizes()[t] != out[t + lead]) {
      in_p[m] = out_p[m] = Replicate();
      in_tables[t].clear();
      continue;
    }
    out_p[m] = Shard(t + lead);
    out_tables[t + lead] = in.shard_table(t);
  }
  ViewLayout layout{
      std::make_shared<DTensorSpec>(in.mesh(), in_p, in.sizes(), in.dtype(), in_tables),
      std::make_shared<DTensorSpec>(in.mesh(), out_p, out, in.dtype(), out_tables)};
  return with_local_size_arg(call, layout);
}

// unsqueeze: positional, so the local op keeps its arguments and shard dims at or after
// `dim` move up by one (a block map could pair a size-1 dim with the wrong neighbour).
OpPlan unsqueeze_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  const int64_t dim = c10::maybe_wrap_dim(call.arg<int64_t>("dim"), in.ndim() + 1);
  auto out = in.sizes();
  out.insert(out.begin() + dim, 1);
  Placements p = in.placements();
  std::vector<ShardTable> tables(out.size());
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    const int64_t t = x.dim() >= dim ? x.dim() + 1 : x.dim();
    tables[t] = in.shard_table(x.dim());
    x = Shard(t);
  }
  OpPlan plan(call);
  plan.output(std::make_shared<DTensorSpec>(in.mesh(), p, out, in.dtype(), tables));
  return plan;
}

// squeeze / squeeze.dim.
OpPlan squeeze_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  std::vector<bool> drop(in.ndim(), false);
  if (call.has("dim")) {
    // A 0-dim tensor accepts dim 0 or -1 and has nothing to drop.
    const int64_t dim = c10::maybe_wrap_dim(call.arg<int64_t>("dim"), in.ndim());
    if (in.ndim() > 0) drop[dim] = in.sizes()[dim] == 1;
  } else {
    for (int64_t t = 0; t < in.ndim(); ++t) drop[t] = in.sizes()[t] == 1;
  }
  std::vector<int64_t> out;
  for (int64_t t = 0; t < in.ndim(); ++t) {
    if (!drop[t]) out.push_back(in.sizes()[t]);
  }
  return reshaped_locally(call, view_layout(in, out));
}

// transpose / t / permute: shard dims follow the permutation; local args are positional.
OpPlan permute_layout(const OpCall& call, const std::vector<int64_t>& perm) {
  const auto& in = *call.spec("self");
  std::vector<int64_t> inv(perm.size()), out_sizes(perm.size());
  for (size_t o = 0; o < perm.size(); ++o) {
    inv[perm[o]] = static_cast<int64_t>(o);
    out_sizes[o] = in.sizes()[perm[o]];
  }
  Placements p = in.placements();
  std::vector<ShardTable> tables(perm.size());
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    tables[inv[x.dim()]] = in.shard_table(x.dim());
    x = Shard(inv[x.dim()]);
  }
  OpPlan plan(call);
  plan.output(std::make_shared<DTensorSpec>(in.mesh(), p, out_sizes, in.dtype(), tables));
  return plan;
}

// transpose.int(self, dim0, dim1) / t(self).
OpPlan transpose_rule(const OpCall& call) {
  const int64_t nd = call.spec("self")->ndim();
  std::vector<int64_t> perm(nd);
  std::iota(perm.begin(), perm.end(), 0);
  if (nd >= 2) {
    const bool dims = call.has("dim0");
    const int64_t a = c10::maybe_wrap_dim(dims ? call.arg<int64_t>("dim0") : 0, nd);
    const int64_t b = c10::maybe_wrap_dim(dims ? call.arg<int64_t>("dim1") : 1, nd);
    std::swap(perm[a], perm[b]);
  }
  return permute_layout(call, perm);
}

OpPlan permute_rule(const OpCall& call) {
  auto perm = call.arg<std::vector<int64_t>>("dims");
  const int64_t nd = call.spec("self")->ndim();
  for (auto& d : perm) d = c10::maybe_wrap_dim(d, nd);
  return permute_layout(call, perm);
}

// new_empty / new_zeros / ... : the requested global size; the input's layout when the size
// matches it (autograd allocates gradient buffers this way), else replicated.
OpPlan new_factory_rule(const OpCall& call) {
  const auto& in = *call.spec("self");
  auto size = call.arg<std::vector<int64_t>>("size");
  SpecPtr out = size == in.sizes()
                    ? std::make_shared<DTensorSpec>(in.partial_as_replicate())
                    : std::make_shared<DTensorSpec>(
                          in.mesh(), Placements(in.mesh().ndim(), Replicate()), size, in.dtype());
  OpPlan plan(call);
  plan.output(out);
  auto local = out->local_sizes();
  const bool strided = call.has("stride");  // new_empty_strided
  plan.local_kernel = [local, strided](KernelCall& k) {
    k.set("size", local);
    if (strided) {
      const auto strides = c10::contiguous_strides(local);
      k.set("stride", std::vector<int64_t>(strides.begin(), strides.end()));
    }
    k.call_op();
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule("aten::view", view_rule);
  register_rule("aten::_unsafe_view", unsafe_view_rule);
  register_rule("aten::_reshape_alias", reshape_alias_rule);
  register_rule("aten::expand", expand_rule);
  register_rule("aten::transpose.int", transpose_rule);
  register_rule("aten::t", transpose_rule);
  register_rule("aten::permute", permute_rule);
  register_rule("aten::unsqueeze", unsqueeze_rule);
  register_rule("aten::squeeze", squeeze_rule);
  register_rule("aten::squeeze.dim", squeeze_rule);
  for (const char* op : {"aten::new_empty", "aten::new_zeros", "aten::new_ones", "aten::new_full",
                         "aten::new_empty_strided"})
    register_rule(op, new_factory_rule);
}};

}  // namespace

}  // namespace tessera::ops
