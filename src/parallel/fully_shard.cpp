// fully_shard: forming a parameter group and swapping the module's parameters. The runtime
// (gathering, freeing, reducing) is in fsdp_group.cpp.
#include "tessera/parallel/fully_shard.h"

#include <mutex>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp_group.h"
#include "gradient_owner.h"
#include "tp_boundary.h"
#include "tessera/parallel/module.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

namespace {

using detail::FsdpGroup;
using detail::FsdpParam;

// Groups by the module they were made for. The module is held weakly: a dead module's entry
// is dropped (with its group) on the next registry access.
struct ModuleEntry {
  const torch::nn::Module* module;
  std::weak_ptr<torch::nn::Module> alive;
  bool owned;  // false: the module is not owned by a shared_ptr, liveness unknown (kept)
  std::shared_ptr<FSDPModule> handle;
};
struct Modules {
  std::mutex mu;
  std::vector<ModuleEntry> entries;
};
Modules& modules() {
  static Modules m;
  return m;
}

void prune_locked(Modules& m) {
  std::vector<std::shared_ptr<FSDPModule>> dying;  // destroyed outside the erase loop
  for (auto it = m.entries.begin(); it != m.entries.end();) {
    if (it->owned && it->alive.expired()) {
      dying.push_back(std::move(it->handle));
      it = m.entries.erase(it);
    } else {
      ++it;
    }
  }
}

std::shared_ptr<FSDPModule> find_locked(Modules& m, const torch::nn::Module& module) {
  for (const auto& e : m.entries)
    if (e.module == &module && (!e.owned || !e.alive.expired())) return e.handle;
  return nullptr;
}

std::string qualified(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// The optimizer's parameter: `like` (a parameter's layout on the root mesh, Replicate over
// `shard_dim`) with dim 0 also cut over `shard_dim`, innermost: rank r along shard_dim holds
// torch.chunk's piece r of the rows it would hold under `like`. Without other cuts of dim 0
// that is Shard(0) on the root. With them (a tensor-parallel Shard(0)), the rows nest inside
// those shards; shards of one dim nest in mesh-dim order (NOTE: [Shard tables]), so the
// parameter lives on the root permuted to put shard_dim last.
SpecPtr sharded_spec_of(const DTensorSpec& like, int64_t shard_dim) {
  const DeviceMesh& root = like.mesh();
  const int64_t n = root.size(shard_dim);
  // Other mesh dims already cut dim 0 (shard_dim is Replicate in `like`).
  const bool nested = !like.mesh_dims_sharding(0).empty();
  ShardTable rows;
  for (int64_t piece : nested ? like.shard_table(0) : ShardTable{like.sizes().at(0)})
    for (int64_t r : chunk_sizes(piece, n)) rows.push_back(r);
  std::vector<int64_t> order;
  for (int64_t d = 0; d < root.ndim(); ++d)
    if (d != shard_dim || !nested) order.push_back(d);
  if (nested) order.push_back(shard_dim);
  Placements placements;
  for (int64_t d : order) placements.push_back(d == shard_dim ? Shard(0) : like.placement(d));
  auto tables = like.shard_tables();
  tables.at(0) = rows;
  return std::make_shared<const DTensorSpec>(root.permute(order), std::move(placements),
                                             like.sizes(), like.dtype(), std::move(tables));
}

struct Candidate {
  torch::nn::Module* owner;
  std::string name, fqn;
  at::Tensor value;
};

// The parameters the group takes: every one not owned by an earlier group. Checks everything
// before changing anything; every check reads replicated information (module structure,
// shapes, placements), so every rank raises the same error.
std::vector<Candidate> collect_candidates(torch::nn::Module& module, const DeviceMesh& root,
                                          const std::vector<int64_t>& dp_dims,
                                          const std::vector<std::shared_ptr<FsdpGroup>>& existing,
                                          const std::string& where) {
  auto owned_by_group = [&](const at::Tensor& t) -> std::shared_ptr<FsdpGroup> {
    for (const auto& g : existing)
      for (const auto& p : g->params)
        if (p.sharded.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return g;
    return nullptr;
  };
  auto consumed_by_group = [&](const at::Tensor& t) -> std::shared_ptr<FsdpGroup> {
    for (const auto& g : existing)
      for (const auto& o : g->originals)
        if (o._unsafe_get_target() == t.unsafeGetTensorImpl()) return g;
    return nullptr;
  };

  std::vector<Candidate> candidates;
  for (const auto& [prefix, owner_ptr] : modules_with_self(module)) {
    torch::nn::Module& owner = *owner_ptr;
    for (const auto& param : owner.named_parameters(/*recurse=*/false)) {
      const at::Tensor& t = param.value();
      const std::string fqn = qualified(prefix, param.key());
      if (!t.defined() || owned_by_group(t)) continue;
      if (auto other = consumed_by_group(t)) {
        TORCH_CHECK(false, where, ": parameter \"", fqn, "\" is the same tensor as a parameter ",
                    "fully_shard(", other->module_name(), ") already sharded (a tied parameter); ",
                    "tied parameters must be in one group: apply fully_shard to a module that ",
                    "contains every module using it, and not to those modules alone");
      }
      TORCH_CHECK(t.dim() >= 1, where, ": parameter \"", fqn, "\" is a scalar; fully_shard ",
                  "shards dim 0. Keep it in a module left out of fully_shard, or make it 1-D");
      if (is_dtensor(t)) {
        const auto& s = spec(t);
        TORCH_CHECK(s.mesh() == root, where, ": parameter \"", fqn, "\" lives on ", s.mesh().str(),
                    ", not on ", root.str(), " (the root of the mesh given); ",
                    "apply tensor parallelism and fully_shard to slices of one mesh");
        bool ok = !s.has_partial();
        for (int64_t d : dp_dims) ok = ok && s.placement(d).is_replicate();
        TORCH_CHECK(ok, where, ": parameter \"", fqn, "\" is distributed as ", s.str(),
                    "; fully_shard shards parameters that are Replicate over its mesh dims ",
                    shape_str(dp_dims), " and not Partial (tensor-parallel shards on other dims ",
                    "are kept)");
      }
      check_splittable(owner, param.key());
      candidates.push_back({&owner, param.key(), fqn, t});
    }
  }
  return candidates;
}

// The group's entry for one parameter: this rank's rows (what the optimizer steps) and the
// unsharded tensor forward reads, gathered on first use.
FsdpParam make_param(const Candidate& c, const FsdpGroup& group, const DeviceMesh& root,
                     int64_t shard_dim) {
  const int64_t n = root.size(shard_dim);
  const int64_t me = root.local_rank(shard_dim);
  at::NoGradGuard no_grad;
  // What forward reads: the parameter's own layout (replicated, or a tensor-parallel
  // shard), gathered from the data-parallel rows of this rank's local tensor.
  const at::Tensor local = (is_dtensor(c.value) ? to_local(c.value) : c.value).detach();
  const DTensorSpec like = is_dtensor(c.value)
                               ? spec(c.value)
                               : DTensorSpec(root, Placements(root.ndim(), Replicate()),
                                             local.sizes().vec(), local.scalar_type());
  FsdpParam p;
  p.owners.emplace_back(c.owner, c.name);
  p.fqn = c.fqn;
  p.rows = chunk_sizes(local.size(0), n);
  int64_t off = 0;
  for (int64_t r : p.rows) p.row_offsets.push_back(off), off += r;
  p.row_numel = local.size(0) == 0 ? 0 : local.numel() / local.size(0);
  // A copy of this rank's rows, so the full value's memory goes with the original.
  p.sharded = make_dtensor(local.narrow(0, p.row_offsets[me], p.rows[me]).clone(),
                           sharded_spec_of(like, shard_dim))
                  .requires_grad_(c.value.requires_grad());
  const auto compute = group.compute_dtype_of(local);
  auto unsharded_spec = std::make_shared<const DTensorSpec>(root, like.placements(), like.sizes(),
                                                            compute, like.shard_tables());
  p.unsharded =
      make_dtensor(at::empty(local.sizes(), local.options().dtype(compute)), unsharded_spec)
          .requires_grad_(c.value.requires_grad());
  // A tensor-parallel module finds its boundary through the parameter its forward reads
  // (NOTE: [Module boundaries without hooks]): that is now the unsharded one, whose
  // StorageImpl survives resharding.
  if (auto boundary = tp::detail::boundary_of(c.value))
    tp::detail::tag_parameter(p.unsharded, std::move(boundary));
  return p;
}

// Adds the candidates to the group (a tied parameter: one entry, registered under each
// name); returns the original tensors, parallel to group.originals.
std::vector<at::Tensor> add_parameters(FsdpGroup& group, const std::vector<Candidate>& candidates,
                                       const DeviceMesh& root, int64_t shard_dim) {
  std::vector<at::Tensor> original_values;
  for (const auto& c : candidates) {
    bool tied = false;
    for (size_t k = 0; k < group.originals.size() && !tied; ++k) {
      if (group.originals[k]._unsafe_get_target() != c.value.unsafeGetTensorImpl()) continue;
      group.params[k].owners.emplace_back(c.owner, c.name);
      tied = true;
    }
    if (tied) continue;
    group.params.push_back(make_param(c, group, root, shard_dim));
    group.originals.emplace_back(c.value.getIntrusivePtr());
    original_values.push_back(c.value);
  }
  return original_values;
}

}  // namespace

std::shared_ptr<FSDPModule> fully_shard(torch::nn::Module& module, const DeviceMesh& mesh,
                                        FullyShardOptions options) {
  const std::string where = "tessera: fully_shard(" + module.name() + ")";
  TORCH_CHECK(mesh.defined() && (mesh.ndim() == 1 || mesh.ndim() == 2), where,
              ": needs a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), got ",
              mesh.defined() ? mesh.str() : std::string("an undefined mesh"),
              "; slice a larger mesh, e.g. mesh[\"dp\"]");
  TORCH_CHECK(mesh.contains_this_rank(), where, ": this rank is not in ", mesh.str());
  auto& registry = modules();
  {
    std::lock_guard<std::mutex> lock(registry.mu);
    prune_locked(registry);
    TORCH_CHECK(!find_locked(registry, module), where,
                ": already applied to this module; apply it once per module, bottom-up");
  }
  const DeviceMesh root = mesh.root();
  const std::vector<int64_t> dp_dims = mesh.dims_in_root();
  auto context = detail::context_of(root);
  const auto existing = context->live();
  const std::vector<Candidate> candidates =
      collect_candidates(module, root, dp_dims, existing, where);
  auto group = std::make_shared<FsdpGroup>(module, mesh, std::move(options), context);
  const std::vector<at::Tensor> original_values =
      add_parameters(*group, candidates, root, dp_dims.back());
  for (size_t k = 0; k < group->params.size(); ++k) {
    auto& p = group->params[k];
    for (auto& [owner, name] : p.owners) split_parameter(*owner, name, p.sharded, p.unsharded);
    // An optimizer built before fully_shard keeps stepping the original object, now a view
    // of this rank's rows (NOTE: [Keeping the user's parameter objects]).
    detail::adopt_user_parameter(original_values[k], p.sharded);
  }
  FsdpGroup::activate(group);
  // Groups of enclosing modules are made later (bottom-up): tell the inner ones.
  for (const auto& sub : module.modules(/*include_self=*/false))
    for (const auto& g : existing)
      if (g->module() == sub.get()) g->ancestors.push_back(group);
  context->groups.push_back(group);

  auto handle = std::make_shared<FSDPModule>(group);
  std::lock_guard<std::mutex> lock(registry.mu);
  auto alive = module.weak_from_this();
  registry.entries.push_back({&module, alive, !alive.expired(), handle});
  return handle;
}

std::shared_ptr<FSDPModule> fsdp_module_of(const torch::nn::Module& module) {
  auto& registry = modules();
  std::lock_guard<std::mutex> lock(registry.mu);
  prune_locked(registry);
  return find_locked(registry, module);
}

torch::OrderedDict<std::string, at::Tensor> full_state_dict(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  torch::OrderedDict<std::string, at::Tensor> out;
  auto full = [](const at::Tensor& t) {
    return t.defined() && is_dtensor(t) ? full_tensor(t.detach()) : t.detach();
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    out.insert(item.key(), full(item.value()));
  for (const auto& item : module.named_buffers(/*recurse=*/true))
    out.insert(item.key(), full(item.value()));
  return out;
}

void FSDPModule::unshard() { group_->unshard(); }
void FSDPModule::reshard() { group_->reshard(); }
bool FSDPModule::is_unsharded() const { return group_->unsharded(); }
void FSDPModule::set_requires_gradient_sync(bool requires_sync) {
  group_->requires_gradient_sync = requires_sync;
}
void FSDPModule::set_reshard_after_forward(bool reshard) {
  group_->options.reshard_after_forward(reshard);
}
void FSDPModule::set_reshard_after_backward(bool reshard) {
  group_->reshard_after_backward = reshard;
}
namespace {
std::vector<std::weak_ptr<FsdpGroup>> groups_of(
    const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  std::vector<std::weak_ptr<FsdpGroup>> out;
  for (const auto& m : modules) {
    TORCH_CHECK(m, "tessera: set_modules_to_*_prefetch: a null FSDPModule");
    out.push_back(m->group());
  }
  return out;
}
}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(
    const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  group_->forward_prefetch = groups_of(modules);
}
void FSDPModule::set_modules_to_backward_prefetch(
    const std::vector<std::shared_ptr<FSDPModule>>& modules) {
  group_->backward_prefetch = groups_of(modules);
}
const DeviceMesh& FSDPModule::mesh() const { return group_->mesh(); }
std::vector<std::string> FSDPModule::parameter_names() const {
  std::vector<std::string> names;
  for (const auto& p : group_->params) names.push_back(p.fqn);
  return names;
}
std::vector<at::Tensor> FSDPModule::unsharded_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : group_->params) out.push_back(p.unsharded);
  return out;
}

}  // namespace tessera
