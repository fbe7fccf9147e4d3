#include "tessera/runtime/env.h"

#include <charconv>
#include <initializer_list>
#include <cstdlib>
#include <stdexcept>
#include <string_view>
#include <system_error>
#include <utility>

namespace tessera::runtime {
namespace {

constexpr std::string_view kSpaces = " \t\r\n";

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(kSpaces);
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(kSpaces);
  return s.substr(b, e - b + 1);
}

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

std::string quoted(const char* name, std::string_view value) {
  std::string out(name);
  out += "='";
  out += value;
  out += "'";
  return out;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("tessera: invalid launcher environment: " + what);
}

// Environment view that treats empty values as unset.
class Env {
 public:
  explicit Env(const EnvLookup& lookup) : lookup_(lookup) {}

  const char* get(const char* name) const {
    if (!lookup_) return nullptr;
    const char* v = lookup_(name);
    if (v == nullptr || trim(v).empty()) return nullptr;
    return v;
  }
  bool has(const char* name) const { return get(name) != nullptr; }

  // Parses a decimal integer; throws naming the variable on failure.
  std::optional<long long> integer(const char* name) const {
    const char* raw = get(name);
    if (raw == nullptr) return std::nullopt;
    const std::string_view s = trim(raw);
    long long value = 0;
    const auto* first = s.data();
    const auto* last = s.data() + s.size();
    const auto res = std::from_chars(first, last, value);
    if (res.ec == std::errc::result_out_of_range) fail(quoted(name, raw) + " is out of range");
    if (res.ec != std::errc() || res.ptr != last) fail(quoted(name, raw) + " is not an integer");
    return value;
  }

 private:
  const EnvLookup& lookup_;
};

// Variable names of one launcher's rank/size quadruple.
struct LauncherVars {
  const char* source;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

constexpr LauncherVars kTorchrun{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                 "LOCAL_WORLD_SIZE"};
constexpr LauncherVars kOpenMpi{"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
constexpr LauncherVars kPmi{"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
constexpr LauncherVars kSlurm{"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                              "SLURM_NTASKS_PER_NODE"};

int checked_size(const Env& env, const char* name, long long v) {
  if (v < 1) fail(quoted(name, env.get(name)) + " must be at least 1");
  if (v > 1'000'000'000LL) fail(quoted(name, env.get(name)) + " is out of range");
  return static_cast<int>(v);
}

int checked_rank(const Env& env, const char* name, long long v, const char* size_name, int size) {
  if (v < 0) fail(quoted(name, env.get(name)) + " must be non-negative");
  if (v >= size) {
    fail(quoted(name, env.get(name)) + " must be less than " +
         (env.has(size_name) ? quoted(size_name, env.get(size_name))
                             : std::string(size_name) + "=" + std::to_string(size)));
  }
  return static_cast<int>(v);
}

// Number of tasks on node `node_id` from a Slurm tasks-per-node string such as
// "4", "2(x3)" or "2(x3),1".
int tasks_on_node(const Env& env, const char* name, long long node_id) {
  const std::string_view all = trim(env.get(name));
  long long node = 0;
  std::size_t pos = 0;
  while (pos <= all.size()) {
    auto comma = all.find(',', pos);
    if (comma == std::string_view::npos) comma = all.size();
    std::string_view item = trim(all.substr(pos, comma - pos));
    long long repeat = 1;
    const auto paren = item.find('(');
    std::string_view count_part = item;
    if (paren != std::string_view::npos) {
      std::string_view rep = item.substr(paren);
      count_part = trim(item.substr(0, paren));
      if (rep.size() < 4 || rep.size() > 12 || rep.substr(0, 2) != "(x" || rep.back() != ')' ||
          !all_digits(rep.substr(2, rep.size() - 3))) {
        fail(quoted(name, env.get(name)) + " is not a valid tasks-per-node list");
      }
      repeat = std::strtoll(std::string(rep.substr(2, rep.size() - 3)).c_str(), nullptr, 10);
    }
    if (!all_digits(count_part) || count_part.size() > 9) {
      fail(quoted(name, env.get(name)) + " is not a valid tasks-per-node list");
    }
    const int count = std::atoi(std::string(count_part).c_str());
    if (node_id < node + repeat) {
      if (count < 1) fail(quoted(name, env.get(name)) + " must be at least 1");
      return count;
    }
    node += repeat;
    pos = comma + 1;
  }
  fail(quoted(name, env.get(name)) + " has no entry for node " + std::to_string(node_id));
}

// A local world size taken from a variable other than the launcher's usual one.
struct LocalSize {
  const char* name;
  long long value;
};

RendezvousInfo read_quad(const Env& env, const LauncherVars& v,
                         std::optional<LocalSize> local_override = {}) {
  const auto rank = env.integer(v.rank);
  const auto size = env.integer(v.size);
  if (!rank) fail(quoted(v.size, env.get(v.size)) + " is set but " + v.rank + " is not");
  if (!size) fail(quoted(v.rank, env.get(v.rank)) + " is set but " + v.size + " is not");

  RendezvousInfo info;
  info.source = v.source;
  info.world_size = checked_size(env, v.size, *size);
  info.rank = checked_rank(env, v.rank, *rank, v.size, info.world_size);

  const char* local_size_name = local_override ? local_override->name : v.local_size;
  const auto local_size =
      local_override ? std::optional<long long>(local_override->value) : env.integer(v.local_size);
  if (local_size) {
    info.local_world_size = checked_size(env, local_size_name, *local_size);
  } else {
    info.local_world_size = info.world_size;
  }
  if (const auto local_rank = env.integer(v.local_rank)) {
    info.local_rank = checked_rank(env, v.local_rank, *local_rank,
                                   local_size ? local_size_name : v.size, info.local_world_size);
  } else {
    info.local_rank = info.rank % info.local_world_size;
  }
  return info;
}

std::string master_from_nodelist(const Env& env) {
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
    if (const char* list = env.get(name)) {
      try {
        return first_host_of_nodelist(list);
      } catch (const std::invalid_argument&) {
        fail(quoted(name, list) + " is not a valid node list");
      }
    }
  }
  return {};
}

std::optional<RendezvousInfo> detect(const Env& env) {
  for (const LauncherVars* v : {&kTorchrun, &kOpenMpi, &kPmi}) {
    if (env.has(v->rank) || env.has(v->size)) return read_quad(env, *v);
  }
  if (env.has(kSlurm.rank)) {
    std::optional<LocalSize> local_size;
    if (!env.has("SLURM_NTASKS_PER_NODE")) {
      for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
        if (env.has(name)) {
          const long long node_id = env.integer("SLURM_NODEID").value_or(0);
          if (node_id < 0)
            fail(quoted("SLURM_NODEID", env.get("SLURM_NODEID")) + " must be non-negative");
          local_size = LocalSize{name, tasks_on_node(env, name, node_id)};
          break;
        }
      }
    }
    RendezvousInfo info = read_quad(env, kSlurm, local_size);
    std::string master = master_from_nodelist(env);
    if (!master.empty()) info.master_addr = std::move(master);
    return info;
  }
  return std::nullopt;
}

}  // namespace

std::string first_host_of_nodelist(const std::string& nodelist) {
  const std::string_view all = trim(nodelist);
  if (all.empty()) throw std::invalid_argument("empty node list");
  const auto bad = [&](const char* why) {
    throw std::invalid_argument("malformed node list '" + nodelist + "': " + why);
  };

  // Find the end of the first top-level entry and check bracket balance.
  int depth = 0;
  std::size_t entry_end = std::string_view::npos;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const char c = all[i];
    if (c == '[') {
      if (depth++ != 0) bad("nested '['");
    } else if (c == ']') {
      if (depth-- != 1) bad("unmatched ']'");
    } else if (c == ',' && depth == 0 && entry_end == std::string_view::npos) {
      entry_end = i;
    }
  }
  if (depth != 0) bad("unmatched '['");
  const std::string_view entry = trim(all.substr(0, entry_end));
  if (entry.empty()) bad("empty host name");

  std::string host;
  for (std::size_t i = 0; i < entry.size(); ++i) {
    if (entry[i] != '[') {
      host += entry[i];
      continue;
    }
    const std::size_t close = entry.find(']', i);
    const std::string_view inner = entry.substr(i + 1, close - i - 1);
    const std::string_view first = trim(inner.substr(0, inner.find(',')));
    const auto dash = first.find('-');
    const std::string_view lo = trim(first.substr(0, dash));
    if (!all_digits(lo)) bad("bracket ranges must be numeric");
    if (dash != std::string_view::npos && !all_digits(trim(first.substr(dash + 1)))) {
      bad("bracket ranges must be numeric");
    }
    host += lo;
    i = close;
  }
  return host;
}

std::optional<RendezvousInfo> rendezvous_from(const EnvLookup& getenv) {
  const Env env(getenv);
  std::optional<RendezvousInfo> info = detect(env);
  if (!info) return std::nullopt;
  if (const char* addr = env.get("MASTER_ADDR")) info->master_addr = std::string(trim(addr));
  if (const auto port = env.integer("MASTER_PORT")) {
    if (*port < 1 || *port > 65535) {
      fail(quoted("MASTER_PORT", env.get("MASTER_PORT")) + " is out of range [1, 65535]");
    }
    info->master_port = static_cast<int>(*port);
  }
  return info;
}

std::optional<RendezvousInfo> rendezvous_from_env() {
  return rendezvous_from([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace tessera::runtime
