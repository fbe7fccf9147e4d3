// mkldnn_rnn_layer and its backward: one LSTM layer in one direction through oneDNN, which
// LibTorch 2.x's lstm takes on CPU (a distributed tensor's options say CPU). 1.13 has
// neither op; the rules register for the overloads the running LibTorch has.
//
// NOTE: [oneDNN RNN workspace]
// mkldnn_rnn_layer(input [L, B, I] (or [B, L, I] with batch_first), weight0..3, hx_ [B, H],
// cx_ [B, H], ..., train) -> (output, hy, cy, workspace). Sequences are independent, so the
// batch may stay sharded: input, hx_ / cx_ and output, hy, cy alike, the weights whole. The
// workspace (what the backward needs from the forward) is an opaque byte buffer whose size
// oneDNN picks from the shapes, not in proportion to the batch. Each rank's is a shard of
// the result along dim 0, with the sizes the op gives each rank's batch: the rule runs the
// op once on zeros per distinct shard size to learn them (every rank does the same, so all
// agree on the table). The backward takes the workspace as it came and gives the weights'
// gradients as Partial(sum). Anything else (batch sharded over several mesh dims, packed
// sequences, a workspace that is not sharded like the batch) is made whole.
#include <map>

#include <ATen/ATen.h>

#include "tessera/tensor/rule.h"
#include "dim_layout.h"

namespace tessera::ops {

namespace {

// The mesh dim that alone shards dim `t` of `s` (and no Partial anywhere), or -1.
int64_t batch_mesh_dim(const DTensorSpec& s, int64_t t) {
  if (s.has_partial()) return -1;
  const auto dims = s.mesh_dims_sharding(t);
  return dims.size() == 1 ? dims[0] : -1;
}

// `sizes` sharded along dim `t` on mesh dim m with `table`, whole elsewhere.
SpecPtr sharded(const DeviceMesh& mesh, int64_t m, std::vector<int64_t> sizes, int64_t t,
                const ShardTable& table, c10::ScalarType dtype) {
  Placements p(mesh.ndim(), Replicate());
  p[m] = Shard(t);
  std::vector<ShardTable> tables(sizes.size());
  tables[t] = table;
  return std::make_shared<DTensorSpec>(mesh, p, std::move(sizes), dtype, std::move(tables));
}

// The workspace for a batch of `b` (its size and dtype): the op run on zeros of that batch.
std::pair<int64_t, c10::ScalarType> workspace_of(const OpCall& call, int64_t batch_dim, int64_t b) {
  if (b == 0) return {0, c10::kByte};
  torch::jit::Stack stack(call.args.begin(), call.args.end());
  KernelCall k(call.op, stack);
  // Argument `name` as zeros of its global shape, with b along `t` (-1: none).
  auto zeros = [&](const char* name, int64_t t) {
    const auto* s = call.spec(name);
    if (!s) return;
    auto sizes = s->sizes();
    if (t >= 0) sizes[t] = b;
    k.set(name, at::zeros(sizes, at::dtype(s->dtype())));
  };
  zeros("input", batch_dim);
  for (const char* w : {"weight0", "weight1", "weight2", "weight3"}) zeros(w, -1);
  zeros("hx_", 0);
  zeros("cx_", 0);
  k.call_op();
  // The schema names no results: (output, hy, cy, workspace).
  const at::Tensor ws = k.stack().back().toTensor();
  return {ws.numel(), ws.scalar_type()};
}

OpPlan rnn_layer_rule(const OpCall& call) {
  const DTensorSpec* in = call.spec("input");
  if (!in || in->ndim() != 3 || !call.arg<std::vector<int64_t>>("batch_sizes").empty())
    return replicate_everything(call);
  const int64_t bdim = call.arg<bool>("batch_first") ? 0 : 1;
  const int64_t m = batch_mesh_dim(*in, bdim);
  if (m < 0) return replicate_everything(call);
  const auto& mesh = in->mesh();
  const ShardTable table = in->shard_table(bdim);
  const int64_t batch = in->sizes()[bdim], hidden = call.arg<int64_t>("hidden_size");

  OpPlan plan(call);
  auto input = sharded(mesh, m, in->sizes(), bdim, table, in->dtype());
  plan.input("input", input);
  for (const char* w : {"weight0", "weight1", "weight2", "weight3"})
    if (const auto* s = call.spec(w)) plan.input(w, replicated(*s));
  for (const char* h : {"hx_", "cx_"})
    if (const auto* s = call.spec(h))
      plan.input(h, sharded(mesh, m, s->sizes(), 0, table, s->dtype()));
  auto out_sizes = in->sizes();
  out_sizes[2] = hidden;
  plan.output(sharded(mesh, m, out_sizes, bdim, table, in->dtype()));
  plan.output(sharded(mesh, m, {batch, hidden}, 0, table, in->dtype()));
  plan.output(sharded(mesh, m, {batch, hidden}, 0, table, in->dtype()));
  std::map<int64_t, std::pair<int64_t, c10::ScalarType>> by_batch;
  ShardTable ws;
  int64_t total = 0;
  c10::ScalarType ws_dtype = c10::kByte;
  for (int64_t b : table) {
    auto it = by_batch.find(b);
    if (it == by_batch.end()) it = by_batch.emplace(b, workspace_of(call, bdim, b)).first;
    ws.push_back(it->second.first);
    total += it->second.first;
    if (b > 0) ws_dtype = it->second.second;
  }
  plan.output(sharded(mesh, m, {total}, 0, ws, ws_dtype));
  if (table[mesh.coordinate()[m]] == 0) {
    std::vector<std::vector<int64_t>> local;
    for (const auto& o : plan.outputs) local.push_back(o->local_sizes());
    plan.local_kernel = [local, ws_dtype](KernelCall& k) {
      const auto o = k.tensor("input").options();
      k.finish({at::zeros(local[0], o), at::zeros(local[1], o), at::zeros(local[2], o),
                at::zeros(local[3], o.dtype(ws_dtype))});
    };
  }
  return plan;
}

// mkldnn_rnn_layer_backward(input, weight1..4, hx_, cx_tmp, output, hy_, cy_, grad_output?,
// grad_hy?, grad_cy?, ..., batch_first, workspace) -> (grad_input, grad_weight1..4,
// grad_hx, grad_cx).
OpPlan rnn_layer_backward_rule(const OpCall& call) {
  const DTensorSpec* in = call.spec("input");
  const DTensorSpec* ws = call.spec("workspace");
  if (!in || !ws || in->ndim() != 3 || !call.arg<std::vector<int64_t>>("batch_sizes").empty())
    return replicate_everything(call);
  const int64_t bdim = call.arg<bool>("batch_first") ? 0 : 1;
  const int64_t m = batch_mesh_dim(*in, bdim);
  if (m < 0 || batch_mesh_dim(*ws, 0) != m) return replicate_everything(call);
  const auto& mesh = in->mesh();
  const ShardTable table = in->shard_table(bdim);

  OpPlan plan(call);
  auto input = sharded(mesh, m, in->sizes(), bdim, table, in->dtype());
  for (const char* name : {"input", "output", "grad_output"})
    if (const auto* s = call.spec(name))
      plan.input(name, sharded(mesh, m, s->sizes(), bdim, table, s->dtype()));
  for (const char* name : {"hx_", "cx_tmp", "hy_", "cy_", "grad_hy", "grad_cy"})
    if (const auto* s = call.spec(name))
      plan.input(name, sharded(mesh, m, s->sizes(), 0, table, s->dtype()));
  plan.input("workspace", std::make_shared<DTensorSpec>(*ws));
  plan.output(input);
  for (const char* w : {"weight1", "weight2", "weight3", "weight4"}) {
    const auto* s = call.spec(w);
    if (s) plan.input(w, replicated(*s));
    plan.output(s ? summed_over_shards(*input, s->sizes()) : replicated(*in));  // (none: unused)
  }
  for (const char* h : {"hx_", "cx_tmp"}) {
    const auto* s = call.spec(h);
    plan.output(s ? sharded(mesh, m, s->sizes(), 0, table, s->dtype()) : replicated(*in));
  }
  if (table[mesh.coordinate()[m]] == 0) {
    std::vector<std::vector<int64_t>> local;
    for (const auto& o : plan.outputs) local.push_back(o->local_sizes());
    plan.local_kernel = [local](KernelCall& k) {
      const auto o = k.tensor("input").options();
      std::vector<c10::IValue> zeros;
      for (const auto& s : local) zeros.emplace_back(at::zeros(s, o));
      k.finish({zeros[0], zeros[1], zeros[2], zeros[3], zeros[4], zeros[5], zeros[6]});
    };
  }
  return plan;
}

const RuleRegistrar registrar{[] {
  register_rule_for_overloads("aten::mkldnn_rnn_layer", rnn_layer_rule, {"out"});
  register_rule_for_overloads("aten::mkldnn_rnn_layer_backward", rnn_layer_backward_rule, {"out"});
}};

}  // namespace

}  // namespace tessera::ops
