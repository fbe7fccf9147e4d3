#pragma once
// Every collective Tessera issues reports here: kind, and the bytes this rank sends and
// receives. Observers (CommDebugMode) are per thread, because ranks may be threads.
#include <cstdint>

namespace tessera::comm {

enum class CollectiveKind : uint8_t {
  AllGather,
  AllReduce,
  ReduceScatter,
  AllToAll,
  Broadcast,
  Scatter,
  SendRecv,
  Metadata,
};
constexpr int kNumCollectiveKinds = 8;
const char* to_string(CollectiveKind k);

struct CommRecord {
  CollectiveKind kind;
  int64_t bytes_sent;
  int64_t bytes_received;
  int64_t group_size;
};

class CommObserver {
 public:
  virtual ~CommObserver() = default;
  virtual void on_collective(const CommRecord& record) = 0;
};

// Observers stack per thread; every active observer sees every record.
void push_observer(CommObserver* observer);
void pop_observer(CommObserver* observer);
void record(const CommRecord& record);

}  // namespace tessera::comm
