// _trilinear: the product behind bilinear (nn::Bilinear) and its own backward.
//
// _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim) lines the three
// inputs up in one common rank (input k fills the common dims not listed in expandk, in
// order), multiplies them and sums the common dims in sumdim; the rest are the output's. It
// is an einsum, so a mesh dim may shard one common dim on every input that has it: an output
// dim gives a sharded output, a summed one a Partial(sum) output. Inputs without that dim
// stay whole on that mesh dim. The product is linear in each input, so one Partial(sum)
// input passes through when the others are whole there. The cheapest candidate is taken.
//
//   bilinear(x1 [B, I], x2 [B, J], W [O, I, J]) = _trilinear(x1, W, x2, {1,3}, {0}, {1,2}, {2,3})
//     x1 S(0), x2 S(0), W R     -> S(0)     data parallel
//     x1 R,    x2 R,    W S(0)  -> S(1)     output features
//     x1 S(1), x2 R,    W S(1)  -> P(sum)   contraction over I
#include <algorithm>

#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

constexpr const char* kInputs[3] = {"i1", "i2", "i3"};
constexpr const char* kExpands[3] = {"expand1", "expand2", "expand3"};

struct Layout {
  int64_t rank = 0;
  std::vector<std::vector<int64_t>> common_of;  // per input: the common dim of each own dim
  std::vector<int64_t> output_common;           // per output dim: its common dim
  std::vector<int64_t> common_size;
};

Layout layout_of(const OpCall& call) {
  Layout l;
  const auto& first = *call.spec(kInputs[0]);
  l.rank = first.ndim() + static_cast<int64_t>(call.arg<std::vector<int64_t>>(kExpands[0]).size());
  l.common_size.assign(l.rank, 1);
  for (int k = 0; k < 3; ++k) {
    const auto expand = call.arg<std::vector<int64_t>>(kExpands[k]);
    const auto& sizes = call.spec(kInputs[k])->sizes();
    std::vector<int64_t> dims;
    for (int64_t c = 0; c < l.rank; ++c)
      if (std::find(expand.begin(), expand.end(), c) == expand.end()) dims.push_back(c);
    TORCH_CHECK(dims.size() == sizes.size(), "tessera: ", call.describe(), ": input ", k + 1,
                " does not fill the common rank");
    for (size_t d = 0; d < dims.size(); ++d)
      l.common_size[dims[d]] = std::max(l.common_size[dims[d]], sizes[d]);
    l.common_of.push_back(std::move(dims));
  }
  const auto sumdim = call.arg<std::vector<int64_t>>("sumdim");
  for (int64_t c = 0; c < l.rank; ++c)
    if (std::find(sumdim.begin(), sumdim.end(), c) == sumdim.end()) l.output_common.push_back(c);
  return l;
}

// The own dim of input k at common dim c, or -1.
int64_t own_dim(const Layout& l, int k, int64_t c) {
  const auto& dims = l.common_of[k];
  auto it = std::find(dims.begin(), dims.end(), c);
  return it == dims.end() ? -1 : static_cast<int64_t>(it - dims.begin());
}

// One choice per mesh dim: -1 replicate, 0..rank-1 shard that common dim, rank + k pass
// input k's Partial(sum) through.
std::vector<Strategy> strategies(const OpCall& call, const Layout& l) {
  const auto& mesh = call.first().mesh();
  const int64_t nd = mesh.ndim();
  std::vector<const DTensorSpec*> in(3);
  for (int k = 0; k < 3; ++k) in[k] = call.spec(kInputs[k]);
  const int64_t options = 1 + l.rank + 3;
  std::vector<Strategy> out;
  std::vector<int64_t> pick(nd, 0);
  while (true) {
    bool valid = true;
    std::vector<Placements> pin(3, Placements(nd, Replicate()));
    Placements pout(nd, Replicate());
    std::vector<int64_t> sharded_common;  // per mesh dim, or -1
    for (int64_t m = 0; m < nd; ++m) {
      const int64_t choice = pick[m] - 1;
      sharded_common.push_back(-1);
      if (choice < 0) continue;
      if (choice >= l.rank) {
        const int k = static_cast<int>(choice - l.rank);
        if (in[k]->placement(m) != Partial()) valid = false;
        pin[k][m] = pout[m] = Partial();
        continue;
      }
      // Every input holding this common dim holds all of it (no size-1 broadcast), and no
      // other mesh dim already shards it (its table would nest).
      for (int64_t other : sharded_common)
        if (other == choice) valid = false;
      sharded_common.back() = choice;
      for (int k = 0; k < 3; ++k) {
        const int64_t d = own_dim(l, k, choice);
        if (d < 0) continue;
        if (in[k]->sizes()[d] != l.common_size[choice]) valid = false;
        pin[k][m] = Shard(d);
      }
      auto it = std::find(l.output_common.begin(), l.output_common.end(), choice);
      pout[m] = it == l.output_common.end()
                    ? Partial()
                    : Shard(static_cast<int64_t>(it - l.output_common.begin()));
    }
    if (valid) {
      // Tables: a sharded common dim keeps the boundaries of the first input that already
      // has them on that mesh dim; else the chunk layout.
      std::vector<ShardTable> common_table(l.rank);
      for (int64_t m = 0; m < nd; ++m) {
        const int64_t c = sharded_common[m];
        if (c < 0) continue;
        for (int k = 0; k < 3 && common_table[c].empty(); ++k) {
          const int64_t d = own_dim(l, k, c);
          if (d >= 0 && in[k]->mesh_dims_sharding(d) == std::vector<int64_t>{m})
            common_table[c] = in[k]->shard_table(d);
        }
      }
      Strategy s;
      s.inputs.resize(call.args.size());
      for (int k = 0; k < 3; ++k) {
        std::vector<ShardTable> tables(in[k]->ndim());
        for (int64_t d = 0; d < in[k]->ndim(); ++d) tables[d] = common_table[l.common_of[k][d]];
        s.inputs[call.index(kInputs[k])] = std::make_shared<DTensorSpec>(
            mesh, pin[k], in[k]->sizes(), in[k]->dtype(), std::move(tables));
      }
      std::vector<int64_t> out_sizes;
      std::vector<ShardTable> out_tables;
      for (int64_t c : l.output_common) {
        out_sizes.push_back(l.common_size[c]);
        out_tables.push_back(common_table[c]);
      }
      s.outputs.push_back(std::make_shared<DTensorSpec>(mesh, pout, out_sizes, in[0]->dtype(),
                                                        std::move(out_tables)));
      out.push_back(std::move(s));
    }
    int64_t m = 0;
    while (m < nd && ++pick[m] == options) pick[m++] = 0;
    if (m == nd) break;
  }
  return out;
}

OpPlan trilinear_rule(const OpCall& call) {
  for (const char* name : kInputs)
    if (!call.spec(name)) return replicate_everything(call);  // a plain input: keep it simple
  const Layout l = layout_of(call);
  return cheapest(call, strategies(call, l));
}

const RuleRegistrar registrar{[] { register_rule("aten::_trilinear", trilinear_rule); }};

}  // namespace

}  // namespace tessera::ops
