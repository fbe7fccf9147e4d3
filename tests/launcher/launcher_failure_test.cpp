// tessera-run: failing ranks, timeouts and signals; nothing may survive the launcher.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "launcher_helpers.h"

namespace {

using namespace tessera::testing_launcher;

// Shell prologue shared by the scripts below. "$1" is a directory for pid files;
// save NAME VALUE writes a file atomically so readers never see partial data.
const std::string kPrologue =
    "D=\"$1\"; save() { echo \"$2\" > \"$D/.t.$1\" && mv \"$D/.t.$1\" \"$D/$1\"; }; save pid.$RANK "
    "$$; ";

// Every rank except `failing` starts a long sleeper and waits for it; the
// failing rank waits until the others are ready and then runs `action`.
std::string script_with_failing_rank(int failing, const std::string& action,
                                     const std::string& others_setup = "") {
  return kPrologue + "if [ \"$RANK\" = " + std::to_string(failing) +
         " ]; then "
         "while [ \"$(ls \"$D\" | grep -c '^ready\\.')\" -lt $((WORLD_SIZE-1)) ]; do sleep 0.02; "
         "done; " +
         action + "; fi; " + others_setup +
         "sleep 60 & save sleep.$RANK $!; save ready.$RANK 1; wait";
}

std::vector<pid_t> all_pids(const TempDir& dir) {
  auto pids = read_pids(dir.path(), "pid.");
  const auto sleepers = read_pids(dir.path(), "sleep.");
  pids.insert(pids.end(), sleepers.begin(), sleepers.end());
  return pids;
}

TEST(LauncherFailure, FailingRankStopsTheOthers) {
  TempDir dir;
  const auto r = run_launcher(
      {"-n", "4", "sh", "-c", script_with_failing_rank(2, "echo 'rank two gives up' >&2; exit 3"),
       "sh", dir.str()},
      dir);
  ASSERT_FALSE(r.hung);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_LT(r.seconds, 20.0);
  EXPECT_NE(r.err.find("[rank 2] rank two gives up\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tessera-run: rank 2 failed (exit code 3); stopping the other ranks"),
            std::string::npos)
      << r.err;
  // The failure notice comes after what the failed rank printed last.
  EXPECT_LT(r.err.find("rank two gives up"), r.err.find("tessera-run: rank 2 failed"));
  const auto pids = all_pids(dir);
  EXPECT_EQ(pids.size(), 7u);  // 4 shells + 3 sleepers
  EXPECT_TRUE(surviving(pids).empty());
}

TEST(LauncherFailure, RankKilledBySignal) {
  TempDir dir;
  const auto r = run_launcher(
      {"-n", "3", "sh", "-c", script_with_failing_rank(1, "kill -KILL $$"), "sh", dir.str()}, dir);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_LT(r.seconds, 20.0);
  EXPECT_NE(r.err.find("rank 1 failed (signal 9); stopping the other ranks"), std::string::npos)
      << r.err;
  const auto pids = all_pids(dir);
  EXPECT_EQ(pids.size(), 5u);
  EXPECT_TRUE(surviving(pids).empty());
}

TEST(LauncherFailure, IgnoredSigtermIsFollowedBySigkill) {
  TempDir dir;
  const auto r =
      run_launcher({"-n", "2", "sh", "-c", script_with_failing_rank(0, "exit 5", "trap '' TERM; "),
                    "sh", dir.str()},
                   dir);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_GE(r.seconds, 4.0);  // the 5 s grace period
  EXPECT_LT(r.seconds, 30.0);
  EXPECT_NE(r.err.find("rank 0 failed (exit code 5)"), std::string::npos) << r.err;
  const auto pids = all_pids(dir);
  EXPECT_EQ(pids.size(), 3u);
  EXPECT_TRUE(surviving(pids).empty());
}

TEST(LauncherFailure, TimeoutKillsEverything) {
  TempDir dir;
  const auto r = run_launcher(
      {"--timeout", "1", "-n", "3", "sh", "-c",
       kPrologue + "if [ $RANK = 1 ]; then exit 0; fi; sleep 60 & save sleep.$RANK $!; wait", "sh",
       dir.str()},
      dir);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_LT(r.seconds, 20.0);
  EXPECT_NE(r.err.find("timeout"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("ranks still running: 0, 2"), std::string::npos) << r.err;
  const auto pids = all_pids(dir);
  EXPECT_EQ(pids.size(), 5u);
  EXPECT_TRUE(surviving(pids).empty());
}

TEST(LauncherFailure, TimeoutDoesNotFireForQuickJobs) {
  TempDir dir;
  const auto r = run_launcher({"--timeout", "30", "-n", "2", "sh", "-c", "echo ok"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 20.0);
  EXPECT_EQ(lines_of(r.out).size(), 2u);
}

TEST(LauncherFailure, SuccessfulRanksDoNotStopTheOthers) {
  TempDir dir;
  // Rank 0 finishes at once; rank 1 keeps working for a while and must not be stopped.
  const auto r = run_launcher(
      {"-n", "2", "sh", "-c", "if [ $RANK = 1 ]; then sleep 0.5; echo late; fi; echo end $RANK"},
      dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank 1] late\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] end 1\n"), std::string::npos) << r.out;
}

// Starts 3 ranks running `tail`, signals the launcher once all are ready and
// checks that the signal reached the ranks (well before the SIGKILL grace).
void expect_forwarded(int sig, const std::string& tail, std::size_t expected_pids) {
  TempDir dir;
  LauncherProcess launcher({"-n", "3", "sh", "-c", kPrologue + tail, "sh", dir.str()}, dir);
  ASSERT_TRUE(wait_for_files(dir.path(), "ready.", 3));
  const auto signalled = Clock::now();
  ASSERT_EQ(::kill(launcher.pid(), sig), 0);
  const auto r = launcher.wait();
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 128 + sig) << r.err;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - signalled).count(), 4.0);
  const auto pids = all_pids(dir);
  EXPECT_EQ(pids.size(), expected_pids);
  EXPECT_TRUE(surviving(pids).empty());
}

TEST(LauncherFailure, ForwardsSigterm) {
  expect_forwarded(SIGTERM, "sleep 60 & save sleep.$RANK $!; save ready.$RANK 1; wait", 6);
}

TEST(LauncherFailure, ForwardsSigint) {
  // Background jobs of a non-interactive shell ignore SIGINT, so the rank
  // itself becomes the sleeper.
  expect_forwarded(SIGINT, "save ready.$RANK 1; exec sleep 60", 3);
}

}  // namespace
