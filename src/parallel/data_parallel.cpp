#include "tessera/parallel/data_parallel.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "tessera/compat_autograd.h"
#include "tessera/comm/collectives.h"
#include "tessera/parallel/module.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

#include "gradient_owner.h"

namespace tessera {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// Gloo reduces float, double and half; bfloat16 gradients are summed in float.
at::ScalarType bucket_dtype(at::ScalarType t) { return t == at::kBFloat16 ? at::kFloat : t; }

struct Param {
  std::string name;
  at::Tensor tensor;                                   // the leaf the optimizer steps
  compat::NodePtr<torch::autograd::Node> accumulator;  // held: the ready hook lives on it
  std::vector<int64_t> reduce_dims;                    // mesh dims the gradient is summed over
  std::vector<int64_t> local_sizes;
  int64_t numel = 0;
  SpecPtr grad_spec;  // distributed inputs: the reduced gradient's layout
  size_t bucket = 0;
  bool ready = false;
};

struct Bucket {
  std::vector<size_t> params;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> reduce_dims;
  std::vector<comm::Group> groups;  // one group over all reduce dims, or one per dim
  size_t pending = 0;
  comm::PendingAllReduce work;
};

}  // namespace

struct ReplicatedModule::State : std::enable_shared_from_this<ReplicatedModule::State> {
  DeviceMesh mesh;
  ReplicateOptions options;
  std::vector<Param> params;
  std::vector<Bucket> buckets;
  // Broadcast from the first rank: every buffer with local batches; with distributed
  // inputs, the replicated buffers after a step whose batch arrived as plain tensors.
  std::vector<at::Tensor> buffers;
  bool require_sync = true;
  bool callback_queued = false;
  size_t next_bucket = 0;
  bool buckets_rebuilt = false;
  std::vector<size_t> ready_order;  // of the first synchronized backward

  bool local() const { return options.local_batches(); }

  // The groups a bucket over `dims` reduces through: the mesh's own group when it spans
  // every dim (one collective), else one per dim. Groups are made at construction, when
  // every rank is here.
  std::vector<comm::Group> groups_for(const std::vector<int64_t>& dims) const {
    if (dims.size() == 1) return {mesh.group(dims[0])};
    if (static_cast<int64_t>(dims.size()) == mesh.ndim()) return {mesh.mesh_group()};
    std::vector<comm::Group> g;
    for (int64_t d : dims) g.push_back(mesh.group(d));
    return g;
  }

  // Fills buckets in `order` (parameter indices), one open bucket per (dtype, reduce dims),
  // closing a bucket once it holds its capacity: the first per key the small first cap.
  void assign_buckets(const std::vector<size_t>& order) {
    buckets.clear();
    std::map<std::pair<int, std::vector<int64_t>>, std::pair<size_t, int64_t>>
        open;  // -> bucket, bytes
    std::map<std::pair<int, std::vector<int64_t>>, int> made;
    for (size_t i : order) {
      Param& p = params[i];
      const auto dtype = bucket_dtype(p.tensor.scalar_type());
      const auto key = std::make_pair(static_cast<int>(dtype), p.reduce_dims);
      auto it = open.find(key);
      if (it == open.end()) {
        Bucket b;
        b.dtype = dtype;
        b.reduce_dims = p.reduce_dims;
        b.groups = groups_for(p.reduce_dims);
        buckets.push_back(std::move(b));
        it = open.emplace(key, std::make_pair(buckets.size() - 1, int64_t{0})).first;
      }
      Bucket& b = buckets[it->second.first];
      b.params.push_back(i);
      p.bucket = it->second.first;
      it->second.second += p.numel * static_cast<int64_t>(c10::elementSize(dtype));
      const double cap = made[key] == 0 ? options.first_bucket_cap_mb() : options.bucket_cap_mb();
      if (double(it->second.second) >= cap * kMiB) {
        ++made[key];
        open.erase(it);
      }
    }
    for (auto& b : buckets) b.pending = b.params.size();
    next_bucket = 0;
  }

  // Distributed inputs, before a gradient is accumulated: an existing gradient that is
  // replicated over a reduce dim (a reduced one, zeroed by zero_grad) is turned into its
  // Partial form without communication (kept whole on the dim's first coordinate, zero
  // elsewhere), so adding the incoming Partial term stays local and the bucket reduces both.
  void partial_form_of_existing_gradient(size_t i, const at::Tensor& incoming) {
    Param& p = params[i];
    at::Tensor& grad = p.tensor.mutable_grad();
    if (!grad.defined() || !is_dtensor(grad) || !is_dtensor(incoming)) return;
    const DTensorSpec& gs = spec(grad);
    const DTensorSpec& in = spec(incoming);
    Placements pl = gs.placements();
    bool keep = true, changed = false;
    for (int64_t d : p.reduce_dims) {
      if (in.placement(d).is_partial() && gs.placement(d).is_replicate()) {
        pl[d] = Partial();
        changed = true;
        keep = keep && mesh.coordinate()[d] == 0;
      }
    }
    if (!changed) return;
    at::Tensor local = dtensor_impl(grad)->local();
    local = keep ? local : at::zeros_like(local);
    grad = make_dtensor(local,
                        std::make_shared<DTensorSpec>(gs.with_placements(pl, gs.shard_tables())));
  }

  void on_gradient_ready(size_t i) {
    if (!require_sync) return;
    if (!callback_queued) {
      callback_queued = true;
      torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this()] {
        if (auto s = weak.lock()) s->finish();
      });
    }
    Param& p = params[i];
    if (p.ready) return;
    p.ready = true;
    if (!buckets_rebuilt) ready_order.push_back(i);
    if (--buckets[p.bucket].pending == 0) launch_ready();
  }

  // Buckets start strictly in index order, so every rank issues the same collectives in the
  // same order whatever order its gradients arrive in.
  void launch_ready() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
  }

  // This rank's term of parameter p's gradient sum, in the bucket's dtype (zeros if none).
  // `partial`: the gradient arrived Partial over a reduce dim (the batch was distributed).
  at::Tensor contribution(Param& p, at::ScalarType dtype, bool& used, bool& partial) {
    at::Tensor g = p.tensor.grad();
    used = g.defined();
    if (!used) return at::zeros({p.numel}, p.tensor.options().dtype(dtype));
    if (local()) return g.reshape({-1}).to(dtype);
    TORCH_CHECK(is_dtensor(g), "tessera: replicate: the gradient of ", p.name,
                " arrived as a plain tensor; its parameter is distributed");
    const DTensorSpec& ps = spec(p.tensor);
    bool direct =
        spec(g).mesh() == ps.mesh() && dtensor_impl(g)->local().sizes().vec() == p.local_sizes;
    for (int64_t d = 0; d < ps.mesh().ndim() && direct; ++d) {
      const Placement& gp = spec(g).placement(d);
      const bool reduce = std::count(p.reduce_dims.begin(), p.reduce_dims.end(), d) != 0;
      direct = reduce ? (gp.is_replicate() || (gp.is_partial() && gp.reduce_op() == PartialOp::Sum))
                      : gp == ps.placement(d);
    }
    // Anything else (a max-partial, a sharded gradient of a replicated weight) is brought
    // to the parameter's layout first: rare, and deterministic on every rank.
    if (!direct) g = redistribute(g, p.grad_spec);
    at::Tensor local = dtensor_impl(g)->local().reshape({-1}).to(dtype);
    // NOTE: [Replicated gradients are averaged]. A gradient replicated over a reduce dim holds
    // either one value on every rank (the batch was replicated there: a global pooling before
    // the layer, say) or, when each rank fed its own plain batch (torch DDP's habit: a plain
    // tensor reads as replicated), each rank's own gradient. The mean over the dim is right in
    // both cases (it is DDP's average in the second), so every rank contributes 1/size.
    int64_t replicas = 1;
    for (int64_t d : p.reduce_dims) {
      const Placement& gp = spec(g).placement(d);
      if (gp.is_replicate()) replicas *= mesh.size(d);
      partial = partial || gp.is_partial();
    }
    return replicas == 1 ? local : local.div(static_cast<double>(replicas));
  }

  // Packs the bucket (gradients, then one "used here" flag per parameter, so that a
  // parameter no rank used keeps an undefined gradient) and starts its all-reduce.
  void launch(size_t bi) {
    Bucket& b = buckets[bi];
    std::vector<at::Tensor> pieces;
    pieces.reserve(b.params.size() + 1);
    // One flag per parameter, then whether any gradient here was Partial (summed: every rank
    // learns what any rank saw).
    std::vector<double> used(b.params.size() + 1);
    bool partial = false;
    for (size_t k = 0; k < b.params.size(); ++k) {
      bool u = false;
      // (a gradient accumulated in this backward was checked before it was accumulated)
      if (!params[b.params[k]].ready)
        detail::drop_gradient_the_user_dropped(params[b.params[k]].tensor.unsafeGetTensorImpl());
      pieces.push_back(contribution(params[b.params[k]], b.dtype, u, partial));
      used[k] = u ? 1.0 : 0.0;
    }
    used.back() = partial ? 1.0 : 0.0;
    pieces.push_back(at::tensor(used, at::kDouble).to(comm::home_options(b.groups[0], b.dtype)));
    const PartialOp op = local() ? PartialOp::Avg : PartialOp::Sum;
    b.work = comm::all_reduce_start(b.groups[0], at::cat(pieces), op);
  }

  void finish() {
    callback_queued = false;
    bool any_partial = false;
    // Buckets holding parameters that got no gradient in this backward go now, in order.
    for (auto& b : buckets) b.pending = 0;
    launch_ready();
    for (auto& b : buckets) {
      at::Tensor flat = b.work.wait();
      const PartialOp op = local() ? PartialOp::Avg : PartialOp::Sum;
      for (size_t g = 1; g < b.groups.size(); ++g) flat = comm::all_reduce(b.groups[g], flat, op);
      int64_t offset = 0;
      const int64_t nflags = static_cast<int64_t>(b.params.size()) + 1;
      auto used = flat.narrow(0, flat.numel() - nflags, nflags).to(at::kCPU, at::kDouble);
      auto used_a = used.accessor<double, 1>();
      any_partial = any_partial || used_a[nflags - 1] != 0;
      for (size_t k = 0; k < b.params.size(); ++k) {
        Param& p = params[b.params[k]];
        at::Tensor reduced = flat.narrow(0, offset, p.numel).view(p.local_sizes);
        offset += p.numel;
        if (used_a[static_cast<int64_t>(k)] == 0) continue;  // no rank used it
        // Own storage, never a view of the bucket: LibTorch 1.13's zero_grad() detaches
        // gradients in place, which views do not allow.
        at::Tensor& grad = p.tensor.mutable_grad();
        if (local() && grad.defined() && !is_dtensor(grad) &&
            grad.scalar_type() == reduced.scalar_type() && !grad.is_view()) {
          grad.copy_(reduced);  // in place: keeps the gradient's storage
        } else {
          reduced = reduced.to(p.tensor.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
          grad = local() ? reduced : make_dtensor(reduced, p.grad_spec);
        }
      }
    }
    // An optimizer built before replicate steps the original parameter objects.
    for (auto& p : params) detail::hand_gradient_to_user(p.tensor.unsafeGetTensorImpl());
    for (auto& p : params) p.ready = false;
    if (!buckets_rebuilt) rebuild_buckets();
    for (auto& b : buckets) b.pending = b.params.size();
    next_bucket = 0;
    // No gradient was Partial anywhere: every rank fed its own plain batch (NOTE: [Replicated
    // gradients are averaged]), so replicated buffers (BatchNorm statistics) drifted apart
    // per rank; as torch DDP, the first rank's go everywhere. The flag came through the
    // buckets, so every rank decides alike.
    const bool plain_batches = !local() && !any_partial && !buckets.empty();
    if ((local() || plain_batches) && options.broadcast_buffers()) sync_buffers();
  }

  // After the first synchronized backward: buckets in the order gradients became ready
  // (rank 0's, broadcast, so every rank agrees); parameters that got none go last.
  void rebuild_buckets() {
    buckets_rebuilt = true;
    if (!options.rebuild_buckets()) return;
    std::vector<int64_t> order(params.size(), -1);
    std::vector<bool> seen(params.size());
    size_t k = 0;
    for (size_t i : ready_order) {
      order[k++] = static_cast<int64_t>(i);
      seen[i] = true;
    }
    for (size_t i = params.size(); i-- > 0;)
      if (!seen[i]) order[k++] = static_cast<int64_t>(i);
    auto pg = mesh.mesh_group();
    auto t = comm::broadcast(pg, at::tensor(order, at::kLong).to(comm::home_device(pg)), 0).cpu();
    std::vector<size_t> agreed(params.size());
    for (size_t i = 0; i < params.size(); ++i)
      agreed[i] = static_cast<size_t>(t[i].item<int64_t>());
    assign_buckets(agreed);
    ready_order.clear();
  }

  // Broadcasts `tensors` (plain) from the mesh's first rank, one collective per dtype.
  void broadcast_from_first(const std::vector<at::Tensor>& tensors) {
    std::map<int, std::vector<at::Tensor>> by_dtype;
    for (const auto& t : tensors)
      if (t.defined() && t.numel() > 0) by_dtype[static_cast<int>(t.scalar_type())].push_back(t);
    at::NoGradGuard no_grad;
    for (auto& [dtype, ts] : by_dtype) {
      std::vector<at::Tensor> flat;
      for (auto& t : ts) flat.push_back(t.reshape({-1}));
      at::Tensor all = comm::broadcast(mesh.mesh_group(), at::cat(flat), 0);
      int64_t off = 0;
      for (auto& t : ts) {
        t.copy_(all.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    }
  }

  void sync_buffers() {
    std::vector<at::Tensor> values;
    for (const auto& b : buffers) values.push_back(is_dtensor(b) ? dtensor_impl(b)->local() : b);
    broadcast_from_first(values);
  }
};

namespace {

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::weak_ptr<ReplicatedModule::State> s, size_t i) : state(std::move(s)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grad_inputs,
                                            const torch::autograd::variable_list&) override {
    if (auto s = state.lock()) s->on_gradient_ready(index);
    return grad_inputs;
  }
  std::weak_ptr<ReplicatedModule::State> state;
  size_t index;
};

std::string qualified(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

namespace {

using State = ReplicatedModule::State;

// Every (module, local name) with a parameter, in registration order (the module's own
// first, then its submodules', as named_parameters() lists them), and the same for buffers.
struct Entries {
  std::vector<std::pair<torch::nn::Module*, std::string>> params, buffers;
  std::vector<std::string> names;  // qualified, per parameter entry
};

Entries collect_entries(torch::nn::Module& module) {
  Entries e;
  auto collect = [&](const std::string& prefix, torch::nn::Module& m) {
    for (const auto& item : m.named_parameters(/*recurse=*/false))
      if (item.value().defined()) {
        e.params.emplace_back(&m, item.key());
        e.names.push_back(qualified(prefix, item.key()));
      }
    for (const auto& item : m.named_buffers(/*recurse=*/false))
      if (item.value().defined()) e.buffers.emplace_back(&m, item.key());
  };
  collect("", module);
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    collect(item.key(), *item.value());
  return e;
}

at::Tensor current(torch::nn::Module& m, const std::string& name) {
  const auto params = m.named_parameters(false);
  if (const auto* p = params.find(name)) return *p;
  return *m.named_buffers(false).find(name);
}

// Devices, tied parameters and distributed layouts: checked before anything changes, from
// values every rank has.
void check_parameters(const Entries& e, const DeviceMesh& mesh, const State& state,
                      const ReplicateOptions& options) {
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  for (size_t k = 0; k < e.params.size(); ++k) {
    at::Tensor t = current(*e.params[k].first, e.params[k].second);
    const std::string& name = e.names[k];
    TORCH_CHECK(t.device().type() == mesh.device_kind(), "tessera: replicate: parameter ", name,
                " is on ", t.device(), " but the mesh ", mesh.str(), " keeps its ", "tensors on ",
                mesh.device_type(), "; move the model first (module->to(",
                mesh.device_type() == "cpu" ? "torch::kCPU"
                                            : "torch::Device(torch::kCUDA, get_local_rank())",
                "))");
    auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), name);
    TORCH_CHECK(fresh || options.local_batches(), "tessera: replicate: ", name, " and ", it->second,
                " are one tensor (tied parameters); with distributed inputs each ",
                "parameter must be registered once. Tie them in forward() instead, or use ",
                "ReplicateOptions().local_batches(true)");
    if (options.local_batches() || !is_dtensor(t)) continue;
    const DTensorSpec& s = spec(t);
    TORCH_CHECK(s.mesh() == state.mesh, "tessera: replicate: parameter ", name, " lives on ",
                s.mesh().str(), ", not on the mesh it is replicated over (", state.mesh.str(),
                "); distribute it on that mesh first");
    TORCH_CHECK(!s.has_partial(), "tessera: replicate: parameter ", name,
                " has a Partial placement ", to_string(s.placements()),
                "; parameters must be Shard or Replicate");
  }
}

// One starting point: the first rank's values of every plain parameter and buffer.
void broadcast_plain_values(const Entries& e, State& state) {
  std::vector<at::Tensor> plain;
  for (const auto* list : {&e.params, &e.buffers})
    for (const auto& [m, name] : *list) {
      at::Tensor t = current(*m, name);
      if (!is_dtensor(t)) plain.push_back(t);
    }
  state.broadcast_from_first(plain);
}

// The parameters to reduce: laid out replicated (distributed inputs) and described by the
// mesh dims their gradients are summed over.
void add_parameters(const Entries& e, State& state, const ReplicateOptions& options) {
  const DeviceMesh& layout = state.mesh;
  const Placements replicated(layout.ndim(), Replicate());
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  for (size_t k = 0; k < e.params.size(); ++k) {
    auto& [m, name] = e.params[k];
    at::Tensor t = current(*m, name);
    if (!seen.emplace(t.unsafeGetTensorImpl(), e.names[k]).second) continue;  // tied
    if (!options.local_batches() && !is_dtensor(t)) {
      distribute_parameter(*m, name, layout, replicated);
      t = current(*m, name);
    }
    Param p;
    p.name = e.names[k];
    p.tensor = t;
    if (options.local_batches()) {
      for (int64_t d = 0; d < layout.ndim(); ++d) p.reduce_dims.push_back(d);
      p.local_sizes = t.sizes().vec();
    } else {
      const DTensorSpec& s = spec(t);
      for (int64_t d = 0; d < layout.ndim(); ++d)
        if (s.placement(d).is_replicate()) p.reduce_dims.push_back(d);
      p.local_sizes = s.local_sizes();
      p.grad_spec = dtensor_impl(t)->spec_ptr();
    }
    p.numel = 1;
    for (int64_t v : p.local_sizes) p.numel *= v;
    if (!t.requires_grad() || p.reduce_dims.empty()) continue;  // nothing to reduce
    state.params.push_back(std::move(p));
  }
}

// The buffers sync_buffers() broadcasts.
void add_buffers(const Entries& e, State& state, const ReplicateOptions& options) {
  if (options.local_batches()) {
    for (auto& [m, name] : e.buffers) state.buffers.push_back(current(*m, name));
    return;
  }
  // Buffers become replicated distributed tensors where Tessera can swap them (running
  // statistics then cover the global batch). A buffer kept in a member Tessera does not
  // know (a rotary table, say) stays plain: plain operands are replicated values anyway.
  const DeviceMesh& layout = state.mesh;
  const Placements replicated(layout.ndim(), Replicate());
  for (auto& [m, name] : e.buffers) {
    if (is_dtensor(current(*m, name))) continue;
    try {
      distribute_parameter(*m, name, layout, replicated);
    } catch (const c10::Error&) {
      // same outcome on every rank: it depends only on the module's type
    }
  }
  for (auto& [m, name] : e.buffers) {
    const at::Tensor b = current(*m, name);
    if (is_dtensor(b) && spec(b).mesh() == layout && !spec(b).has_partial()) {
      bool replicated_everywhere = true;
      for (const auto& pl : spec(b).placements()) replicated_everywhere &= pl.is_replicate();
      if (replicated_everywhere) state.buffers.push_back(b);
    }
  }
}

// Buckets in reverse registration order (gradients of the last layers are ready first), and
// the hooks that launch a bucket once its gradients are ready.
void bucket_and_hook(const std::shared_ptr<State>& state, const ReplicateOptions& options) {
  std::vector<size_t> order(state->params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  state->assign_buckets(order);
  std::weak_ptr<State> weak = state;
  for (size_t i = 0; i < state->params.size(); ++i) {
    Param& p = state->params[i];
    if (!options.local_batches()) {
      detail::set_gradient_owned(p.tensor.unsafeGetTensorImpl(), true);
      p.tensor.register_hook([weak, i](const at::Tensor& g) -> at::Tensor {
        if (auto s = weak.lock()) s->partial_form_of_existing_gradient(i, g);
        return g;
      });
    }
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    p.accumulator->add_post_hook(std::make_unique<ReadyHook>(weak, i));
  }
}

}  // namespace

std::shared_ptr<ReplicatedModule> replicate(torch::nn::Module& module, const DeviceMesh& mesh,
                                            const ReplicateOptions& options) {
  TORCH_CHECK(mesh.defined() && mesh.contains_this_rank(),
              "tessera: replicate: this rank is not part of the mesh ",
              mesh.defined() ? mesh.str() : std::string("(undefined)"));
  TORCH_CHECK(options.bucket_cap_mb() > 0 && options.first_bucket_cap_mb() > 0,
              "tessera: replicate: bucket capacities must be positive (got bucket_cap_mb=",
              options.bucket_cap_mb(), ", first_bucket_cap_mb=", options.first_bucket_cap_mb(),
              ")");
  auto state = std::make_shared<State>();
  // Distributed inputs live on the whole mesh (a slice such as mesh["dp"] lays parameters out
  // on its root, as tensor parallelism does), and a gradient is summed over every mesh dim
  // it is replicated on: the data-parallel dim and domain dims alike.
  state->mesh = options.local_batches() ? mesh : mesh.root();
  state->options = options;
  const Entries entries = collect_entries(module);
  check_parameters(entries, mesh, *state, options);
  broadcast_plain_values(entries, *state);
  add_parameters(entries, *state, options);
  add_buffers(entries, *state, options);
  bucket_and_hook(state, options);
  return std::shared_ptr<ReplicatedModule>(new ReplicatedModule(std::move(state)));
}

ReplicatedModule::ReplicatedModule(std::shared_ptr<State> state) : state_(std::move(state)) {}

ReplicatedModule::~ReplicatedModule() {
  if (!state_->local())
    for (auto& p : state_->params)
      detail::set_gradient_owned(p.tensor.unsafeGetTensorImpl(), false);
}

ReplicatedModule::NoSync::NoSync(ReplicatedModule& owner)
    : owner_(owner), previous_(owner.state_->require_sync) {
  owner_.state_->require_sync = false;
}
ReplicatedModule::NoSync::~NoSync() { owner_.state_->require_sync = previous_; }

void ReplicatedModule::set_requires_gradient_sync(bool sync) { state_->require_sync = sync; }
bool ReplicatedModule::requires_gradient_sync() const { return state_->require_sync; }
void ReplicatedModule::sync_buffers() { state_->sync_buffers(); }
const DeviceMesh& ReplicatedModule::mesh() const { return state_->mesh; }

std::vector<std::vector<std::string>> ReplicatedModule::bucket_parameter_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : state_->buckets) {
    out.emplace_back();
    for (size_t i : b.params) out.back().push_back(state_->params[i].name);
  }
  return out;
}

}  // namespace tessera
