// tessera-run with --nnodes > 1, two launchers on loopback: rank numbering, the rendezvous
// and its errors, and a failure on one node stopping the other.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "launcher_helpers.h"

namespace {

using namespace tessera::testing_launcher;

// Whether a listener could take `port` on loopback now.
bool free_now(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  close(fd);
  return ok;
}

// A port for node 0's launcher: below Linux's ephemeral range (32768 on), where the other
// tests' connections and listeners on port 0 get theirs (a port drawn from that range was
// taken between the draw and the launcher's listen), and free when drawn.
std::string some_port() {
  std::random_device rd;
  for (int tries = 0; tries < 100; ++tries) {
    const int port = 20000 + static_cast<int>(rd() % 12000);
    if (free_now(port)) return std::to_string(port);
  }
  return std::to_string(20000 + rd() % 12000);
}

std::vector<std::string> node_args(int node, const std::string& port, std::vector<std::string> rest,
                                   int nnodes = 2, int nproc = 2) {
  std::vector<std::string> a{"-n",
                             std::to_string(nproc),
                             "--nnodes",
                             std::to_string(nnodes),
                             "--node-rank",
                             std::to_string(node),
                             "--master-port",
                             port,
                             "--rdzv-timeout",
                             "30"};
  a.insert(a.end(), rest.begin(), rest.end());
  return a;
}

std::vector<std::string> sorted_lines(const std::string& text) {
  auto lines = lines_of(text);
  std::sort(lines.begin(), lines.end());
  return lines;
}

TEST(LauncherMultiNode, RanksAreNumberedByNode) {
  TempDir d0, d1;
  const std::string port = some_port();
  const std::vector<std::string> prog{
      "sh", "-c", "echo $RANK/$WORLD_SIZE local $LOCAL_RANK/$LOCAL_WORLD_SIZE node $GROUP_RANK"};
  LauncherProcess n1(node_args(1, port, prog), d1);
  LauncherProcess n0(node_args(0, port, prog), d0);
  const auto r0 = n0.wait(), r1 = n1.wait();
  ASSERT_FALSE(r0.hung || r1.hung);
  EXPECT_EQ(r0.exit_code, 0) << r0.err;
  EXPECT_EQ(r1.exit_code, 0) << r1.err;
  EXPECT_EQ(sorted_lines(r0.out), (std::vector<std::string>{"[rank 0] 0/4 local 0/2 node 0",
                                                            "[rank 1] 1/4 local 1/2 node 0"}));
  EXPECT_EQ(sorted_lines(r1.out), (std::vector<std::string>{"[rank 2] 2/4 local 0/2 node 1",
                                                            "[rank 3] 3/4 local 1/2 node 1"}));
}

TEST(LauncherMultiNode, RanksShareOneStorePortPickedByNodeZero) {
  TempDir d0, d1;
  const std::string port = some_port();
  const std::vector<std::string> prog{"sh", "-c", "echo $MASTER_ADDR:$MASTER_PORT"};
  LauncherProcess n1(node_args(1, port, prog), d1);
  LauncherProcess n0(node_args(0, port, prog), d0);
  const auto r0 = n0.wait(), r1 = n1.wait();
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  std::vector<std::string> seen;
  for (const auto& l : lines_of(r0.out + r1.out)) seen.push_back(l.substr(l.find("] ") + 2));
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_TRUE(
      std::all_of(seen.begin(), seen.end(), [&](const std::string& s) { return s == seen[0]; }));
  EXPECT_EQ(seen[0].rfind("127.0.0.1:", 0), 0u);
  EXPECT_NE(seen[0], "127.0.0.1:" + port);  // the launchers' own port is not the ranks'
}

TEST(LauncherMultiNode, UnreachableMasterIsAClearErrorWithinTheTimeout) {
  TempDir d;
  auto args = node_args(1, some_port(), {"true"});
  args[args.size() - 2] = "2";  // --rdzv-timeout 2
  const auto r = run_launcher(args, d);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_NE(r.err.find("cannot reach node 0's launcher at 127.0.0.1:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Connection refused"), std::string::npos) << r.err;
}

TEST(LauncherMultiNode, MissingNodeTimesOutTheRendezvousNamingIt) {
  TempDir d;
  auto args = node_args(0, some_port(), {"true"}, /*nnodes=*/3);
  args[args.size() - 2] = "2";
  const auto r = run_launcher(args, d);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("node(s) 1, 2 of 3 did not join"), std::string::npos) << r.err;
}

TEST(LauncherMultiNode, MismatchedJobShapeIsRefusedOnBothNodes) {
  TempDir d0, d1;
  const std::string port = some_port();
  LauncherProcess n0(node_args(0, port, {"true"}, 2, 2), d0);
  LauncherProcess n1(node_args(1, port, {"true"}, 2, 3), d1);
  const auto r0 = n0.wait(), r1 = n1.wait();
  EXPECT_EQ(r0.exit_code, 1);
  EXPECT_EQ(r1.exit_code, 1);
  EXPECT_NE(r0.err.find("--nproc-per-node 3, node 0 with --nnodes 2 --nproc-per-node 2"),
            std::string::npos)
      << r0.err;
  EXPECT_NE(r1.err.find("node 0 refused this node"), std::string::npos) << r1.err;
}

TEST(LauncherMultiNode, NodeRankOutOfRange) {
  TempDir d;
  const auto r = run_launcher(node_args(2, some_port(), {"true"}), d);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--node-rank 2 is out of range for --nnodes 2"), std::string::npos) << r.err;
}

TEST(LauncherMultiNode, FailedRankOnOneNodeStopsTheOther) {
  TempDir d0, d1;
  const std::string port = some_port();
  const std::string script =
      "echo $$ > \"$1/pid.$RANK\"; if [ $RANK = 3 ]; then sleep 0.5; exit 5; fi; exec sleep 60";
  LauncherProcess n1(node_args(1, port, {"sh", "-c", script, "sh", d1.str()}), d1);
  LauncherProcess n0(node_args(0, port, {"sh", "-c", script, "sh", d0.str()}), d0);
  const auto r0 = n0.wait(), r1 = n1.wait();
  ASSERT_FALSE(r0.hung || r1.hung);
  EXPECT_EQ(r1.exit_code, 5);
  EXPECT_EQ(r0.exit_code, 1);
  EXPECT_LT(r0.seconds, 20.0);
  EXPECT_NE(r1.err.find("tessera-run[node 1]: rank 3 failed (exit code 5)"), std::string::npos)
      << r1.err;
  EXPECT_NE(
      r0.err.find("tessera-run[node 0]: rank 3 on node 1 failed (exit code 5); stopping the job"),
      std::string::npos)
      << r0.err;
  auto pids = read_pids(d0.path(), "pid.");
  const auto more = read_pids(d1.path(), "pid.");
  pids.insert(pids.end(), more.begin(), more.end());
  EXPECT_EQ(pids.size(), 4u);
  EXPECT_TRUE(surviving(pids).empty());
}

TEST(LauncherMultiNode, KilledLauncherTakesItsRanksAndStopsTheJob) {
  TempDir d0, d1;
  const std::string port = some_port();
  const std::string script = "echo $$ > \"$1/pid.$RANK\"; exec sleep 60";
  LauncherProcess n1(node_args(1, port, {"sh", "-c", script, "sh", d1.str()}), d1);
  LauncherProcess n0(node_args(0, port, {"sh", "-c", script, "sh", d0.str()}), d0);
  ASSERT_TRUE(wait_for_files(d1.path(), "pid.", 2));
  ASSERT_TRUE(wait_for_files(d0.path(), "pid.", 2));
  ::kill(n1.pid(), SIGKILL);
  const auto r0 = n0.wait();
  ASSERT_FALSE(r0.hung);
  EXPECT_EQ(r0.exit_code, 1);
  EXPECT_NE(r0.err.find("lost node 1: its launcher closed the connection"), std::string::npos)
      << r0.err;
  n1.wait();
  // Node 1's ranks die with their launcher (they may linger as zombies of another parent).
  const auto until = Clock::now() + std::chrono::seconds(10);
  std::vector<pid_t> left;
  do {
    left.clear();
    for (pid_t p : read_pids(d1.path(), "pid.")) {
      std::ifstream stat("/proc/" + std::to_string(p) + "/stat");
      std::string pid, comm, state;
      if (stat >> pid >> comm >> state && state != "Z") left.push_back(p);
    }
    if (!left.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (!left.empty() && Clock::now() < until);
  EXPECT_TRUE(left.empty());
}

}  // namespace
