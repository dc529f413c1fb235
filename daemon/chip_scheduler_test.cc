#include "daemon/chip_scheduler.h"

#include <atomic>
#include <thread>
#include <vector>

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

// Two sessions that always have work queued: one whose ops take 100x longer.
// The light one must get a like share of chip time, not one op per heavy op
// (which would give it 1%). Busy times are reported, not slept: the test
// checks the scheduling policy, not the clock.
TEST_CASE("a heavy session does not starve a light one") {
  ChipScheduler sched(1);
  constexpr uint64_t kHeavyNs = 10000000, kLightNs = 100000;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> heavy_busy{0}, light_busy{0}, heavy_ops{0};
  std::atomic<bool> light_started{false};
  std::thread heavy([&] {
    while (!light_started.load()) std::this_thread::yield();
    while (heavy_ops.load() < 200) {
      sched.Acquire(0, 1);
      sched.Release(0, 1, kHeavyNs, true);
      heavy_busy += kHeavyNs;
      ++heavy_ops;
    }
    stop = true;
  });
  std::thread light([&] {
    while (!stop.load()) {
      sched.Acquire(0, 2);
      sched.Release(0, 2, kLightNs, true);
      // Counted only once both compete.
      if (light_started.exchange(true)) light_busy += kLightNs;
    }
  });
  heavy.join();
  light.join();
  const double share = static_cast<double>(light_busy) / (light_busy + heavy_busy);
  INFO("light session's share of chip time: " << share);
  CHECK(share > 0.3);
  CHECK(share < 0.7);
  ChipUsage u = sched.Usage(0);
  CHECK(u.busy_ns >= heavy_busy + light_busy);
}

TEST_CASE("a session returning from idle gets no credit for the time away") {
  ChipScheduler sched(1);
  // Session 1 runs alone for a long time.
  for (int i = 0; i < 100; ++i) {
    sched.Acquire(0, 1);
    sched.Release(0, 1, 1000000, false);
  }
  // Session 2 has been busy too, then both compete: neither may monopolise.
  std::atomic<int> turns1{0}, turns2{0};
  std::atomic<bool> stop{false}, b_started{false};
  std::thread a([&] {
    while (!b_started.load()) std::this_thread::yield();
    for (int i = 0; i < 300; ++i) {
      sched.Acquire(0, 1);
      sched.Release(0, 1, 1000000, true);
      ++turns1;
    }
    stop = true;
  });
  std::thread b([&] {
    bool first = true;
    while (!stop.load()) {
      sched.Acquire(0, 3);
      if (first) b_started = true;
      first = false;
      sched.Release(0, 3, 1000000, true);
      ++turns2;
    }
  });
  a.join();
  b.join();
  INFO("turns: " << turns1 << " vs " << turns2);
  CHECK(turns2.load() > 100);
  CHECK(turns2.load() < 3 * turns1.load());
}

TEST_CASE("a reservation that is not taken lapses") {
  ChipScheduler sched(1);
  sched.Acquire(0, 1);
  sched.Release(0, 1, 1000, /*more_work=*/true);  // reserved for session 1
  // Session 1 never comes back: session 2 still gets the chip.
  std::thread other([&] {
    sched.Acquire(0, 2);
    sched.Release(0, 2, 1000, false);
  });
  other.join();
  SUCCEED();
}

}  // namespace
}  // namespace tpud
