// The neighbourhood-attention op in the dispatcher, its plain (CPU / CUDA) kernels, its
// autograd kernel and the functional API.
//
//   tessera::neighborhood_attention(q, k, v, kernel_size, stride, dilation, is_causal,
//       circular, scale, rpb?, additional_keys?, additional_values?) -> (out, lse)
//   tessera::neighborhood_attention_backward(grad_out, q, k, v, out, lse, <same>)
//       -> (dq, dk, dv, drpb, dadditional_keys, dadditional_values)
//
// The plain kernels sit at CPU and CUDA only (not at a composite key), so a distributed
// tensor falls through to the PrivateUse1 fallback and its sharding rule. The autograd
// kernel wraps the forward in an autograd Function whose backward calls the backward op,
// both through the dispatcher for the same reason.
#include "tessera/nn/neighborhood_attention.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/window/na_local.h"
#include "tessera/comm/halo.h"

namespace tessera::nn {

namespace {

using Tensor = at::Tensor;
using OptTensor = c10::optional<Tensor>;
using BoolList = c10::List<bool>;

using ForwardFn = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                             at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                             const BoolList&, const BoolList&, double,
                                             const OptTensor&, const OptTensor&, const OptTensor&);
using BackwardFn = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, const BoolList&, const BoolList&, double,
    const OptTensor&, const OptTensor&, const OptTensor&);

constexpr const char* kOp = "tessera::neighborhood_attention";
constexpr const char* kBackwardOp = "tessera::neighborhood_attention_backward";

Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }
OptTensor optional_if_defined(const Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }
bool requires_grad(const OptTensor& t) {
  return t.has_value() && t->defined() && t->requires_grad();
}

std::vector<bool> to_vector(const BoolList& l) {
  std::vector<bool> r;
  for (size_t i = 0; i < l.size(); ++i) r.push_back(l.get(i));
  return r;
}

// The K/V window of every axis on one process: the whole axis, plus the wrap-around rows of
// a circular axis (fetched periodically from the tensor itself).
struct LocalWindows {
  std::vector<detail::NAAxis> axes;
  std::vector<comm::Window> windows;
  std::vector<detail::TapTable> tables;
};

LocalWindows local_windows(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                           at::IntArrayRef kernel_size, at::IntArrayRef stride,
                           at::IntArrayRef dilation, const BoolList& is_causal,
                           const BoolList& circular, const OptTensor& rpb, const OptTensor& ek,
                           const OptTensor& ev) {
  LocalWindows w;
  w.axes = detail::make_axes(op, q.sizes(), kernel_size, stride, dilation, to_vector(is_causal),
                             to_vector(circular));
  detail::check_arguments(op, q.sizes(), k.sizes(), v.sizes(), w.axes, rpb, ek, ev);
  detail::check_tensors(op, q, k, v, value_or_undefined(rpb), value_or_undefined(ek),
                        value_or_undefined(ev));
  for (const auto& a : w.axes) {
    const comm::Window win = a.circular ? detail::reads(a, 0, a.length) : comm::Window{0, a.length};
    w.windows.push_back(win);
    w.tables.push_back(detail::tap_table(a, 0, a.length, win.lo, win.size()));
  }
  return w;
}

bool is_whole(const comm::Window& w, int64_t length) { return w.lo == 0 && w.hi == length; }

Tensor fill_windows(const LocalWindows& w, Tensor x) {
  for (size_t a = 0; a < w.axes.size(); ++a) {
    if (is_whole(w.windows[a], w.axes[a].length)) continue;
    x = comm::fetch_window(comm::Group(), x, static_cast<int64_t>(a) + 1, {w.axes[a].length},
                           {w.windows[a]}, comm::HaloBoundary::Periodic);
  }
  return x;
}

Tensor fold_windows(const LocalWindows& w, Tensor g) {
  for (size_t a = w.axes.size(); a-- > 0;) {
    if (is_whole(w.windows[a], w.axes[a].length)) continue;
    g = comm::fetch_window_backward(comm::Group(), g, static_cast<int64_t>(a) + 1,
                                    {w.axes[a].length}, {w.windows[a]},
                                    comm::HaloBoundary::Periodic);
  }
  return g;
}

std::tuple<Tensor, Tensor> na_forward_plain(const Tensor& q, const Tensor& k, const Tensor& v,
                                            at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                            at::IntArrayRef dilation, const BoolList& is_causal,
                                            const BoolList& circular, double scale,
                                            const OptTensor& rpb, const OptTensor& ek,
                                            const OptTensor& ev) {
  const auto w =
      local_windows(kOp, q, k, v, kernel_size, stride, dilation, is_causal, circular, rpb, ek, ev);
  if (q.numel() == 0 || k.numel() == 0) {  // an empty batch or heads shard
    auto os = q.sizes().vec();
    os.back() = v.size(-1);
    const auto lse_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    return {at::zeros(os, q.options()),
            at::zeros(q.sizes().slice(0, q.dim() - 1), q.options().dtype(lse_type))};
  }
  return detail::forward(q, fill_windows(w, k), fill_windows(w, v), w.tables, scale,
                         value_or_undefined(rpb), value_or_undefined(ek), value_or_undefined(ev));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> na_backward_plain(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef dilation, const BoolList& is_causal, const BoolList& circular, double scale,
    const OptTensor& rpb, const OptTensor& ek, const OptTensor& ev) {
  const auto w = local_windows(kBackwardOp, q, k, v, kernel_size, stride, dilation, is_causal,
                               circular, rpb, ek, ev);
  TORCH_CHECK(grad_out.sizes() == out.sizes(), kBackwardOp, ": grad_out ", grad_out.sizes(),
              " must have the shape of out ", out.sizes());
  if (q.numel() == 0 || k.numel() == 0) {  // an empty batch or heads shard
    auto zeros_or_empty = [&](const OptTensor& t) {
      return t.has_value() && t->defined() ? at::zeros_like(*t) : at::empty({0}, q.options());
    };
    return {at::zeros_like(q),   at::zeros_like(k),  at::zeros_like(v),
            zeros_or_empty(rpb), zeros_or_empty(ek), zeros_or_empty(ev)};
  }
  auto r = detail::backward(grad_out, q, fill_windows(w, k), fill_windows(w, v), out, lse, w.tables,
                            scale, value_or_undefined(rpb), value_or_undefined(ek),
                            value_or_undefined(ev));
  auto empty_if_undefined = [&](const Tensor& t) {
    return t.defined() ? t : at::empty({0}, q.options());
  };
  return {std::get<0>(r),
          fold_windows(w, std::get<1>(r)),
          fold_windows(w, std::get<2>(r)),
          empty_if_undefined(std::get<3>(r)),
          empty_if_undefined(std::get<4>(r)),
          empty_if_undefined(std::get<5>(r))};
}

const c10::TypedOperatorHandle<ForwardFn>& forward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(kOp, "").typed<ForwardFn>();
  return op;
}

const c10::TypedOperatorHandle<BackwardFn>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kBackwardOp, "").typed<BackwardFn>();
  return op;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct NeighborhoodAttentionFunction
    : public torch::autograd::Function<NeighborhoodAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, std::vector<int64_t> kernel_size,
                               std::vector<int64_t> stride, std::vector<int64_t> dilation,
                               BoolList is_causal, BoolList circular, double scale,
                               const OptTensor& rpb, const OptTensor& ek, const OptTensor& ev,
                               bool keep_windows) {
    // (Absent tensors are passed as nullopt: autograd skips them as inputs.)
    Tensor out, lse;
    detail::KVWindows windows;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      // NOTE: [K/V windows kept for backward] (ops/window/na_local.h)
      detail::KeepWindows keep(keep_windows ? &windows : nullptr);
      std::tie(out, lse) = forward_op().call(q, k, v, kernel_size, stride, dilation, is_causal,
                                             circular, scale, rpb, ek, ev);
    }
    ctx->save_for_backward({q, k, v, out, lse, value_or_undefined(rpb), value_or_undefined(ek),
                            value_or_undefined(ev)});
    if (windows.k.defined() && windows.v.defined()) {
      ctx->saved_data["k_window"] = windows.k;
      ctx->saved_data["v_window"] = windows.v;
    }
    ctx->saved_data["kernel_size"] = kernel_size;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["circular"] = circular;
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& grad_out = grads[0];
    variable_list result(13);
    if (!grad_out.defined()) return result;  // only the lse was used
    TORCH_CHECK(!at::GradMode::is_enabled(), kOp,
                ": double backward is not supported (backward was called with create_graph)");
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const Tensor &rpb = saved[5], &ek = saved[6], &ev = saved[7];
    detail::KVWindows windows;
    if (ctx->saved_data.count("k_window") != 0) {
      windows.k = ctx->saved_data["k_window"].toTensor();
      windows.v = ctx->saved_data["v_window"].toTensor();
    }
    detail::OfferWindows offer(&windows);
    auto r = backward_op().call(
        grad_out, q, k, v, out, lse, ctx->saved_data["kernel_size"].toIntVector(),
        ctx->saved_data["stride"].toIntVector(), ctx->saved_data["dilation"].toIntVector(),
        ctx->saved_data["is_causal"].toBoolList(), ctx->saved_data["circular"].toBoolList(),
        ctx->saved_data["scale"].toDouble(), optional_if_defined(rpb), optional_if_defined(ek),
        optional_if_defined(ev));
    result[0] = std::get<0>(r);
    result[1] = std::get<1>(r);
    result[2] = std::get<2>(r);
    if (rpb.defined()) result[9] = std::get<3>(r);
    if (ek.defined()) result[10] = std::get<4>(r);
    if (ev.defined()) result[11] = std::get<5>(r);
    return result;
  }
};

std::tuple<Tensor, Tensor> na_forward_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                               at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                               at::IntArrayRef dilation, const BoolList& is_causal,
                                               const BoolList& circular, double scale,
                                               const OptTensor& rpb, const OptTensor& ek,
                                               const OptTensor& ev) {
  auto r = NeighborhoodAttentionFunction::apply(
      q, k, v, kernel_size.vec(), stride.vec(), dilation.vec(), is_causal, circular, scale,
      optional_if_defined(value_or_undefined(rpb)), optional_if_defined(value_or_undefined(ek)),
      optional_if_defined(value_or_undefined(ev)),
      at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                     requires_grad(rpb) || requires_grad(ek) || requires_grad(ev)));
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY(tessera, m) {
  m.def(
      "neighborhood_attention(Tensor query, Tensor key, Tensor value, int[] kernel_size, "
      "int[] stride, int[] dilation, bool[] is_causal, bool[] circular, float scale, "
      "Tensor? rpb=None, Tensor? additional_keys=None, Tensor? additional_values=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "neighborhood_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
      "Tensor out, Tensor lse, int[] kernel_size, int[] stride, int[] dilation, "
      "bool[] is_causal, bool[] circular, float scale, Tensor? rpb=None, "
      "Tensor? additional_keys=None, Tensor? additional_values=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tessera, CPU, m) {
  m.impl("neighborhood_attention", TORCH_FN(na_forward_plain));
  m.impl("neighborhood_attention_backward", TORCH_FN(na_backward_plain));
}

TORCH_LIBRARY_IMPL(tessera, CUDA, m) {
  m.impl("neighborhood_attention", TORCH_FN(na_forward_plain));
  m.impl("neighborhood_attention_backward", TORCH_FN(na_backward_plain));
}

TORCH_LIBRARY_IMPL(tessera, Autograd, m) {
  m.impl("neighborhood_attention", TORCH_FN(na_forward_autograd));
}

// ---- functional API -----------------------------------------------------------------------

namespace functional {

namespace {

template <class T>
std::vector<T> per_axis(const char* name, const std::vector<T>& v, int64_t nd) {
  TORCH_CHECK(v.size() == 1 || static_cast<int64_t>(v.size()) == nd, kOp, ": ", name, " has ",
              v.size(), " entries; give one, or one per spatial axis (", nd, ")");
  return v.size() == 1 ? std::vector<T>(static_cast<size_t>(nd), v[0]) : v;
}

BoolList to_list(const std::vector<bool>& v) {
  BoolList l;
  for (bool b : v) l.push_back(b);
  return l;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> neighborhood_attention_with_lse(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::vector<int64_t> kernel_size,
    const NeighborhoodAttentionFuncOptions& options) {
  const int64_t nd = q.dim() - 3;
  TORCH_CHECK(nd >= 1 && nd <= 3, kOp, ": query must be [B, *S, H, D] with 1 to 3 spatial ",
              "axes, got ", q.dim(), " dims ", q.sizes());
  const double scale = options.scale().has_value()
                           ? *options.scale()
                           : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  return forward_op().call(
      q, k, v, per_axis("kernel_size", kernel_size, nd), per_axis("stride", options.stride(), nd),
      per_axis("dilation", options.dilation(), nd),
      to_list(per_axis("is_causal", options.is_causal(), nd)),
      to_list(per_axis("circular", options.circular(), nd)), scale,
      optional_if_defined(options.rpb()), optional_if_defined(options.additional_keys()),
      optional_if_defined(options.additional_values()));
}

at::Tensor neighborhood_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  std::vector<int64_t> kernel_size,
                                  const NeighborhoodAttentionFuncOptions& options) {
  return std::get<0>(neighborhood_attention_with_lse(q, k, v, std::move(kernel_size), options));
}

namespace {
at::Tensor na_nd(const char* name, int64_t nd, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, std::vector<int64_t> kernel_size,
                 const NeighborhoodAttentionFuncOptions& options) {
  TORCH_CHECK(q.dim() == nd + 3, "tessera::", name, ": query must be [B, ", nd,
              " spatial dims, H, D] (", nd + 3, " dims), got ", q.sizes());
  return neighborhood_attention(q, k, v, std::move(kernel_size), options);
}
}  // namespace

at::Tensor na1d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::vector<int64_t> kernel_size, const NeighborhoodAttentionFuncOptions& options) {
  return na_nd("na1d", 1, q, k, v, std::move(kernel_size), options);
}
at::Tensor na2d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::vector<int64_t> kernel_size, const NeighborhoodAttentionFuncOptions& options) {
  return na_nd("na2d", 2, q, k, v, std::move(kernel_size), options);
}
at::Tensor na3d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::vector<int64_t> kernel_size, const NeighborhoodAttentionFuncOptions& options) {
  return na_nd("na3d", 3, q, k, v, std::move(kernel_size), options);
}

}  // namespace functional

}  // namespace tessera::nn
