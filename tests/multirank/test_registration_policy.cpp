// The sharding rules against the running LibTorch's dispatcher: every ruled name exists,
// every overload of a ruled op has a rule, and every seeded random op a distributed tensor
// can reach draws what one device draws. Then the pointwise partial tables and overloads
// that name guessing used to miss, against one device on uneven shards. Tags are read from
// the dispatcher (OperatorHandle::hasTag), in 1.13 as in 2.x.
#include <iostream>
#include <map>
#include <random>
#include <set>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/enum_tag.h>
#include <ATen/core/stack.h>
#include <torch/version.h>

#include "helpers.h"
#include "tensor/out_form.h"

using namespace tessera;
using tessera::test::make_dtensor_from_full;
using tessera::test::same_values;

namespace {

// The allow-lists below take exact names ("aten::fill.Tensor") or base names, which stand
// for every overload of that base ("aten::normal": normal.Tensor_float, normal.out, ...).

// Ruled names that exist only in other LibTorch versions than the running one.
// clang-format off
const std::set<std::string> kOtherVersionsOnly = {
    // 2.x only: the batch norm forms norm.cpp rules there.
    "aten::_batch_norm_no_update", "aten::_batch_norm_with_update",
    "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit.no_stats",
    "aten::_native_batch_norm_legit_no_training", "aten::batch_norm_backward",
    // 1.13 only: 2.x dropped the backward .vec overloads (upsample.cpp).
    "aten::upsample_bilinear2d_backward.vec", "aten::upsample_linear1d_backward.vec",
    "aten::upsample_nearest1d_backward.vec", "aten::upsample_nearest2d_backward.vec",
    "aten::upsample_nearest3d_backward.vec", "aten::upsample_trilinear3d_backward.vec",
    // 1.13 only: 2.x replaced it with _prelu_kernel_backward (pointwise.cpp rules both).
    "aten::prelu_backward",
    // 2.x only: ops the dim-wise, reduction-collective, loss and attention families rule there.
    "aten::_safe_softmax", "aten::all.dims", "aten::any.dims",
    "aten::binary_cross_entropy_with_logits_backward",
    // Newer LibTorch only (the 2.15 wheel): random_like draws with a generator (random.cpp).
    "aten::rand_like.generator", "aten::randn_like.generator", "aten::randint_like.generator",
    "aten::randint_like.low_generator_dtype",
};
// clang-format on

// Ops whose out= overloads (a written kwarg-only tensor: out, values, grad_input) have no
// rule: every other out= form of a ruled op borrows its functional sibling's rule (NOTE: [out=
// forms]). The fallback refuses these on non-replicated inputs.
// clang-format off
const std::set<std::string> kOutFormsWithoutRule = {
    // The functional form takes dtype / layout / device options that the out= form does not
    // (the out tensor carries them), so no schema matches.
    "aten::_to_copy", "aten::empty_like", "aten::full_like", "aten::ones_like",
    "aten::zeros_like", "aten::rand_like", "aten::randn_like", "aten::randint_like",
    "aten::new_empty", "aten::new_empty_strided", "aten::new_full", "aten::new_ones",
    "aten::new_zeros",
    // The functional sibling has no rule either (kUnruledOverloads).
    "aten::scatter.reduce_out", "aten::scatter.value_reduce_out", "aten::fill.Tensor_out",
    // A Tensor[] out.
    "aten::unsafe_split.Tensor_out", "aten::unsafe_split_with_sizes.out",
};
// clang-format on

// Other overloads of ruled ops without a rule.
const std::set<std::string> kUnruledOverloads = {
    // TODO(index.cpp): scatter with a reduce argument.
    "aten::scatter.reduce",
    "aten::scatter.value_reduce",
    "aten::scatter_.reduce",
    "aten::scatter_.value_reduce",
    // TODO(like.cpp): fill with a 0-dim tensor value.
    "aten::fill.Tensor",
    "aten::fill_.Tensor",
    // TODO(random.cpp): bernoulli_ with a tensor of probabilities.
    "aten::bernoulli_.Tensor",
    // TODO(view.cpp): view as another dtype; squeeze of several dims (2.x).
    "aten::view.dtype",
    "aten::squeeze.dims",
    // TODO(matrix.cpp): products with an output dtype (newer LibTorch: the 2.15 wheel).
    "aten::mm.dtype",
    "aten::mm.dtype_out",
    "aten::bmm.dtype",
    "aten::bmm.dtype_out",
    "aten::addmm.dtype",
    "aten::addmm.dtype_out",
    "aten::baddbmm.dtype",
    "aten::baddbmm.dtype_out",
    // TODO(random.cpp): randint_like with a tensor bound (newer LibTorch).
    "aten::randint_like.Tensor",
    "aten::randint_like.Tensor_generator",
};

// Seeded ops a distributed tensor reaches without a rule: the fallback refuses them (no
// sharding rule) rather than drawing wrong values.
const std::set<std::string> kSeededWithoutRule = {
    // TODO(random.cpp): functional and out= forms of the fills, the samplers, and the
    // factories' out= forms (a distributed `out`).
    "aten::bernoulli",
    "aten::bernoulli_.Tensor",
    "aten::binomial",
    "aten::cauchy",
    "aten::exponential",
    "aten::geometric",
    "aten::log_normal",
    "aten::multinomial",
    "aten::normal",
    "aten::normal_functional",
    "aten::poisson",
    "aten::random",
    "aten::uniform",
    "aten::_sample_dirichlet",
    "aten::_standard_gamma",
    "aten::rand",
    "aten::randn",
    "aten::randint",
    "aten::randperm",
    "aten::rand_like.out",
    "aten::randn_like.out",
    "aten::randint_like.out",
    "aten::randint_like.low_dtype_out",
    // (newer LibTorch: the out= forms of the .generator / .Tensor overloads)
    "aten::rand_like.generator_out",
    "aten::randn_like.generator_out",
    "aten::randint_like.generator_out",
    "aten::randint_like.Tensor_out",
    "aten::randint_like.Tensor_generator_out",
    "aten::randint_like.low_generator_dtype_out",
    "aten::randint_like.Tensor",
    "aten::randint_like.Tensor_generator",
    // TODO(random.cpp): dropout kernels (at::dropout itself decomposes into bernoulli_) and
    // rrelu's noise.
    "aten::native_dropout",
    "aten::_fused_dropout",
    "aten::rrelu_with_noise",
    "aten::rrelu_with_noise_",
    "aten::rrelu_with_noise_functional",
    // TODO(new family): attention and RNN kernels with dropout, backend-specific (2.x).
    "aten::_cudnn_init_dropout_state",
    "aten::_cudnn_rnn",
    "aten::miopen_rnn",
    "aten::_lstm_mps",
    "aten::_fused_sdp_choice",
    "aten::_efficient_attention_forward",
    "aten::_flash_attention_forward",
    "aten::_fill_mem_eff_dropout_mask_",
    "aten::_nested_tensor_softmax_with_shape",
    "aten::_scaled_dot_product_attention_math_for_mps",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_cudnn_attention_forward",
    "aten::_cudnn_attention_backward",
    "aten::_cudnn_attention_forward_no_dropout_inplace",
    "aten::_flash_attention_forward_no_dropout_inplace",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_triton_scaled_dot_attention",
};

// Seeded composite ops with a kernel of their own at the distributed-tensor key (not a rule):
// it sends their draws to ops with rules, and their own tests compare them with one device.
const std::set<std::string> kSeededOwnKernels = {
    // (tests/multirank/test_context_parallel.cpp, DropoutDrawsOneDevicesMask)
    "aten::scaled_dot_product_attention",
};

// Seeded ops whose rule raises whenever they would draw (dropout_p > 0): nothing to compare.
// tests/multirank/test_context_parallel.cpp checks the refusal.
const std::set<std::string> kSeededRulesRefusingDraws = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
};

// Entries of the lists above that only some LibTorch versions need (the others' dispatchers
// lack the op, or rule it differently); every other entry must match something everywhere.
const std::set<std::string> kVersionSpecific = {
    // Newer LibTorch only (the 2.15 wheel): products with an output dtype, squeeze of
    // several dims, randint_like with a tensor bound.
    "aten::addmm.dtype",
    "aten::addmm.dtype_out",
    "aten::baddbmm.dtype",
    "aten::baddbmm.dtype_out",
    "aten::bmm.dtype",
    "aten::bmm.dtype_out",
    "aten::mm.dtype",
    "aten::mm.dtype_out",
    "aten::randint_like.Tensor",
    "aten::randint_like.Tensor_generator",
    "aten::squeeze.dims",
    // Not in the newest LibTorch (2.15 reaches no aten::randn overload with a distributed tensor).
    "aten::randn",
    // 2.x only: attention and RNN kernels with dropout, the random fills' .generator and
    // .Tensor out= forms, rrelu's functional form.
    "aten::_cudnn_attention_backward",
    "aten::_cudnn_attention_forward",
    "aten::_cudnn_attention_forward_no_dropout_inplace",
    "aten::_cudnn_init_dropout_state",
    "aten::_cudnn_rnn",
    "aten::_efficient_attention_forward",
    "aten::_fill_mem_eff_dropout_mask_",
    "aten::_flash_attention_forward",
    "aten::_flash_attention_forward_no_dropout_inplace",
    "aten::_fused_sdp_choice",
    "aten::_lstm_mps",
    "aten::_nested_tensor_softmax_with_shape",
    "aten::_scaled_dot_product_attention_math_for_mps",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::scaled_dot_product_attention",  // (2.x with the fused CPU pair: kSeededOwnKernels)
    "aten::_triton_scaled_dot_attention",
    "aten::miopen_rnn",
    "aten::rand_like.generator_out",
    "aten::randint_like.Tensor",
    "aten::randint_like.Tensor_generator",
    "aten::randint_like.Tensor_generator_out",
    "aten::randint_like.Tensor_out",
    "aten::randint_like.generator_out",
    "aten::randint_like.low_generator_dtype_out",
    "aten::randn_like.generator_out",
    "aten::rrelu_with_noise_functional",
};

std::string qualified(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

c10::OperatorName parse(const std::string& name) {
  const auto dot = name.find('.');
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

// The entry of `list` that covers `name` (itself or its base name), or "".
std::string entry_for(const std::set<std::string>& list, const std::string& name) {
  if (list.count(name)) return name;
  const std::string base = parse(name).name;
  return list.count(base) ? base : "";
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "\n  " + x;
  return s;
}

// An entry that matches nothing fails: it is stale (a rule landed; delete the entry), unless
// kVersionSpecific says it serves other LibTorch versions.
void fail_unused(const char* list, const std::set<std::string>& entries,
                 const std::set<std::string>& used) {
  std::vector<std::string> unused;
  for (const auto& e : entries)
    if (!used.count(e) && !kVersionSpecific.count(e)) unused.push_back(e);
  EXPECT_TRUE(unused.empty()) << unused.size() << " entries of " << list
                              << " match nothing in LibTorch " << TORCH_VERSION
                              << " (delete them, or list them in kVersionSpecific if another "
                              << "version needs them):" << join(unused);
}

// kOtherVersionsOnly serves other versions by definition: its unused entries are printed.
void note_unused(const char* list, const std::set<std::string>& entries,
                 const std::set<std::string>& used) {
  std::vector<std::string> unused;
  for (const auto& e : entries)
    if (!used.count(e)) unused.push_back(e);
  if (!unused.empty())
    std::cout << "entries of " << list << " unused by this LibTorch:" << join(unused) << "\n";
}

bool is_tensor_type(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::TensorType) return true;
  if (auto o = t->cast<c10::OptionalType>()) return is_tensor_type(o->getElementType());
  if (auto l = t->cast<c10::ListType>()) return is_tensor_type(l->getElementType());
  return false;
}

// out=, values=, grad_input=: a written kwarg-only argument.
bool is_out_form(const c10::OperatorHandle& op) {
  for (const auto& a : op.schema().arguments())
    if (a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite()) return true;
  return false;
}

// A distributed tensor reaches the op's fallback entry unless the op has no tensor argument
// or is CompositeImplicitAutograd (it decomposes above our key) without a kernel of ours.
bool reachable(const c10::OperatorHandle& op) {
  bool tensor_arg = false;
  for (const auto& a : op.schema().arguments()) tensor_arg = tensor_arg || is_tensor_type(a.type());
  return tensor_arg && (!op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
                        op.hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1));
}

}  // namespace

TEST(RegistrationPolicy, EveryRuledNameExists) {
  std::vector<std::string> offenders;
  std::set<std::string> used;
  for (const auto& name : ops::registered_rule_names()) {
    if (kOtherVersionsOnly.count(name))
      used.insert(name);  // here or not
    else if (!c10::Dispatcher::singleton().findOp(parse(name)))
      offenders.push_back(name);
  }
  note_unused("kOtherVersionsOnly", kOtherVersionsOnly, used);
  EXPECT_TRUE(offenders.empty()) << offenders.size() << " ruled names LibTorch " << TORCH_VERSION
                                 << "'s dispatcher does not have (a name one version lacks goes "
                                 << "in kOtherVersionsOnly):" << join(offenders);
}

// Rules are registered per overload name; an overload left out (eq.Scalar_out, say) makes
// the fallback refuse a call that a sibling overload handles.
TEST(RegistrationPolicy, EveryOverloadOfARuledOpHasARule) {
  const auto names = ops::registered_rule_names();
  const std::set<std::string> ruled(names.begin(), names.end());
  std::set<std::string> bases;
  for (const auto& n : names) bases.insert(parse(n).name);
  std::vector<std::string> offenders;
  std::set<std::string> used_out, used_other;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    const std::string q = qualified(name);
    if (!bases.count(name.name) || ruled.count(q)) continue;
    const auto op = c10::Dispatcher::singleton().findOp(name);
    if (!reachable(*op)) continue;  // its rule would never run
    // An out= form runs its functional sibling's rule (NOTE: [out= forms]).
    if (is_out_form(*op) && ops::detail::find_out_form_rule(*op)) continue;
    const std::string out_entry = is_out_form(*op) ? entry_for(kOutFormsWithoutRule, q) : "";
    const std::string other_entry = entry_for(kUnruledOverloads, q);
    if (!out_entry.empty())
      used_out.insert(out_entry);
    else if (!other_entry.empty())
      used_other.insert(other_entry);
    else
      offenders.push_back(q);
  }
  std::sort(offenders.begin(), offenders.end());
  fail_unused("kOutFormsWithoutRule", kOutFormsWithoutRule, used_out);
  fail_unused("kUnruledOverloads", kUnruledOverloads, used_other);
  EXPECT_TRUE(offenders.empty()) << offenders.size() << " overloads of ruled ops in LibTorch "
                                 << TORCH_VERSION << " have no rule (give them one, or list "
                                 << "an overload only this version has in kUnruledOverloads):"
                                 << join(offenders);
}

namespace {

// Arguments for a seeded op from its schema: `tensor(out)` for tensor arguments, defaults
// where the schema has them, and small valid values by name otherwise. Empty if unknown.
c10::optional<torch::jit::Stack> seeded_args(const c10::FunctionSchema& schema,
                                             const std::function<at::Tensor(bool)>& tensor,
                                             std::vector<int64_t> shape) {
  static const std::map<std::string, int64_t> ints = {
      {"from", 3}, {"low", 3}, {"to", 9}, {"high", 9}, {"num_samples", 2}};
  torch::jit::Stack stack;
  for (const auto& a : schema.arguments()) {
    const auto kind = a.type()->kind();
    const auto* opt = a.type()->castRaw<c10::OptionalType>();
    const auto inner = opt ? opt->getElementType()->kind() : kind;
    if (kind == c10::TypeKind::TensorType) {
      stack.emplace_back(tensor(a.alias_info() && a.alias_info()->isWrite() && a.kwarg_only()));
    } else if (ints.count(a.name()) && inner == c10::TypeKind::IntType) {
      stack.emplace_back(ints.at(a.name()));
    } else if (a.default_value()) {
      stack.push_back(*a.default_value());
    } else if (opt) {
      stack.emplace_back();
    } else if (kind == c10::TypeKind::FloatType) {
      stack.emplace_back(0.5);
    } else if (kind == c10::TypeKind::ListType && a.type()->str() == "int[]") {
      stack.emplace_back(shape);
    } else {
      return c10::nullopt;
    }
  }
  return stack;
}

// The results of a boxed call: its tensor returns.
std::vector<at::Tensor> call(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  std::vector<at::Tensor> out;
  for (auto& v : stack)
    if (v.isTensor()) out.push_back(v.toTensor());
  return out;
}

}  // namespace

// NOTE: [Random numbers] promises one device's draws. A layout-preserving (local) rule would
// draw the first values of the stream on every rank: uneven shards on 2 and 3 ranks show it.
TEST(RegistrationPolicy, SeededOpsDrawWhatOneDeviceDraws) {
  const std::vector<int64_t> shape = {7, 6};
  // Values in (0.2, 0.8): valid probabilities, rates and counts for every seeded op.
  const auto x = at::rand(shape, tessera::test::generator(3)) * 0.6 + 0.2;
  std::vector<std::string> without_rule, unbuildable;
  std::set<std::string> used, used_refusing, used_own;
  int checked = 0;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    const auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasTag(at::Tag::nondeterministic_seeded) || !reachable(*op)) continue;
    const std::string q = qualified(name);
    if (const std::string own = entry_for(kSeededOwnKernels, q); !own.empty()) {
      used_own.insert(own);
      continue;
    }
    if (!ops::find_rule(*op) && !ops::detail::find_out_form_rule(*op)) {
      const std::string entry = entry_for(kSeededWithoutRule, q);
      if (!entry.empty())
        used.insert(entry);
      else
        without_rule.push_back(q);
      continue;
    }
    if (const std::string refusing = entry_for(kSeededRulesRefusingDraws, q); !refusing.empty()) {
      used_refusing.insert(refusing);
      continue;
    }
    auto ref_args = seeded_args(
        op->schema(), [&](bool out) { return out ? at::empty_like(x) : x.clone(); }, shape);
    if (!ref_args) {
      unbuildable.push_back(q);
      continue;
    }
    at::manual_seed(1234);  // on the test thread, before the rank threads exist
    const auto expected = call(*op, *ref_args);
    ++checked;
    for (int world : {1, 2, 3}) {
      tessera::testing::run_ranks(world, [&](int) {
        auto mesh = init_device_mesh("cpu", {world});
        ShardTable rows(world, 0);
        rows[0] = world > 1 ? 5 : 7;
        if (world > 1) rows.back() += 2;
        auto dist = [&](const at::Tensor& t) {
          return distribute_tensor(t, mesh, {Shard(0)}, std::nullopt, ShardSizes::Given(0, rows));
        };
        tessera::manual_seed(1234);
        auto args = seeded_args(
            op->schema(), [&](bool out) { return dist(out ? at::empty_like(x) : x); }, shape);
        const auto got = call(*op, *args);
        tessera::clear_manual_seed();
        ASSERT_EQ(got.size(), expected.size()) << q;
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_TRUE(is_dtensor(got[i])) << q << " result " << i;
          EXPECT_TRUE(at::equal(full_tensor(got[i]), expected[i]))
              << q << " result " << i << " on " << world << " ranks differs from one device's "
              << "draws: its rule must draw the global tensor (NOTE: [Random numbers])";
        }
      });
    }
  }
  std::sort(without_rule.begin(), without_rule.end());
  fail_unused("kSeededWithoutRule", kSeededWithoutRule, used);
  fail_unused("kSeededRulesRefusingDraws", kSeededRulesRefusingDraws, used_refusing);
  fail_unused("kSeededOwnKernels", kSeededOwnKernels, used_own);
  EXPECT_GT(checked, 0);
  EXPECT_TRUE(unbuildable.empty()) << "no arguments for these seeded ops of LibTorch "
                                   << TORCH_VERSION << "; extend seeded_args:" << join(unbuildable);
  EXPECT_TRUE(without_rule.empty()) << without_rule.size() << " seeded ops of LibTorch "
                                    << TORCH_VERSION << " reach the fallback "
                                    << "without a rule:" << join(without_rule);
}

// The check above can fail: local draws (what a layout-preserving rule gives) differ.
TEST(RegistrationPolicy, LocalDrawsAreNotOneDevicesDraws) {
  at::manual_seed(1234);
  const auto expected = at::empty({7, 6}).uniform_();
  tessera::testing::run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    tessera::manual_seed(1234);
    auto local = at::empty({rank == 0 ? 5 : 2, 6}).uniform_(0, 1, thread_generator());
    tessera::clear_manual_seed();
    auto d = from_local(local, mesh, {Shard(0)}, {ShardSizes::Given(0, {5, 2})});
    EXPECT_FALSE(at::equal(full_tensor(d), expected));
  });
}

namespace {

void on_one_to_three_ranks(const std::function<void(const DeviceMesh&)>& body) {
  for (int world : {1, 2, 3})
    tessera::testing::run_ranks(world, [&](int) { body(init_device_mesh("cpu", {world})); });
}

// Rows 0..n-1 unevenly: n - 2 on the first rank, 2 on the last, none between.
ShardSizes uneven_rows(const DeviceMesh& mesh, int64_t n) {
  ShardTable t(mesh.size(), 0);
  t[0] = mesh.size() > 1 ? n - 2 : n;
  if (mesh.size() > 1) t.back() = 2;
  return ShardSizes::Given(0, t);
}

void expect_layout_and_value(const at::Tensor& got, Placement p, const at::Tensor& want,
                             const std::string& what) {
  ASSERT_TRUE(is_dtensor(got)) << what;
  // On one rank every redistribution is free, and the first candidate layout wins ties.
  if (spec(got).mesh().size() > 1) {
    EXPECT_EQ(placements(got)[0], p) << what << ": " << spec(got).str();
  }
  EXPECT_TRUE(same_values(full_tensor(got), want)) << what;
}

}  // namespace

// exp(P(max)) stays P(max): the max of exp of the terms is exp of their max, one device's
// max-reduction followed by exp. Ops without a row reduce first.
TEST(PointwiseTables, MonotoneOpsKeepMaxAndMin) {
  const auto full = tessera::test::randn({7, 5}, 11);
  const auto other = tessera::test::randn({7, 5}, 12);
  const auto ints = tessera::test::randn({7, 5}, 13, at::kLong);
  const auto mask = tessera::test::randn({7, 5}, 14) > 0;
  const Placement pmax = Partial(PartialOp::Max), pmin = Partial(PartialOp::Min);
  on_one_to_three_ranks([&](const DeviceMesh& mesh) {
    auto x = make_dtensor_from_full(full, mesh, {pmax});
    auto y = make_dtensor_from_full(other, mesh, {pmax});
    auto lo = make_dtensor_from_full(full, mesh, {pmin});
    auto r = distribute_tensor(other, mesh, {Replicate()}, std::nullopt);
    auto s = distribute_tensor(other, mesh, {Shard(0)}, std::nullopt, uneven_rows(mesh, 7));
    expect_layout_and_value(x.exp(), pmax, full.exp(), "exp(P(max))");
    expect_layout_and_value(x.relu(), pmax, full.relu(), "relu(P(max))");
    expect_layout_and_value(at::round(x, 1), pmax, at::round(full, 1), "round.decimals");
    expect_layout_and_value(lo.clamp(-0.5, 0.5), pmin, full.clamp(-0.5, 0.5), "clamp(P(min))");
    expect_layout_and_value(lo.sigmoid().floor(), pmin, full.sigmoid().floor(), "floor(P(min))");
    expect_layout_and_value(-x, pmin, -full, "neg(P(max))");
    expect_layout_and_value(x + r, pmax, full + other, "P(max) + R");
    expect_layout_and_value(at::maximum(r, x), pmax, at::maximum(other, full),
                            "maximum(R, P(max))");
    expect_layout_and_value(at::where(mask, x, y), pmax, at::where(mask, full, other),
                            "where(c, P(max), P(max))");
    expect_layout_and_value(x.masked_fill(mask, 2.0), pmax, full.masked_fill(mask, 2.0),
                            "masked_fill(P(max))");
    expect_layout_and_value(at::bitwise_not(make_dtensor_from_full(ints, mesh, {pmax})), pmin,
                            at::bitwise_not(ints), "bitwise_not(P(max) int)");
    auto z = make_dtensor_from_full(full, mesh, {pmax});
    z.exp_();
    expect_layout_and_value(z, pmax, full.exp(), "exp_(P(max))");
    // Uneven shards next to P(max): either operand may set the layout.
    auto m = at::maximum(x.tanh(), s);
    EXPECT_TRUE(same_values(full_tensor(m), at::maximum(full.tanh(), other))) << spec(m).str();
    // No row: reduced first.
    expect_layout_and_value(x.abs(), Replicate(), full.abs(), "abs(P(max))");
    expect_layout_and_value(x.exp().log(), Replicate(), full.exp().log(), "log(P(max))");
    expect_layout_and_value(x * 2, Replicate(), full * 2, "P(max) * 2");
    expect_layout_and_value(make_dtensor_from_full(ints, mesh, {pmax}) + 1, Replicate(), ints + 1,
                            "P(max) + 1 on integers");
    auto w = make_dtensor_from_full(full, mesh, {pmax});
    w.neg_();  // in place: self keeps its layout, so P(max) cannot become P(min)
    expect_layout_and_value(w, Replicate(), -full, "neg_(P(max))");
  });
}

// Sums pass through linear operands, and R operands become terms.
TEST(PointwiseTables, LinearOpsKeepSums) {
  const auto a = tessera::test::randn({6, 4}, 21), b = tessera::test::randn({6, 4}, 22);
  const auto c = tessera::test::randn({4}, 23);
  const auto mask = tessera::test::randn({6, 4}, 24) > 0;
  const Placement psum = Partial();
  on_one_to_three_ranks([&](const DeviceMesh& mesh) {
    auto pa = make_dtensor_from_full(a, mesh, {psum});
    auto pb = make_dtensor_from_full(b, mesh, {psum});
    auto rb = distribute_tensor(b, mesh, {Replicate()}, std::nullopt);
    auto rc = distribute_tensor(c, mesh, {Replicate()}, std::nullopt);
    expect_layout_and_value(pa - rc, psum, a - c, "P - R broadcast");
    expect_layout_and_value(pa * rb, psum, a * b, "P * R");
    expect_layout_and_value(rb * pa, psum, b * a, "R * P");
    expect_layout_and_value(pa / rb.abs().add(1), psum, a / (b.abs() + 1), "P / R");
    expect_layout_and_value(at::lerp(pa, pb, 0.25), psum, at::lerp(a, b, 0.25), "lerp(P, P)");
    expect_layout_and_value(at::addcmul(pa, rb, rc), psum, at::addcmul(a, b, c),
                            "addcmul(P, R, R)");
    expect_layout_and_value(at::where(mask, pa, rb), psum, at::where(mask, a, b), "where(c, P, R)");
    expect_layout_and_value(at::deg2rad(pa), psum, at::deg2rad(a), "deg2rad(P)");
    // A number cannot be split into terms, nor can a divisor be one; rounding is not linear.
    expect_layout_and_value(pa + 1, Replicate(), a + 1, "P + 1");
    expect_layout_and_value(rb / pa, Replicate(), b / a, "R / P");
    expect_layout_and_value(at::div(pa, rb, "floor"), Replicate(), at::div(a, b, "floor"),
                            "div(P, R, floor)");
    expect_layout_and_value(pa.masked_fill(mask, 1.0), Replicate(), a.masked_fill(mask, 1.0),
                            "masked_fill(P(sum), 1)");
  });
}

// Overloads the guessed names missed: out= comparisons, round.decimals, Scalar-first forms.
TEST(PointwiseTables, OverloadsFromTheDispatcher) {
  const auto x = tessera::test::randn({7, 5}, 31), y = tessera::test::randn({7, 5}, 32);
  const auto halves = (x * 2).round() / 2;
  on_one_to_three_ranks([&](const DeviceMesh& mesh) {
    auto dist = [&](const at::Tensor& t) {
      return distribute_tensor(t, mesh, {Shard(0)}, std::nullopt, uneven_rows(mesh, 7));
    };
    const Placement s0 = Shard(0);
    auto dx = dist(x), dy = dist(y), dh = dist(halves);
    auto bools = dist(at::zeros({7, 5}, at::kBool));
    at::eq_out(bools, dh, 0.5);  // eq.Scalar_out
    expect_layout_and_value(bools, s0, at::eq(halves, 0.5), "eq.Scalar_out");
    EXPECT_EQ(bools.scalar_type(), at::kBool);
    at::lt_out(bools, dx, dy);  // lt.Tensor_out
    expect_layout_and_value(bools, s0, at::lt(x, y), "lt.Tensor_out");
    auto floats = dist(at::zeros({7, 5}));
    at::pow_out(floats, dx, 2);  // pow.Tensor_Scalar_out
    expect_layout_and_value(floats, s0, at::pow(x, 2), "pow.Tensor_Scalar_out");
    at::where_out(floats, dx > 0, dx, dy);  // where.self_out
    expect_layout_and_value(floats, s0, at::where(x > 0, x, y), "where.self_out");
    expect_layout_and_value(at::round(dx, 2), s0, at::round(x, 2), "round.decimals");
    auto dr = dist(x);
    dr.round_(1);  // round_.decimals
    expect_layout_and_value(dr, s0, at::round(x, 1), "round_.decimals");
    expect_layout_and_value(at::remainder(2.5, dy), s0, at::remainder(2.5, y),
                            "remainder.Scalar_Tensor");
    expect_layout_and_value(at::xlogy(3, dy.abs()), s0, at::xlogy(3, y.abs()), "xlogy.Scalar_Self");
  });
}

// Ops with several results and several out= arguments take the same pointwise path.
TEST(PointwiseTables, SeveralResultsAndOutArguments) {
  const auto x = tessera::test::randn({7, 5}, 33);
  on_one_to_three_ranks([&](const DeviceMesh& mesh) {
    auto dist = [&](const at::Tensor& t) {
      return distribute_tensor(t, mesh, {Shard(0)}, std::nullopt, uneven_rows(mesh, 7));
    };
    const Placement s0 = Shard(0);
    auto dx = dist(x);
    auto result = at::log_sigmoid_forward(dx);
    expect_layout_and_value(std::get<0>(result), s0, at::log_sigmoid(x), "log_sigmoid_forward");
    auto output = dist(at::zeros({7, 5})), buffer = dist(at::zeros({7, 5}));
    at::log_sigmoid_forward_out(output, buffer, dx);  // log_sigmoid_forward.output
    expect_layout_and_value(output, s0, at::log_sigmoid(x), "log_sigmoid_forward.output");
    auto elu = dist(at::zeros({7, 5}));
    at::elu_out(elu, dx);  // elu.out
    expect_layout_and_value(elu, s0, at::elu(x), "elu.out");
  });
}

namespace {

// Every placement kind on every mesh dim, Shard(0) with uneven tables.
Placement any_placement(tessera::test::Rng& rng) {
  static const Placement kinds[] = {Shard(0),
                                    Shard(1),
                                    Replicate(),
                                    Partial(PartialOp::Sum),
                                    Partial(PartialOp::Avg),
                                    Partial(PartialOp::Max),
                                    Partial(PartialOp::Min)};
  return kinds[rng.index(7)];
}

struct PointwiseCase {
  const char* name;
  int operands;
  std::function<at::Tensor(const std::vector<at::Tensor>&, const at::Tensor& mask)> fn;
};

const std::vector<PointwiseCase>& pointwise_cases() {
  static const std::vector<PointwiseCase> cases = {
      {"add", 2, [](auto& v, auto&) { return v[0] + v[1]; }},
      {"sub alpha", 2, [](auto& v, auto&) { return at::sub(v[0], v[1], 2); }},
      {"mul", 2, [](auto& v, auto&) { return v[0] * v[1]; }},
      {"div", 2, [](auto& v, auto&) { return v[0] / (v[1].abs() + 1); }},
      {"neg", 1, [](auto& v, auto&) { return -v[0]; }},
      {"exp", 1, [](auto& v, auto&) { return v[0].exp(); }},
      {"relu then add 1", 1, [](auto& v, auto&) { return v[0].relu() + 1; }},
      {"clamp", 1, [](auto& v, auto&) { return v[0].clamp(-0.5, 0.5); }},
      {"clamp tensors", 3, [](auto& v, auto&) { return at::clamp(v[0], v[1], v[2] + 1); }},
      {"maximum", 2, [](auto& v, auto&) { return at::maximum(v[0], v[1]); }},
      {"minimum", 2, [](auto& v, auto&) { return at::minimum(v[0], v[1]); }},
      {"where", 2, [](auto& v, auto& m) { return at::where(m, v[0], v[1]); }},
      {"masked_fill", 1, [](auto& v, auto& m) { return v[0].masked_fill(m, 2.0); }},
      {"lerp", 3, [](auto& v, auto&) { return at::lerp(v[0], v[1], v[2].sigmoid()); }},
      {"addcmul", 3, [](auto& v, auto&) { return at::addcmul(v[0], v[1], v[2], 0.5); }},
      {"addcdiv", 3, [](auto& v, auto&) { return at::addcdiv(v[0], v[1], v[2].abs() + 1); }},
      {"deg2rad", 1, [](auto& v, auto&) { return at::deg2rad(v[0]); }},
      {"round decimals", 1, [](auto& v, auto&) { return at::round(v[0], 1); }},
      {"exp_", 1, [](auto& v, auto&) { return v[0].clone().exp_(); }},
      {"add_", 2, [](auto& v, auto&) { return v[0].clone().add_(v[1]); }},
      {"neg_", 1, [](auto& v, auto&) { return v[0].clone().neg_(); }},
  };
  return cases;
}

void random_partial_cases(tessera::test::Sweep& sweep, const std::vector<int64_t>& mesh_shape,
                          int cases) {
  int world = 1;
  for (auto s : mesh_shape) world *= static_cast<int>(s);
  const auto block = sweep.cases(cases);
  if (!block.any()) return;
  tessera::testing::run_ranks(world, [&](int) {
    auto mesh = init_device_mesh("cpu", mesh_shape);
    const auto mask = tessera::test::randn({5, 4}, 40) > 0;
    block.run([&](tessera::test::Rng& rng, int64_t c) {
      const auto& pc = pointwise_cases()[rng.index(pointwise_cases().size())];
      std::vector<at::Tensor> full, dist;
      std::string what =
          std::string(pc.name) + " case " + std::to_string(c) + " mesh " + shape_str(mesh_shape);
      for (int i = 0; i < pc.operands; ++i) {
        // Operands may broadcast: [5, 4] or [4].
        const bool row = i > 0 && rng.index(4) == 0;
        full.push_back(row ? tessera::test::randn({4}, 50 + c * 3 + i)
                           : tessera::test::randn({5, 4}, 50 + c * 3 + i));
        Placements p;
        for (int64_t m = 0; m < mesh.ndim(); ++m) {
          auto pl = any_placement(rng);
          if (row && pl.is_shard()) pl = Shard(0);
          p.push_back(pl);
        }
        auto tables = tessera::test::random_tables(rng, mesh, p, full.back().sizes().vec());
        dist.push_back(make_dtensor_from_full(full.back(), mesh, p, tables));
        what += " | " + to_string(p);
      }
      const auto expected = pc.fn(full, mask);
      const auto got = pc.fn(dist, mask);
      ASSERT_TRUE(same_values(full_tensor(got), expected)) << what << " -> " << spec(got).str();
    });
  });
}

}  // namespace

// Partial rows under random layouts (all four partial ops, uneven shards, broadcasting),
// against one device.
TEST(PointwiseTables, RandomLayoutsMatchOneDevice) {
  tessera::test::Sweep sweep;
  random_partial_cases(sweep, {2}, 150);
  random_partial_cases(sweep, {3}, 150);
  random_partial_cases(sweep, {2, 2}, 150);
}
