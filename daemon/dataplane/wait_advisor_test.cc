#include "daemon/dataplane/wait_advisor.h"

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

// Feeds the same sample until the moving average has settled.
uint32_t Settle(WaitAdvisor& a, int parties, int runnable) {
  uint32_t advice = 0;
  for (int i = 0; i < 40; ++i) advice = a.Update(parties, runnable);
  return advice;
}

TEST_CASE(
    "waiters spin while tpud's parties and everything else fit in the cores") {
  WaitAdvisor a(2);
  CHECK(Settle(a, 1, 1) == tpu::kWaitSpin);  // one client, nothing else
  CHECK(Settle(a, 2, 2) == tpu::kWaitSpin);  // client and executor on two cores
  CHECK(Settle(a, 1, 2) ==
        tpu::kWaitSpin);  // one foreign thread on the free core
}

TEST_CASE("waiters yield when only tpud's own parties outnumber the cores") {
  WaitAdvisor a(2);
  CHECK(Settle(a, 16, 16) == tpu::kWaitYield);
  CHECK(Settle(a, 64, 40) ==
        tpu::kWaitYield);  // some parties were asleep when sampled
}

TEST_CASE("waiters sleep at once when foreign threads need the cores") {
  WaitAdvisor a(2);
  CHECK(Settle(a, 2, 3) ==
        tpu::kWaitSleep);  // client, executor and a busy loop
  CHECK(Settle(a, 2, 4) == tpu::kWaitSleep);  // two busy loops
  CHECK(Settle(a, 16, 18) == tpu::kWaitSleep);
}

TEST_CASE("the advice has hysteresis and follows the average, not one sample") {
  WaitAdvisor a(2);
  REQUIRE(Settle(a, 1, 1) == tpu::kWaitSpin);
  // One sample with a burst of foreign threads does not end spinning.
  CHECK(a.Update(1, 4) == tpu::kWaitSpin);
  // Six samples of two foreign threads over one free core take the average
  // from 0 to 1.64: past the on threshold (1.5), short of off (1.75), so a
  // spinning advisor keeps spinning; the seventh and eighth (1.80) end it.
  WaitAdvisor b(2);
  REQUIRE(Settle(b, 1, 1) == tpu::kWaitSpin);
  for (int i = 0; i < 6; ++i) b.Update(1, 3);
  CHECK(b.advice() == tpu::kWaitSpin);
  b.Update(1, 3);
  CHECK(b.Update(1, 3) == tpu::kWaitSleep);
  // Coming down from four foreign threads to one, six samples reach 1.53:
  // below off, not yet below on, so a sleeping advisor stays asleep.
  WaitAdvisor c(2);
  REQUIRE(Settle(c, 1, 5) == tpu::kWaitSleep);
  for (int i = 0; i < 6; ++i) c.Update(1, 2);
  CHECK(c.advice() == tpu::kWaitSleep);
  CHECK(c.Update(1, 2) == tpu::kWaitSpin);
}

TEST_CASE("after an idle period the average starts afresh") {
  WaitAdvisor a(2);
  REQUIRE(Settle(a, 2, 6) == tpu::kWaitSleep);
  a.Restart();
  CHECK(a.Update(1, 1) == tpu::kWaitSpin);
}

}  // namespace
}  // namespace tpud
