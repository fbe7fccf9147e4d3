#include "tessera/tools/comm_debug_mode.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace tessera {

namespace {
constexpr auto kMeta = static_cast<size_t>(comm::CollectiveKind::Metadata);
comm::CollectiveKind kind_at(size_t i) { return static_cast<comm::CollectiveKind>(i); }
}  // namespace

CommDebugMode::CommDebugMode() { comm::push_observer(this); }
CommDebugMode::~CommDebugMode() { comm::pop_observer(this); }

void CommDebugMode::on_collective(const comm::CommRecord& r) {
  auto& s = stats_[static_cast<size_t>(r.kind)];
  s.calls += 1;
  s.bytes_sent += r.bytes_sent;
  s.bytes_received += r.bytes_received;
}

int64_t CommDebugMode::get_total_counts() const {
  int64_t n = 0;
  for (size_t i = 0; i < stats_.size(); ++i)
    if (i != kMeta) n += stats_[i].calls;
  return n;
}

std::map<std::string, int64_t> CommDebugMode::get_comm_counts() const {
  std::map<std::string, int64_t> out;
  for (size_t i = 0; i < stats_.size(); ++i)
    if (stats_[i].calls) out[comm::to_string(kind_at(i))] = stats_[i].calls;
  return out;
}

CollectiveStats CommDebugMode::stats(comm::CollectiveKind kind) const {
  return stats_[static_cast<size_t>(kind)];
}

int64_t CommDebugMode::total_bytes_sent() const {
  int64_t n = 0;
  for (size_t i = 0; i < stats_.size(); ++i)
    if (i != kMeta) n += stats_[i].bytes_sent;
  return n;
}

int64_t CommDebugMode::total_bytes_received() const {
  int64_t n = 0;
  for (size_t i = 0; i < stats_.size(); ++i)
    if (i != kMeta) n += stats_[i].bytes_received;
  return n;
}

void CommDebugMode::reset() { stats_ = {}; }

std::string CommDebugMode::table() const {
  std::string out = fmt::format("{:<16}{:>8}{:>16}{:>16}\n", "collective", "calls", "bytes sent",
                                "bytes received");
  CollectiveStats total;
  for (size_t i = 0; i < stats_.size(); ++i) {
    const auto& s = stats_[i];
    if (!s.calls) continue;
    out += fmt::format("{:<16}{:>8}{:>16}{:>16}\n", comm::to_string(kind_at(i)), s.calls,
                       s.bytes_sent, s.bytes_received);
    if (i == kMeta) continue;
    total.calls += s.calls;
    total.bytes_sent += s.bytes_sent;
    total.bytes_received += s.bytes_received;
  }
  out += fmt::format("{:<16}{:>8}{:>16}{:>16}\n", "total", total.calls, total.bytes_sent,
                     total.bytes_received);
  return out;
}

std::string CommDebugMode::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (size_t i = 0; i < stats_.size(); ++i) {
    const auto& s = stats_[i];
    if (!s.calls) continue;
    j[comm::to_string(kind_at(i))] = {
        {"calls", s.calls}, {"bytes_sent", s.bytes_sent}, {"bytes_received", s.bytes_received}};
  }
  return j.dump();
}

}  // namespace tessera
