// StateDict, the model / optimizer state helpers, and export to / import from LibTorch's
// own single-file module format.
#include <filesystem>
#include <map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "format.h"
#include "tessera/comm/agree.h"
#include "tessera/compat.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::checkpoint {

void StateDict::insert(const std::string& name, Value value) {
  TORCH_CHECK(!contains(name), "tessera: StateDict: \"", name, "\" is already in the state");
  items_.emplace_back(name, std::move(value));
}

void StateDict::merge(const StateDict& other) {
  for (const auto& [name, value] : other.items_) insert(name, value);
}

bool StateDict::contains(const std::string& name) const {
  for (const auto& item : items_)
    if (item.first == name) return true;
  return false;
}

const Value& StateDict::at(const std::string& name) const {
  for (const auto& item : items_)
    if (item.first == name) return item.second;
  TORCH_CHECK(false, "tessera: StateDict: no entry \"", name, "\"");
}
Value& StateDict::at(const std::string& name) {
  return const_cast<Value&>(static_cast<const StateDict&>(*this).at(name));
}

const at::Tensor& StateDict::tensor(const std::string& name) const {
  const auto* t = std::get_if<at::Tensor>(&at(name));
  TORCH_CHECK(t, "tessera: StateDict: \"", name, "\" is not a tensor");
  return *t;
}
int64_t StateDict::integer(const std::string& name) const {
  const auto* v = std::get_if<int64_t>(&at(name));
  TORCH_CHECK(v, "tessera: StateDict: \"", name, "\" is not an integer");
  return *v;
}
double StateDict::real(const std::string& name) const {
  const auto* v = std::get_if<double>(&at(name));
  TORCH_CHECK(v, "tessera: StateDict: \"", name, "\" is not a double");
  return *v;
}

StateDict model_state(const torch::nn::Module& module, const std::string& prefix) {
  StateDict s;
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    if (item.value().defined()) s.insert(prefix + item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true))
    if (item.value().defined()) s.insert(prefix + item.key(), item.value());
  return s;
}

namespace {

// The module's name of each optimizer parameter, in parameter-group order.
std::vector<std::pair<std::string, at::Tensor>> named_optimizer_parameters(
    torch::optim::Optimizer& optimizer, const torch::nn::Module& module) {
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    names[item.value().unsafeGetTensorImpl()] = item.key();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      auto it = names.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != names.end(), "tessera: checkpoint::optimizer_state: the optimizer steps ",
                  "a parameter that is not one of the module's (", shape_str(p.sizes().vec()),
                  "); give the module whose parameters() the optimizer was built from. An ",
                  "optimizer built before replicate / fully_shard / distribute_module steps the ",
                  "original tensors: build it after them to checkpoint it");
      out.emplace_back(it->second, p);
    }
  return out;
}

template <class ParamState>
ParamState& adam_like_state(torch::optim::Optimizer& optimizer, const at::Tensor& p, bool amsgrad) {
  auto& states = optimizer.state();
  const auto key = compat::optimizer_state_key(states, p);
  auto it = states.find(key);
  if (it == states.end()) {
    // What the optimizer's first step creates, so loading can fill it in place.
    auto st = std::make_unique<ParamState>();
    st->step(0);
    st->exp_avg(at::zeros_like(p));
    st->exp_avg_sq(at::zeros_like(p));
    if (amsgrad) st->max_exp_avg_sq(at::zeros_like(p));
    it = states.emplace(key, std::move(st)).first;
  }
  return static_cast<ParamState&>(*it->second);
}

template <class ParamState, class Options>
void add_adam_like(StateDict& s, torch::optim::Optimizer& optimizer,
                   const std::vector<std::pair<std::string, at::Tensor>>& params,
                   const std::string& prefix) {
  size_t i = 0;
  for (auto& group : optimizer.param_groups()) {
    const bool amsgrad = static_cast<Options&>(group.options()).amsgrad();
    for (size_t k = 0; k < group.params().size(); ++k, ++i) {
      const auto& [name, p] = params[i];
      auto& st = adam_like_state<ParamState>(optimizer, p, amsgrad);
      s.insert(prefix + name + ".exp_avg", st.exp_avg());
      s.insert(prefix + name + ".exp_avg_sq", st.exp_avg_sq());
      if (amsgrad) s.insert(prefix + name + ".max_exp_avg_sq", st.max_exp_avg_sq());
      s.insert(prefix + name + ".step", static_cast<int64_t>(st.step()));
    }
  }
}

}  // namespace

StateDict optimizer_state(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                          const std::string& prefix) {
  at::NoGradGuard no_grad;
  StateDict s;
  const auto params = named_optimizer_parameters(optimizer, module);
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g)
    s.insert(prefix + "param_groups." + std::to_string(g) + ".lr",
             optimizer.param_groups()[g].options().get_lr());
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    add_adam_like<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(s, optimizer, params,
                                                                             prefix);
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    add_adam_like<torch::optim::AdamParamState, torch::optim::AdamOptions>(s, optimizer, params,
                                                                           prefix);
  } else if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    size_t i = 0;
    auto& states = optimizer.state();
    for (auto& group : optimizer.param_groups()) {
      const double momentum = static_cast<torch::optim::SGDOptions&>(group.options()).momentum();
      for (size_t k = 0; k < group.params().size(); ++k, ++i) {
        if (momentum == 0) continue;  // SGD keeps no state without momentum
        const auto& [name, p] = params[i];
        const auto key = compat::optimizer_state_key(states, p);
        auto it = states.find(key);
        if (it == states.end()) {
          auto st = std::make_unique<torch::optim::SGDParamState>();
          st->momentum_buffer(at::zeros_like(p));
          it = states.emplace(key, std::move(st)).first;
        }
        s.insert(prefix + name + ".momentum_buffer",
                 static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
      }
    }
  } else {
    TORCH_CHECK(false, "tessera: checkpoint::optimizer_state: supports torch::optim::Adam, ",
                "AdamW and SGD; save another optimizer's tensors as StateDict entries yourself");
  }
  return s;
}

void restore_optimizer_scalars(const StateDict& state, torch::optim::Optimizer& optimizer,
                               const torch::nn::Module& module, const std::string& prefix) {
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g)
    optimizer.param_groups()[g].options().set_lr(
        state.real(prefix + "param_groups." + std::to_string(g) + ".lr"));
  const auto params = named_optimizer_parameters(optimizer, module);
  auto& states = optimizer.state();
  for (const auto& [name, p] : params) {
    const std::string key = prefix + name + ".step";
    if (!state.contains(key)) continue;
    auto it = states.find(compat::optimizer_state_key(states, p));
    TORCH_CHECK(it != states.end(), "tessera: restore_optimizer_scalars: no state for ", name,
                "; build the StateDict with optimizer_state() before load");
    if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get()))
      adamw->step(state.integer(key));
    else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get()))
      adam->step(state.integer(key));
  }
}

namespace {
// LRScheduler keeps its step count protected, with no accessor; a pointer to that member,
// named through a derived class, reads and writes it on any scheduler.
struct SchedulerAccess : torch::optim::LRScheduler {
  static constexpr unsigned torch::optim::LRScheduler::*step_count = &SchedulerAccess::step_count_;
};
}  // namespace

StateDict scheduler_state(const torch::optim::LRScheduler& scheduler, const std::string& prefix) {
  StateDict s;
  s.insert(prefix + "step_count", static_cast<int64_t>(scheduler.*SchedulerAccess::step_count));
  return s;
}

void restore_scheduler(const StateDict& state, torch::optim::LRScheduler& scheduler,
                       const std::string& prefix) {
  scheduler.*SchedulerAccess::step_count =
      static_cast<unsigned>(state.integer(prefix + "step_count"));
}

namespace {

at::Tensor full_value(const at::Tensor& t) {
  return is_dtensor(t) ? full_tensor(t.detach()) : t.detach();
}

// As torch::nn::Module::save lays a module out, with full tensors: collective (every rank
// gathers); only `archive` holders write.
void write_module(const torch::nn::Module& module, torch::serialize::OutputArchive* archive) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    at::Tensor full = full_value(item.value());
    if (archive) archive->write(item.key(), full);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    at::Tensor full = full_value(item.value());
    if (archive) archive->write(item.key(), full, /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    if (!archive) {
      write_module(*child.value(), nullptr);
      continue;
    }
    torch::serialize::OutputArchive child_archive(archive->compilation_unit());
    write_module(*child.value(), &child_archive);
    archive->write(child.key(), child_archive);
  }
}

// Copies this rank's part of the full tensor `full` into `target` (plain: all of it).
void fill_from_full(const at::Tensor& target, const at::Tensor& full, const std::string& name) {
  TORCH_CHECK(full.sizes() == target.sizes(), "tessera: checkpoint::import_module: \"", name,
              "\" has shape ", shape_str(full.sizes().vec()), " in the file but ",
              shape_str(target.sizes().vec()), " in the module");
  at::NoGradGuard no_grad;
  if (!is_dtensor(target)) {
    target.copy_(full);
    return;
  }
  const DTensorSpec& sp = spec(target);
  if (!sp.mesh().contains_this_rank()) return;
  TORCH_CHECK(!sp.has_partial(), "tessera: checkpoint::import_module: \"", name, "\" is Partial (",
              sp.str(), "); import into Replicate or Shard placements");
  TORCH_CHECK(!sp.has_head_tail(), "tessera: checkpoint::import_module: \"", name, "\" is ",
              sp.str(), ", whose shard is two ranges; import into Shard placements");
  at::Tensor part = full;
  const auto off = sp.local_offsets(), len = sp.local_sizes();
  for (int64_t d = 0; d < full.dim(); ++d) part = part.narrow(d, off[d], len[d]);
  dtensor_impl(target)->local().copy_(part);
  target.unsafeGetTensorImpl()->bump_version();  // see checkpoint::load
}

void read_module(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                 const std::string& prefix) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    at::Tensor full;
    archive.read(item.key(), full);
    fill_from_full(item.value(), full, prefix + item.key());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    at::Tensor full;
    archive.read(item.key(), full, /*is_buffer=*/true);
    fill_from_full(item.value(), full, prefix + item.key());
  }
  for (const auto& child : module.named_children()) {
    torch::serialize::InputArchive child_archive;
    archive.read(child.key(), child_archive);
    read_module(*child.value(), child_archive, prefix + child.key() + ".");
  }
}

}  // namespace

void export_module(const torch::nn::Module& module, const std::string& path) {
  const auto group = detail::world_group();
  const bool writer = comm::group_rank(group) == 0;
  std::string err;
  std::unique_ptr<torch::serialize::OutputArchive> archive;
  if (writer) archive = std::make_unique<torch::serialize::OutputArchive>();
  write_module(module, archive.get());  // collective: the full tensors
  if (writer) {
    try {
      // Complete or absent: written beside, then renamed over.
      const std::string tmp = path + ".tmp";
      archive->save_to(tmp);
      std::filesystem::rename(tmp, path);
    } catch (const std::exception& e) {
      err = "tessera: checkpoint::export_module(" + path + "): " + e.what();
    }
  }
  comm::check_everywhere(group, err.empty(), err);
}

void import_module(torch::nn::Module& module, const std::string& path) {
  const auto group = detail::world_group();
  std::string err;
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    read_module(module, archive, "");
  } catch (const c10::Error& e) {
    err = "tessera: checkpoint::import_module(" + path + "): " + e.what_without_backtrace();
  } catch (const std::exception& e) {
    err = "tessera: checkpoint::import_module(" + path + "): " + e.what();
  }
  comm::check_everywhere(group, err.empty(), err);
}

}  // namespace tessera::checkpoint
