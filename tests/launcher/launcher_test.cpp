// tessera-run: successful runs, output handling and argument passing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "launcher_helpers.h"

namespace {

using namespace tessera::testing_launcher;

std::vector<std::string> sorted_lines(const std::string& text) {
  auto lines = lines_of(text);
  std::sort(lines.begin(), lines.end());
  return lines;
}

TEST(Launcher, FourRanksPrefixEveryLine) {
  TempDir dir;
  const auto r = run_launcher({"-n", "4", "sh", "-c", "echo hi $RANK $WORLD_SIZE"}, dir);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out), (std::vector<std::string>{"[rank 0] hi 0 4", "[rank 1] hi 1 4",
                                                           "[rank 2] hi 2 4", "[rank 3] hi 3 4"}));
  EXPECT_EQ(r.err, "");
}

TEST(Launcher, StdoutAndStderrStaySeparate) {
  TempDir dir;
  const auto r = run_launcher(
      {"-n", "2", "sh", "-c", "echo out $RANK; echo err $RANK >&2; echo more out $RANK"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out),
            (std::vector<std::string>{"[rank 0] more out 0", "[rank 0] out 0",
                                      "[rank 1] more out 1", "[rank 1] out 1"}));
  EXPECT_EQ(sorted_lines(r.err), (std::vector<std::string>{"[rank 0] err 0", "[rank 1] err 1"}));
}

TEST(Launcher, LinesFromOneRankKeepTheirOrder) {
  TempDir dir;
  const auto r = run_launcher(
      {"-n", "3", "sh", "-c", "i=0; while [ $i -lt 200 ]; do echo $RANK:$i; i=$((i+1)); done"},
      dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 600u);
  std::vector<int> next(3, 0);
  for (const auto& line : lines) {
    ASSERT_EQ(line.rfind("[rank ", 0), 0u) << line;
    const int rank = line[6] - '0';
    ASSERT_GE(rank, 0);
    ASSERT_LT(rank, 3);
    EXPECT_EQ(line, "[rank " + std::to_string(rank) + "] " + std::to_string(rank) + ":" +
                        std::to_string(next[rank]));
    ++next[rank];
  }
}

TEST(Launcher, PartialLastLineIsFlushed) {
  TempDir dir;
  const auto r = run_launcher(
      {"-n", "2", "sh", "-c", "printf 'first\\nlast %s' $RANK; printf 'e%s' $RANK >&2"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out), (std::vector<std::string>{"[rank 0] first", "[rank 0] last 0",
                                                           "[rank 1] first", "[rank 1] last 1"}));
  EXPECT_EQ(sorted_lines(r.err), (std::vector<std::string>{"[rank 0] e0", "[rank 1] e1"}));
  EXPECT_EQ(r.out.back(), '\n');
}

TEST(Launcher, SetsRendezvousVariables) {
  TempDir dir;
  const auto r = run_launcher(
      {"-n", "2", "--master-addr", "10.1.2.3", "--master-port", "12345", "sh", "-c",
       "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
       "$TESSERA_LAUNCHER"},
      dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out), (std::vector<std::string>{"[rank 0] 0 0 2 2 10.1.2.3 12345 1",
                                                           "[rank 1] 1 1 2 2 10.1.2.3 12345 1"}));
}

// Several ranks on a host get one compute thread each unless the user chose (torchrun's
// rule); a single rank keeps the machine's default.
TEST(Launcher, OneComputeThreadPerRankUnlessSet) {
  const char* was = std::getenv("OMP_NUM_THREADS");
  const std::string saved = was ? was : "";
  TempDir dir;
  ::unsetenv("OMP_NUM_THREADS");
  const auto two = run_launcher({"-n", "2", "sh", "-c", "echo \"<$OMP_NUM_THREADS>\""}, dir);
  const auto one = run_launcher({"-n", "1", "sh", "-c", "echo \"<$OMP_NUM_THREADS>\""}, dir);
  ::setenv("OMP_NUM_THREADS", "3", 1);
  const auto chosen = run_launcher({"-n", "2", "sh", "-c", "echo \"<$OMP_NUM_THREADS>\""}, dir);
  if (was)
    ::setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  else
    ::unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(sorted_lines(two.out), (std::vector<std::string>{"[rank 0] <1>", "[rank 1] <1>"}))
      << two.err;
  EXPECT_EQ(one.out, "[rank 0] <>\n") << one.err;
  EXPECT_EQ(sorted_lines(chosen.out), (std::vector<std::string>{"[rank 0] <3>", "[rank 1] <3>"}))
      << chosen.err;
}

TEST(Launcher, DefaultPortIsSharedAndValid) {
  TempDir dir;
  const auto r = run_launcher({"-n", "3", "sh", "-c", "echo $MASTER_ADDR $MASTER_PORT"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> values;
  for (const auto& line : lines_of(r.out)) values.insert(line.substr(line.find("] ") + 2));
  ASSERT_EQ(values.size(), 1u) << r.out;
  const std::string value = *values.begin();
  ASSERT_EQ(value.rfind("127.0.0.1 ", 0), 0u) << value;
  const int port = std::stoi(value.substr(10));
  EXPECT_GE(port, 1);
  EXPECT_LE(port, 65535);
}

TEST(Launcher, ArgumentsAfterTheProgramPassThrough) {
  TempDir dir;
  const auto r = run_launcher({"-n", "2", "sh", "-c", "for a in \"$@\"; do echo \"<$a>\"; done",
                               "argv0", "--foo", "-n", "7", "two words", "--timeout=3"},
                              dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* rank : {"[rank 0] ", "[rank 1] "}) {
    std::vector<std::string> got;
    for (const auto& line : lines_of(r.out)) {
      if (line.rfind(rank, 0) == 0) got.push_back(line.substr(9));
    }
    EXPECT_EQ(got,
              (std::vector<std::string>{"<--foo>", "<-n>", "<7>", "<two words>", "<--timeout=3>"}))
        << rank;
  }
}

TEST(Launcher, DoubleDashSeparatesTheProgram) {
  TempDir dir;
  const auto r = run_launcher({"-n", "1", "--", "sh", "-c", "echo \"$0 $1\"", "x", "--help"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank 0] x --help\n");
}

TEST(Launcher, NoPrefixWritesDirectly) {
  TempDir dir;
  const auto r =
      run_launcher({"--no-prefix", "-n", "2", "sh", "-c", "echo plain $RANK; echo e >&2"}, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out), (std::vector<std::string>{"plain 0", "plain 1"}));
  EXPECT_EQ(r.err, "e\ne\n");
}

TEST(Launcher, StrayBackgroundProcessesAreCleanedUp) {
  TempDir dir;
  // Each rank leaves a sleeper behind that still holds the output pipe.
  const auto r = run_launcher(
      {"-n", "2", "sh", "-c",
       "sleep 60 & echo $! > \"$1/.t$RANK\" && mv \"$1/.t$RANK\" \"$1/sleep.$RANK\"; echo done",
       "sh", dir.str()},
      dir);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 30.0);
  const auto pids = read_pids(dir.path(), "sleep.");
  EXPECT_EQ(pids.size(), 2u);
  EXPECT_TRUE(surviving(pids).empty());
}

TEST(Launcher, UsageErrors) {
  TempDir dir;
  const auto no_program = run_launcher({"-n", "2"}, dir);
  EXPECT_NE(no_program.exit_code, 0);
  EXPECT_NE(no_program.err.find("missing the program"), std::string::npos) << no_program.err;

  const auto no_n = run_launcher({"true"}, dir);
  EXPECT_NE(no_n.exit_code, 0);

  const auto zero = run_launcher({"-n", "0", "true"}, dir);
  EXPECT_NE(zero.exit_code, 0);

  const auto bad_port = run_launcher({"-n", "1", "--master-port", "70000", "true"}, dir);
  EXPECT_NE(bad_port.exit_code, 0);

  const auto unknown = run_launcher({"-n", "1", "--bogus", "true"}, dir);
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.err.find("--bogus"), std::string::npos) << unknown.err;
}

TEST(Launcher, UnknownProgramFailsWith127) {
  TempDir dir;
  const auto r = run_launcher({"-n", "2", "/nonexistent/tessera-program"}, dir);
  ASSERT_FALSE(r.hung);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_NE(r.err.find("cannot execute '/nonexistent/tessera-program'"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("failed (exit code 127)"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 30.0);
}

}  // namespace
