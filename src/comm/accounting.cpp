#include "tessera/comm/accounting.h"

#include <algorithm>
#include <vector>

namespace tessera::comm {

namespace {
thread_local std::vector<CommObserver*> t_observers;
}

const char* to_string(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllGather: return "all_gather";
    case CollectiveKind::AllReduce: return "all_reduce";
    case CollectiveKind::ReduceScatter: return "reduce_scatter";
    case CollectiveKind::AllToAll: return "all_to_all";
    case CollectiveKind::Broadcast: return "broadcast";
    case CollectiveKind::Scatter: return "scatter";
    case CollectiveKind::SendRecv: return "send_recv";
    case CollectiveKind::Metadata: return "metadata";
  }
  return "?";
}

void push_observer(CommObserver* observer) { t_observers.push_back(observer); }

void pop_observer(CommObserver* observer) {
  auto it = std::find(t_observers.rbegin(), t_observers.rend(), observer);
  if (it != t_observers.rend()) t_observers.erase(std::next(it).base());
}

void record(const CommRecord& r) {
  for (auto* o : t_observers) o->on_collective(r);
}

}  // namespace tessera::comm
