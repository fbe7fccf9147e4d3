// One block's attention by LibTorch's memory-efficient kernel pair
// (_scaled_dot_product_efficient_attention and its backward: CUDA), with the block kernels'
// conventions (NOTE: [Block kernels] in attention_ring.h). The pair differs from the fused CPU
// pair in three ways this file absorbs:
//  - its log-sum-exp comes padded to a multiple of 32 rows (its backward reads it in whole
//    tiles of 32), so forward cuts it to the rows and backward pads the global one again;
//  - it takes no fewer K/V heads than query heads: grouped heads are repeated per block and
//    their dK / dV summed back per group;
//  - its backward reads the output as stored [B, L, H, E] (the forward's own layout), so the
//    global output is handed over so;
//  - its schema has grown arguments across versions: arguments are matched by name, and one
//    it does not know raises.
// ROCm builds run another backward (AOTriton) that reads the log-sum-exp unpadded: this route
// is for CUDA builds.
#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "attention_ring.h"

namespace tessera::ops::attention {

namespace {

constexpr int64_t kLseRowsAlign = 32;

std::atomic<int64_t>& calls() {
  static std::atomic<int64_t> n{0};
  return n;
}

// (Looked up once, not per call; absent in LibTorch 1.13.)
const c10::optional<c10::OperatorHandle>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findOp({"aten::_scaled_dot_product_efficient_attention", ""});
  return op;
}
const c10::optional<c10::OperatorHandle>& backward_op() {
  static const auto op = c10::Dispatcher::singleton().findOp(
      {"aten::_scaled_dot_product_efficient_attention_backward", ""});
  return op;
}

using Named = std::initializer_list<std::pair<const char*, c10::IValue>>;

// Calls `op` with `args` by name, defaults for the rest; returns its results. An argument
// of the schema without a value here and without a default, or a value given (not None) for
// a name the schema lacks, raises: a LibTorch whose schema has changed.
torch::jit::Stack call_by_name(const c10::OperatorHandle& op, Named args) {
  const auto& schema = op.schema();
  const char* fix = "; TESSERA_ATTENTION_BLOCKS=products runs the blocks as matrix products";
  for (const auto& [name, value] : args)
    TORCH_CHECK(value.isNone() || schema.argumentIndexWithName(name).has_value(),
                "tessera: attention: ", schema.name(), " has no argument '", name,
                "' in this LibTorch version", fix);
  torch::jit::Stack s;
  for (const auto& a : schema.arguments()) {
    const auto it =
        std::find_if(args.begin(), args.end(), [&](const auto& n) { return a.name() == n.first; });
    if (it != args.end()) {
      s.push_back(it->second);
    } else {
      TORCH_CHECK(a.default_value().has_value(), "tessera: attention: ", schema.name(),
                  " has an argument '", a.name(),
                  "' the block kernel does not know in this LibTorch version", fix);
      s.push_back(*a.default_value());
    }
  }
  op.callBoxed(&s);
  return s;
}

// Whether the pair has a kernel for t's device (CUDA builds; on CPU only a test's stand-in).
bool has_kernel_for(const at::Tensor& t) {
  const auto key = t.is_cuda()  ? c10::DispatchKey::CUDA
                   : t.is_cpu() ? c10::DispatchKey::CPU
                                : c10::DispatchKey::Undefined;
  return key != c10::DispatchKey::Undefined && forward_op()->hasKernelForDispatchKey(key) &&
         backward_op()->hasKernelForDispatchKey(key);
}

// [B, H, L, E] `t` stored as [B, L, H, E], as the forward kernel returns its output: the
// backward reads the output's rows at a stride of H x E whatever strides it is given.
at::Tensor heads_inner(const at::Tensor& t) {
  const at::Tensor blhe = t.transpose(1, 2);
  return (blhe.is_contiguous() ? blhe : blhe.contiguous()).transpose(1, 2);
}

// The kernel's alignment of the head dim, strides and offsets, in elements (16 bytes for
// half precision, as LibTorch's backend choice requires).
int64_t alignment(const at::Tensor& t) { return t.element_size() == 2 ? 8 : 4; }

// `t` itself where its strides and offset keep the kernel's alignment, else a contiguous copy.
at::Tensor aligned(const at::Tensor& t) {
  const int64_t a = alignment(t);
  bool ok = t.stride(-1) == 1 && t.storage_offset() % a == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) == 1 || t.stride(d) % a == 0);
  return ok ? t : t.contiguous();
}

c10::IValue scale_value(c10::optional<double> scale) {
  return scale ? c10::IValue(*scale) : c10::IValue();
}

}  // namespace

bool efficient_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask) {
  if (!forward_op() || !backward_op() || mask.defined() || !has_kernel_for(q)) return false;
  const auto dt = q.scalar_type();
  if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) return false;
  if (k.scalar_type() != dt || v.scalar_type() != dt || q.dim() != 4 || k.dim() != 4 ||
      v.dim() != 4)
    return false;
  const int64_t e = q.size(3);
  return e == k.size(3) && e == v.size(3) && e % alignment(q) == 0 && q.numel() > 0 &&
         k.numel() > 0 && k.size(1) > 0 && q.size(1) % k.size(1) == 0;
}

std::tuple<at::Tensor, at::Tensor> efficient_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, bool causal,
                                                     c10::optional<double> scale) {
  calls().fetch_add(1, std::memory_order_relaxed);
  const int64_t g = groups_of(q, k);
  auto r = call_by_name(*forward_op(), {{"query", aligned(q)},
                                        {"key", aligned(repeat_heads(k, g))},
                                        {"value", aligned(repeat_heads(v, g))},
                                        {"attn_bias", c10::IValue()},
                                        {"compute_log_sumexp", true},
                                        {"dropout_p", 0.0},
                                        {"is_causal", causal},
                                        {"scale", scale_value(scale)}});
  return {r.at(0).toTensor(), r.at(1).toTensor().narrow(-1, 0, q.size(2))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> efficient_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, bool causal, c10::optional<double> scale) {
  calls().fetch_add(1, std::memory_order_relaxed);
  const int64_t g = groups_of(q, k);
  const int64_t rows = q.size(2);
  // The global log-sum-exp, padded as the forward kernel returns it (the padding is not read
  // for any row that exists).
  auto lse_sizes = lse.sizes().vec();
  lse_sizes.back() = (rows + kLseRowsAlign - 1) / kLseRowsAlign * kLseRowsAlign;
  at::Tensor padded = at::zeros(lse_sizes, lse.options().dtype(at::kFloat));
  padded.narrow(-1, 0, rows).copy_(lse);
  const at::Tensor no_rng = at::empty({}, at::dtype(at::kLong));
  auto r =
      call_by_name(*backward_op(), {{"grad_out_", aligned(grad_out.contiguous())},
                                    {"query", aligned(q)},
                                    {"key", aligned(repeat_heads(k, g))},
                                    {"value", aligned(repeat_heads(v, g))},
                                    {"attn_bias", at::Tensor()},
                                    {"out", heads_inner(out)},
                                    {"logsumexp", padded},
                                    {"philox_seed", no_rng},
                                    {"philox_offset", no_rng},
                                    {"dropout_p", 0.0},
                                    {"grad_input_mask", c10::List<bool>({true, true, true, false})},
                                    {"is_causal", causal},
                                    {"scale", scale_value(scale)}});
  return {r.at(0).toTensor(), sum_groups(r.at(1).toTensor(), g), sum_groups(r.at(2).toTensor(), g)};
}

int64_t efficient_calls() { return calls().load(std::memory_order_relaxed); }

}  // namespace tessera::ops::attention
