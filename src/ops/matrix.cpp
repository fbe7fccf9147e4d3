// Matrix products as einsum strategies (mm "mk,kn->mn", bmm "bmk,bkn->bmn"): on each mesh
// dim, shard one label (operands that carry it shard it; a label missing from the output
// makes the output Partial(sum)), replicate, or pass a Partial operand through (the product
// is linear in each operand). The N-D combinations are costed and the cheapest is taken.
//
//   [out    | A      B     ]  mm, one mesh dim
//    S(0)   | S(0)   R        rows of A
//    S(1)   | R      S(1)     columns of B
//    P(sum) | S(1)   S(0)     contraction: partial sums, reduced later only if needed
//    R      | R      R
//    P(sum) | P(sum) R        and R, P(sum): linear in each operand
#include <map>

#include <c10/util/Exception.h>

#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

struct Einsum {
  std::vector<std::string> operands;  // labels per operand dim
  std::string output;
  std::vector<const char*> arg_names;  // the schema argument of each operand
};

// One choice per mesh dim: a label to shard, 'R', or 'p' + operand index for pass-through.
using Choice = std::pair<char, int>;

std::vector<Choice> choices_for(const Einsum& e) {
  std::vector<Choice> out = {{'R', -1}};
  std::string labels;
  for (auto& o : e.operands)
    for (char c : o)
      if (labels.find(c) == std::string::npos) labels += c;
  for (char c : labels) out.push_back({c, -1});
  for (size_t i = 0; i < e.operands.size(); ++i) out.push_back({'p', static_cast<int>(i)});
  return out;
}

// The table a label should use: an operand already sharding that label's dim with exactly
// these mesh dims keeps its boundaries; otherwise the chunk layout.
ShardTable label_table(const OpCall& call, const Einsum& e, char label,
                       const std::vector<int64_t>& mesh_dims) {
  for (size_t i = 0; i < e.operands.size(); ++i) {
    const auto* s = call.spec(e.arg_names[i]);
    const auto pos = e.operands[i].find(label);
    if (!s || pos == std::string::npos) continue;
    if (s->mesh_dims_sharding(static_cast<int64_t>(pos)) == mesh_dims)
      return s->shard_table(static_cast<int64_t>(pos));
  }
  return {};
}

std::vector<Strategy> einsum_strategies(const OpCall& call, const Einsum& e) {
  const auto& ref = call.first();
  const auto& mesh = ref.mesh();
  const int64_t nd = mesh.ndim();
  std::map<char, int64_t> label_size;
  for (size_t i = 0; i < e.operands.size(); ++i) {
    const auto& sizes = call.spec(e.arg_names[i])->sizes();
    for (size_t d = 0; d < e.operands[i].size(); ++d) {
      auto [it, fresh] = label_size.emplace(e.operands[i][d], sizes[d]);
      TORCH_CHECK(fresh || it->second == sizes[d] || sizes[d] == 1 || it->second == 1,
                  "tessera: ", call.describe(), ": sizes of '", e.operands[i][d], "' disagree (",
                  it->second, " vs ", sizes[d], ")");
    }
  }
  const auto options = choices_for(e);
  std::vector<Strategy> out;
  std::vector<size_t> pick(nd, 0);
  while (true) {
    std::vector<Placements> in_p(e.operands.size(), Placements(nd, Replicate()));
    Placements out_p(nd, Replicate());
    std::map<char, std::vector<int64_t>> sharded_by;
    bool valid = true;
    for (int64_t m = 0; m < nd; ++m) {
      auto [c, op] = options[pick[m]];
      if (c == 'R') continue;
      if (c == 'p') {
        // Only an operand that already holds partial sums passes them through.
        if (call.spec(e.arg_names[op])->placement(m) != Partial()) valid = false;
        in_p[op][m] = Partial();
        out_p[m] = Partial();
        continue;
      }
      sharded_by[c].push_back(m);
      for (size_t i = 0; i < e.operands.size(); ++i) {
        auto pos = e.operands[i].find(c);
        if (pos != std::string::npos) {
          // A broadcast (size-1) dim of a batched operand cannot be split with the others.
          if (call.spec(e.arg_names[i])->sizes()[pos] != label_size[c]) valid = false;
          in_p[i][m] = Shard(static_cast<int64_t>(pos));
        }
      }
      auto opos = e.output.find(c);
      out_p[m] = opos == std::string::npos ? Partial() : Shard(static_cast<int64_t>(opos));
    }
    if (valid) {
      Strategy s;
      s.inputs.resize(call.args.size());
      for (size_t i = 0; i < e.operands.size(); ++i) {
        const auto& sp = *call.spec(e.arg_names[i]);
        std::vector<ShardTable> tables(sp.ndim());
        for (auto& [c, dims] : sharded_by) {
          auto pos = e.operands[i].find(c);
          if (pos != std::string::npos) tables[pos] = label_table(call, e, c, dims);
        }
        s.inputs[call.index(e.arg_names[i])] =
            std::make_shared<DTensorSpec>(mesh, in_p[i], sp.sizes(), sp.dtype(), tables);
      }
      std::vector<int64_t> out_sizes;
      std::vector<ShardTable> out_tables;
      for (char c : e.output) {
        out_sizes.push_back(label_size[c]);
        out_tables.push_back(sharded_by.count(c) ? label_table(call, e, c, sharded_by[c])
                                                 : ShardTable{});
      }
      s.outputs.push_back(
          std::make_shared<DTensorSpec>(mesh, out_p, out_sizes, ref.dtype(), out_tables));
      out.push_back(std::move(s));
    }
    int64_t m = 0;
    while (m < nd && ++pick[m] == options.size()) pick[m++] = 0;
    if (m == nd) break;
  }
  return out;
}

OpPlan mm_rule(const OpCall& call) {
  TORCH_CHECK(call.spec("self") && call.spec("mat2"), "tessera: ", call.describe(),
              ": both operands must be tensors");
  return cheapest(call, einsum_strategies(call, {{"mk", "kn"}, "mn", {"self", "mat2"}}));
}

OpPlan bmm_rule(const OpCall& call) {
  return cheapest(call, einsum_strategies(call, {{"bmk", "bkn"}, "bmn", {"self", "mat2"}}));
}

// addmm(self, m1, m2): beta*self + alpha*m1@m2. self follows the product's layout (its
// broadcast dims replicated; a Partial product makes it Partial too: it is linear in self).
OpPlan add_product_rule(const OpCall& call, const Einsum& e) {
  auto strategies = einsum_strategies(call, e);
  // A plain (0-dim) self contributes nothing to the layout.
  if (const auto* self_spec = call.spec("self")) {
    const auto& self = *self_spec;
    for (auto& s : strategies) {
      const auto& out = *s.outputs[0];
      const int64_t shift = out.ndim() - self.ndim();
      Placements p = out.placements();
      std::vector<ShardTable> tables(self.ndim());
      for (auto& x : p) {
        if (!x.is_shard()) continue;
        const int64_t t = x.dim() - shift;
        if (t < 0 || self.sizes()[t] != out.sizes()[x.dim()]) {
          x = Replicate();
        } else {
          tables[t] = out.shard_table(x.dim());
          x = Shard(t);
        }
      }
      s.inputs[call.index("self")] =
          std::make_shared<DTensorSpec>(out.mesh(), p, self.sizes(), self.dtype(), tables);
    }
  }
  return cheapest(call, strategies);
}

OpPlan addmm_rule(const OpCall& call) {
  return add_product_rule(call, {{"mk", "kn"}, "mn", {"mat1", "mat2"}});
}
OpPlan baddbmm_rule(const OpCall& call) {
  return add_product_rule(call, {{"bmk", "bkn"}, "bmn", {"batch1", "batch2"}});
}

OpPlan mv_rule(const OpCall& call) {
  return cheapest(call, einsum_strategies(call, {{"mk", "k"}, "m", {"self", "vec"}}));
}
OpPlan dot_rule(const OpCall& call) {
  return cheapest(call, einsum_strategies(call, {{"k", "k"}, "", {"self", "tensor"}}));
}

const RuleRegistrar registrar{[] {
  register_rule("aten::mm", mm_rule);
  register_rule("aten::mm.out", mm_rule);
  register_rule("aten::bmm", bmm_rule);
  register_rule("aten::bmm.out", bmm_rule);
  register_rule("aten::addmm", addmm_rule);
  register_rule("aten::addmm.out", addmm_rule);
  register_rule("aten::addmm_", addmm_rule);
  register_rule("aten::baddbmm", baddbmm_rule);
  register_rule("aten::baddbmm_", baddbmm_rule);
  register_rule("aten::mv", mv_rule);
  register_rule("aten::dot", dot_rule);
}};

}  // namespace

}  // namespace tessera::ops
