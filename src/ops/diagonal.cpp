// Diagonals of matrices: diagonal / diagonal_copy (+ backward), diag, trace (+ backward).
// diagonal makes its two dims whole (NOTE: [Dim-wise ops]); diag gathers; trace stays sharded:
// each rank sums the part of the diagonal inside its block, Partial(sum). trace_backward, which
// autograd builds from plain buffers, is a kernel at the distributed-tensor key (NOTE: [How to
// add an op], case 2).
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

int64_t diagonal_length(int64_t n1, int64_t n2, int64_t offset) {
  const int64_t len = offset >= 0 ? std::min(n1, n2 - offset) : std::min(n1 + offset, n2);
  return std::max<int64_t>(len, 0);
}

// diagonal(self, offset, dim1, dim2): both dims whole; they leave, the diagonal is appended.
OpPlan diagonal_rule(const OpCall& call) {
  const auto& self = self_of(call);
  const int64_t nd = self.ndim();
  const int64_t d1 = wrap_dim(call.arg<int64_t>("dim1"), nd),
                d2 = wrap_dim(call.arg<int64_t>("dim2"), nd);
  auto in = whole_along(self, {d1, d2});
  Placements p = in->placements();
  for (auto& x : p)
    if (x.is_shard()) x = Shard(x.dim() - (x.dim() > d1) - (x.dim() > d2));
  std::vector<int64_t> sizes;
  std::vector<ShardTable> tables;
  for (int64_t t = 0; t < nd; ++t) {
    if (t == d1 || t == d2) continue;
    sizes.push_back(in->sizes()[t]);
    tables.push_back(in->shard_table(t));
  }
  sizes.push_back(diagonal_length(in->sizes()[d1], in->sizes()[d2], call.arg<int64_t>("offset")));
  tables.emplace_back();
  return along(call, {d1, d2},
               std::make_shared<DTensorSpec>(in->mesh(), p, sizes, in->dtype(), tables));
}

// diagonal_backward(grad_output, input_sizes, offset, dim1, dim2): the diagonal dim whole; the
// other dims keep their shards at their places in the input.
OpPlan diagonal_backward_rule(const OpCall& call) {
  const auto* g = call.spec("grad_output");
  TORCH_INTERNAL_ASSERT(g, call.describe());
  const auto sizes = call.arg<std::vector<int64_t>>("input_sizes");
  const int64_t nd = static_cast<int64_t>(sizes.size());
  const int64_t d1 = wrap_dim(call.arg<int64_t>("dim1"), nd),
                d2 = wrap_dim(call.arg<int64_t>("dim2"), nd);
  auto in = whole_along(*g, {g->ndim() - 1});
  std::vector<int64_t> to_input;  // grad dim -> input dim
  for (int64_t t = 0; t < nd; ++t)
    if (t != d1 && t != d2) to_input.push_back(t);
  Placements p = in->placements();
  std::vector<ShardTable> tables(nd);
  for (auto& x : p) {
    if (!x.is_shard()) continue;
    tables[to_input[x.dim()]] = in->shard_table(x.dim());
    x = Shard(to_input[x.dim()]);
  }
  return with_local_sizes(call, "grad_output", in,
                          std::make_shared<DTensorSpec>(in->mesh(), p, sizes, in->dtype(), tables));
}

// trace(self): each rank sums the diagonal entries inside its block; mesh dims that shard
// either dim give Partial(sum). Partial(sum) inputs pass through (trace is linear).
OpPlan trace_rule(const OpCall& call) {
  const auto& self = self_of(call);
  TORCH_CHECK(self.ndim() == 2, "tessera: ", call.describe(), ": trace needs a matrix");
  auto in = std::make_shared<DTensorSpec>(self.replicate_where([](int64_t, const Placement& x) {
    return x.is_partial() && x.reduce_op() != PartialOp::Sum;
  }));
  Placements out(in->mesh().ndim(), Replicate());
  for (int64_t m = 0; m < in->mesh().ndim(); ++m)
    if (!in->placement(m).is_replicate()) out[m] = Partial();
  OpPlan plan(call);
  plan.input("self", in);
  plan.output(std::make_shared<DTensorSpec>(in->mesh(), out, std::vector<int64_t>{}, in->dtype()));
  const auto off = in->local_offsets();
  const int64_t shift = off[0] - off[1];  // local (a, a + shift) is global (r0 + a, r0 + a)
  plan.local_kernel = [shift](KernelCall& k) {
    k.finish({at::sum(k.tensor("self").diagonal(shift))});
  };
  return plan;
}

// trace_backward(grad, sizes): the gradient times the identity pattern, replicated (the
// forward input's layout is not known here).
void trace_backward_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::Stack args = torch::jit::pop(*stack, op.schema().arguments().size());
  KernelCall k(op, args);
  const at::Tensor grad = k.tensor("grad");
  const auto sizes = k.arg("sizes").toIntVector();
  TORCH_CHECK(sizes.size() == 2, "tessera: aten::trace_backward: expected a matrix, got sizes ",
              shape_str(sizes));
  // A plain tensor next to a distributed one is a replicated value (docs/design.md).
  const at::Tensor eye = at::eye(sizes[0], sizes[1], grad.options().device(grad.device()));
  stack->emplace_back(grad * eye);
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::diagonal", "aten::diagonal_copy"}) register_rule(op, diagonal_rule);
  register_rule("aten::diagonal_backward", diagonal_backward_rule);
  // diag turns a vector into a matrix and back: gathered.
  register_rule("aten::diag", computed_replicated);
  register_rule("aten::trace", trace_rule);
  register_kernel("aten::trace_backward",
                  torch::CppFunction::makeFromBoxedFunction<&trace_backward_kernel>());
}};

}  // namespace

}  // namespace tessera::ops
