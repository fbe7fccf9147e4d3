// loss_parallel: cross entropy on class-sharded logits (see loss_parallel.h and
// docs/loss_parallel.md).
//
// NOTE: [Cross entropy on class shards]
// For one row (a batch element, or a position of a [N, C, d1, ...] input) with logits x_c,
// target t, class weights w_c (1 without weights), W = sum_c w_c and smoothing e:
//   m = max_c x_c, z_c = x_c - m, lse = log sum_c exp(z_c), log p_c = z_c - lse
//   nll    = -w_t log p_t                       (0 for an ignored row)
//   smooth = -sum_c w_c log p_c = W lse - sum_c w_c z_c
//   loss   = (1 - e) nll + e / C smooth
// and reduction mean divides the sum over rows by the total weight sum of w_t over rows not
// ignored (for nll and for smooth alike, as one device does). With the classes sharded, each
// rank holds some x_c of every row it holds. The forward takes
//   1. one all-reduce MAX of the local row maxima (m), then
//   2. one all-reduce SUM of the per-row local sums stacked into one buffer: sum exp(z_c),
//      z_t where this rank owns t (0 elsewhere), and, with smoothing, sum_c w_c z_c,
// over each mesh dim that shards the classes (one group when they are all the mesh's dims).
// Steps 1 and 2 cannot merge into one all-reduce: the sums need m and are of another kind.
// Mean with the rows sharded over other mesh dims all-reduces the scalar total weight there.
// The gradient, d loss / d x_c = g ((1 - e) w_t + e W / C) p_c - g (1 - e) w_t [c = t]
// - g e w_c / C (g: the incoming gradient, divided by the total weight for mean), needs only
// this rank's x_c, the saved per-row lse and the target: the backward communicates nothing.
#include "tessera/compat_autograd.h"
#include "tessera/parallel/loss_parallel.h"

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include "tessera/comm/collectives.h"
#include "tessera/compat.h"
#include "tessera/tensor/rule.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

namespace {
thread_local int scope_depth = 0;
}  // namespace

LossParallel::LossParallel() { ++scope_depth; }
LossParallel::~LossParallel() { --scope_depth; }
bool LossParallel::enabled() { return scope_depth > 0; }

namespace {

constexpr const char* kWho = "tessera::loss_parallel: cross_entropy";

// Every decision below is made from specs, shapes and dtypes, which all ranks share, so a
// bad call raises on every rank before any collective.
struct Layout {
  SpecPtr logits;  // as the computation reads them: Partial mesh dims reduced
  SpecPtr target;  // where the target must be: the logits' layout without the class dim
  int64_t cdim = 1;
  int64_t classes = 0;
  int64_t class_offset = 0, local_classes = 0;
  std::vector<int64_t> class_mesh_dims;  // mesh dims that shard the classes
  std::vector<int64_t> row_mesh_dims;    // mesh dims that shard the rows
};

std::string describe_call(const DTensorSpec& logits, const at::Tensor& target) {
  std::string s = std::string(kWho) + "(logits " + logits.str() + ", target ";
  if (is_dtensor(target)) return s + spec(target).str() + ")";
  return s + "plain " + shape_str(target.sizes().vec()) + " " +
         std::string(c10::toString(target.scalar_type())) + ")";
}

Layout plan_layout(const DTensorSpec& in, const at::Tensor& target) {
  Layout l;
  const int64_t nd = in.ndim();
  TORCH_CHECK(nd >= 1, kWho, ": logits must have at least one dim (the classes), got ", in.str());
  l.cdim = nd >= 2 ? 1 : 0;
  // Rows in position order: head-tail logits are relayed first (NOTE: [Head-tail order]).
  const DTensorSpec natural = in.natural_spec();
  l.logits = natural.has_partial() ? std::make_shared<DTensorSpec>(natural.partial_as_replicate())
                                   : std::make_shared<DTensorSpec>(natural);
  const auto& P = l.logits->placements();
  for (int64_t m = 0; m < static_cast<int64_t>(P.size()); ++m) {
    if (P[m].is_shard(l.cdim))
      l.class_mesh_dims.push_back(m);
    else if (P[m].is_shard())
      l.row_mesh_dims.push_back(m);
  }
  TORCH_CHECK(!l.class_mesh_dims.empty(), kWho,
              ": loss_parallel needs logits sharded on the class dim (dim ", l.cdim, " of a ", nd,
              "-dim input), got placements ", to_string(in.placements()),
              " for logits of global shape ", shape_str(in.sizes()), " (", in.str(),
              "). Shard the class dim (e.g. the Shard(-1) output of a column-wise parallel "
              "projection), or call cross_entropy outside the LossParallel scope.");
  l.classes = in.sizes()[l.cdim];
  l.class_offset = l.logits->local_offsets()[l.cdim];
  l.local_classes = l.logits->local_sizes()[l.cdim];

  const std::string what = describe_call(in, target);
  TORCH_CHECK(!at::isFloatingType(target.scalar_type()) && !at::isComplexType(target.scalar_type()),
              what,
              ": probability (soft) targets are not supported under loss_parallel; pass "
              "class indices");
  TORCH_CHECK(at::isIntegralType(target.scalar_type(), /*includeBool=*/false), what,
              ": the target must hold class indices (an integer tensor)");
  std::vector<int64_t> row_sizes = in.sizes();
  row_sizes.erase(row_sizes.begin() + l.cdim);
  TORCH_CHECK(target.sizes().vec() == row_sizes, what, ": the target must have shape ",
              shape_str(row_sizes), " for logits of shape ", shape_str(in.sizes()));
  if (is_dtensor(target))
    TORCH_CHECK(device_mesh(target) == in.mesh(), what,
                ": the target lives on another mesh than the logits");

  // The target: replicated where the classes are sharded, sharded like the rows elsewhere.
  Placements tp = P;
  std::vector<ShardTable> tables(row_sizes.size());
  for (size_t m = 0; m < tp.size(); ++m) {
    if (!tp[m].is_shard()) continue;
    const int64_t t = tp[m].dim();
    if (t == l.cdim) {
      tp[m] = Replicate();
      continue;
    }
    const int64_t tt = t < l.cdim ? t : t - 1;
    tables[tt] = l.logits->shard_table(t);
    tp[m] = Shard(tt);
  }
  l.target = std::make_shared<DTensorSpec>(in.mesh(), tp, row_sizes, at::kLong, tables);
  return l;
}

// `spec` with another dtype.
SpecPtr with_dtype(const DTensorSpec& s, c10::ScalarType dtype) {
  if (s.dtype() == dtype) return std::make_shared<DTensorSpec>(s);
  return std::make_shared<DTensorSpec>(s.mesh(), s.placements(), s.sizes(), dtype,
                                       s.shard_tables());
}

// This rank's block of `value` laid out as `want` (its dtype kept): a distributed value is
// redistributed if its layout differs, a plain one is taken as the replicated whole.
at::Tensor local_as(const at::Tensor& value, const DTensorSpec& want) {
  const auto target = with_dtype(want, value.scalar_type());
  if (is_dtensor(value)) {
    at::Tensor v = spec(value) == *target ? value : redistribute(value, target);
    return dtensor_impl(v)->local();
  }
  const auto off = target->local_offsets();
  const auto len = target->local_sizes();
  at::Tensor b = value;
  for (int64_t t = 0; t < target->ndim(); ++t)
    if (len[t] != b.size(t)) b = b.narrow(t, off[t], len[t]);
  return b;
}

comm::Group class_group_or_null(const Layout& l) {
  const auto& mesh = l.logits->mesh();
  if (mesh.ndim() > 1 && static_cast<int64_t>(l.class_mesh_dims.size()) == mesh.ndim())
    return mesh.mesh_group();
  return {};
}

// op over the ranks that share this rank's rows (the class shards).
at::Tensor reduce_over_classes(const Layout& l, at::Tensor x, PartialOp op) {
  if (auto whole = class_group_or_null(l)) return comm::all_reduce(whole, x, op);
  for (auto d : l.class_mesh_dims) x = comm::all_reduce(l.logits->mesh().group(d), x, op);
  return x;
}

// Per row, computed in the forward and read by the backward (all local, row-shaped).
struct Rows {
  at::Tensor valid;      // target != ignore_index
  at::Tensor own;        // valid, and this rank holds the target's class
  at::Tensor local_idx;  // the target's index among this rank's classes (0 where not own)
  at::Tensor w_target;   // weight of the target class, 0 where ignored
  at::Tensor log_norm;   // m + lse: log p_c = x_c - log_norm
};

struct Setup {
  Layout layout;
  SpecPtr out;
  int64_t reduction = at::Reduction::Mean;
  double smoothing = 0;
  double weight_sum = 0;                 // W: the sum of every class weight (C without weights)
  at::Tensor local_weight;               // this rank's classes' weights, or undefined
  bool vector_input = false;             // 1-D logits: one row, handled as [1, C]
  c10::ScalarType compute = at::kFloat;  // the logits' dtype, float for half / bfloat16
  at::Tensor total_weight;               // mean: the global total weight (0-d)
};

// Shape [1, Cl, 1, ...] to broadcast a per-class vector against [N, Cl, d1, ...].
at::Tensor per_class(const at::Tensor& v, int64_t ndim) {
  std::vector<int64_t> shape(ndim, 1);
  shape[1] = v.numel();
  return v.view(shape);
}

struct CrossEntropyBackward : torch::autograd::Node {
  std::shared_ptr<const Setup> setup;
  Rows rows;
  torch::autograd::SavedVariable input;  // the logits as laid out (distributed)

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    const Setup& s = *setup;
    const Layout& l = s.layout;
    // The incoming gradient: the output's layout, Partial ones whole (a reduced loss's
    // gradient is the same scalar on every rank). ones_like of the loss already is.
    const auto grad_spec = std::make_shared<DTensorSpec>(s.out->partial_as_replicate());
    at::Tensor g = local_as(grads[0], *grad_spec);
    at::Tensor x = dtensor_impl(input.unpack())->local();
    const auto dtype = x.scalar_type();
    at::AutoDispatchBelowADInplaceOrView guard;
    x = x.to(s.compute);
    if (s.vector_input) {
      x = x.unsqueeze(0);
      if (s.reduction == at::Reduction::None) g = g.unsqueeze(0);
    }
    g = g.to(x.scalar_type());
    if (s.reduction == at::Reduction::Mean) g = g / s.total_weight;
    const double e = s.smoothing;
    const int64_t C = l.classes;
    // Rows not ignored get g, ignored rows nothing.
    const at::Tensor g_rows = at::where(rows.valid, g, at::zeros({}, x.options()));
    at::Tensor coef = g_rows * rows.w_target * (1 - e);
    if (e > 0) coef = coef + g_rows * (e * s.weight_sum / static_cast<double>(C));
    at::Tensor grad = (x - rows.log_norm.unsqueeze(1)).exp_().mul_(coef.unsqueeze(1));
    if (l.local_classes > 0) {
      const at::Tensor hit =
          at::where(rows.own, g_rows * rows.w_target * (e - 1), at::zeros({}, x.options()));
      grad.scatter_add_(1, rows.local_idx.unsqueeze(1), hit.unsqueeze(1));
      if (e > 0) {
        const at::Tensor w = s.local_weight.defined() ? per_class(s.local_weight, x.dim())
                                                      : at::ones({}, x.options());
        grad.sub_(g_rows.unsqueeze(1) * w * (e / static_cast<double>(C)));
      }
    }
    if (s.vector_input) grad = grad.squeeze(0);
    return {make_dtensor(grad.to(dtype), l.logits)};
  }

  std::string name() const override { return "tessera::LossParallelCrossEntropyBackward"; }
  void release_variables() override {
    input.reset_data();
    rows = Rows();
  }
};

// The whole weight vector, in the logits' dtype (undefined without weights). A distributed
// weight is made whole: replicated ones (the usual case) without communication.
at::Tensor whole_weight(const c10::optional<at::Tensor>& weight, int64_t classes,
                        c10::ScalarType dtype, const std::string& what) {
  if (!weight || !weight->defined()) return {};
  at::Tensor w = weight->detach();
  if (is_dtensor(w)) w = full_tensor(w);
  TORCH_CHECK(w.dim() == 1 && w.numel() == classes, what,
              ": the class weights must be defined for all ", classes,
              " classes or none, got shape ", shape_str(w.sizes().vec()));
  return w.to(dtype);
}

// The valid rows, their target weights, and for a mean the total weight (summed over the
// row-sharding mesh dims). Out-of-range targets raise as on one device.
void weigh_rows(Setup& s, Rows& rows, const at::Tensor& t, const at::Tensor& w_full,
                int64_t ignore_index, const at::TensorOptions& opts, const DeviceMesh& mesh,
                const std::string& what) {
  const Layout& l = s.layout;
  const int64_t C = l.classes;
  const int64_t Cl = l.local_classes;
  const int64_t reduction = s.reduction;
  const double smoothing = s.smoothing;
  const at::Tensor zero = at::zeros({}, opts);
  rows.valid = t.ne(ignore_index);
  const at::Tensor bad = rows.valid.logical_and(t.lt(0).logical_or(t.ge(C)));
  const at::Tensor safe_t = at::where(rows.valid, t, at::zeros({}, t.options())).clamp(0, C - 1);
  rows.w_target =
      w_full.defined()
          ? at::where(rows.valid, w_full.index_select(0, safe_t.flatten()).view(t.sizes()), zero)
          : rows.valid.to(s.compute);
  if (smoothing > 0)
    s.weight_sum = w_full.defined() ? w_full.sum().item<double>() : static_cast<double>(C);
  if (w_full.defined()) s.local_weight = w_full.narrow(0, l.class_offset, Cl);

  // Out-of-range targets raise as on one device. The ranks sharing these rows (the class
  // shards) see the same targets and raise together; where a scalar all-reduce over the
  // row-sharding mesh dims follows (mean), the count travels with it so all raise.
  const bool row_reduce = reduction == at::Reduction::Mean && !l.row_mesh_dims.empty();
  const int64_t bad_here = bad.sum().item<int64_t>();
  auto out_of_range = [&] {
    const at::Tensor first = t.masked_select(bad);
    return first.numel() ? "target " + std::to_string(first[0].item<int64_t>()) +
                               " is out of bounds for " + std::to_string(C) + " classes"
                         : std::string("a target on another rank is out of bounds for ") +
                               std::to_string(C) + " classes";
  };
  TORCH_CHECK(row_reduce || bad_here == 0, what, ": ", out_of_range());
  if (reduction == at::Reduction::Mean) {
    at::Tensor total = rows.w_target.sum();
    if (row_reduce) {
      at::Tensor packed = at::stack({total, at::full({}, static_cast<double>(bad_here), opts)});
      for (auto d : l.row_mesh_dims)
        packed = comm::all_reduce(mesh.group(d), packed, PartialOp::Sum);
      TORCH_CHECK(packed[1].item<double>() == 0, what, ": ", out_of_range());
      total = packed[0];
    }
    s.total_weight = total;
  }
}

// The per-row loss -w_t log p_t (and the smoothing term) over the class shards: row maxima and
// sums reduced over the class-sharding mesh dims; ignored rows give 0.
at::Tensor row_losses(Setup& s, Rows& rows, const at::Tensor& x, const at::Tensor& t) {
  const Layout& l = s.layout;
  const int64_t C = l.classes;
  const int64_t Cl = l.local_classes;
  const double smoothing = s.smoothing;
  const auto opts = x.options();
  const at::Tensor zero = at::zeros({}, opts);
  // 1. the row maxima.
  std::vector<int64_t> row_shape = t.sizes().vec();
  at::Tensor m =
      Cl > 0 ? x.amax(1) : at::full(row_shape, -std::numeric_limits<double>::infinity(), opts);
  m = reduce_over_classes(l, m, PartialOp::Max);
  // 2. the per-row sums, in one buffer.
  const at::Tensor z = x - m.unsqueeze(1);
  rows.own = rows.valid.logical_and(t.ge(l.class_offset)).logical_and(t.lt(l.class_offset + Cl));
  rows.local_idx = at::where(rows.own, t - l.class_offset, at::zeros({}, t.options()));
  std::vector<at::Tensor> parts;
  parts.push_back(z.exp().sum(1));
  parts.push_back(
      Cl > 0 ? at::where(rows.own, z.gather(1, rows.local_idx.unsqueeze(1)).squeeze(1), zero)
             : at::zeros(row_shape, opts));
  if (smoothing > 0)
    parts.push_back(s.local_weight.defined() ? (z * per_class(s.local_weight, z.dim())).sum(1)
                                             : z.sum(1));
  const at::Tensor sums = reduce_over_classes(l, at::stack(parts), PartialOp::Sum);
  const at::Tensor lse = sums[0].log();
  rows.log_norm = m + lse;

  // -w_t log p_t, and the smoothing term; ignored rows give 0.
  at::Tensor loss = at::where(rows.valid, rows.w_target * (lse - sums[1]), zero);
  if (smoothing > 0) {
    const at::Tensor smooth = at::where(rows.valid, lse * s.weight_sum - sums[2], zero);
    loss = loss * (1 - smoothing) + smooth * (smoothing / static_cast<double>(C));
  }
  return loss;
}

at::Tensor loss_parallel_cross_entropy(const at::Tensor& self, const at::Tensor& target,
                                       const c10::optional<at::Tensor>& weight, int64_t reduction,
                                       int64_t ignore_index, double smoothing) {
  const DTensorSpec& in = spec(self);
  const std::string what = describe_call(in, target);
  TORCH_CHECK(reduction == at::Reduction::None || reduction == at::Reduction::Sum ||
                  reduction == at::Reduction::Mean,
              what, ": unknown reduction ", reduction);
  TORCH_CHECK(smoothing >= 0.0 && smoothing <= 1.0, what,
              ": label_smoothing must be between 0.0 and 1.0, got ", smoothing);
  TORCH_CHECK(at::isFloatingType(self.scalar_type()), what, ": logits must be floating point, got ",
              c10::toString(self.scalar_type()));

  auto setup = std::make_shared<Setup>();
  Setup& s = *setup;
  s.layout = plan_layout(in, target);
  const Layout& l = s.layout;
  s.reduction = reduction;
  s.smoothing = smoothing;
  s.vector_input = in.ndim() == 1;
  const auto dtype = self.scalar_type();
  s.compute = dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
  const auto& mesh = in.mesh();
  const int64_t C = l.classes;
  const at::Tensor w_full = whole_weight(weight, C, s.compute, what);

  if (reduction == at::Reduction::None) {
    s.out = with_dtype(*l.target, dtype);
  } else {
    Placements p(mesh.ndim(), Replicate());
    for (auto d : l.row_mesh_dims) p[d] = Partial();
    s.out = std::make_shared<DTensorSpec>(mesh, p, std::vector<int64_t>{}, dtype);
  }

  // Layouts: Partial logits are reduced first; the target goes where the rows are.
  const at::Tensor laid = in == *l.logits ? self : redistribute(self, l.logits);
  at::Tensor t_local = local_as(target, *l.target);

  at::Tensor out_local;
  Rows rows;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor x = dtensor_impl(laid)->local().to(s.compute);
    at::Tensor t = t_local.to(at::kLong);
    if (s.vector_input) {
      x = x.unsqueeze(0);
      t = t.unsqueeze(0);
    }
    weigh_rows(s, rows, t, w_full, ignore_index, x.options(), mesh, what);
    const at::Tensor loss = row_losses(s, rows, x, t);
    switch (reduction) {
      case at::Reduction::None: out_local = s.vector_input ? loss.squeeze(0) : loss; break;
      case at::Reduction::Sum: out_local = loss.sum(); break;
      default: out_local = loss.sum() / s.total_weight; break;
    }
  }

  at::Tensor out = make_dtensor(out_local.to(dtype), s.out);
  if (laid.requires_grad() && at::GradMode::is_enabled()) {
    auto node = compat::make_node<CrossEntropyBackward>();
    node->setup = setup;
    node->rows = std::move(rows);
    node->input = torch::autograd::SavedVariable(laid, /*is_output=*/false);
    node->set_next_edges(torch::autograd::collect_next_edges(laid));
    torch::autograd::set_history(out, node);
  }
  return out;
}

// aten::cross_entropy_loss(self, target, weight?, reduction, ignore_index, label_smoothing)
// at the distributed tensors' autograd key: ours inside a scope, the usual one elsewhere.
void cross_entropy_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  TORCH_INTERNAL_ASSERT(stack->size() == op.schema().arguments().size(),
                        "aten::cross_entropy_loss: expected a stack of its arguments only");
  ops::KernelCall call(op, *stack);
  const at::Tensor self = call.tensor("self");
  const at::Tensor target = call.tensor("target");
  const auto weight = call.arg("weight").toOptional<at::Tensor>();
  const int64_t reduction = call.arg("reduction").toInt();
  const int64_t ignore_index = call.arg("ignore_index").toInt();
  const double smoothing = call.arg("label_smoothing").toDouble();
  at::Tensor out =
      LossParallel::enabled() && is_dtensor(self)
          ? loss_parallel_cross_entropy(self, target, weight, reduction, ignore_index, smoothing)
          : compat::cross_entropy_loss_composite(self, target, weight, reduction, ignore_index,
                                                 smoothing);
  call.finish({std::move(out)});
}

const ops::RuleRegistrar registrar{[] {
  ops::register_autograd_kernel("aten::cross_entropy_loss",
                                torch::CppFunction::makeFromBoxedFunction<&cross_entropy_kernel>());
}};

}  // namespace

}  // namespace tessera
