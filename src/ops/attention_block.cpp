// One block's attention by matrix products, on any device and in any dtype, with the fused CPU
// kernel's results and conventions (NOTE: [Block kernels] in attention_ring.h).
#include <cmath>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>

#include "attention_ring.h"

namespace tessera::ops::attention {

namespace {

at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

double scale_of(const at::Tensor& q, c10::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// scale * q k^T plus the mask, in the accumulation dtype, with the top-left causal cut (key j
// hidden from row i when j > i).
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& mask, bool causal,
                  c10::optional<double> scale) {
  const auto acc = accumulate_type(q.scalar_type());
  at::Tensor x = at::matmul(q.to(acc), k.to(acc).transpose(-2, -1)).mul_(scale_of(q, scale));
  if (mask.defined()) x.add_(mask.to(acc));
  if (causal) {
    const auto hidden = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu_(1);
    x.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
  }
  return x;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> products_forward(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& mask,
                                                    bool causal, c10::optional<double> scale) {
  const at::Tensor x = scores(q, k, mask, causal, scale);
  at::Tensor lse = at::logsumexp(x, -1);
  // A row hidden from every key: out 0 and log-sum-exp 0, as the fused kernel answers it.
  lse.masked_fill_(lse.isneginf(), 0.0);
  const at::Tensor p = (x - lse.unsqueeze(-1)).exp_();
  return {at::matmul(p, v.to(p.scalar_type())).to(q.scalar_type()), lse};
}

// The fused backward's formula: with P = exp(S - lse) (lse the whole row's, so a block of the
// keys gives its share), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = scale dS K,
// dK = scale dS^T Q.
std::tuple<at::Tensor, at::Tensor, at::Tensor> products_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask, bool causal,
    c10::optional<double> scale) {
  const at::Tensor x = scores(q, k, mask, causal, scale);
  const auto acc = x.scalar_type();
  const at::Tensor p = (x - lse.to(acc).unsqueeze(-1)).exp_();
  const at::Tensor go = grad_out.to(acc);
  const at::Tensor dv = at::matmul(p.transpose(-2, -1), go);
  const at::Tensor d = (go * out.to(acc)).sum(-1, /*keepdim=*/true);
  const at::Tensor ds = at::matmul(go, v.to(acc).transpose(-2, -1)).sub_(d).mul_(p);
  const double s = scale_of(q, scale);
  const at::Tensor dq = at::matmul(ds, k.to(acc)).mul_(s);
  const at::Tensor dk = at::matmul(ds.transpose(-2, -1), q.to(acc)).mul_(s);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

}  // namespace tessera::ops::attention
