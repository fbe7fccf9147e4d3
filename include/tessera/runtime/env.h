// Discovery of rank / world size / rendezvous address from the environment
// variables exported by common process launchers.
//
// This header is deliberately free of LibTorch so that small tools (such as the
// tessera-run launcher) can use it without linking the full library.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace tessera::runtime {

// Everything a process needs to join a process group.
struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Which launcher the values came from: "torchrun", "openmpi", "pmi" or "slurm".
  std::string source;
};

// Looks up one environment variable; returns nullptr when it is not set.
using EnvLookup = std::function<const char*(const char*)>;

// Reads the launcher variables through `getenv`. Returns std::nullopt when none
// of the known launchers' variables are set. Variables set to the empty string
// count as unset.
//
// Launchers are tried in this order, the first one detected wins:
//   torchrun : RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//              (detected by RANK or WORLD_SIZE)
//   openmpi  : OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//              OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE
//   pmi      : PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   slurm    : SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
//              (falling back to SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE
//              with SLURM_NODEID); the master address is the first host of
//              SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST.
// For every launcher, MASTER_ADDR and MASTER_PORT (when set) override the
// master address and port. When the local rank / local world size are missing
// they default to `rank % local_world_size` and `world_size`.
//
// Throws std::invalid_argument, with a message naming the offending variable
// and its value, for malformed input: a value that is not an integer, a
// negative rank, a world size < 1, rank >= world size (likewise for the local
// pair), a port outside [1, 65535], a rank without a world size (or vice
// versa), or an unparsable node list.
std::optional<RendezvousInfo> rendezvous_from(const EnvLookup& getenv);

// rendezvous_from() reading the process environment with std::getenv.
std::optional<RendezvousInfo> rendezvous_from_env();

// Returns the first host name of a Slurm-style node list, expanding the simple
// bracket forms: "node[01-04,07]" -> "node01", "a,b" -> "a",
// "rack[2-3]-gpu[5,9]" -> "rack2-gpu5". Surrounding whitespace is ignored.
// Throws std::invalid_argument for an empty or malformed list.
std::string first_host_of_nodelist(const std::string& nodelist);

}  // namespace tessera::runtime
