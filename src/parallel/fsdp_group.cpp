// NOTE: [Gather on first touch]
// LibTorch modules have no forward hooks, so a group cannot gather its parameters when its
// module's forward() starts. Instead, forward() reads the *unsharded* parameter u (a
// replicated distributed tensor), whose local storage is freed while the group is sharded.
// Every op on distributed tensors goes through the fallback or the fast path, and both hand
// an argument with elements but no bytes to on_freed_storage (fallback_hooks.h) before
// anything reads it: that gathers the owning group (one all-gather for all its parameters).
// This covers forward, backward (autograd saved u or views of it; they share its storage)
// and activation recomputation alike.
//
// NOTE: [Freeing unsharded parameters]
// Resharding swaps the data of u's StorageImpl for nothing (nbytes 0) but keeps the
// StorageImpl, so the views autograd saved still alias it; gathering allocates into the same
// StorageImpl again. (FSDP2 does the same by resizing the storage to 0.)
//
// Forward frees: when forward first touches a group, every other unsharded group that is
// not an ancestor of it (an enclosing module, still running) and reshards after forward is
// freed. The last group forward touches stays unsharded for backward, which needs it first.
// Forward and backward are told apart by the autograd engine's current graph task (set on
// the threads running backward only): robust to grad mode, no_grad evaluation and re-entrant
// backward. In backward nothing is freed on touch; a group reshards once its gradients are
// reduced.
//
// Gradients: a post-hook on each u's grad accumulator marks it ready; when all of a group's
// are, one reduce-scatter (SUM) over the shard dim and one all-reduce per other dim where the
// gradient is Partial. Tessera's gradients are exact sums over the sharded activations
// (global means are taken by the loss), so nothing is divided. The first hook of a backward
// queues an engine final callback that reduces groups whose parameters were only partly used
// (in group order, identical on every rank) and reshards what is left unsharded.
//
// NOTE: [Prefetch]
// Each direction (forward, backward) records the order its touches gathered groups in. When
// a touch gathers group g as the k-th of this pass and g was also the k-th of the previous
// pass, the all-gather of the previous pass's (k+1)-th group is started at once (or of the
// groups set_modules_to_*_prefetch named): it runs on the backend's threads while g
// computes, and the touch that needs it only waits. Its storage stays empty until then, so
// that touch still comes through on_freed_storage. The orders are identical on every rank
// (the same module code runs everywhere), so every rank starts the same collectives in the
// same order. Backward recording its own order means it prefetches only what it gathered
// last time (not a weight backward never reads), and a changed control flow costs at most
// one useless all-gather, never a wrong value.
#include "fsdp_group.h"

#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "tensor/fallback_hooks.h"
#include "gradient_owner.h"
#include "tessera/comm/collectives.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::detail {

namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, std::weak_ptr<FsdpGroup>> by_storage;
  std::unordered_map<const void*, std::weak_ptr<FsdpContext>> contexts;  // by root mesh id
  int live_groups = 0;
};
Registry& registry() {
  static Registry r;
  return r;
}

const at::Tensor& local_of(const at::Tensor& t) { return dtensor_impl(t)->local(); }
c10::StorageImpl* storage_of(const at::Tensor& t) {
  return local_of(t).storage().unsafeGetStorageImpl();
}

bool in_backward() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }

void on_freed_storage(c10::ArrayRef<at::Tensor> locals) {
  std::vector<std::shared_ptr<FsdpGroup>> touched;
  bool unknown_freed = false;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const auto& local : locals) {
      if (!local.has_storage()) continue;
      auto it = r.by_storage.find(local.storage().unsafeGetStorageImpl());
      std::shared_ptr<FsdpGroup> g = it == r.by_storage.end() ? nullptr : it->second.lock();
      if (!g) {
        unknown_freed = unknown_freed || (local.numel() > 0 && local.storage().nbytes() == 0);
        continue;
      }
      bool seen = false;
      for (const auto& t : touched) seen = seen || t == g;
      if (!seen) touched.push_back(std::move(g));
    }
  }
  TORCH_CHECK(!unknown_freed, "tessera: an op got a distributed tensor whose local storage was ",
              "freed and that belongs to no live fully_shard group (was its module destroyed?)");
  bool any_sharded = false;
  for (const auto& g : touched) any_sharded = any_sharded || !g->unsharded();
  if (!any_sharded) return;
  const bool backward = in_backward();
  if (backward) touched.front()->context().advance();  // NOTE: [Gradient reduction]
  // A group left unsharded across an optimizer step (kept after a forward that no backward
  // followed, or with reshard_after_backward off) would feed forward old values: drop it so
  // its next use gathers the new ones.
  for (const auto& other : touched.front()->context().live())
    if (other->stale()) other->reshard();
  if (!backward) {
    for (const auto& other : touched.front()->context().live()) {
      if (!other->unsharded() || !other->reshard_after_forward()) continue;
      bool keep = false;
      for (const auto& t : touched) keep = keep || t == other || t->has_ancestor(other.get());
      if (!keep) other->reshard();
    }
  }
  for (const auto& g : touched) {
    if (g->unsharded()) continue;
    g->unshard();
    g->context().on_gathered(g, backward);
  }
}

struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(std::weak_ptr<FsdpGroup> g, size_t i) : group(std::move(g)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto g = group.lock()) g->on_grad_ready(index);
    return outputs;
  }
  std::weak_ptr<FsdpGroup> group;
  size_t index;
};

void allocate(c10::StorageImpl* s, size_t bytes) {
  if (s->nbytes() == bytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

void free_bytes(c10::StorageImpl* s) {
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(static_cast<size_t>(0));
}

// Changes with every step on the sharded parameter or on the original object it replaced
// (an optimizer built before fully_shard steps that one).
int64_t version_of(const FsdpParam& p) {
  return static_cast<int64_t>(p.sharded._version()) +
         user_parameter_version(p.sharded.unsafeGetTensorImpl());
}

at::Tensor flat_bytes(const at::Tensor& t) { return t.contiguous().view({-1}).view(at::kByte); }

}  // namespace

std::shared_ptr<FsdpContext> context_of(const DeviceMesh& root) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& slot = r.contexts[root.id()];
  auto ctx = slot.lock();
  if (!ctx) {
    ctx = std::make_shared<FsdpContext>();
    slot = ctx;
  }
  return ctx;
}

void FsdpGroup::activate(const std::shared_ptr<FsdpGroup>& group) {
  for (size_t i = 0; i < group->params.size(); ++i) {
    auto& p = group->params[i];
    if (!p.unsharded.requires_grad()) continue;
    p.accumulator = torch::autograd::impl::grad_accumulator(p.unsharded);
    p.accumulator->add_post_hook(std::make_unique<GradReadyHook>(group, i));
    ++group->requiring_grad_;
  }
  group->unsharded_ = true;
  group->reshard();
  // Forward computes in param_dtype: inputs meeting these parameters are cast to it.
  if (const auto dtype = group->options.mp_policy().param_dtype)
    for (const auto& p : group->params) register_compute_dtype(p.unsharded, *dtype);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& p : group->params) r.by_storage[storage_of(p.unsharded)] = group;
}

std::vector<std::shared_ptr<FsdpGroup>> FsdpContext::live() const {
  std::vector<std::shared_ptr<FsdpGroup>> out;
  for (const auto& w : groups)
    if (auto g = w.lock()) out.push_back(std::move(g));
  return out;
}

void FsdpContext::queue_final_callback() {
  if (callback_queued_) return;
  callback_queued_ = true;
  // The context outlives the callback: live groups hold it, and it runs within this backward.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
}

void FsdpContext::finish_backward() {
  callback_queued_ = false;
  auto all = live();
  for (const auto& g : all)
    if (g->any_ready()) g->finish_gradients();
  drain();
  for (const auto& g : all)
    if ((g->unsharded() || g->gathering()) && g->reshard_after_backward) g->reshard();
  forward_.roll();
  backward_.roll();
}

void FsdpContext::on_gathered(const std::shared_ptr<FsdpGroup>& g, bool backward) {
  Order& order = backward ? backward_ : forward_;
  // Forward passes without a backward between them (evaluation): a group gathered twice
  // starts a new pass.
  for (const auto& w : order.current)
    if (w.lock() == g) {
      order.roll();
      break;
    }
  order.current.push_back(g);
  // Prefetch what came next last time (or what the user named). Every rank gathers in the
  // same order, so every rank starts the same all-gathers in the same order.
  std::vector<std::shared_ptr<FsdpGroup>> next;
  const auto& chosen = backward ? g->backward_prefetch : g->forward_prefetch;
  if (chosen) {
    for (const auto& w : *chosen)
      if (auto n = w.lock()) next.push_back(std::move(n));
  } else {
    const size_t k = order.current.size() - 1;
    if (k + 1 < order.last.size() && order.last[k].lock() == g)
      if (auto n = order.last[k + 1].lock()) next.push_back(std::move(n));
  }
  for (const auto& n : next)
    if (n != g) n->unshard_start();
}

FsdpGroup::FsdpGroup(const torch::nn::Module& module, DeviceMesh mesh, FullyShardOptions opts,
                     std::shared_ptr<FsdpContext> context)
    : options(std::move(opts)),
      module_(&module),
      module_name_(module.name()),
      mesh_(std::move(mesh)),
      root_(mesh_.root()),
      shard_dim_(mesh_.dims_in_root().back()),
      context_(std::move(context)) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.live_groups++ == 0) set_freed_storage_handler(&on_freed_storage);
}

FsdpGroup::~FsdpGroup() {
  if (options.mp_policy().param_dtype)
    for (const auto& p : params)
      if (p.unsharded.defined()) unregister_compute_dtype(p.unsharded);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& p : params) {
    if (!p.unsharded.defined()) continue;
    auto it = r.by_storage.find(storage_of(p.unsharded));
    if (it != r.by_storage.end() && it->second.expired()) r.by_storage.erase(it);
  }
  if (--r.live_groups == 0) set_freed_storage_handler(nullptr);
}

c10::ScalarType FsdpGroup::compute_dtype(const at::Tensor& original) const {
  return options.mp_policy().param_dtype.value_or(original.scalar_type());
}

bool FsdpGroup::is_root() const {
  for (const auto& a : ancestors)
    if (!a.expired()) return false;
  return true;
}

bool FsdpGroup::reshard_after_forward() const {
  return options.reshard_after_forward().value_or(!is_root());
}

bool FsdpGroup::has_ancestor(const FsdpGroup* other) const {
  for (const auto& a : ancestors)
    if (auto g = a.lock(); g.get() == other) return true;
  return false;
}

void FsdpGroup::unshard_start() {
  if (stale()) reshard();
  if (unsharded_ || gathering_) return;
  at::NoGradGuard no_grad;
  const int64_t n = root_.size(shard_dim_);
  if (n == 1) {  // this rank holds every row: a copy (and cast), no buffer in between
    for (auto& p : params) {
      const at::Tensor& u = local_of(p.unsharded);
      allocate(storage_of(p.unsharded), static_cast<size_t>(u.numel()) * u.element_size());
      u.copy_(local_of(p.sharded));
      p.gathered_version = version_of(p);
    }
    unsharded_ = true;
    return;
  }
  // One flat byte buffer per rank: its rows of every parameter, in the compute dtype. Rank
  // r's piece is sum_j rows_j[r] * row_bytes_j long. The unsharded storage stays empty until
  // the all-gather is finished, so a touch in between still comes here to wait for it.
  std::vector<at::Tensor> mine;
  std::vector<int64_t> piece(n, 0);
  for (auto& p : params) {
    const at::Tensor& u = local_of(p.unsharded);
    mine.push_back(flat_bytes(local_of(p.sharded).to(u.scalar_type())));
    p.gathered_version = version_of(p);
    for (int64_t r = 0; r < n; ++r) piece[r] += p.rows[r] * p.row_numel * u.element_size();
  }
  gather_ = comm::all_gather_start(root_.group(shard_dim_), at::cat(mine), piece);
  gathering_ = true;
}

void FsdpGroup::unshard() {
  unshard_start();
  if (unsharded_) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> pieces = gather_.wait();
  gathering_ = false;
  for (auto& p : params) {
    const at::Tensor& u = local_of(p.unsharded);
    allocate(storage_of(p.unsharded), static_cast<size_t>(u.numel()) * u.element_size());
  }
  for (size_t r = 0; r < pieces.size(); ++r) {
    int64_t pos = 0;
    for (auto& p : params) {
      const at::Tensor& u = local_of(p.unsharded);
      const int64_t row_bytes = p.row_numel * u.element_size();
      const int64_t len = p.rows[r] * row_bytes;
      if (len > 0)
        u.view({-1})
            .view(at::kByte)
            .narrow(0, p.row_offsets[r] * row_bytes, len)
            .copy_(pieces[r].narrow(0, pos, len));
      pos += len;
    }
    pieces[r] = at::Tensor();  // each received block goes as soon as it is copied out
  }
  unsharded_ = true;
}

bool FsdpGroup::stale() const {
  if (!unsharded_ && !gathering_) return false;
  for (const auto& p : params)
    if (version_of(p) != p.gathered_version) return true;
  return false;
}

void FsdpGroup::reshard() {
  if (gathering_) {
    gather_.wait();  // the backend may still write into its buffers
    gathering_ = false;
  }
  if (!unsharded_) return;
  for (auto& p : params) free_bytes(storage_of(p.unsharded));
  unsharded_ = false;
}

void FsdpGroup::on_grad_ready(size_t index) {
  context_->queue_final_callback();
  auto& p = params.at(index);
  if (!p.ready) {
    p.ready = true;
    ++ready_;
  }
  if (ready_ == requiring_grad_) finish_gradients();
}

void FsdpGroup::finish_gradients() {
  std::vector<size_t> ready;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].ready && params[i].unsharded.grad().defined()) ready.push_back(i);
    params[i].ready = false;
  }
  ready_ = 0;
  // The parameters go first: their memory is free before the reduce-scatter buffer is taken.
  if (reshard_after_backward) reshard();
  // No sync: the unsharded gradients stay and keep accumulating (torch's no_sync).
  if (requires_gradient_sync && !ready.empty()) context_->stage(stage_reduction(ready));
}

// One gradient on its way to the sharded parameter.
struct ReduceItem {
  size_t index = 0;
  at::Tensor grad;         // local, as autograd left it (any strides); dropped once staged
  Placements placements;   // as reduced: Partial where summed (or averaged)
  int64_t replicas = 1;    // ranks whose replicated gradients are averaged
  bool scattered = false;  // part of the reduce-scatter buffer (else `shard` is set at staging)
  int64_t offset = 0;      // in this rank's block of the buffer
  at::Tensor shard;        // this rank's rows, reduce dtype (flat once reduced)
};

// See NOTE: [Gradient reduction].
struct GradientReduction {
  std::weak_ptr<FsdpGroup> group;
  std::vector<ReduceItem> items;
  at::Tensor blocks;  // staged: n blocks, block r = rank r's rows of every scattered gradient
  comm::PendingReduceScatter scatter;
  bool started = false;

  void start();
  void finish();
};

namespace {

// The gradient of each: Partial(sum) or Replicate on every root dim (anything else, e.g. a
// rule that left it sharded, is redistributed to Replicate first). No copies.
std::vector<ReduceItem> gradients_to_reduce(const std::vector<FsdpParam>& params,
                                            const std::vector<size_t>& ready,
                                            const DeviceMesh& root) {
  std::vector<ReduceItem> items;
  for (size_t i : ready) {
    at::Tensor g = params[i].unsharded.grad();
    const auto& s = spec(g);
    // The parameter's own layout (replicated over the data-parallel dims, tensor-parallel
    // shards kept), a sum wherever the gradient is one and the parameter is replicated.
    const DTensorSpec& like = spec(params[i].unsharded);
    Placements target;
    for (int64_t d = 0; d < root.ndim(); ++d) {
      const Placement& pl = s.placement(d);
      const bool sum = pl.is_partial() && pl.reduce_op() == PartialOp::Sum;
      target.push_back(sum && like.placement(d).is_replicate() ? pl : like.placement(d));
    }
    auto target_spec = std::make_shared<const DTensorSpec>(root, target, like.sizes(),
                                                           g.scalar_type(), like.shard_tables());
    if (s != *target_spec) g = redistribute(g, target_spec);
    ReduceItem item;
    item.index = i;
    item.grad = local_of(g);
    item.placements = target;
    items.push_back(std::move(item));
    // NOTE: [Replicated gradients are averaged] (data_parallel.cpp), as replicate does: a
    // gradient replicated over a data-parallel dim is one value everywhere (a replicated
    // batch) or each rank's own (plain per-rank batches, FSDP2's habit); the mean over the dim
    // is right in both, and is FSDP2's average in the second. So it is reduced as a sum and
    // divided by the number of replicas.
    for (int64_t d = 0; d < root.ndim(); ++d) {
      if (root.size(d) == 1 || !target[d].is_replicate() || !like.placement(d).is_replicate())
        continue;
      items.back().placements[static_cast<size_t>(d)] = Partial();
      items.back().replicas *= root.size(d);
    }
  }
  return items;
}

// Rows [offset, offset + rows) of a local gradient (dim 0), any strides.
at::Tensor rows_of(const at::Tensor& grad, const FsdpParam& p, int64_t r) {
  return grad.narrow(0, p.row_offsets[r], p.rows[r]);
}

// Every other dim where the gradient is a sum (HSDP's replicate dim, domain dims): one
// all-reduce of the shards.
void all_reduce_other_dims(std::vector<ReduceItem>& items, const DeviceMesh& root,
                           int64_t shard_dim) {
  for (int64_t d = 0; d < root.ndim(); ++d) {
    if (d == shard_dim || root.size(d) == 1) continue;
    std::vector<ReduceItem*> partial;
    for (auto& it : items)
      if (it.placements[d].is_partial()) partial.push_back(&it);
    if (partial.empty()) continue;
    std::vector<at::Tensor> parts;
    for (auto* it : partial) parts.push_back(it->shard.reshape({-1}));
    at::Tensor summed = comm::all_reduce(root.group(d), at::cat(parts), PartialOp::Sum);
    int64_t off = 0;
    for (auto* it : partial) {
      it->shard = summed.narrow(0, off, it->shard.numel());
      off += it->shard.numel();
    }
  }
}

// The reduced shards added to the sharded parameters' gradients.
void accumulate_sharded_gradients(const std::vector<ReduceItem>& items,
                                  std::vector<FsdpParam>& params) {
  for (const auto& it : items) {
    auto& p = params[it.index];
    const DTensorImpl* sharded = dtensor_impl(p.sharded);
    at::Tensor local =
        it.shard.to(sharded->local().scalar_type()).reshape(sharded->local().sizes());
    // Its own storage: a shard may be a view of the whole reduce-scatter block.
    if (local.storage().nbytes() != local.nbytes())
      local = local.clone(at::MemoryFormat::Contiguous);
    at::Tensor grad = make_dtensor(local, sharded->spec_ptr());
    detail::drop_gradient_the_user_dropped(p.sharded.unsafeGetTensorImpl());
    if (p.sharded.grad().defined())
      p.sharded.mutable_grad().add_(grad);
    else
      p.sharded.mutable_grad() = grad;
    // An optimizer built before fully_shard steps the original objects (now this rank's rows).
    detail::hand_gradient_to_user(p.sharded.unsafeGetTensorImpl());
  }
}

}  // namespace

// NOTE: [Gradient reduction]
// A group's gradients are ready inside the post-hook of its last gradient accumulator, where
// the autograd engine still holds that gradient. Staging (in the hook) copies every ready
// gradient's rows straight into one reduce-scatter buffer (rank r's rows of each parameter,
// back to back, block r; the copy reads any strides and converts to the reduce dtype: one
// copy, no contiguous() or cat in between) and drops the unsharded gradients. The reduce-
// scatter starts at the next event of this backward (another group's hook, a gather, the
// engine's final callback), once the engine has let the gradient go, so a group's gradient and
// the backend's copy of the buffer are never alive together; it then runs on the backend's
// threads while the following groups compute. At most one runs at a time: starting one
// finishes the one before (summing over the other mesh dims and adding the shards to the
// sharded parameters' gradients). The final callback finishes all, before backward returns.
// Every rank stages and starts in the same order (the same hooks fire everywhere).
void GradientReduction::start() {
  started = true;
  auto g = group.lock();
  if (!g || !blocks.defined()) return;
  scatter = comm::reduce_scatter_start(g->root().group(g->shard_dim()), std::move(blocks));
}

void GradientReduction::finish() {
  auto g = group.lock();
  if (!g) return;
  at::NoGradGuard no_grad;
  if (scatter.pending()) {
    const at::Tensor mine = scatter.wait();
    const int64_t me = g->root().local_rank(g->shard_dim());
    for (auto& it : items) {
      const auto& p = g->params[it.index];
      if (it.scattered) it.shard = mine.narrow(0, it.offset, p.rows[me] * p.row_numel);
    }
  }
  for (auto& it : items)
    if (it.replicas > 1) it.shard = it.shard.div(static_cast<double>(it.replicas));
  all_reduce_other_dims(items, g->root(), g->shard_dim());
  accumulate_sharded_gradients(items, g->params);
}

std::unique_ptr<GradientReduction> FsdpGroup::stage_reduction(const std::vector<size_t>& ready) {
  at::NoGradGuard no_grad;
  auto job = std::make_unique<GradientReduction>();
  job->group = weak_from_this();
  job->items = gradients_to_reduce(params, ready, root_);
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  for (const auto& it : job->items)
    dtype = dtype == c10::ScalarType::Undefined ? it.grad.scalar_type()
                                                : at::promote_types(dtype, it.grad.scalar_type());
  dtype = options.mp_policy().reduce_dtype.value_or(dtype);
  const int64_t n = root_.size(shard_dim_);
  const int64_t me = root_.local_rank(shard_dim_);
  // Block r holds rank r's rows of every gradient summed over the shard dim; blocks are padded
  // to the largest (rows differ by at most one per parameter).
  int64_t block = 0;
  for (int64_t r = 0; r < n; ++r) {
    int64_t len = 0;
    for (auto& it : job->items) {
      it.scattered = n > 1 && it.placements[shard_dim_].is_partial();
      if (it.scattered) len += params[it.index].rows[r] * params[it.index].row_numel;
    }
    block = std::max(block, len);
  }
  if (block > 0) {
    job->blocks = at::empty({n * block}, job->items.front().grad.options().dtype(dtype));
    for (int64_t r = 0; r < n; ++r) {
      int64_t pos = r * block;
      for (auto& it : job->items) {
        if (!it.scattered) continue;
        const auto& p = params[it.index];
        at::Tensor src = rows_of(it.grad, p, r);
        if (r == me) it.offset = pos - r * block;
        job->blocks.narrow(0, pos, src.numel()).view(src.sizes()).copy_(src);
        pos += src.numel();
      }
      job->blocks.narrow(0, pos, (r + 1) * block - pos).zero_();  // no stale bytes on the wire
    }
  }
  for (auto& it : job->items) {
    if (!it.scattered) it.shard = rows_of(it.grad, params[it.index], me).to(dtype);  // no copy
    it.grad = at::Tensor();
    params[it.index].unsharded.mutable_grad() = at::Tensor();
  }
  return job;
}

FsdpContext::FsdpContext() = default;
FsdpContext::~FsdpContext() = default;

void FsdpContext::stage(std::unique_ptr<GradientReduction> reduction) {
  advance();
  reductions_.push_back(std::move(reduction));
}

void FsdpContext::advance() {
  if (reductions_.empty() || reductions_.back()->started) return;
  while (reductions_.front()->started) {
    auto done = std::move(reductions_.front());
    reductions_.pop_front();
    done->finish();
  }
  reductions_.front()->start();
}

void FsdpContext::drain() {
  while (!reductions_.empty()) {
    auto r = std::move(reductions_.front());
    reductions_.pop_front();
    if (!r->started) r->start();
    r->finish();
  }
}

}  // namespace tessera::detail
