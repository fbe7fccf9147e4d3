// one_hot(self, num_classes): a kernel at the distributed-tensor key (NOTE: [How to add an
// op], case 2): the class count and the range check need global reductions of the labels.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "tessera/tensor/rule.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/api.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera::ops {

namespace {

// one_hot(self, num_classes): the labels' layout plus a whole class dim. The class count and
// the range check use global reductions, so every rank raises the same error.
void one_hot_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::Stack args = torch::jit::pop(*stack, op.schema().arguments().size());
  KernelCall k(op, args);
  at::Tensor self = k.tensor("self");
  int64_t classes = k.arg<int64_t>("num_classes");
  const auto* d = dtensor_impl(self, "aten::one_hot");
  if (d->spec().has_partial())
    self = redistribute(self, std::make_shared<DTensorSpec>(d->spec().partial_as_replicate()));
  const auto& spec = dtensor_impl(self)->spec();
  TORCH_CHECK(self.scalar_type() == at::kLong, "tessera: aten::one_hot(", spec.str(),
              "): one_hot is only applicable to index tensors");
  if (self.numel() > 0) {
    const int64_t lo = self.min().item<int64_t>(), hi = self.max().item<int64_t>();
    TORCH_CHECK(lo >= 0, "tessera: aten::one_hot(", spec.str(),
                "): class values must be non-negative");
    if (classes < 0) classes = hi + 1;
    TORCH_CHECK(hi < classes, "tessera: aten::one_hot(", spec.str(),
                "): class values must be smaller than num_classes ", classes);
  }
  TORCH_CHECK(classes >= 0, "tessera: aten::one_hot(", spec.str(),
              "): cannot infer the number of classes from an empty tensor");
  const at::Tensor local = at::one_hot(dtensor_impl(self)->local(), classes);
  auto sizes = spec.sizes();
  sizes.push_back(classes);
  auto tables = spec.shard_tables();
  tables.emplace_back();
  stack->emplace_back(make_dtensor(
      local,
      std::make_shared<DTensorSpec>(spec.mesh(), spec.placements(), sizes, at::kLong, tables)));
}

const RuleRegistrar registrar{[] {
  register_kernel("aten::one_hot", torch::CppFunction::makeFromBoxedFunction<&one_hot_kernel>());
}};

}  // namespace

}  // namespace tessera::ops
