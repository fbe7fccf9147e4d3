#pragma once
// CommDebugMode (RAII): counts every collective this thread issues while it is alive, per
// kind, with the bytes this rank sent and received. Mirrors torch's CommDebugMode
// (get_total_counts / get_comm_counts) and adds byte totals, a table and JSON.
#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "tessera/comm/accounting.h"

namespace tessera {

struct CollectiveStats {
  int64_t calls = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};

class CommDebugMode : public comm::CommObserver {
 public:
  CommDebugMode();
  ~CommDebugMode() override;
  CommDebugMode(const CommDebugMode&) = delete;
  CommDebugMode& operator=(const CommDebugMode&) = delete;

  int64_t get_total_counts() const;                        // calls, metadata excluded
  std::map<std::string, int64_t> get_comm_counts() const;  // calls per kind ("all_gather")
  CollectiveStats stats(comm::CollectiveKind kind) const;
  int64_t total_bytes_sent() const;  // metadata excluded
  int64_t total_bytes_received() const;
  void reset();

  std::string table() const;    // aligned text table, one row per kind used
  std::string to_json() const;  // {"all_gather": {"calls":1,"bytes_sent":..},..}

  void on_collective(const comm::CommRecord& record) override;

 private:
  std::array<CollectiveStats, comm::kNumCollectiveKinds> stats_{};
};

}  // namespace tessera
