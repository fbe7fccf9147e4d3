// Random fills on distributed tensors draw exactly what one device would draw.
//
// NOTE: [Random numbers]
// Every rank draws the whole global tensor from the same generator state and keeps its own
// block, so a sharded tensor holds the values a single device gets from that state, replicas
// are identical, and the generators of all ranks stay in step (each advances by the global
// numel). The cost is compute and memory for the global tensor on each rank (no communication).
// The generator is the op's own when it has one, else this rank's generator for distributed
// random ops (tensor/random.h): separate from ATen's default generator, so random ops on plain
// tensors cannot move it, and made equal on all ranks of the world (world rank 0's state) before
// the first draw after a reset. docs/random.md has the design and its guarantees. CUDA
// generators could skip ahead by offset instead (Philox); not done yet.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "tessera/tensor/rule.h"
#include "tessera/tensor/random.h"

namespace tessera {

namespace ops {

namespace {

// This rank's block of a global-sized buffer.
at::Tensor own_block(at::Tensor full, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& lengths) {
  for (size_t t = 0; t < offsets.size(); ++t) full = full.narrow(t, offsets[t], lengths[t]);
  return full;
}

// In-place fills (self, ..., *, Generator? generator): the op runs on a global-sized buffer.
OpPlan fill_rule(const OpCall& call) {
  const auto& self = *call.spec("self");
  auto out = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  OpPlan plan(call);
  plan.output(out);
  const auto global = self.sizes();
  const auto offsets = out->local_offsets();
  const auto lengths = out->local_sizes();
  plan.local_kernel = [global, offsets, lengths](KernelCall& k) {
    at::Tensor local = k.tensor("self");
    at::Tensor full = at::empty(global, local.options());
    k.set("self", full);
    if (k.arg("generator").isNone())
      k.set("generator", detail::agreed_generator(local.device().type()));
    k.call_op();
    local.copy_(own_block(full, offsets, lengths));
    k.finish({local});
  };
  return plan;
}

// rand_like / randn_like / randint_like: on one device they are empty_like followed by an
// in-place fill (uniform_(0, 1), normal_(0, 1), random_(low, high)) from the default
// generator. The kernel makes that fill on a global-sized buffer, with this rank's generator
// for distributed random ops, and keeps its own block (NOTE: [Random numbers]).
enum class LikeFill : uint8_t { Uniform, Normal, RandomTo, RandomFromTo };

OpPlan random_like_rule(const OpCall& call, LikeFill fill) {
  const auto& self = *call.spec("self");
  auto out = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  OpPlan plan(call);
  plan.output(out);
  TORCH_INTERNAL_ASSERT(call.has("dtype") && (fill < LikeFill::RandomTo || call.has("high")) &&
                        (fill != LikeFill::RandomFromTo || call.has("low")));
  const auto global = self.sizes();
  const auto offsets = out->local_offsets();
  const auto lengths = out->local_sizes();
  plan.local_kernel = [fill, global, offsets, lengths](KernelCall& k) {
    auto options = k.tensor("self").options();
    if (const auto dtype = k.arg<c10::optional<at::ScalarType>>("dtype"))
      options = options.dtype(*dtype);
    at::Tensor full = at::empty(global, options);
    // The .generator overloads draw from the caller's generator, as one device would.
    const bool own = k.has("generator") && !k.arg("generator").isNone();
    const c10::optional<at::Generator> gen =
        own ? k.arg("generator").toGenerator() : detail::agreed_generator(options.device().type());
    auto bound = [&k](const char* name) { return k.arg<int64_t>(name); };
    switch (fill) {
      case LikeFill::Uniform: full.uniform_(0, 1, gen); break;
      case LikeFill::Normal: full.normal_(0, 1, gen); break;
      case LikeFill::RandomTo: full.random_(0, bound("high"), gen); break;
      case LikeFill::RandomFromTo: full.random_(bound("low"), bound("high"), gen); break;
    }
    k.finish({own_block(full, offsets, lengths).clone(at::MemoryFormat::Contiguous)});
  };
  return plan;
}
OpPlan rand_like_rule(const OpCall& c) { return random_like_rule(c, LikeFill::Uniform); }
OpPlan randn_like_rule(const OpCall& c) { return random_like_rule(c, LikeFill::Normal); }
OpPlan randint_like_rule(const OpCall& c) { return random_like_rule(c, LikeFill::RandomTo); }
OpPlan randint_like_low_rule(const OpCall& c) {
  return random_like_rule(c, LikeFill::RandomFromTo);
}

const RuleRegistrar registrar{[] {
  register_rule("aten::rand_like", rand_like_rule);
  register_rule("aten::randn_like", randn_like_rule);
  register_rule("aten::randint_like", randint_like_rule);
  register_rule("aten::randint_like.low_dtype", randint_like_low_rule);
  // Newer LibTorch: the same draws with an explicit generator.
  register_rule("aten::rand_like.generator", rand_like_rule);
  register_rule("aten::randn_like.generator", randn_like_rule);
  register_rule("aten::randint_like.generator", randint_like_rule);
  register_rule("aten::randint_like.low_generator_dtype", randint_like_low_rule);
  for (const char* op :
       {"aten::bernoulli_.float", "aten::uniform_", "aten::normal_", "aten::random_",
        "aten::random_.from", "aten::random_.to", "aten::exponential_", "aten::log_normal_",
        "aten::cauchy_", "aten::geometric_"})
    register_rule(op, fill_rule);
}};

}  // namespace

}  // namespace ops

}  // namespace tessera
