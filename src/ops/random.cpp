// Random fills on distributed tensors draw exactly what one device would draw.
//
// NOTE: [Random numbers]
// Every rank draws the whole global tensor from the same generator state and keeps its own
// block, so a sharded tensor holds the values a single device gets for the same seed, and
// the generators of all ranks stay in step. The cost is compute and memory for the global
// tensor on each rank (no communication). The generator is the op's own, or Tessera's per
// thread generator when tessera::manual_seed was called on this thread (ranks as threads
// share ATen's default generator), or ATen's default one. CUDA generators could skip ahead
// by offset instead (Philox); not done yet.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "tessera/ops/rule.h"
#include "tessera/tensor/random.h"

namespace tessera {

namespace ops {

namespace {

// In-place fills (self, ..., *, Generator? generator): the op runs on a global-sized buffer.
OpPlan fill_rule(const OpCall& call) {
  const auto& self = *call.specs[0];
  auto out = std::make_shared<DTensorSpec>(self.partial_as_replicate());
  OpPlan plan;
  plan.inputs.resize(call.args.size());
  plan.outputs.push_back(out);
  c10::OperatorHandle op = call.op;
  const auto global = self.sizes();
  const auto offsets = out->local_offsets();
  const auto lengths = out->local_sizes();
  const size_t gen_arg = call.args.size() - 1;
  plan.local_kernel = [op, global, offsets, lengths, gen_arg](torch::jit::Stack& stack) {
    at::Tensor local = stack[0].toTensor();
    at::Tensor full = at::empty(global, local.options());
    stack[0] = full;
    if (stack[gen_arg].isNone()) {
      if (auto g = thread_generator()) stack[gen_arg] = c10::IValue(*g);
    }
    op.callBoxed(&stack);
    at::Tensor block = full;
    for (size_t t = 0; t < global.size(); ++t) block = block.narrow(t, offsets[t], lengths[t]);
    local.copy_(block);
    stack.clear();
    stack.emplace_back(local);
  };
  return plan;
}

const RuleRegistrar registrar{[] {
  for (const char* op : {"aten::bernoulli_.float", "aten::uniform_",
                         "aten::normal_", "aten::random_", "aten::random_.from",
                         "aten::random_.to", "aten::exponential_", "aten::log_normal_",
                         "aten::cauchy_", "aten::geometric_"})
    register_rule(op, fill_rule);
}};

}  // namespace

}  // namespace ops

}  // namespace tessera
