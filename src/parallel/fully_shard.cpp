// fully_shard: forming a parameter group and swapping the module's parameters. The runtime
// (gathering, freeing, reducing) is in fsdp_group.cpp.
#include "tessera/parallel/fully_shard.h"

#include <mutex>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp_group.h"
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

struct Candidate {
  torch::nn::Module* owner;
  std::string name, fqn;
  at::Tensor value;
};

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
  auto context = detail::context_of(root);
  const auto existing = context->live();
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

  // Check everything before changing anything; every check reads replicated information
  // (module structure, shapes, placements), so every rank raises the same error.
  std::vector<Candidate> candidates;
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    torch::nn::Module& owner = *item.value();
    for (const auto& param : owner.named_parameters(/*recurse=*/false)) {
      const at::Tensor& t = param.value();
      const std::string fqn = qualified(item.key(), param.key());
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
        TORCH_CHECK(s.is_replicated(), where, ": parameter \"", fqn, "\" is already distributed ",
                    "as ", s.str(), "; fully_shard takes plain or replicated parameters (sharding ",
                    "a tensor-parallel or domain-sharded parameter again is not supported yet)");
      }
      check_splittable(owner, param.key());
      candidates.push_back({&owner, param.key(), fqn, t});
    }
  }

  auto group = std::make_shared<FsdpGroup>(module, mesh, std::move(options), context);
  const int64_t shard_dim = mesh.dims_in_root().back();
  Placements sharded_placements(root.ndim(), Replicate());
  sharded_placements[shard_dim] = Shard(0);
  const Placements replicated(root.ndim(), Replicate());
  const int64_t n = root.size(shard_dim);
  const int64_t me = root.local_rank(shard_dim);
  for (const auto& c : candidates) {
    // A tied parameter: one group entry, registered under each name.
    bool tied = false;
    for (size_t k = 0; k < group->originals.size() && !tied; ++k) {
      if (group->originals[k]._unsafe_get_target() != c.value.unsafeGetTensorImpl()) continue;
      group->params[k].owners.emplace_back(c.owner, c.name);
      tied = true;
    }
    if (tied) continue;
    at::NoGradGuard no_grad;
    const at::Tensor full = (is_dtensor(c.value) ? to_local(c.value) : c.value).detach();
    FsdpParam p;
    p.owners.emplace_back(c.owner, c.name);
    p.fqn = c.fqn;
    p.rows = chunk_sizes(full.size(0), n);
    int64_t off = 0;
    for (int64_t r : p.rows) p.row_offsets.push_back(off), off += r;
    p.row_numel = full.size(0) == 0 ? 0 : full.numel() / full.size(0);
    auto sharded_spec = std::make_shared<const DTensorSpec>(
        root, sharded_placements, full.sizes().vec(), full.scalar_type());
    // A copy of this rank's rows, so the full value's memory goes with the original.
    p.sharded = make_dtensor(full.narrow(0, p.row_offsets[me], p.rows[me]).clone(),
                             sharded_spec)
                    .requires_grad_(c.value.requires_grad());
    const auto compute = group->compute_dtype_of(full);
    auto unsharded_spec = std::make_shared<const DTensorSpec>(root, replicated,
                                                              full.sizes().vec(), compute);
    p.unsharded = make_dtensor(at::empty(full.sizes(), full.options().dtype(compute)),
                               unsharded_spec)
                      .requires_grad_(c.value.requires_grad());
    group->originals.emplace_back(c.value.getIntrusivePtr());
    group->params.push_back(std::move(p));
  }
  for (auto& p : group->params)
    for (auto& [owner, name] : p.owners) split_parameter(*owner, name, p.sharded, p.unsharded);
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
