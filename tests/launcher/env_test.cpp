// Parsing of launcher environment variables (tessera/runtime/env.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>

#include "tessera/runtime/env.h"

namespace {

using tessera::runtime::EnvLookup;
using tessera::runtime::first_host_of_nodelist;
using tessera::runtime::rendezvous_from;
using tessera::runtime::RendezvousInfo;

using Vars = std::map<std::string, std::string>;

EnvLookup lookup(const Vars& vars) {
  return [&vars](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

RendezvousInfo parse(const Vars& vars) {
  const auto info = rendezvous_from(lookup(vars));
  if (!info) throw std::runtime_error("no launcher detected");
  return *info;
}

// Asserts that parsing throws std::invalid_argument mentioning every needle.
void expect_invalid(const Vars& vars, std::initializer_list<std::string> needles) {
  try {
    rendezvous_from(lookup(vars));
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    for (const auto& needle : needles) {
      EXPECT_NE(what.find(needle), std::string::npos) << "'" << needle << "' not in: " << what;
    }
  }
}

TEST(Env, NothingSetGivesNullopt) {
  EXPECT_FALSE(rendezvous_from(lookup({})).has_value());
  // Rendezvous variables alone do not identify a launcher.
  EXPECT_FALSE(
      rendezvous_from(lookup({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}})).has_value());
  // Empty values count as unset.
  EXPECT_FALSE(rendezvous_from(lookup({{"RANK", ""}, {"WORLD_SIZE", ""}})).has_value());
}

TEST(Env, Torchrun) {
  const auto info = parse({{"RANK", "5"},
                           {"WORLD_SIZE", "8"},
                           {"LOCAL_RANK", "1"},
                           {"LOCAL_WORLD_SIZE", "4"},
                           {"MASTER_ADDR", "node17"},
                           {"MASTER_PORT", "4321"}});
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "node17");
  EXPECT_EQ(info.master_port, 4321);
}

TEST(Env, TorchrunDefaults) {
  const auto info = parse({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 3);
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_EQ(info.master_port, 29500);

  const auto with_local_size =
      parse({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}});
  EXPECT_EQ(with_local_size.local_rank, 1);
  EXPECT_EQ(with_local_size.local_world_size, 4);
}

TEST(Env, OpenMpi) {
  const auto info = parse({{"OMPI_COMM_WORLD_RANK", "3"},
                           {"OMPI_COMM_WORLD_SIZE", "4"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_EQ(info.master_port, 29500);
}

TEST(Env, Pmi) {
  const auto info = parse(
      {{"PMI_RANK", "6"}, {"PMI_SIZE", "16"}, {"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "8"}});
  EXPECT_EQ(info.source, "pmi");
  EXPECT_EQ(info.rank, 6);
  EXPECT_EQ(info.world_size, 16);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 8);
}

TEST(Env, Slurm) {
  const auto info = parse({{"SLURM_PROCID", "9"},
                           {"SLURM_NTASKS", "16"},
                           {"SLURM_LOCALID", "1"},
                           {"SLURM_NTASKS_PER_NODE", "4"},
                           {"SLURM_STEP_NODELIST", "gpu[07-10,12]"},
                           {"SLURM_JOB_NODELIST", "other[1-9]"}});
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 9);
  EXPECT_EQ(info.world_size, 16);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, 29500);
}

TEST(Env, SlurmJobNodelistAndTasksPerNodeFallback) {
  const auto info = parse({{"SLURM_PROCID", "5"},
                           {"SLURM_NTASKS", "7"},
                           {"SLURM_LOCALID", "0"},
                           {"SLURM_NODEID", "3"},
                           {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                           {"SLURM_JOB_NODELIST", "login1,compute2"}});
  EXPECT_EQ(info.local_world_size, 1);
  EXPECT_EQ(info.master_addr, "login1");

  const auto no_list = parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(no_list.master_addr, "127.0.0.1");
  EXPECT_EQ(no_list.local_world_size, 1);
}

TEST(Env, MasterOverridesApplyToEveryLauncher) {
  const auto slurm = parse({{"SLURM_PROCID", "0"},
                            {"SLURM_NTASKS", "2"},
                            {"SLURM_STEP_NODELIST", "n[1-2]"},
                            {"MASTER_ADDR", "10.0.0.1"},
                            {"MASTER_PORT", "6000"}});
  EXPECT_EQ(slurm.master_addr, "10.0.0.1");
  EXPECT_EQ(slurm.master_port, 6000);

  const auto mpi = parse(
      {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_PORT", "7000"}});
  EXPECT_EQ(mpi.master_addr, "127.0.0.1");
  EXPECT_EQ(mpi.master_port, 7000);
}

TEST(Env, Precedence) {
  Vars all{{"RANK", "1"},
           {"WORLD_SIZE", "2"},
           {"OMPI_COMM_WORLD_RANK", "2"},
           {"OMPI_COMM_WORLD_SIZE", "3"},
           {"PMI_RANK", "3"},
           {"PMI_SIZE", "4"},
           {"SLURM_PROCID", "4"},
           {"SLURM_NTASKS", "5"}};
  EXPECT_EQ(parse(all).source, "torchrun");
  EXPECT_EQ(parse(all).rank, 1);
  all.erase("RANK");
  all.erase("WORLD_SIZE");
  EXPECT_EQ(parse(all).source, "openmpi");
  EXPECT_EQ(parse(all).rank, 2);
  all.erase("OMPI_COMM_WORLD_RANK");
  all.erase("OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(parse(all).source, "pmi");
  EXPECT_EQ(parse(all).rank, 3);
  all.erase("PMI_RANK");
  all.erase("PMI_SIZE");
  EXPECT_EQ(parse(all).source, "slurm");
  EXPECT_EQ(parse(all).rank, 4);
}

TEST(Env, MalformedValuesNameTheVariable) {
  expect_invalid({{"RANK", "abc"}, {"WORLD_SIZE", "4"}}, {"RANK", "abc"});
  expect_invalid({{"RANK", "1"}, {"WORLD_SIZE", "4x"}}, {"WORLD_SIZE", "4x"});
  expect_invalid({{"RANK", "1.5"}, {"WORLD_SIZE", "4"}}, {"RANK", "1.5"});
  expect_invalid({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, {"RANK", "'4'", "WORLD_SIZE"});
  expect_invalid({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, {"RANK", "-1"});
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE", "'0'"});
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}},
                 {"WORLD_SIZE", "99999999999999999999"});
  expect_invalid(
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
      {"LOCAL_RANK", "LOCAL_WORLD_SIZE"});
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
                 {"MASTER_PORT", "70000"});
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}},
                 {"MASTER_PORT", "'0'"});
  expect_invalid({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}},
                 {"MASTER_PORT", "http"});
  expect_invalid({{"RANK", "0"}}, {"WORLD_SIZE"});
  expect_invalid({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
                 {"OMPI_COMM_WORLD_RANK", "x"});
  expect_invalid({{"PMI_RANK", "0"}, {"PMI_SIZE", "-3"}}, {"PMI_SIZE", "-3"});
  expect_invalid({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "z"}},
                 {"SLURM_LOCALID", "z"});
  expect_invalid({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_NODELIST", "n[1-2"}},
                 {"SLURM_STEP_NODELIST", "n[1-2"});
  expect_invalid({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "2(x"}},
                 {"SLURM_TASKS_PER_NODE"});
}

TEST(Env, ReadsProcessEnvironment) {
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_PORT", "2345", 1);
  const auto info = tessera::runtime::rendezvous_from_env();
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("MASTER_PORT");
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->rank, 1);
  EXPECT_EQ(info->world_size, 2);
  EXPECT_EQ(info->master_port, 2345);
}

TEST(Nodelist, FirstHost) {
  EXPECT_EQ(first_host_of_nodelist("node01"), "node01");
  EXPECT_EQ(first_host_of_nodelist("node[01-04,07]"), "node01");
  EXPECT_EQ(first_host_of_nodelist("node[07,01-04]"), "node07");
  EXPECT_EQ(first_host_of_nodelist("a,b"), "a");
  EXPECT_EQ(first_host_of_nodelist(" a , b "), "a");
  EXPECT_EQ(first_host_of_nodelist("gpu[3]"), "gpu3");
  EXPECT_EQ(first_host_of_nodelist("x[1-2],y[5-6]"), "x1");
  EXPECT_EQ(first_host_of_nodelist("rack[2-3]-gpu[005-009]"), "rack2-gpu005");
  EXPECT_EQ(first_host_of_nodelist("host-1.example.org,host-2.example.org"), "host-1.example.org");
}

TEST(Nodelist, Malformed) {
  EXPECT_THROW(first_host_of_nodelist(""), std::invalid_argument);
  EXPECT_THROW(first_host_of_nodelist("  "), std::invalid_argument);
  EXPECT_THROW(first_host_of_nodelist("node[01-04"), std::invalid_argument);
  EXPECT_THROW(first_host_of_nodelist("node01]"), std::invalid_argument);
  EXPECT_THROW(first_host_of_nodelist("node[[1]]"), std::invalid_argument);
  EXPECT_THROW(first_host_of_nodelist("node[]"), std::invalid_argument);
  EXPECT_THROW(first_host_of_nodelist("node[a-b]"), std::invalid_argument);
  EXPECT_THROW(first_host_of_nodelist(",a"), std::invalid_argument);
}

}  // namespace
