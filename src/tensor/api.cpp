// redistribute to placements (agreed across the mesh first), the spec accessors, and
// printing a distributed tensor.
#include "tessera/tensor/api.h"

#include <cstdlib>
#include <sstream>

#include <ATen/ATen.h>

#include "comm/wait.h"
#include "layout_args.h"
#include "layout_autograd.h"
#include "redistribute/agreement_ledger.h"
#include "tessera/redistribute/redistribute.h"
#include "tessera/tensor/dtensor_impl.h"

namespace tessera {

using namespace detail;

namespace {

// NOTE: [Agreed signatures]
// The argument agreement (NOTE: [Agreeing on arguments]) is a collective, which would dwarf a
// redistribute that moves little or nothing (R -> S(0) is a local slice). So each mesh keeps a
// ledger of the signatures (the source's layout and the target) that every rank passed at an
// exchange. A call whose local checks pass and whose signature is in the ledger is taken on
// trust: no exchange; its signature is folded into a digest of the trusted calls. The next
// exchange (a new signature, or at the latest the TESSERA_CHECK_ARGUMENTS-th call) carries the
// digest and count, so ranks that took different agreed signatures on trust raise there, on
// every rank. Ledgers change only after an exchange, so they are the same on every rank.
// Until that exchange such ranks compute on layouts that differ (a window of up to n calls
// in which a rank-dependent choice between two agreed targets is not yet an error; n = 1
// closes it). What no ledger can see: one rank's signature is new while another's was agreed; the first
// waits in an exchange the others skipped, and both fail within the collective timeout (the
// stuck-rank report names who waited where) instead of raising the disagreement at once.
constexpr int64_t kDefaultExchangePeriod = 10000;
constexpr size_t kLedgerCapacity = 4096;  // signatures per mesh; emptied (everywhere) when full

// TESSERA_CHECK_ARGUMENTS: exchange at least every n-th call (1: every call, 0: never, trusting
// every rank to pass the same arguments). Read on every call, so a program may change it around
// a loop.
int64_t exchange_period() {
  const char* v = std::getenv("TESSERA_CHECK_ARGUMENTS");
  if (!v || !*v) return kDefaultExchangePeriod;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK(*end == '\0' && n >= 0, "tessera: TESSERA_CHECK_ARGUMENTS=", v,
              " is not a count: 0 (never exchange), 1 (every call) or n (at least every n-th)");
  return n;
}

// Whether this call may skip the exchange (and is recorded as trusted); otherwise `history`
// describes the trusted calls since the last exchange, for the exchange to compare.
bool take_on_trust(const DeviceMesh& mesh, uint64_t signature, int64_t period,
                   std::string& history) {
  bool trusted = false;
  detail::with_agreement_ledger(mesh, [&](detail::AgreementLedger& l) {
    if (period > 1 && l.trusted + 1 < period && l.agreed.count(signature)) {
      ++l.trusted;
      l.trusted_digest = detail::hash_mix(l.trusted_digest, signature);
      trusted = true;
    } else if (l.trusted > 0) {
      history = ", after " + std::to_string(l.trusted) + " calls taken on trust (digest " +
                std::to_string(l.trusted_digest) + ")";
    }
  });
  return trusted;
}

void record_agreed(const DeviceMesh& mesh, uint64_t signature) {
  detail::with_agreement_ledger(mesh, [&](detail::AgreementLedger& l) {
    if (l.agreed.size() >= kLedgerCapacity) l.agreed.clear();
    l.agreed.insert(signature);
    l.trusted = 0;
    l.trusted_digest = 0;
  });
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
  const int64_t period = exchange_period();
  if (s.mesh().size() == 1 || !s.mesh().contains_this_rank() || period == 0) {
    checks();
    return redistribute_to(dtensor, target);
  }
  // Ranks asking for different targets (or holding differently declared tensors) would run
  // different collectives: one small exchange first (NOTE: [Agreeing on arguments]), unless
  // every rank agreed on this signature before (NOTE: [Agreed signatures]).
  const std::string error = error_of(checks);
  const uint64_t signature = error.empty() ? detail::hash_mix(s.hash(), target->hash()) : 0;
  std::string history;
  if (take_on_trust(s.mesh(), signature, error.empty() ? period : 1, history))
    return redistribute_to(dtensor, target);
  agree("redistribute", s.mesh(), error,
        "source " + s.str() + " " + c10::toString(s.dtype()) + " -> placements " +
            to_string(placements) + sizes_str(sizes) + history,
        {});
  record_agreed(s.mesh(), signature);
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
