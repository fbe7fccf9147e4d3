// comm::Pending: a transfer left in flight finishes exactly once, whether it is waited for,
// assigned over, moved from or dropped.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "tessera/comm/pending.h"

using tessera::comm::Pending;

namespace {
Pending<int> counting(int value, int& finished) {
  return Pending<int>([value, &finished] {
    ++finished;
    return value;
  });
}
}  // namespace

TEST(Pending, WaitFinishesOnceAndKeepsNothing) {
  int finished = 0;
  auto p = counting(7, finished);
  EXPECT_TRUE(p.pending());
  EXPECT_EQ(p.wait(), 7);
  EXPECT_EQ(p.wait(), 0);  // handed over: a later wait() returns an empty result
  EXPECT_FALSE(p.pending());
  EXPECT_EQ(finished, 1);
}

TEST(Pending, AssigningOverOneInFlightFinishesItFirst) {
  int a = 0, b = 0;
  auto p = counting(1, a);
  p = counting(2, b);
  EXPECT_EQ(a, 1);  // finished when assigned over
  EXPECT_EQ(b, 0);
  EXPECT_EQ(p.wait(), 2);
  EXPECT_EQ(b, 1);
}

TEST(Pending, DestructorAndMovesFinishExactlyOnce) {
  int finished = 0;
  {
    auto p = counting(3, finished);
    Pending<int> q(std::move(p));
    EXPECT_FALSE(p.pending());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_TRUE(q.pending());
  }
  EXPECT_EQ(finished, 1);
  EXPECT_EQ(Pending<int>::ready(5).wait(), 5);
  Pending<int> empty;
  EXPECT_EQ(empty.wait(), 0);
}

TEST(Pending, AFailedFinishIsRaisedByWaitAndSwallowedByTheDestructor) {
  Pending<int> p([]() -> int { TORCH_CHECK(false, "transport failed"); });
  EXPECT_THROW(p.wait(), c10::Error);
  {
    Pending<int> q([]() -> int { TORCH_CHECK(false, "transport failed"); });
  }
}
