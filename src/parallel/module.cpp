#include "tessera/parallel/module.h"

#include <atomic>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/functional/instancenorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/loss.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/rnn.h>

#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

#include "gradient_owner.h"

namespace tessera {

namespace detail {
namespace {
struct OwnedGradients {
  std::mutex mu;
  std::unordered_set<const c10::TensorImpl*> params;
  std::atomic<size_t> count{0};  // lets the common case (no reducer) skip the lock
};
OwnedGradients& owned_gradients() {
  static OwnedGradients o;
  return o;
}
}  // namespace

void set_gradient_owned(const c10::TensorImpl* param, bool owned) {
  auto& o = owned_gradients();
  std::lock_guard<std::mutex> lock(o.mu);
  if (owned)
    o.params.insert(param);
  else
    o.params.erase(param);
  o.count.store(o.params.size(), std::memory_order_relaxed);
}

bool gradient_owned(const c10::TensorImpl* param) {
  auto& o = owned_gradients();
  if (o.count.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard<std::mutex> lock(o.mu);
  return o.params.count(param) != 0;
}

// NOTE: [Keeping the user's parameter objects] (gradient_owner.h)
namespace {
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct UserParameters {
  struct Entry {
    WeakImpl dist;  // weak: the binding must not keep the parameter alive
    at::Tensor user;
  };
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, Entry> by_dist;
  std::atomic<size_t> count{0};  // lets the common case (nothing bound) skip the lock
};
UserParameters& user_parameters() {
  static UserParameters u;
  return u;
}

// (user, dist) of a live binding, or undefined tensors. A binding whose parameter died, or
// whose original nobody else holds any more (nobody can read it), is released.
std::pair<at::Tensor, at::Tensor> bound(const c10::TensorImpl* dist) {
  auto& u = user_parameters();
  if (u.count.load(std::memory_order_relaxed) == 0) return {};
  std::lock_guard<std::mutex> lock(u.mu);
  auto it = u.by_dist.find(dist);
  if (it == u.by_dist.end()) return {};
  auto alive = it->second.dist.lock();
  if (!alive || it->second.user.use_count() == 1) {
    u.by_dist.erase(it);
    u.count.store(u.by_dist.size(), std::memory_order_relaxed);
    return {};
  }
  return {it->second.user, at::Tensor(std::move(alive))};
}
}  // namespace

void adopt_user_parameter(const at::Tensor& previous, const at::Tensor& dist) {
  if (!previous.defined() || !dist.defined() || !is_dtensor(dist) ||
      previous.unsafeGetTensorImpl() == dist.unsafeGetTensorImpl())
    return;
  // A distributed parameter replaced again (tensor parallel, then fully_shard): its own
  // original, if it has one, moves on to the new parameter.
  at::Tensor user = is_dtensor(previous) ? bound(previous.unsafeGetTensorImpl()).first : previous;
  if (!user.defined() || !user.is_leaf()) return;
  // (set_data keeps the original's identity and autograd metadata: an optimizer's handle and
  // its state keyed by that identity stay valid)
  user.set_data(dtensor_impl(dist)->local());
  user.mutable_grad() = at::Tensor();  // a gradient of the old shape and value is meaningless now
  auto& u = user_parameters();
  std::lock_guard<std::mutex> lock(u.mu);
  u.by_dist.erase(previous.unsafeGetTensorImpl());  // moved on (a no-op for a plain original)
  for (auto it = u.by_dist.begin(); it != u.by_dist.end();)
    it = it->second.dist.expired() ? u.by_dist.erase(it) : std::next(it);
  u.by_dist.insert_or_assign(dist.unsafeGetTensorImpl(),
                             UserParameters::Entry{WeakImpl(dist.getIntrusivePtr()), user});
  u.count.store(u.by_dist.size(), std::memory_order_relaxed);
}

void hand_gradient_to_user(const c10::TensorImpl* dist) {
  auto [user, d] = bound(dist);
  if (!user.defined()) return;
  const at::Tensor& g = d.grad();
  // The same storage: an in-place zero_grad on either handle zeroes both.
  user.mutable_grad() = g.defined() && is_dtensor(g) ? dtensor_impl(g)->local() : at::Tensor();
}

void drop_gradient_the_user_dropped(const c10::TensorImpl* dist) {
  auto [user, d] = bound(dist);
  if (user.defined() && !user.grad().defined() && d.grad().defined())
    d.mutable_grad() = at::Tensor();
}

int64_t user_parameter_version(const c10::TensorImpl* dist) {
  auto [user, d] = bound(dist);
  return user.defined() ? static_cast<int64_t>(user._version()) : 0;
}
}  // namespace detail

namespace {

using TensorDict = torch::OrderedDict<std::string, at::Tensor>;

// NOTE: [Reaching LibTorch's non-public members]
// Swapping a parameter (NOTE: [Swapping module parameters]) writes handles LibTorch keeps
// out of reach. All of that access is in this namespace and nowhere else in Tessera:
//   Module::parameters_                         protected: named through a class derived from
//                                               Module (a derived class may form a pointer to
//                                               a protected member when it names itself).
//   Module::buffers_                            private: named as the template argument of
//                                               an explicit instantiation, where access is
//                                               not checked ([temp.explicit] in C++17); a
//                                               friend function declared by that
//                                               instantiation hands the pointer out.
//   RNNImplBase::flat_weights_ and              protected: through a derived class, as
//   RNNImplBase::flat_weights_names_            parameters_. RNN / LSTM / GRU forward() read
//                                               their weights from flat_weights_.
// Each depends only on the member's name and type, which are the same in every LibTorch
// Tessera supports (1.13 and 2.x; checked against 1.13 and 2.6), so none of it is in
// compat.h. A rename or a type change is a compile error here, never a silent miss; the
// BuiltinModule tests (test_builtin_modules.cpp) check that every one still reaches the
// handle forward() reads.
namespace nonpublic {

struct ModuleParameters : torch::nn::Module {
  static TensorDict torch::nn::Module::*member() { return &ModuleParameters::parameters_; }
};

TensorDict torch::nn::Module::*module_buffers();
template <TensorDict torch::nn::Module::*Member>
struct ModuleBuffers {
  friend TensorDict torch::nn::Module::*module_buffers() { return Member; }
};
template struct ModuleBuffers<&torch::nn::Module::buffers_>;

template <class Derived>
struct RnnFlatWeights : torch::nn::detail::RNNImplBase<Derived> {
  using Base = torch::nn::detail::RNNImplBase<Derived>;
  static std::vector<at::Tensor> Base::*weights() { return &RnnFlatWeights::flat_weights_; }
  static std::vector<std::string> Base::*names() { return &RnnFlatWeights::flat_weights_names_; }
};

}  // namespace nonpublic

TensorDict& parameter_registry(torch::nn::Module& m) {
  return m.*nonpublic::ModuleParameters::member();
}
TensorDict& buffer_registry(torch::nn::Module& m) { return m.*nonpublic::module_buffers(); }

// The handles forward() reads a registry entry through: usually one member, two where a
// module keeps both a member and its options' copy (either may be read, depending on the
// LibTorch version), none where the registry itself is what is read (ParameterDict).
using Handles = c10::SmallVector<at::Tensor*, 2>;
// nullopt: the accessor does not know this module type or this name.
using HandleAccessor =
    std::function<std::optional<Handles>(torch::nn::Module&, const std::string&)>;

std::optional<Handles> one(at::Tensor& t) { return Handles{&t}; }

template <class Impl>
std::optional<Handles> weight_bias(Impl& m, const std::string& name) {
  if (name == "weight") return one(m.weight);
  if (name == "bias") return one(m.bias);
  return std::nullopt;
}

template <class Impl>
std::optional<Handles> norm_members(Impl& m, const std::string& name) {
  if (name == "running_mean") return one(m.running_mean);
  if (name == "running_var") return one(m.running_var);
  if (name == "num_batches_tracked") return one(m.num_batches_tracked);
  return weight_bias(m, name);
}

template <class Impl>
std::optional<Handles> weight_only(Impl& m, const std::string& name) {
  if (name == "weight") return one(m.weight);
  return std::nullopt;
}

std::optional<Handles> attention_members(torch::nn::MultiheadAttentionImpl& m,
                                         const std::string& name) {
  for (auto [n, t] : {std::pair<const char*, at::Tensor*>{"in_proj_weight", &m.in_proj_weight},
                      {"in_proj_bias", &m.in_proj_bias},
                      {"bias_k", &m.bias_k},
                      {"bias_v", &m.bias_v},
                      {"q_proj_weight", &m.q_proj_weight},
                      {"k_proj_weight", &m.k_proj_weight},
                      {"v_proj_weight", &m.v_proj_weight}})
    if (name == n) return one(*t);
  return std::nullopt;
}

// RNN / LSTM / GRU: the registered weight_ih_l0, ..., and flat_weights_[i], read by forward().
template <class Impl>
std::optional<Handles> rnn_flat_weight(Impl& m, const std::string& name) {
  using Access = nonpublic::RnnFlatWeights<Impl>;
  auto& names = m.*Access::names();
  auto& weights = m.*Access::weights();
  for (size_t i = 0; i < names.size() && i < weights.size(); ++i)
    if (names[i] == name) return one(weights[i]);
  return std::nullopt;
}

template <class Impl>
std::optional<Handles> rnn_cell_members(Impl& m, const std::string& name) {
  if (name == "weight_ih") return one(m.weight_ih);
  if (name == "weight_hh") return one(m.weight_hh);
  if (name == "bias_ih") return one(m.bias_ih);
  if (name == "bias_hh") return one(m.bias_hh);
  return std::nullopt;
}

// Losses with class weights: the buffer is read from the member or from the options,
// depending on the loss and the LibTorch version; both are swapped.
template <class Impl>
std::optional<Handles> loss_weight_member(Impl& m, const std::string& name) {
  if (name == "weight") return Handles{&m.weight, &m.options.weight()};
  return std::nullopt;
}
template <class Impl>
std::optional<Handles> loss_weight_option(Impl& m, const std::string& name) {
  if (name == "weight") return one(m.options.weight());
  return std::nullopt;
}
std::optional<Handles> bce_with_logits_members(torch::nn::BCEWithLogitsLossImpl& m,
                                               const std::string& name) {
  if (name == "pos_weight") return Handles{&m.pos_weight, &m.options.pos_weight()};
  return loss_weight_member(m, name);
}

template <class Impl>
std::optional<Handles> fractional_pool_samples(Impl& m, const std::string& name) {
  if (name == "_random_samples") return Handles{&m._random_samples, &m.options._random_samples()};
  return std::nullopt;
}

// ParameterDict / ParameterList read their registry directly: no separate handle.
template <class Impl>
std::optional<Handles> registry_only(Impl&, const std::string&) {
  return Handles{};
}

struct Accessor {
  std::type_index type;  // the module type it was written for (builtins; user ones: Module)
  HandleAccessor handles;
};

template <class Impl, class F>
Accessor builtin(F handles_of) {
  return {typeid(Impl),
          [handles_of](torch::nn::Module& m, const std::string& name) -> std::optional<Handles> {
            auto* impl = dynamic_cast<Impl*>(&m);
            if (!impl) return std::nullopt;
            return handles_of(*impl, name);
          }};
}

struct Accessors {
  std::mutex mu;
  std::vector<Accessor> builtins;  // constant after construction
  std::vector<Accessor> user;
  Accessors() {
    using namespace torch::nn;
    auto& b = builtins;
    b.push_back(builtin<LinearImpl>(weight_bias<LinearImpl>));
    b.push_back(builtin<BilinearImpl>(weight_bias<BilinearImpl>));
    b.push_back(builtin<Conv1dImpl>(weight_bias<Conv1dImpl>));
    b.push_back(builtin<Conv2dImpl>(weight_bias<Conv2dImpl>));
    b.push_back(builtin<Conv3dImpl>(weight_bias<Conv3dImpl>));
    b.push_back(builtin<ConvTranspose1dImpl>(weight_bias<ConvTranspose1dImpl>));
    b.push_back(builtin<ConvTranspose2dImpl>(weight_bias<ConvTranspose2dImpl>));
    b.push_back(builtin<ConvTranspose3dImpl>(weight_bias<ConvTranspose3dImpl>));
    b.push_back(builtin<LayerNormImpl>(weight_bias<LayerNormImpl>));
    b.push_back(builtin<GroupNormImpl>(weight_bias<GroupNormImpl>));
    b.push_back(builtin<BatchNorm1dImpl>(norm_members<BatchNorm1dImpl>));
    b.push_back(builtin<BatchNorm2dImpl>(norm_members<BatchNorm2dImpl>));
    b.push_back(builtin<BatchNorm3dImpl>(norm_members<BatchNorm3dImpl>));
    b.push_back(builtin<InstanceNorm1dImpl>(norm_members<InstanceNorm1dImpl>));
    b.push_back(builtin<InstanceNorm2dImpl>(norm_members<InstanceNorm2dImpl>));
    b.push_back(builtin<InstanceNorm3dImpl>(norm_members<InstanceNorm3dImpl>));
    b.push_back(builtin<EmbeddingImpl>(weight_only<EmbeddingImpl>));
    b.push_back(builtin<EmbeddingBagImpl>(weight_only<EmbeddingBagImpl>));
    b.push_back(builtin<PReLUImpl>(weight_only<PReLUImpl>));
    b.push_back(builtin<MultiheadAttentionImpl>(attention_members));
    b.push_back(builtin<RNNImpl>(rnn_flat_weight<RNNImpl>));
    b.push_back(builtin<LSTMImpl>(rnn_flat_weight<LSTMImpl>));
    b.push_back(builtin<GRUImpl>(rnn_flat_weight<GRUImpl>));
    b.push_back(builtin<RNNCellImpl>(rnn_cell_members<RNNCellImpl>));
    b.push_back(builtin<LSTMCellImpl>(rnn_cell_members<LSTMCellImpl>));
    b.push_back(builtin<GRUCellImpl>(rnn_cell_members<GRUCellImpl>));
    b.push_back(builtin<NLLLossImpl>(loss_weight_member<NLLLossImpl>));
    b.push_back(builtin<CrossEntropyLossImpl>(loss_weight_member<CrossEntropyLossImpl>));
    b.push_back(builtin<BCEWithLogitsLossImpl>(bce_with_logits_members));
    b.push_back(builtin<BCELossImpl>(loss_weight_option<BCELossImpl>));
    b.push_back(builtin<MultiMarginLossImpl>(loss_weight_option<MultiMarginLossImpl>));
    b.push_back(
        builtin<MultiLabelSoftMarginLossImpl>(loss_weight_option<MultiLabelSoftMarginLossImpl>));
    b.push_back(builtin<FractionalMaxPool2dImpl>(fractional_pool_samples<FractionalMaxPool2dImpl>));
    b.push_back(builtin<FractionalMaxPool3dImpl>(fractional_pool_samples<FractionalMaxPool3dImpl>));
    b.push_back(builtin<ParameterDictImpl>(registry_only<ParameterDictImpl>));
    b.push_back(builtin<ParameterListImpl>(registry_only<ParameterListImpl>));
  }
};

Accessors& accessors() {
  static Accessors a;
  return a;
}

// The handles of `name` in `module`: user accessors first (they may refine a built-in
// type), then the built-in ones.
std::optional<Handles> member_handles(torch::nn::Module& module, const std::string& name) {
  auto& a = accessors();
  {
    std::lock_guard<std::mutex> lock(a.mu);
    for (auto& acc : a.user)
      if (auto h = acc.handles(module, name)) return h;
  }
  for (auto& acc : a.builtins)
    if (auto h = acc.handles(module, name)) return h;
  return std::nullopt;
}

}  // namespace

void register_member_accessor(MemberAccessor accessor) {
  auto& a = accessors();
  std::lock_guard<std::mutex> lock(a.mu);
  a.user.push_back({typeid(torch::nn::Module),
                    [accessor = std::move(accessor)](
                        torch::nn::Module& m, const std::string& name) -> std::optional<Handles> {
                      if (at::Tensor* t = accessor(m, name)) return one(*t);
                      return std::nullopt;
                    }});
}

std::vector<std::type_index> builtin_member_accessor_types() {
  std::vector<std::type_index> types;
  for (const auto& acc : accessors().builtins) types.push_back(acc.type);
  return types;
}

void replace_parameter(torch::nn::Module& module, const std::string& name, at::Tensor value) {
  auto& params = parameter_registry(module);
  auto& buffers = buffer_registry(module);
  at::Tensor* entry = params.find(name);
  const bool is_param = entry != nullptr;
  if (!entry) entry = buffers.find(name);
  TORCH_CHECK(entry, "tessera: replace_parameter: module ", module.name(),
              " has no parameter or buffer named \"", name, "\" (submodule entries are replaced ",
              "on the submodule itself)");
  const std::optional<Handles> members = member_handles(module, name);
  TORCH_CHECK(members || !entry->defined(), "tessera: replace_parameter: ", module.name(),
              " keeps \"", name, "\" in a member tessera does not know; its forward() would go on ",
              "using the old tensor. Register an accessor with tessera::register_member_accessor");
  if (is_param && value.defined()) {
    value = value.detach().requires_grad_(entry->requires_grad());
    // An optimizer built earlier keeps stepping the original object (NOTE: [Keeping the
    // user's parameter objects]).
    detail::adopt_user_parameter(*entry, value);
    if (value.requires_grad() && is_dtensor(value)) {
      // A parameter's gradient takes the parameter's own layout as it arrives: a replicated
      // weight used on sharded activations gets Partial terms, reduced here once (one
      // all-reduce per mesh dim) instead of each time the optimizer reads the gradient.
      SpecPtr target = dtensor_impl(value)->spec_ptr();
      // (the hook lives in the parameter's autograd metadata: the parameter outlives it)
      const c10::TensorImpl* param = value.unsafeGetTensorImpl();
      value.register_hook([target, param](const at::Tensor& g) -> at::Tensor {
        detail::drop_gradient_the_user_dropped(param);
        if (!detail::gradient_owned(param)) {
          // After the accumulation, once per backward: the original's gradient (a bucketed
          // reducer hands it over itself, once it has reduced).
          torch::autograd::Engine::get_default_engine().queue_callback(
              [param] { detail::hand_gradient_to_user(param); });
        }
        if (!g.defined() || !is_dtensor(g) || spec(g) == *target) return g;
        if (detail::gradient_owned(param)) return g;  // a bucketed reducer reduces it
        // (in the gradient's own dtype, should it differ from the parameter's)
        return redistribute(
            g, std::make_shared<DTensorSpec>(target->mesh(), target->placements(), target->sizes(),
                                             g.scalar_type(), target->shard_tables()));
      });
    }
  }
  *entry = value;
  if (members)
    for (at::Tensor* handle : *members) *handle = value;
}

void check_splittable(torch::nn::Module& module, const std::string& name) {
  TORCH_CHECK(parameter_registry(module).find(name), "tessera: fully_shard: module ", module.name(),
              " has no parameter named \"", name, "\"");
  const std::optional<Handles> members = member_handles(module, name);
  TORCH_CHECK(members, "tessera: fully_shard: ", module.name(), " keeps parameter \"", name,
              "\" in a member tessera does not know, so its forward() cannot be given the ",
              "unsharded parameter. Register an accessor with tessera::register_member_accessor");
  TORCH_CHECK(!members->empty(), "tessera: fully_shard: ", module.name(), " has no member handle ",
              "for parameter \"", name, "\": its forward() reads the registry (ParameterDict / ",
              "ParameterList), which must hold the sharded parameter. Keep such parameters in a ",
              "module with a member (e.g. a custom module with a registered accessor), or leave ",
              "the module out of fully_shard and distribute it with distribute_module");
}

void split_parameter(torch::nn::Module& module, const std::string& name, at::Tensor registered,
                     at::Tensor member) {
  check_splittable(module, name);
  *parameter_registry(module).find(name) = std::move(registered);
  // In a variable: in `for (h : *member_handles(...))` the optional is a temporary destroyed
  // before the loop body runs (before C++23), leaving the loop a dangling range.
  const std::optional<Handles> members = member_handles(module, name);
  for (at::Tensor* handle : *members) *handle = member;
}

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn) {
  auto visit = [&](const std::string& name, torch::nn::Module& m) {
    if (partition_fn) {
      partition_fn(name, m, mesh);
      return;
    }
    Placements rep(mesh.ndim(), Replicate());
    for (const auto& item : m.named_parameters(/*recurse=*/false))
      if (item.value().defined()) distribute_parameter(m, item.key(), mesh, rep);
    for (const auto& item : m.named_buffers(/*recurse=*/false))
      if (item.value().defined()) distribute_parameter(m, item.key(), mesh, rep);
  };
  visit("", module);
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false))
    visit(item.key(), *item.value());
}

void distribute_parameter(torch::nn::Module& module, const std::string& name,
                          const DeviceMesh& mesh, const Placements& placements) {
  // (named_parameters returns a dictionary by value: keep it alive while reading from it)
  at::Tensor current;
  const auto params = module.named_parameters(/*recurse=*/false);
  const auto buffers = module.named_buffers(/*recurse=*/false);
  if (const auto* p = params.find(name))
    current = *p;
  else if (const auto* b = buffers.find(name))
    current = *b;
  TORCH_CHECK(current.defined(), "tessera: distribute_parameter: module ", module.name(),
              " has no parameter or buffer named \"", name, "\"");
  replace_parameter(module, name,
                    distribute_tensor(current.detach(), mesh, placements, std::nullopt));
}

std::vector<std::pair<std::string, torch::nn::Module*>> modules_with_self(
    torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::nn::Module*>> out{{"", &module}};
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false))
    out.emplace_back(item.key(), item.value().get());
  return out;
}

}  // namespace tessera
