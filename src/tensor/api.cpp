// redistribute to placements (agreed across the mesh first), the spec accessors, and
// printing a distributed tensor.
#include "tessera/tensor/api.h"

#include <cstdlib>
#include <sstream>

#include <ATen/ATen.h>

#include "comm/wait.h"
#include "layout_args.h"
#include "layout_autograd.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

using namespace detail;

namespace {

// TESSERA_CHECK_ARGUMENTS=0 trusts every rank to pass the same arguments to redistribute and
// skips its agreement round trip (for a hot loop known to be consistent). Read on every call,
// so a program may set it around such a loop.
bool redistribute_agreement_wanted() {
  const char* v = std::getenv("TESSERA_CHECK_ARGUMENTS");
  return !(v && std::string(v) == "0");
}

}  // namespace

at::Tensor redistribute(const at::Tensor& dtensor, const Placements& placements,
                        const ShardSizes& sizes) {
  comm::detail::CallerScope caller("redistribute");
  const auto& s = spec(dtensor);
  SpecPtr target;
  auto checks = [&] {
    for (size_t m = 0; m < placements.size(); ++m) {
      TORCH_CHECK(!placements[m].is_partial() ||
                      (m < s.placements().size() && s.placements()[m] == placements[m]),
                  "tessera: redistribute ", to_string(s.placements()), " -> ",
                  to_string(placements), ": Partial targets are internal; keep the source's ",
                  "Partial or choose Replicate/Shard");
    }
    TORCH_CHECK(sizes.mode() != ShardSizes::Mode::Infer,
                "tessera: redistribute: ShardSizes::Infer() only applies to from_local");
    check_placements("redistribute", s.mesh(), placements, s.sizes());
    target = make_spec("redistribute", s.mesh(), placements, s.sizes(), s.dtype(),
                       target_tables("redistribute", &s, s.mesh(), placements, s.sizes(), sizes));
  };
  if (s.mesh().size() == 1 || !s.mesh().contains_this_rank() || !redistribute_agreement_wanted()) {
    checks();
    return redistribute_to(dtensor, target);
  }
  // Ranks asking for different targets (or holding differently declared tensors) would run
  // different collectives: one small exchange first (NOTE: [Agreeing on arguments]).
  const std::string error = error_of(checks);
  agree("redistribute", s.mesh(), error,
        "source " + s.str() + " " + c10::toString(s.dtype()) + " -> placements " +
            to_string(placements) + sizes_str(sizes),
        {});
  return redistribute_to(dtensor, target);
}

at::Tensor redistribute(const at::Tensor& dtensor, const SpecPtr& target) {
  return redistribute_to(dtensor, target);
}

const DTensorSpec& spec(const at::Tensor& dtensor) { return dtensor_impl(dtensor)->spec(); }
const Placements& placements(const at::Tensor& dtensor) { return spec(dtensor).placements(); }
const DeviceMesh& device_mesh(const at::Tensor& dtensor) { return spec(dtensor).mesh(); }

std::string to_string(const at::Tensor& t) {
  std::ostringstream os;
  if (!is_dtensor(t)) {
    os << t;
    return os.str();
  }
  auto* d = dtensor_impl(t);
  const auto& s = d->spec();
  os << "DTensor(placements=" << to_string(s.placements()) << ", mesh=" << s.mesh().str()
     << ", global=" << shape_str(s.sizes()) << ", local=" << shape_str(d->local().sizes().vec())
     << ", dtype=" << s.dtype();
  std::string tabs;
  for (int64_t i = 0; i < s.ndim(); ++i)
    if (!s.shard_table(i).empty())
      tabs += (tabs.empty() ? "" : ", ") + std::to_string(i) + ": " + shape_str(s.shard_table(i));
  if (!tabs.empty()) os << ", shards={" << tabs << "}";
  if (s.mesh().contains_this_rank()) os << ", coordinate=" << shape_str(s.mesh().coordinate());
  os << ")\nlocal values:\n" << d->local();
  return os.str();
}

}  // namespace tessera
