// The built-in parallel styles. Each lays out its module's parameters and records the
// module's boundary (tp_boundary.h); nothing here communicates except the parameters'
// scatter/broadcast from src_data_rank.
#include <sstream>

#include <ATen/ATen.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "tessera/parallel/module.h"
#include "tessera/parallel/tensor_parallel.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"
#include "tp_boundary.h"

namespace tessera {

namespace tp {

namespace {
thread_local std::string g_current_path;
}  // namespace

const std::string& current_path() { return g_current_path; }

namespace detail {
// Set while parallelize_module applies a style (tp_plan.cpp).
void set_current_path(const std::string& path) { g_current_path = path; }
}  // namespace detail

namespace {

std::string where(const ParallelStyle& style) {
  const auto& p = current_path();
  return "parallelize_module: " + style.name() + " on '" + p + "'";
}

std::string describe(const torch::nn::Module& m) {
  std::ostringstream os;
  m.pretty_print(os);
  return os.str();
}

at::Tensor registered(torch::nn::Module& module, const std::string& name) {
  const auto params = module.named_parameters(/*recurse=*/false);
  if (const auto* p = params.find(name)) return *p;
  const auto buffers = module.named_buffers(/*recurse=*/false);
  if (const auto* b = buffers.find(name)) return *b;
  return {};
}

}  // namespace

void distribute_parameter(const ParallelStyle& style, torch::nn::Module& module,
                          const std::string& name, const DeviceMesh& tp_mesh, Placement placement,
                          const std::optional<ShardTable>& sizes) {
  const auto mesh = detail::TpMesh::of(tp_mesh, where(style));
  at::Tensor current = registered(module, name);
  TORCH_CHECK(current.defined(), "tessera: ", where(style), ": ", describe(module),
              " has no parameter or buffer named \"", name, "\"");
  TORCH_CHECK(!is_dtensor(current), "tessera: ", where(style), ": parameter \"", name,
              "\" is already distributed (",
              tp::describe_parameter(current).empty() ? spec(current).str()
                                                      : tp::describe_parameter(current),
              "); a module takes one parameter style");
  if (placement.is_shard()) placement = placement.normalized(current.dim());
  ShardSizes shard_sizes = ShardSizes::Chunk();
  if (sizes && placement.is_shard()) shard_sizes = ShardSizes::Given(placement.dim(), *sizes);
  at::Tensor laid = distribute_tensor(current.detach(), mesh.root, mesh.with({}, placement),
                                      style.src_data_rank, shard_sizes);
  replace_parameter(module, name, laid);
  detail::note_laid_out(module);
}

bool is_anchored_leaf(const torch::nn::Module& module) {
  for (const auto& a : detail::anchored_modules())
    if (a.matches(module)) return true;
  return false;
}

}  // namespace tp

namespace {

using tp::detail::Boundary;
using tp::detail::BoundaryPtr;
using tp::detail::Convert;
using tp::detail::TpMesh;

// Shard sizes of `n` features over the tp ranks: given, or whole units as even as possible,
// or torch.chunk's layout. Always known, so plain inputs are read without exchanging sizes.
std::optional<ShardTable> feature_table(const std::string& where, int64_t n, int64_t parts,
                                        int64_t unit, const std::optional<ShardTable>& given) {
  if (given) {
    int64_t sum = 0;
    for (auto v : *given) sum += v;
    TORCH_CHECK(static_cast<int64_t>(given->size()) == parts && sum == n, "tessera: ", where,
                ": shard_sizes ", shape_str(*given), " must have one entry per tp rank (", parts,
                ") summing to ", n);
    return given;
  }
  if (unit <= 1) return chunk_sizes(n, parts);
  TORCH_CHECK(n % unit == 0, "tessera: ", where, ": shard_unit(", unit, ") does not divide the ", n,
              " features");
  const int64_t units = n / unit;
  ShardTable t(static_cast<size_t>(parts));
  for (int64_t r = 0; r < parts; ++r)
    t[static_cast<size_t>(r)] = (units / parts + (r < units % parts ? 1 : 0)) * unit;
  return t;
}

void tag_all(torch::nn::Module& module, const BoundaryPtr& b, bool recurse) {
  for (const auto& p : module.named_parameters(recurse))
    if (p.value().defined()) tp::detail::tag_parameter(p.value(), b);
  for (const auto& p : module.named_buffers(recurse))  // the state a module keeps is its own too
    if (p.value().defined() && is_dtensor(p.value())) tp::detail::tag_parameter(p.value(), b);
}

std::string error_prefix(const ParallelStyle& style) {
  return "tessera: parallelize_module: " + style.name() + " on '" + tp::current_path() + "'";
}

std::string type_of(const torch::nn::Module& m) {
  std::ostringstream os;
  m.pretty_print(os);
  return os.str();
}

// Colwise and Rowwise take Linear and Embedding only (as in PyTorch).
std::pair<torch::nn::LinearImpl*, torch::nn::EmbeddingImpl*> linear_or_embedding(
    torch::nn::Module& module, const ParallelStyle& style) {
  auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module);
  auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&module);
  TORCH_CHECK(linear || embedding, error_prefix(style), ": ", style.name(), " applies to Linear ",
              "and Embedding; this module is ", type_of(module),
              ". Give its Linear children styles, or write a ParallelStyle for it");
  return {linear, embedding};
}

}  // namespace

// ---- ColwiseParallel -----------------------------------------------------------------------

void ColwiseParallel::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  auto [linear, embedding] = linear_or_embedding(module, *this);
  const int64_t tp_size = mesh.size();
  const int64_t features =
      linear ? linear->options.out_features() : embedding->options.embedding_dim();
  const auto table = feature_table(error_prefix(*this), features, tp_size, unit_, sizes_);
  BoundaryPtr b = tp::detail::claim_boundary(module, *this, mesh);
  if (linear) {
    tp::distribute_parameter(*this, module, "weight", mesh, Shard(0), table);
    if (linear->options.bias())
      tp::distribute_parameter(*this, module, "bias", mesh, Shard(0), table);
  } else {
    tp::distribute_parameter(*this, module, "weight", mesh, Shard(1), table);
  }
  Convert in;
  in.plain = input_ ? input_ : IoLayout(Replicate());
  in.desired = Replicate();
  set_input_conversion(module, mesh, in);
  Convert out;
  out.desired = output_ ? output_ : IoLayout(Shard(-1));
  out.desired_table = table;
  out.to_local = local_;
  add_output_conversion(module, mesh, out);
  tag_all(module, b, /*recurse=*/false);
}

// ---- RowwiseParallel -----------------------------------------------------------------------

void RowwiseParallel::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  auto [linear, embedding] = linear_or_embedding(module, *this);
  const int64_t tp_size = mesh.size();
  BoundaryPtr b = tp::detail::claim_boundary(module, *this, mesh);
  Convert in;
  if (linear) {
    const auto table =
        feature_table(error_prefix(*this), linear->options.in_features(), tp_size, unit_, sizes_);
    tp::distribute_parameter(*this, module, "weight", mesh, Shard(1), table);
    if (linear->options.bias()) tp::distribute_parameter(*this, module, "bias", mesh, Replicate());
    in.plain = input_ ? input_ : IoLayout(Shard(-1));
    in.plain_table = table;
    in.desired = Shard(-1);
    in.desired_table = table;
  } else {
    const auto table = feature_table(error_prefix(*this), embedding->options.num_embeddings(),
                                     tp_size, unit_, sizes_);
    tp::distribute_parameter(*this, module, "weight", mesh, Shard(0), table);
    // Indices are read as Replicate unless declared (PyTorch's Shard(-1) default is a trap).
    in.plain = input_ ? input_ : IoLayout(Replicate());
    in.desired = Replicate();
  }
  set_input_conversion(module, mesh, in);
  Convert out;
  out.desired = output_ ? output_ : IoLayout(Replicate());
  out.to_local = local_;
  add_output_conversion(module, mesh, out);
  tag_all(module, b, /*recurse=*/false);
}

// ---- SequenceParallel ----------------------------------------------------------------------

void SequenceParallel::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  const auto own = module.named_parameters(/*recurse=*/false);
  const auto all = module.named_parameters(/*recurse=*/true);
  bool any = false;
  for (const auto& p : all) any = any || p.value().defined();
  TORCH_CHECK(any, error_prefix(*this), ": ", type_of(module), " has no parameters, so Tessera ",
              "cannot see its calls (LibTorch modules have no hooks). A distributed input "
              "already keeps its sequence shards through it; leave it out of the plan");
  const bool anchored = tp::is_anchored_leaf(module);
  TORCH_CHECK(anchored || !local_, error_prefix(*this), ": use_local_output(true) on ",
              type_of(module),
              ", whose forward is not one ATen op Tessera intercepts: its "
              "output cannot be made local (LibTorch modules have no hooks). Leave "
              "use_local_output(false) and call tessera::to_local on the output");
  BoundaryPtr b = tp::detail::claim_boundary(module, *this, mesh);
  b->anchored = anchored;
  b->plain_forbidden = !anchored;
  b->sequence_dim = seq_;
  // Parameters and buffers replicated, from src_data_rank (PyTorch assumes equal values
  // without a check; its distribute_module replicates the buffers a style leaves alone).
  for (const auto& item : modules_with_self(module)) {
    auto& m = *item.second;
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      if (p.value().defined()) tp::distribute_parameter(*this, m, p.key(), mesh, Replicate());
    for (const auto& p : m.named_buffers(/*recurse=*/false))
      if (p.value().defined() && !is_dtensor(p.value()))
        tp::distribute_parameter(*this, m, p.key(), mesh, Replicate());
  }
  // The input is converted where Tessera sees it: at the module's one op. Inside a module
  // it cannot intercept, every tagged op would take its operand for the module's input
  // (an RNN's hidden state too), so nothing is converted there; the input must arrive
  // distributed (NOTE: [Plain operands at modules Tessera cannot intercept]).
  if (anchored) {
    Convert in;
    in.plain = Shard(seq_);
    in.desired = Shard(seq_);
    set_input_conversion(module, mesh, in);
  }
  if (local_) {
    Convert out;
    out.to_local = true;
    add_output_conversion(module, mesh, out);
  }
  tag_all(module, b, /*recurse=*/true);
}

// ---- PrepareModuleInput / Output -----------------------------------------------------------

void PrepareModuleInput::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  const std::string prefix = error_prefix(*this);
  TORCH_CHECK(input_.empty() || !desired_.empty(), prefix, ": desired_input_layouts must be ",
              "given with input_layouts");
  TORCH_CHECK(input_.empty() || input_.size() == desired_.size(), prefix, ": input_layouts (",
              input_.size(), ") and desired_input_layouts (", desired_.size(),
              ") must have the same length");
  TORCH_CHECK(kw_input_.size() == kw_desired_.size(), prefix, ": input_kwarg_layouts and ",
              "desired_input_kwarg_layouts must have the same length");
  // Tessera sees the module's input where it reaches a tagged op, so it can tell apart one
  // laid-out input (the others, e.g. masks and rotary tables, pass through).
  Convert c;
  std::vector<std::string> laid;
  auto take = [&](const std::string& what, const IoLayout& in, const IoLayout& want) {
    if (!in && !want) return;
    laid.push_back(what);
    c.plain = in;
    c.desired = want;
  };
  for (size_t i = 0; i < desired_.size(); ++i)
    take("input " + std::to_string(i), i < input_.size() ? input_[i] : IoLayout(), desired_[i]);
  for (size_t i = 0; i < kw_desired_.size(); ++i) {
    IoLayout in;
    for (const auto& kv : kw_input_)
      if (kv.first == kw_desired_[i].first) in = kv.second;
    take("'" + kw_desired_[i].first + "'", in, kw_desired_[i].second);
  }
  if (laid.size() > 1) {
    std::string names;
    for (const auto& n : laid) names += (names.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, prefix, " (", type_of(module), "): ", laid.size(), " inputs have layouts (",
                names,
                "). LibTorch modules have no forward hooks, so Tessera converts a module's "
                "input where it reaches the tensor-parallel ops inside the module, and there it "
                "can tell one input apart. Keep here the layout of the input those ops read, and "
                "convert the others before the call (tessera::from_local / redistribute) or with "
                "input_layouts on the styles of the modules that consume them");
  }
  if (laid.empty()) return;
  c.to_local = local_;
  set_input_conversion(module, mesh, c);
}

void PrepareModuleOutput::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  const std::string prefix = error_prefix(*this);
  TORCH_CHECK(!output_.empty() && output_.size() == desired_.size(), prefix,
              ": output_layouts and desired_output_layouts must be given, with the same length");
  TORCH_CHECK(output_.size() == 1, prefix, ": ", output_.size(), " outputs have layouts; ",
              "Tessera converts the one output of a tensor-parallel op");
  Convert c;
  c.plain = output_[0];
  c.desired = desired_[0];
  c.to_local = local_;
  add_output_conversion(module, mesh, c);
}

void PrepareModuleInputOutput::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  in_.apply(module, mesh);
  out_.apply(module, mesh);
}

}  // namespace tessera
