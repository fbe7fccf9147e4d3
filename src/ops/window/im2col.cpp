// im2col / col2im (nn::Unfold / Fold): every sliding window's values as a column, and back.
// They read whole channel and spatial planes: those trailing dims are whole, the batch dim keeps
// its shards (NOTE: [Dim-wise ops]).
#include <vector>

#include "ops/dim_layout.h"
#include "tessera/tensor/rule.h"

namespace tessera::ops {

namespace {

int64_t windows(int64_t n, int64_t k, int64_t d, int64_t p, int64_t s) {
  return (n + 2 * p - d * (k - 1) - 1) / s + 1;
}

// im2col(self, kernel_size, dilation, padding, stride): [N?, C, H, W] -> [N?, C kh kw, L]
OpPlan im2col_rule(const OpCall& call) {
  const auto k = call.arg<std::vector<int64_t>>("kernel_size");
  const auto d = call.arg<std::vector<int64_t>>("dilation");
  const auto p = call.arg<std::vector<int64_t>>("padding");
  const auto st = call.arg<std::vector<int64_t>>("stride");
  auto s = last_sizes(self_of(call), 3);
  const int64_t l = windows(s[1], k[0], d[0], p[0], st[0]) * windows(s[2], k[1], d[1], p[1], st[1]);
  return trailing(call, 3, {s[0] * k[0] * k[1], l});
}

// col2im(self, output_size, kernel_size, dilation, padding, stride): [N?, C kh kw, L] -> [N?, C, H,
// W]
OpPlan col2im_rule(const OpCall& call) {
  const auto out = call.arg<std::vector<int64_t>>("output_size");
  const auto k = call.arg<std::vector<int64_t>>("kernel_size");
  auto s = last_sizes(self_of(call), 2);
  return trailing(call, 2, {s[0] / (k[0] * k[1]), out[0], out[1]});
}

const RuleRegistrar registrar{[] {
  register_rule("aten::im2col", im2col_rule);
  register_rule("aten::col2im", col2im_rule);
}};

}  // namespace

}  // namespace tessera::ops
