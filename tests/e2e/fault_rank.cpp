// A job that keeps running collectives until something goes wrong (faults.sh and
// multinode.sh drive it):
//   fault_rank kill  R PIDDIR   rank R SIGKILLs itself while the ranks are in an all-reduce
//   fault_rank hang  R PIDDIR   rank R sleeps instead of joining a collective
//   fault_rank loop  - PIDDIR   no fault here: the test kills a launcher or cuts a link
// Every rank writes PIDDIR/rank<R>.pid first, so the test can check that none survives;
// the faulty rank writes PIDDIR/fault.time (seconds since the epoch) as the fault happens, so
// the test can time the stop from the fault itself.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <string>
#include <thread>

#include "tessera/tessera.h"

using namespace tessera;

namespace {

void note_fault_time(const std::string& dir) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  std::ofstream(dir + "/fault.time")
      << std::fixed << std::setprecision(6)
      << std::chrono::duration_cast<std::chrono::microseconds>(now).count() / 1e6 << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: fault_rank kill|hang|loop RANK PIDDIR\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int target = mode == "loop" ? -1 : std::stoi(argv[2]);
  init_process_group();
  const int rank = get_rank();
  std::ofstream(std::string(argv[3]) + "/rank" + std::to_string(rank) + ".pid")
      << ::getpid() << "\n";
  auto mesh = init_device_mesh("cpu", {get_world_size()});
  const auto term = at::ones({1 << 20});  // 4 MiB per all-reduce: long enough to be cut
  for (long step = 0;; ++step) {
    if (step == 3 && rank == target) {
      if (mode == "kill") {
        // From another thread, so the main thread is inside the all-reduce when it lands.
        std::thread([dir = std::string(argv[3])] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          note_fault_time(dir);
          std::raise(SIGKILL);
        }).detach();
      } else if (mode == "hang") {
        std::fprintf(stderr, "rank %d: sleeping instead of joining the collective\n", rank);
        note_fault_time(argv[3]);
        std::this_thread::sleep_for(std::chrono::hours(1));
      }
    }
    auto sum = full_tensor(from_local(term, mesh, {Partial()}));
    if (step == 0)
      std::printf("rank %d: collectives running (sum %g)\n", rank, sum[0].item<double>());
    std::fflush(stdout);
  }
}
