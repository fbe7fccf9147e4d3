// A sweep of everyday ops (what a transformer, a CNN and an optimizer step call) on
// distributed tensors: each op runs forward and backward on uneven row shards over 1-3
// ranks (an empty shard on 3), on column shards, replicated, as Partial(sum) terms and on a
// 2x2 mesh, and is compared with the same op on the full tensors in one process. An op either
// matches one device or raises a c10::Error on every rank; only ops on the expected-error list
// below may do the latter.
//
// Adding an op is one line in a table: a name, its operands and a lambda.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "helpers.h"

using namespace tessera;

namespace {

using Shape = std::vector<int64_t>;
using Args = const std::vector<at::Tensor>&;
using OpFn = std::function<at::Tensor(Args)>;

// How an operand is made and laid out.
enum class Kind {
  Data,      // double, normal values, laid out as the variant says; requires grad
  Positive,  // Data with values in [0.5, 2] (log, sqrt, division)
  Unit,      // Data with values in (-0.9, 0.9) (asin, atanh)
  Counts,    // Data holding small integers 0..3 as doubles (mode: repeated values)
  Weight,    // double, distributed Replicate (weights, biases); requires grad
  Plain,     // double, a plain tensor (a user constant), no grad
  Index,     // int64 in [0, hi), plain
  Labels,    // int64 in [0, hi), laid out as the variant says
  Mask,      // bool, laid out as the variant says
};

struct Arg {
  Shape shape;
  Kind kind = Kind::Data;
  int64_t hi = 0;
};

Arg D(Shape s) { return {std::move(s), Kind::Data}; }
Arg Pos(Shape s) { return {std::move(s), Kind::Positive}; }
Arg U(Shape s) { return {std::move(s), Kind::Unit}; }
Arg Cnt(Shape s) { return {std::move(s), Kind::Counts}; }
Arg W(Shape s) { return {std::move(s), Kind::Weight}; }
Arg C(Shape s) { return {std::move(s), Kind::Plain}; }
Arg I(Shape s, int64_t hi) { return {std::move(s), Kind::Index, hi}; }
Arg L(Shape s, int64_t hi) { return {std::move(s), Kind::Labels, hi}; }
Arg M(Shape s) { return {std::move(s), Kind::Mask}; }

struct OpCase {
  std::string name;
  std::vector<Arg> args;
  OpFn fn;
};

// Shapes: 7 rows split unevenly (5/2 on 2 ranks, 4/0/3 on 3), 6 columns (4/2).
const Shape A{7, 6}, B{6, 5}, A3{7, 4, 5}, Row{6}, Col{7}, Img{7, 3, 6, 6}, Seq{7, 3, 8};

bool floating(const at::Tensor& t) { return at::isFloatingType(t.scalar_type()); }

// ---- the op table ---------------------------------------------------------------------------

std::vector<OpCase> pointwise_cases() {
  return {
      {"abs", {D(A)}, [](Args v) { return v[0].abs(); }},
      {"neg", {D(A)}, [](Args v) { return -v[0]; }},
      {"exp", {D(A)}, [](Args v) { return v[0].exp(); }},
      {"expm1", {D(A)}, [](Args v) { return v[0].expm1(); }},
      {"exp2", {D(A)}, [](Args v) { return v[0].exp2(); }},
      {"log", {Pos(A)}, [](Args v) { return v[0].log(); }},
      {"log1p", {Pos(A)}, [](Args v) { return v[0].log1p(); }},
      {"log2", {Pos(A)}, [](Args v) { return v[0].log2(); }},
      {"log10", {Pos(A)}, [](Args v) { return v[0].log10(); }},
      {"sqrt", {Pos(A)}, [](Args v) { return v[0].sqrt(); }},
      {"rsqrt", {Pos(A)}, [](Args v) { return v[0].rsqrt(); }},
      {"reciprocal", {Pos(A)}, [](Args v) { return v[0].reciprocal(); }},
      {"square", {D(A)}, [](Args v) { return v[0].square(); }},
      {"sin", {D(A)}, [](Args v) { return v[0].sin(); }},
      {"cos", {D(A)}, [](Args v) { return v[0].cos(); }},
      {"tan", {U(A)}, [](Args v) { return v[0].tan(); }},
      {"asin", {U(A)}, [](Args v) { return v[0].asin(); }},
      {"acos", {U(A)}, [](Args v) { return v[0].acos(); }},
      {"atan", {D(A)}, [](Args v) { return v[0].atan(); }},
      {"sinh", {D(A)}, [](Args v) { return v[0].sinh(); }},
      {"cosh", {D(A)}, [](Args v) { return v[0].cosh(); }},
      {"tanh", {D(A)}, [](Args v) { return v[0].tanh(); }},
      {"asinh", {D(A)}, [](Args v) { return v[0].asinh(); }},
      {"atanh", {U(A)}, [](Args v) { return v[0].atanh(); }},
      {"sigmoid", {D(A)}, [](Args v) { return v[0].sigmoid(); }},
      {"logit", {U(A)}, [](Args v) { return (v[0] * 0.5 + 0.5).logit(); }},
      {"erf", {D(A)}, [](Args v) { return v[0].erf(); }},
      {"erfc", {D(A)}, [](Args v) { return v[0].erfc(); }},
      {"lgamma", {Pos(A)}, [](Args v) { return v[0].lgamma(); }},
      {"digamma", {Pos(A)}, [](Args v) { return v[0].digamma(); }},
      {"floor", {D(A)}, [](Args v) { return v[0].floor() + v[0]; }},
      {"ceil", {D(A)}, [](Args v) { return v[0].ceil() * v[0]; }},
      {"round", {D(A)}, [](Args v) { return (v[0] * 3).round() + v[0]; }},
      {"trunc", {D(A)}, [](Args v) { return v[0].trunc() + v[0]; }},
      {"frac", {D(A)}, [](Args v) { return v[0].frac(); }},
      {"sign", {D(A)}, [](Args v) { return v[0].sign() * v[0]; }},
      {"relu", {D(A)}, [](Args v) { return v[0].relu(); }},
      {"relu6", {D(A)}, [](Args v) { return at::relu6(v[0] * 4); }},
      {"leaky_relu", {D(A)}, [](Args v) { return at::leaky_relu(v[0], 0.1); }},
      {"elu", {D(A)}, [](Args v) { return at::elu(v[0]); }},
      {"selu", {D(A)}, [](Args v) { return at::selu(v[0]); }},
      {"celu", {D(A)}, [](Args v) { return at::celu(v[0], 0.5); }},
      {"gelu", {D(A)}, [](Args v) { return at::gelu(v[0]); }},
      {"gelu tanh", {D(A)}, [](Args v) { return at::gelu(v[0], "tanh"); }},
      {"silu", {D(A)}, [](Args v) { return at::silu(v[0]); }},
      {"mish", {D(A)}, [](Args v) { return at::mish(v[0]); }},
      {"softplus", {D(A)}, [](Args v) { return at::softplus(v[0], 2, 3); }},
      {"hardswish", {D(A)}, [](Args v) { return at::hardswish(v[0] * 4); }},
      {"hardsigmoid", {D(A)}, [](Args v) { return at::hardsigmoid(v[0] * 4); }},
      {"hardtanh", {D(A)}, [](Args v) { return at::hardtanh(v[0], -0.5, 0.5); }},
      {"logsigmoid", {D(A)}, [](Args v) { return at::log_sigmoid(v[0]); }},
      {"softsign", {D(A)}, [](Args v) { return v[0] / (v[0].abs() + 1); }},
      {"tanhshrink", {D(A)}, [](Args v) { return v[0] - v[0].tanh(); }},
      {"hardshrink", {D(A)}, [](Args v) { return at::hardshrink(v[0], 0.5); }},
      {"softshrink", {D(A)}, [](Args v) { return at::softshrink(v[0], 0.5); }},
      {"threshold", {D(A)}, [](Args v) { return at::threshold(v[0], 0.1, -2); }},
      {"clamp", {D(A)}, [](Args v) { return v[0].clamp(-0.5, 0.7); }},
      {"clamp_min", {D(A)}, [](Args v) { return v[0].clamp_min(0.1); }},
      {"clamp_max", {D(A)}, [](Args v) { return v[0].clamp_max(0.1); }},
      {"clamp tensor", {D(A), D(A)}, [](Args v) { return at::clamp(v[0], v[1], v[1] + 1); }},
      {"nan_to_num", {D(A)}, [](Args v) { return at::nan_to_num(v[0].log(), 0, 9, -9); }},
      {"pow scalar", {D(A)}, [](Args v) { return v[0].pow(3); }},
      {"pow tensor", {Pos(A), D(A)}, [](Args v) { return v[0].pow(v[1]); }},
      {"scalar pow", {D(A)}, [](Args v) { return at::pow(2.0, v[0]); }},
      {"add", {D(A), D(A)}, [](Args v) { return v[0] + v[1]; }},
      {"add alpha", {D(A), D(A)}, [](Args v) { return at::add(v[0], v[1], 0.5); }},
      {"sub", {D(A), D(A)}, [](Args v) { return v[0] - v[1]; }},
      {"rsub scalar", {D(A)}, [](Args v) { return 1 - v[0]; }},
      {"mul", {D(A), D(A)}, [](Args v) { return v[0] * v[1]; }},
      {"div", {D(A), Pos(A)}, [](Args v) { return v[0] / v[1]; }},
      {"div floor", {D(A), Pos(A)}, [](Args v) { return at::div(v[0], v[1], "floor") + v[0]; }},
      {"add bias row", {D(A), W(Row)}, [](Args v) { return v[0] + v[1]; }},
      {"mul column", {D(A), D({7, 1})}, [](Args v) { return v[0] * v[1]; }},
      {"add plain", {D(A), C(A)}, [](Args v) { return v[0] + v[1]; }},
      {"maximum", {D(A), D(A)}, [](Args v) { return at::maximum(v[0], v[1]); }},
      {"minimum", {D(A), D(A)}, [](Args v) { return at::minimum(v[0], v[1]); }},
      {"fmod", {D(A)}, [](Args v) { return at::fmod(v[0] * 3, 1.5); }},
      {"remainder", {D(A)}, [](Args v) { return at::remainder(v[0] * 3, 1.5); }},
      {"atan2", {D(A), D(A)}, [](Args v) { return at::atan2(v[0], v[1]); }},
      {"hypot", {D(A), D(A)}, [](Args v) { return at::hypot(v[0], v[1]); }},
      {"xlogy", {D(A), Pos(A)}, [](Args v) { return at::xlogy(v[0], v[1]); }},
      {"copysign", {D(A), D(A)}, [](Args v) { return at::copysign(v[0], v[1]); }},
      {"lerp", {D(A), D(A)}, [](Args v) { return at::lerp(v[0], v[1], 0.3); }},
      {"addcmul", {D(A), D(A), D(A)}, [](Args v) { return at::addcmul(v[0], v[1], v[2], 0.5); }},
      {"addcdiv", {D(A), D(A), Pos(A)}, [](Args v) { return at::addcdiv(v[0], v[1], v[2], 2); }},
      {"where", {M(A), D(A), D(A)}, [](Args v) { return at::where(v[0], v[1], v[2]); }},
      {"where scalar",
       {D(A)},
       [](Args v) { return at::where(v[0] > 0, v[0], at::zeros({}, v[0].options())); }},
      {"masked_fill", {D(A), M(A)}, [](Args v) { return v[0].masked_fill(v[1], -1.5); }},
      {"comparisons",
       {D(A), D(A)},
       [](Args v) {
         return ((v[0] < v[1]) | (v[0] >= 1)).logical_and(v[0] != v[1]) ^ (v[0].eq(0.5));
       }},
      {"isnan isfinite", {D(A)}, [](Args v) { return v[0].log().isnan() | v[0].isfinite(); }},
      {"logical_not", {M(A)}, [](Args v) { return v[0].logical_not(); }},
      {"logaddexp", {D(A), D(A)}, [](Args v) { return at::logaddexp(v[0], v[1]); }},
      {"erfinv", {U(A)}, [](Args v) { return v[0].erfinv(); }},
      {"prelu", {D(Img), W({3})}, [](Args v) { return at::prelu(v[0], v[1]); }},
      {"bucketize",
       {D(A)},
       [](Args v) {
         return at::bucketize(v[0], at::linspace(-1, 1, 5, v[0].options().device(at::kCPU)));
       }},
      {"searchsorted",
       {D(A)},
       [](Args v) {
         return at::searchsorted(at::linspace(-1, 1, 5, at::TensorOptions().dtype(at::kDouble)),
                                 v[0]);
       }},
      {"isclose", {D(A), D(A)}, [](Args v) { return at::isclose(v[0], v[0] + v[1] * 1e-9); }},
      {"to float", {D(A)}, [](Args v) { return v[0].to(at::kFloat).sigmoid(); }},
      // Fails on P(sum): _to_copy keeps Partial(sum) across a cast to an integer dtype, so
      // each term is truncated on its own (like.cpp); a silently wrong result.
      {"to long", {D(A)}, [](Args v) { return (v[0] * 4).to(at::kLong); }},
  };
}

std::vector<OpCase> reduction_cases() {
  return {
      {"sum", {D(A)}, [](Args v) { return v[0].sum(); }},
      {"sum dim0", {D(A)}, [](Args v) { return v[0].sum(0); }},
      {"sum dim1 keepdim", {D(A)}, [](Args v) { return v[0].sum(1, true); }},
      {"mean", {D(A3)}, [](Args v) { return v[0].mean(); }},
      {"mean dims",
       {D(A3)},
       [](Args v) {
         return v[0].mean(at::IntArrayRef{0, 2});
       }},
      {"nansum", {D(A)}, [](Args v) { return v[0].nansum(at::IntArrayRef{1}); }},
      {"prod", {D(A)}, [](Args v) { return v[0].prod(); }},
      {"prod dim", {D(A)}, [](Args v) { return v[0].prod(0); }},
      {"amax", {D(A)}, [](Args v) { return v[0].amax(0); }},
      {"amin", {D(A)}, [](Args v) { return v[0].amin(1); }},
      {"max", {D(A)}, [](Args v) { return v[0].max(); }},
      {"min", {D(A)}, [](Args v) { return v[0].min(); }},
      {"max dim", {D(A)}, [](Args v) { return std::get<0>(v[0].max(0)); }},
      {"min dim indices", {D(A)}, [](Args v) { return std::get<1>(v[0].min(1)); }},
      {"argmax", {D(A)}, [](Args v) { return v[0].argmax(0); }},
      {"argmin", {D(A)}, [](Args v) { return v[0].argmin(1, true); }},
      {"var", {D(A)}, [](Args v) { return v[0].var(); }},
      {"var dim", {D(A)}, [](Args v) { return v[0].var(at::IntArrayRef{0}); }},
      {"std dim", {D(A)}, [](Args v) { return v[0].std(at::IntArrayRef{1}, false, true); }},
      {"var_mean",
       {D(A)},
       [](Args v) {
         auto r = at::var_mean(v[0], at::IntArrayRef{0});
         return std::get<0>(r) + std::get<1>(r);
       }},
      {"norm", {D(A)}, [](Args v) { return v[0].norm(); }},
      {"norm dim", {D(A)}, [](Args v) { return v[0].norm(1, at::IntArrayRef{1}); }},
      {"linalg_vector_norm",
       {D(A)},
       [](Args v) { return at::linalg_vector_norm(v[0], 3, at::IntArrayRef{0}); }},
      {"logsumexp dim0", {D(A3)}, [](Args v) { return v[0].logsumexp(at::IntArrayRef{0}); }},
      {"logsumexp dim1", {D(A3)}, [](Args v) { return v[0].logsumexp(at::IntArrayRef{1}, true); }},
      {"logsumexp last", {D(A3)}, [](Args v) { return v[0].logsumexp(at::IntArrayRef{-1}); }},
      {"logsumexp all",
       {D(A)},
       [](Args v) {
         return v[0].logsumexp(at::IntArrayRef{0, 1});
       }},
      {"any", {M(A)}, [](Args v) { return v[0].any(); }},
      {"any dim", {M(A)}, [](Args v) { return v[0].any(0); }},
      {"all dim", {D(A)}, [](Args v) { return (v[0] > -2).all(1); }},
      {"count_nonzero", {M(A)}, [](Args v) { return at::count_nonzero(v[0], at::IntArrayRef{0}); }},
      {"aminmax",
       {D(A)},
       [](Args v) {
         auto r = at::aminmax(v[0].detach(), 0);
         return std::get<0>(r) * std::get<1>(r);
       }},
      {"std_mean",
       {D(A)},
       [](Args v) {
         auto r = at::std_mean(v[0], at::IntArrayRef{1});
         return std::get<0>(r) * std::get<1>(r);
       }},
      {"frobenius norm",
       {D(A)},
       [](Args v) {
         return at::frobenius_norm(v[0], at::IntArrayRef{0, 1}, false);  // 2.x has no dim-less form
       }},
      {"linalg_norm", {D(A)}, [](Args v) { return at::linalg_norm(v[0], 2, at::IntArrayRef{1}); }},
      {"equal",
       {D(A), D(A)},
       [](Args v) {
         return v[0] * (at::equal(v[0], v[1]) ? 1.0 : 2.0) *
                (at::equal(v[0], v[0] * 1) ? 3.0 : 4.0);
       }},
      {"allclose",
       {D(A), D(A)},
       [](Args v) { return v[0] * (at::allclose(v[0], v[0] + v[1] * 1e-9) ? 3.0 : 4.0); }},
      {"median", {D(A)}, [](Args v) { return v[0].median(); }},
      {"nanmedian", {D(A)}, [](Args v) { return v[0].nanmedian(); }},
      {"median dim0", {D(A)}, [](Args v) { return std::get<0>(v[0].median(0)); }},
      {"median dim1 indices", {D(A)}, [](Args v) { return std::get<1>(v[0].median(1, true)); }},
      {"nanmedian dim", {D(A)}, [](Args v) { return std::get<0>(v[0].nanmedian(1)); }},
      {"mode", {Cnt(A)}, [](Args v) { return std::get<0>(v[0].mode(1)) * v[0].sum(1); }},
      {"mode dim0 indices", {Cnt(A)}, [](Args v) { return std::get<1>(v[0].mode(0)); }},
      {"kthvalue", {D(A)}, [](Args v) { return std::get<0>(v[0].kthvalue(2, 0)); }},
      {"kthvalue keepdim", {D(A)}, [](Args v) { return std::get<0>(v[0].kthvalue(3, 1, true)); }},
      {"topk dim1", {D(A)}, [](Args v) { return std::get<0>(v[0].topk(3, 1)); }},
      {"topk dim0 smallest", {D(A)}, [](Args v) { return std::get<0>(v[0].topk(2, 0, false)); }},
      {"topk indices", {D(A3)}, [](Args v) { return std::get<1>(v[0].topk(2, -1)); }},
      {"sort", {D(A)}, [](Args v) { return std::get<0>(v[0].sort(1)); }},
      {"argsort", {D(A)}, [](Args v) { return v[0].argsort(0, true); }},
      {"cumsum", {D(A)}, [](Args v) { return v[0].cumsum(0); }},
      {"cumsum cols", {D(A)}, [](Args v) { return v[0].cumsum(1); }},
      {"cumprod", {D(A)}, [](Args v) { return v[0].cumprod(0); }},
      {"cumprod cols", {D(A)}, [](Args v) { return v[0].cumprod(1); }},
      {"cumprod zeros", {D(A)}, [](Args v) { return (v[0] * (v[0] > -0.5)).cumprod(0); }},
      {"cummax", {D(A)}, [](Args v) { return std::get<0>(v[0].cummax(0)); }},
      {"cummax indices", {D(A)}, [](Args v) { return std::get<1>(v[0].cummax(1)); }},
      {"cummin", {D(A)}, [](Args v) { return std::get<0>(v[0].cummin(0)); }},
      {"logcumsumexp", {D(A)}, [](Args v) { return v[0].logcumsumexp(0); }},
  };
}

std::vector<OpCase> shape_cases() {
  return {
      {"view",
       {D(A)},
       [](Args v) {
         return v[0].view({7, 2, 3}) * 2;
       }},
      {"reshape",
       {D(A3)},
       [](Args v) {
         return v[0].reshape({7, 20}) * 2;
       }},
      {"flatten", {D(A3)}, [](Args v) { return v[0].flatten(1) * 2; }},
      {"unflatten",
       {D(A)},
       [](Args v) {
         return v[0].unflatten(1, at::IntArrayRef{3, 2}) * 2;
       }},
      {"transpose", {D(A3)}, [](Args v) { return v[0].transpose(1, 2) * 2; }},
      {"t", {D(A)}, [](Args v) { return v[0].t() * 2; }},
      {"permute",
       {D(A3)},
       [](Args v) {
         return v[0].permute({2, 0, 1}) * 2;
       }},
      {"movedim", {D(A3)}, [](Args v) { return v[0].movedim(0, -1) * 2; }},
      {"unsqueeze", {D(A)}, [](Args v) { return v[0].unsqueeze(1) * 2; }},
      {"squeeze", {D({7, 1, 6})}, [](Args v) { return v[0].squeeze(1) * 2; }},
      {"expand",
       {D({7, 1})},
       [](Args v) {
         return v[0].expand({7, 6}) * 2;
       }},
      {"contiguous", {D(A)}, [](Args v) { return v[0].t().contiguous() * 2; }},
      {"narrow rows", {D(A)}, [](Args v) { return v[0].narrow(0, 1, 4) * 2; }},
      {"slice step", {D(A)}, [](Args v) { return v[0].slice(1, 1, 6, 2) * 2; }},
      {"select", {D(A3)}, [](Args v) { return v[0].select(1, 2) * 2; }},
      {"chunk", {D(A)}, [](Args v) { return v[0].chunk(3, 1)[1] * 2; }},
      {"split",
       {D(A)},
       [](Args v) {
         auto p = v[0].split(2, 0);
         return p[0] * 2 + p[1];
       }},
      {"unbind", {D(A3)}, [](Args v) { return v[0].unbind(1)[3] * 2; }},
      {"cat rows",
       {D(A), D(A)},
       [](Args v) {
         return at::cat({v[0], v[1] * 2}, 0);
       }},
      {"cat cols",
       {D(A), D({7, 2})},
       [](Args v) {
         return at::cat({v[0], v[1]}, 1);
       }},
      {"stack",
       {D(A), D(A)},
       [](Args v) {
         return at::stack({v[0], v[1]}, 1);
       }},
      {"repeat",
       {D(A)},
       [](Args v) {
         return v[0].repeat({1, 2});
       }},
      {"repeat rows",
       {D(A)},
       [](Args v) {
         return v[0].repeat({2, 1});
       }},
      {"repeat new dim",
       {D(A)},
       [](Args v) {
         return v[0].repeat({2, 1, 3});
       }},
      {"unfold cols", {D(A)}, [](Args v) { return v[0].unfold(1, 3, 2); }},
      {"unfold rows", {D(A)}, [](Args v) { return v[0].unfold(0, 2, 1); }},
      {"flip", {D(A)}, [](Args v) { return v[0].flip({0}); }},
      {"roll", {D(A)}, [](Args v) { return v[0].roll({2}, {1}); }},
      {"tril", {D(A)}, [](Args v) { return v[0].tril(); }},
      // maxnorm below the slices' norms, so every slice is rescaled
      {"renorm(dim 0)", {D(A)}, [](Args v) { return v[0].renorm(2, 0, 0.5); }},
      {"renorm(dim 1)", {D(A3)}, [](Args v) { return v[0].renorm(1, 1, 0.5); }},
      {"triu", {D(A)}, [](Args v) { return v[0].triu(1); }},
      {"trace", {D(A)}, [](Args v) { return v[0].trace(); }},
      {"diag", {D(A)}, [](Args v) { return at::diag(v[0], 1) * 2; }},
      {"glu", {D(A)}, [](Args v) { return at::glu(v[0], 1); }},
      {"repeat_interleave", {D(A)}, [](Args v) { return v[0].repeat_interleave(2, 1); }},
      {"diff", {D(A)}, [](Args v) { return at::diff(v[0], 1, 1); }},
      {"diff rows", {D(A)}, [](Args v) { return at::diff(v[0], 1, 0); }},
      {"cross", {D({7, 3}), D({7, 3})}, [](Args v) { return at::linalg_cross(v[0], v[1]); }},
      {"take_along_dim", {D(A), L(A, 6)}, [](Args v) { return at::take_along_dim(v[0], v[1], 1); }},
      {"index_fill", {D(A), I({2}, 6)}, [](Args v) { return v[0].index_fill(1, v[1], -1.0); }},
      {"index_copy",
       {D(A), I({2}, 6), D({7, 2})},
       [](Args v) { return v[0].index_copy(1, at::arange(2, at::kLong) * 2, v[2]); }},
      {"masked_fill tensor",
       {D(A), M(A)},
       [](Args v) { return v[0].masked_fill(v[1], at::scalar_tensor(2.5, at::kDouble)); }},
      {"diagonal", {D(A)}, [](Args v) { return v[0].diagonal() * 2; }},
      {"index_select", {D(A), I({4}, 6)}, [](Args v) { return v[0].index_select(1, v[1]); }},
      {"index_select rows", {D(A), I({4}, 7)}, [](Args v) { return v[0].index_select(0, v[1]); }},
      {"gather", {D(A), L(A, 6)}, [](Args v) { return v[0].gather(1, v[1]); }},
      {"scatter_add",
       {D(A), L(A, 6), D(A)},
       [](Args v) { return v[0].scatter_add(1, v[1], v[2]); }},
      {"index cols",
       {D(A), I({4}, 6)},
       [](Args v) {
         return v[0].index({at::indexing::Slice(), v[1]});
       }},
      {"index rows", {D(A), I({4}, 7)}, [](Args v) { return v[0].index({v[1]}); }},
      {"index 3d middle",
       {D(A3), I({2, 3}, 4)},
       [](Args v) {
         return v[0].index({at::indexing::Slice(), v[1]});
       }},
      {"index two tensors",
       {D(A3), I({3}, 4), I({3}, 5)},
       [](Args v) {
         return v[0].index({at::indexing::Slice(), v[1], v[2]});
       }},
      {"index mask", {D(A), M(Col)}, [](Args v) { return v[0].index({v[1]}); }},
      {"index mask cols",
       {D(A), M(Row)},
       [](Args v) {
         return v[0].index({at::indexing::Slice(), v[1]});
       }},
      {"x[:, idx] = v",
       {D(A), I({3}, 6), D({7, 3})},
       [](Args v) {
         auto y = v[0] * 1;
         y.index_put_({at::indexing::Slice(), v[1]}, v[2]);
         return y;
       }},
      {"index_put_",
       {D(A), I({3}, 6), D({7, 3})},
       [](Args v) {
         auto y = v[0] * 1;
         c10::List<c10::optional<at::Tensor>> idx;
         idx.push_back(c10::nullopt);
         idx.push_back(v[1]);
         y.index_put_(idx, v[2]);
         return y;
       }},
      {"index_put_ rows",
       {D(A), D({3, 6})},
       [](Args v) {
         auto y = v[0] * 1;
         c10::List<c10::optional<at::Tensor>> idx;
         idx.push_back(at::tensor({5, 0, 3}, at::kLong));
         y.index_put_(idx, v[1]);
         return y;
       }},
      {"index_put_ mask",
       {D(A), M(A)},
       [](Args v) {
         auto y = v[0] * 1;
         c10::List<c10::optional<at::Tensor>> idx;
         idx.push_back(v[1]);
         y.index_put_(idx, at::scalar_tensor(0.5, at::kDouble));
         return y;
       }},
      // Raises (see the expected-error list): autograd's CopySlices runs as_strided with the
      // wrapper's geometry (contiguous, offset 0), which would pick the wrong rows.
      {"in-place on a slice view",
       {D(A)},
       [](Args v) {
         auto y = v[0] * 1;
         y.narrow(1, 2, 3).mul_(3);
         return y;
       }},
      {"index_put_ accumulate",
       {D(A), I({3}, 6), D({7, 3})},
       [](Args v) {
         c10::List<c10::optional<at::Tensor>> idx;
         idx.push_back(c10::nullopt);
         idx.push_back(v[1]);
         return v[0].index_put(idx, v[2], true);
       }},
      {"masked_select", {D(A), M(A)}, [](Args v) { return v[0].masked_select(v[1]); }},
      {"embedding", {W({9, 4}), L({7, 3}, 9)}, [](Args v) { return at::embedding(v[0], v[1]); }},
      {"one_hot", {L(Col, 5)}, [](Args v) { return at::one_hot(v[0], 5); }},
      {"clone", {D(A)}, [](Args v) { return v[0].clone() * 2; }},
      {"zeros_like", {D(A)}, [](Args v) { return at::zeros_like(v[0]) + v[0]; }},
      {"full_like", {D(A)}, [](Args v) { return at::full_like(v[0], 2) * v[0]; }},
  };
}

std::vector<OpCase> nn_cases() {
  return {
      {"mm", {D(A), W(B)}, [](Args v) { return at::mm(v[0], v[1]); }},
      {"matmul batched", {D(A3), W({5, 3})}, [](Args v) { return at::matmul(v[0], v[1]); }},
      {"bmm", {D(A3), D({7, 5, 2})}, [](Args v) { return at::bmm(v[0], v[1]); }},
      {"addmm", {W({5}), D(A), W(B)}, [](Args v) { return at::addmm(v[0], v[1], v[2]); }},
      {"linear", {D(A3), W({3, 5}), W({3})}, [](Args v) { return at::linear(v[0], v[1], v[2]); }},
      {"mv", {D(A), W(Row)}, [](Args v) { return at::mv(v[0], v[1]); }},
      {"dot", {D(Col), D(Col)}, [](Args v) { return at::dot(v[0], v[1]); }},
      {"outer", {D(Col), W({3})}, [](Args v) { return at::outer(v[0], v[1]); }},
      {"einsum",
       {D(A3), W({5, 2})},
       [](Args v) {
         return at::einsum("bij,jk->bik", {v[0], v[1]});
       }},
      {"baddbmm",
       {D({7, 4, 2}), D(A3), D({7, 5, 2})},
       [](Args v) { return at::baddbmm(v[0], v[1], v[2], 0.5, 2); }},
      {"cdist", {D(A), W({4, 6})}, [](Args v) { return at::cdist(v[0], v[1]); }},
      {"cdist p1", {D(A), W({4, 6})}, [](Args v) { return at::cdist(v[0], v[1], 1); }},
      {"cdist batched", {D(A3), W({7, 3, 5})}, [](Args v) { return at::cdist(v[0], v[1]); }},
      {"cdist large (mm path)",
       {D({30, 6}), W({27, 6})},
       [](Args v) { return at::cdist(v[0], v[1]); }},
      {"addmv", {W(Col), D(A), W(Row)}, [](Args v) { return at::addmv(v[0], v[1], v[2]); }},
      {"tensordot",
       {D(A3), W({4, 5, 2})},
       [](Args v) {
         return at::tensordot(v[0], v[1], {1, 2}, {0, 1});
       }},
      {"lstm_cell",
       {D({7, 4}), D({7, 3}), D({7, 3}), W({12, 4}), W({12, 3}), W({12})},
       [](Args v) {
         auto r = at::lstm_cell(v[0], {v[1], v[2]}, v[3], v[4], v[5]);
         return std::get<0>(r) + std::get<1>(r);
       }},
      {"softmax", {D(A)}, [](Args v) { return at::softmax(v[0], -1); }},
      {"softmax double from float",
       {D(A)},
       [](Args v) { return at::softmax(v[0].to(at::kFloat), 1, at::kDouble); }},
      {"softmax dim0", {D(A)}, [](Args v) { return at::softmax(v[0], 0); }},
      {"log_softmax", {D(A3)}, [](Args v) { return at::log_softmax(v[0], 1); }},
      {"layer_norm",
       {D(A3), W({5}), W({5})},
       [](Args v) { return at::layer_norm(v[0], {5}, v[1], v[2]); }},
      {"rms norm",
       {D(A3), W({5})},
       [](Args v) { return v[0] * (v[0].pow(2).mean(-1, true) + 1e-6).rsqrt() * v[1]; }},
      {"group_norm",
       {D(Img), W({3}), W({3})},
       [](Args v) { return at::group_norm(v[0], 3, v[1], v[2]); }},
      {"batch_norm",
       {D(Img), W({3}), W({3})},
       [](Args v) { return at::batch_norm(v[0], v[1], v[2], {}, {}, true, 0.1, 1e-5, false); }},
      {"instance_norm",
       {D(Img)},
       [](Args v) { return at::instance_norm(v[0], {}, {}, {}, {}, true, 0.1, 1e-5, false); }},
      {"normalize",
       {D(A)},
       [](Args v) { return v[0] / v[0].norm(2, at::IntArrayRef{1}, true).clamp_min(1e-12); }},
      {"cosine_similarity",
       {D(A), D(A)},
       [](Args v) { return at::cosine_similarity(v[0], v[1], 1); }},
      {"pairwise_distance", {D(A), D(A)}, [](Args v) { return at::pairwise_distance(v[0], v[1]); }},
      {"dropout eval", {D(A)}, [](Args v) { return at::dropout(v[0], 0.5, false); }},
      {"conv1d",
       {D(Seq), W({4, 3, 3}), W({4})},
       [](Args v) { return at::conv1d(v[0], v[1], v[2], 1, 1); }},
      {"conv2d",
       {D(Img), W({2, 3, 3, 3}), W({2})},
       [](Args v) { return at::conv2d(v[0], v[1], v[2], 1, 1); }},
      {"conv2d stride",
       {D(Img), W({2, 3, 3, 3})},
       [](Args v) { return at::conv2d(v[0], v[1], {}, 2); }},
      {"conv_transpose2d",
       {D(Img), W({3, 2, 2, 2})},
       [](Args v) { return at::conv_transpose2d(v[0], v[1], {}, 2); }},
      {"max_pool2d", {D(Img)}, [](Args v) { return at::max_pool2d(v[0], 2); }},
      {"avg_pool2d", {D(Img)}, [](Args v) { return at::avg_pool2d(v[0], 3, 1, 1); }},
      {"adaptive_avg_pool2d",
       {D(Img)},
       [](Args v) {
         return at::adaptive_avg_pool2d(v[0], {1, 1});
       }},
      {"max_pool1d", {D(Seq)}, [](Args v) { return at::max_pool1d(v[0], 2); }},
      {"avg_pool1d", {D(Seq)}, [](Args v) { return at::avg_pool1d(v[0], 2); }},
      {"adaptive_avg_pool1d", {D(Seq)}, [](Args v) { return at::adaptive_avg_pool1d(v[0], 4); }},
      {"adaptive_max_pool2d",
       {D(Img)},
       [](Args v) {
         return std::get<0>(at::adaptive_max_pool2d(v[0], {3, 3}));
       }},
      {"pixel_shuffle", {D({7, 4, 3, 3})}, [](Args v) { return at::pixel_shuffle(v[0], 2); }},
      {"pixel_unshuffle", {D(Img)}, [](Args v) { return at::pixel_unshuffle(v[0], 2); }},
      {"unfold (im2col)",
       {D(Img)},
       [](Args v) {
         return at::im2col(v[0], {2, 2}, {1, 1}, {0, 0}, {2, 2});
       }},
      {"fold (col2im)",
       {D({7, 12, 9})},
       [](Args v) {
         return at::col2im(v[0], {6, 6}, {2, 2}, {1, 1}, {0, 0}, {2, 2});
       }},
      {"weight_norm",
       {W({4, 3}), W({4, 1})},
       [](Args v) { return at::_weight_norm(v[0], v[1], 0); }},
      {"upsample nearest",
       {D(Img)},
       [](Args v) {
         return at::upsample_nearest2d(v[0], {12, 12});
       }},
      {"upsample bilinear",
       {D(Img)},
       [](Args v) {
         return at::upsample_bilinear2d(v[0], {9, 9}, false);
       }},
      {"pad constant",
       {D(Img)},
       [](Args v) {
         return at::constant_pad_nd(v[0], {1, 2, 0, 1}, 0.5);
       }},
      {"pad reflect",
       {D(Img)},
       [](Args v) {
         return at::reflection_pad2d(v[0], {1, 1, 2, 0});
       }},
      {"mse_loss", {D(A), D(A)}, [](Args v) { return at::mse_loss(v[0], v[1]); }},
      {"l1_loss", {D(A), D(A)}, [](Args v) { return at::l1_loss(v[0], v[1]); }},
      {"smooth_l1_loss",
       {D(A), D(A)},
       [](Args v) { return at::smooth_l1_loss(v[0], v[1], 1, 0.5); }},
      {"huber_loss", {D(A), D(A)}, [](Args v) { return at::huber_loss(v[0], v[1], 1, 0.7); }},
      {"cross_entropy",
       {D(A), L(Col, 6)},
       [](Args v) { return at::cross_entropy_loss(v[0], v[1]); }},
      {"cross_entropy smoothing",
       {D(A), L(Col, 6)},
       [](Args v) { return at::cross_entropy_loss(v[0], v[1], {}, 1, -100, 0.1); }},
      {"nll_loss",
       {D(A), L(Col, 6)},
       [](Args v) { return at::nll_loss(at::log_softmax(v[0], 1), v[1]); }},
      {"bce_with_logits",
       {D(A), U(A)},
       [](Args v) {
         return at::binary_cross_entropy_with_logits(v[0], v[1].detach() * 0.5 + 0.5);
       }},
      {"binary_cross_entropy",
       {D(A), U(A)},
       [](Args v) { return at::binary_cross_entropy(v[0].sigmoid(), v[1].detach() * 0.5 + 0.5); }},
      {"margin_ranking_loss",
       {D(Col), D(Col), C(Col)},
       [](Args v) { return at::margin_ranking_loss(v[0], v[1], v[2].sign(), 0.1); }},
      {"hinge_embedding_loss",
       {D(A), C(A)},
       [](Args v) { return at::hinge_embedding_loss(v[0], v[1].sign(), 0.5); }},
      {"cosine_embedding_loss",
       {D(A), D(A), C(Col)},
       [](Args v) { return at::cosine_embedding_loss(v[0], v[1], v[2].sign(), 0.1); }},
      {"triplet_margin_loss",
       {D(A), D(A), D(A)},
       [](Args v) { return at::triplet_margin_loss(v[0], v[1], v[2]); }},
      {"poisson_nll_loss",
       {D(A), Pos(A)},
       [](Args v) {
         return at::poisson_nll_loss(v[0], v[1].detach(), true, false, 1e-8, at::Reduction::Mean);
       }},
      {"kl_div",
       {D(A), D(A)},
       [](Args v) {
         return at::kl_div(at::log_softmax(v[0], 1), at::softmax(v[1], 1), at::Reduction::Mean);
       }},
      {"attention",
       {D(Seq), D(Seq), D(Seq)},
       [](Args v) {
         auto s = at::matmul(v[0], v[1].transpose(1, 2)) / 2.0;
         return at::matmul(at::softmax(s, -1), v[2]);
       }},
  };
}

// Optimizer-style updates: in place, without autograd (as torch::optim does).
std::vector<OpCase> optimizer_cases() {
  auto update = [](std::function<void(at::Tensor&, Args)> step) {
    return [step](Args v) {
      at::NoGradGuard no_grad;
      at::Tensor p = v[0].detach().clone();
      step(p, v);
      return p;
    };
  };
  return {
      {"mul_", {D(A)}, update([](at::Tensor& p, Args) { p.mul_(0.9); })},
      {"mul_ tensor", {D(A), D(A)}, update([](at::Tensor& p, Args v) { p.mul_(v[1]); })},
      {"add_ alpha", {D(A), D(A)}, update([](at::Tensor& p, Args v) { p.add_(v[1], -0.01); })},
      {"sub_", {D(A), D(A)}, update([](at::Tensor& p, Args v) { p.sub_(v[1]); })},
      {"div_", {D(A), Pos(A)}, update([](at::Tensor& p, Args v) { p.div_(v[1]); })},
      {"addcmul_", {D(A), D(A)}, update([](at::Tensor& p, Args v) {
         p.addcmul_(v[1], v[1], 0.001);
       })},
      {"addcdiv_", {D(A), D(A), Pos(A)}, update([](at::Tensor& p, Args v) {
         p.addcdiv_(v[1], v[2].sqrt().add_(1e-8), -0.01);
       })},
      {"lerp_", {D(A), D(A)}, update([](at::Tensor& p, Args v) { p.lerp_(v[1], 0.1); })},
      {"sqrt_", {Pos(A)}, update([](at::Tensor& p, Args) { p.sqrt_(); })},
      {"clamp_", {D(A)}, update([](at::Tensor& p, Args) { p.clamp_(-0.5, 0.5); })},
      {"sign_", {D(A)}, update([](at::Tensor& p, Args) { p.sign_(); })},
      {"zero_", {D(A)}, update([](at::Tensor& p, Args) { p.zero_(); })},
      {"copy_", {D(A), D(A)}, update([](at::Tensor& p, Args v) { p.copy_(v[1]); })},
      {"maximum_ (amsgrad)", {D(A), D(A)}, update([](at::Tensor& p, Args v) {
         at::maximum_out(p, p, v[1]);
       })},
      {"adam step", {D(A), D(A), D(A), Pos(A)}, update([](at::Tensor& p, Args v) {
         auto m = v[2].detach().clone(), s = v[3].detach().clone();
         m.mul_(0.9).add_(v[1], 0.1);
         s.mul_(0.999).addcmul_(v[1], v[1], 0.001);
         p.addcdiv_(m, s.sqrt().div_(0.5).add_(1e-8), -0.001);
       })},
      {"clip_grad_norm", {D(A), D(B)}, update([](at::Tensor& p, Args v) {
         auto total = at::stack({p.norm(2), v[1].norm(2)}).norm(2);
         p.mul_((1.0 / (total + 1e-6)).clamp_max(1.0));
       })},
      {"in-place with grad",
       {D(A)},
       [](Args v) {
         auto y = v[0] * 1;
         y.mul_(2).add_(1).tanh_();
         return y;
       }},
  };
}

// ---- expected errors ------------------------------------------------------------------------

// Ops that may raise a clear c10::Error (on every rank) instead of giving one device's result,
// with the reason. Anything else that errors fails the sweep.
const std::map<std::string, std::string>& expected_errors() {
  static const std::map<std::string, std::string> list = {
      // In-place ops on a view of a tensor that requires grad: autograd's CopySlices node
      // calls as_strided on the gradient with the view's geometry, and a distributed tensor's
      // wrapper reports contiguous strides and offset 0 whatever the view, so as_strided
      // raises on every layout rather than pick the wrong elements (like.cpp). x[:, idx] = v
      // takes this path too (set_item slices first).
      // (LibTorch 2.11 and later index-assign without that as_strided: it matches one device
      // there, see kMayWorkOnNewerLibTorch.)
      {"x[:, idx] = v", "as_strided in CopySlices (in-place on a view with autograd)"},
      {"in-place on a slice view", "as_strided in CopySlices (in-place on a view with autograd)"},
  };
  return list;
}

// Expected errors that newer LibTorch no longer raises (they then must match one device like
// any other case): measured raising on 1.13 and 2.6, matching on 2.11 and 2.15.
bool may_work_on_this_libtorch(const std::string& name) {
  static const std::set<std::string> kMayWorkOnNewerLibTorch = {"x[:, idx] = v"};
  const bool newer =
      TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR > 6);
  return newer && kMayWorkOnNewerLibTorch.count(name) > 0;
}

// ---- running --------------------------------------------------------------------------------

// One layout of the sweep: a mesh and where Data operands are sharded.
struct Variant {
  std::string name;
  Shape mesh;
  std::function<Placements(int64_t ndim)> placements;
};

// 5/2 rows on 2 ranks, 4/0/3 on 3.
ShardTable uneven(int64_t size, int64_t parts) {
  if (parts == 1) return {size};
  if (parts == 2) return {size - size / 3, size / 3};
  ShardTable t(parts, 0);
  t.front() = (size + 1) / 2;
  t.back() = size - t.front();
  return t;
}

std::vector<Variant> variants_for(int world) {
  auto whole = [](int64_t) { return Placements{Replicate()}; };
  auto terms = [](int64_t) { return Placements{Partial()}; };
  auto rows = [](int64_t nd) { return nd == 0 ? Placements{Replicate()} : Placements{Shard(0)}; };
  auto cols = [](int64_t nd) {
    return nd == 0 ? Placements{Replicate()} : Placements{Shard(nd - 1)};
  };
  auto grid = [](int64_t nd) {
    if (nd == 0) return Placements{Replicate(), Replicate()};
    if (nd == 1) return Placements{Shard(0), Replicate()};
    return Placements{Shard(0), Shard(1)};
  };
  switch (world) {
    case 1: return {{"1 rank, S(0)", {1}, rows}};
    case 2:
      return {{"2 ranks, S(0) 5/2", {2}, rows},
              {"2 ranks, S(-1)", {2}, cols},
              {"2 ranks, R", {2}, whole},
              {"2 ranks, P(sum)", {2}, terms}};
    case 3: return {{"3 ranks, S(0) with an empty shard", {3}, rows}};
    default: return {{"2x2 mesh, S(0) x S(1)", {2, 2}, grid}};
  }
}

at::Tensor make_full(const Arg& a, uint64_t seed) {
  auto g = tessera::test::generator(seed);
  const auto dbl = at::TensorOptions().dtype(at::kDouble);
  switch (a.kind) {
    case Kind::Positive: return at::rand(a.shape, g, dbl) * 1.5 + 0.5;
    case Kind::Unit: return at::rand(a.shape, g, dbl) * 1.8 - 0.9;
    case Kind::Counts: return at::randint(0, 4, a.shape, g, dbl);
    case Kind::Index:
    case Kind::Labels:
      return at::randint(0, a.hi, a.shape, g, at::TensorOptions().dtype(at::kLong));
    case Kind::Mask: return at::rand(a.shape, g, dbl) > 0.5;
    default: return at::randn(a.shape, g, dbl);
  }
}

bool laid_out(Kind k) { return k != Kind::Weight && k != Kind::Plain && k != Kind::Index; }
bool wants_grad(Kind k) {
  return k == Kind::Data || k == Kind::Positive || k == Kind::Unit || k == Kind::Counts ||
         k == Kind::Weight;
}

bool close(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (!floating(a)) return at::equal(a, b);
  return at::allclose(a, b, 1e-6, 1e-8, /*equal_nan=*/true);
}

// Runs one case on one variant; returns "" on success, else what went wrong. Errors are
// returned as "error: <message>".
std::string run_case(const OpCase& c, size_t case_index, const DeviceMesh& mesh,
                     const Variant& variant) {
  std::vector<at::Tensor> full, dist;
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    at::Tensor f = make_full(a, 1000 * case_index + i);
    at::Tensor d;
    if (a.kind == Kind::Plain || a.kind == Kind::Index) {
      d = f;
    } else {
      Placements p =
          laid_out(a.kind) ? variant.placements(f.dim()) : Placements(mesh.ndim(), Replicate());
      // Partial terms only for floating data (labels, masks and weights stay whole).
      const bool terms = a.kind != Kind::Labels && a.kind != Kind::Mask;
      for (auto& x : p)
        if (x.is_partial() && !terms) x = Replicate();
      std::vector<ShardTable> tables(f.dim());
      for (int64_t t = 0; t < f.dim(); ++t) {
        int64_t parts = 1;
        bool sharded = false;
        for (int64_t m = 0; m < mesh.ndim(); ++m)
          if (p[m].is_shard(t)) parts *= mesh.size(m), sharded = true;
        if (sharded) tables[t] = uneven(f.size(t), parts);
      }
      d = tessera::test::make_dtensor_from_full(f, mesh, p, tables);
    }
    if (wants_grad(a.kind)) {
      f.requires_grad_();
      d = d.detach().requires_grad_();
    }
    full.push_back(f);
    dist.push_back(d);
  }
  at::Tensor expected = c.fn(full);
  at::Tensor got;
  try {
    got = c.fn(dist);
    if (!is_dtensor(got)) return "the result is not a distributed tensor";
    if (got.sizes() != expected.sizes())
      return "global shape " + shape_str(got.sizes().vec()) + ", one device " +
             shape_str(expected.sizes().vec());
    if (!close(full_tensor(got).detach(), expected.detach()))
      return "forward differs from one device (" + spec(got).str() + ")";
    if (!expected.requires_grad()) return "";
    auto g = tessera::test::randn(expected.sizes(), 99 + case_index, at::kDouble);
    expected.backward(g);
    auto gd = distribute_tensor(g, mesh, spec(got).partial_as_replicate().placements(),
                                std::nullopt, ShardSizes::Given(spec(got).shard_tables()));
    got.backward(gd);
    for (size_t i = 0; i < full.size(); ++i) {
      if (!full[i].requires_grad() || !full[i].grad().defined()) continue;
      const at::Tensor& dg = dist[i].grad();
      const std::string which = "the gradient of operand " + std::to_string(i);
      if (!dg.defined()) return which + " is missing";
      // A plain gradient is a replicated value (docs/design.md): autograd builds some zero
      // gradients from the input's sizes alone (copysign's `other`).
      if (!close(is_dtensor(dg) ? full_tensor(dg) : dg, full[i].grad()))
        return which + " differs from one device (" + (is_dtensor(dg) ? spec(dg).str() : "plain") +
               ")";
    }
  } catch (const c10::Error& e) {
    return std::string("error: ") + e.what_without_backtrace();
  }
  return "";
}

struct Outcome {
  std::string variant, message;
};

// Runs every case on every variant of `world` ranks in one run_ranks call; each rank checks
// that all ranks reached the same verdict on every case.
void sweep(const std::vector<OpCase>& cases, int world,
           std::map<std::string, std::vector<Outcome>>& outcomes, std::mutex& mu) {
  const auto variants = variants_for(world);
  // TESSERA_SWEEP_VERBOSE=1 names every case as it starts (to find a case that hangs).
  const bool verbose = std::getenv("TESSERA_SWEEP_VERBOSE") != nullptr;
  tessera::testing::RunOptions options;
  options.timeout = std::chrono::minutes(10);
  tessera::testing::run_ranks(
      world,
      [&](int rank) {
        for (const auto& variant : variants) {
          auto mesh = init_device_mesh("cpu", variant.mesh);
          for (size_t k = 0; k < cases.size(); ++k) {
            if (verbose)
              std::printf("rank %d [%s] %s\n", rank, variant.name.c_str(), cases[k].name.c_str());
            std::string message = run_case(cases[k], k, mesh, variant);
            // 0: success, 1: error, 2: mismatch.
            const int64_t code = message.empty() ? 0 : message.rfind("error: ", 0) == 0 ? 1 : 2;
            auto codes = comm::all_gather_ints(mesh.mesh_group(), {code});
            for (const auto& other : codes)
              if (other[0] != code)
                message = "ranks disagree (one raised, another did not): " + message;
            if (rank != 0) continue;
            std::lock_guard<std::mutex> lock(mu);
            outcomes[cases[k].name].push_back({variant.name, message});
          }
        }
      },
      options);
}

void check(const std::vector<OpCase>& cases) {
  std::set<std::string> names;
  for (const auto& c : cases)
    ASSERT_TRUE(names.insert(c.name).second) << "duplicate case " << c.name;
  std::map<std::string, std::vector<Outcome>> outcomes;
  std::mutex mu;
  for (int world : {1, 2, 3, 4}) sweep(cases, world, outcomes, mu);
  for (const auto& c : cases) {
    const bool may_fail = expected_errors().count(c.name) > 0;
    bool errored = false;
    for (const auto& o : outcomes[c.name]) {
      if (o.message.empty()) continue;
      const bool is_error = o.message.rfind("error: ", 0) == 0;
      errored = errored || is_error;
      if (is_error && may_fail) {
        // Clear: it names the op and the layouts.
        EXPECT_NE(o.message.find("aten::"), std::string::npos)
            << c.name << " [" << o.variant << "]: the error does not name the op: " << o.message;
        continue;
      }
      ADD_FAILURE() << c.name << " [" << o.variant << "]: " << o.message;
    }
    if (may_fail && !errored && !may_work_on_this_libtorch(c.name)) {
      ADD_FAILURE() << c.name << " is on the expected-error list but now works everywhere";
    }
  }
}

}  // namespace

TEST(OpSweep, Pointwise) { check(pointwise_cases()); }
TEST(OpSweep, Reductions) { check(reduction_cases()); }
TEST(OpSweep, ShapesAndIndexing) { check(shape_cases()); }
TEST(OpSweep, NeuralNetworkOps) { check(nn_cases()); }
TEST(OpSweep, OptimizerUpdates) { check(optimizer_cases()); }

// The sweep's size: at least 150 ops.
TEST(OpSweep, Coverage) {
  const size_t n = pointwise_cases().size() + reduction_cases().size() + shape_cases().size() +
                   nn_cases().size() + optimizer_cases().size();
  EXPECT_GE(n, 150u);
}
