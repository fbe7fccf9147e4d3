// Every test process computes on one intra-op thread. The suite runs its cases side by side
// (ctest -j, a process each) and multi-rank cases pin each rank thread to one already; and
// float64 oracles computed on two MKL threads varied from run to run well above rounding
// (LibTorch 2.15 from pip: neighbourhood attention's oracle log-sum-exp moved by 1.2e-9 in
// about 1 run in 50, never on one thread), which 1e-10 tolerances cannot absorb.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace {

class OneIntraOpThread : public ::testing::Environment {
 public:
  void SetUp() override { at::set_num_threads(1); }
};

[[maybe_unused]] ::testing::Environment* const kOneIntraOpThread =
    ::testing::AddGlobalTestEnvironment(new OneIntraOpThread);

}  // namespace
