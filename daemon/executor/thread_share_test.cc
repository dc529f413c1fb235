#include "daemon/executor/thread_share.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

TEST_CASE("an explicit count is that count, whatever the load") {
  CHECK(IntraOpThreadsFor(3, 2, 1, 0) == 3);
  CHECK(IntraOpThreadsFor(3, 2, 4, 3) == 3);
  CHECK(IntraOpThreadsFor(1, 64, 1, 0) == 1);
}

TEST_CASE("one busy chip alone gets every core") {
  CHECK(IntraOpThreadsFor(0, 2, 1, 0) == 2);
  CHECK(IntraOpThreadsFor(0, 16, 1, 0) == 16);
  CHECK(IntraOpThreadsFor(0, 1, 1, 0) == 1);
}

TEST_CASE("busy chips share the cores, at least one thread each") {
  // Two cores, four busy chips: one each, never zero.
  for (int p = 0; p < 4; ++p) CHECK(IntraOpThreadsFor(0, 2, 4, p) == 1);
  CHECK(IntraOpThreadsFor(0, 2, 2, 0) == 1);
  CHECK(IntraOpThreadsFor(0, 2, 2, 1) == 1);
  // The remainder goes to the first ones: every core used, none twice.
  for (int cores : {3, 7, 16, 17}) {
    for (int busy = 1; busy <= 8; ++busy) {
      int total = 0;
      for (int p = 0; p < busy; ++p) {
        const int t = IntraOpThreadsFor(0, cores, busy, p);
        CHECK(t >= 1);
        CHECK(t <= (cores + busy - 1) / busy);
        total += t;
      }
      CHECK(total == std::max(cores, busy));
    }
  }
  CHECK(IntraOpThreadsFor(0, 16, 3, 0) == 6);
  CHECK(IntraOpThreadsFor(0, 16, 3, 2) == 5);
  // Nonsense in, a sane count out.
  CHECK(IntraOpThreadsFor(0, 0, 0, 5) == 1);
  CHECK(IntraOpThreadsFor(-1, 4, 2, 9) == 2);
}

TEST_CASE("cgroup CPU quotas read as whole cores, rounded up") {
  CHECK(CpuMaxCores("max 100000\n") == 0);
  CHECK(CpuMaxCores("200000 100000\n") == 2);
  CHECK(CpuMaxCores("150000 100000") == 2);
  CHECK(CpuMaxCores("50000 100000") == 1);
  CHECK(CpuMaxCores("300000") == 3);
  CHECK(CpuMaxCores("") == 0);
  CHECK(CpuMaxCores("garbage") == 0);
  CHECK(CfsQuotaCores(-1, 100000) == 0);
  CHECK(CfsQuotaCores(400000, 100000) == 4);
  CHECK(CfsQuotaCores(250000, 100000) == 3);
  CHECK(CfsQuotaCores(100000, 0) == 0);
}

TEST_CASE("this process has at least one core, no more than it may use") {
  const HostCores h = AvailableCores();
  CHECK(h.affinity >= 1);
  CHECK(h.cores >= 1);
  CHECK(h.cores <= h.affinity);
  if (h.quota > 0) CHECK(h.cores <= h.quota);
  CHECK(DescribeThreadPolicy(0, h).find("automatic") != std::string::npos);
  CHECK(DescribeThreadPolicy(3, h) == "3 per executor (--intra_op_threads=3)");
}

// A backend whose count is a number, recording every change.
class CountingBackend : public ChipBackend {
 public:
  explicit CountingBackend(int threads) : threads_(threads) {}
  int intra_op_threads() const override { return threads_; }
  void set_intra_op_threads(int n) override {
    threads_ = n;
    sets.push_back(n);
  }
  std::string Describe() const override { return "counting"; }
  absl::StatusOr<std::shared_ptr<const BackendOp>> LookupOp(
      absl::string_view) override {
    return absl::UnimplementedError("none");
  }
  absl::Status Run(const BackendOp&, const tpu::DecodedOp&,
                   const std::vector<ResolvedTensor>&,
                   std::vector<ResultValue>*, ResultAllocator*) override {
    return absl::UnimplementedError("none");
  }
  std::vector<int> sets;

 private:
  int threads_;
};

struct Host {
  explicit Host(int executors, int cpus) : shared(new ExecutorShared()) {
    shared->num_executors = executors;
    shared->num_cpus = cpus;
    for (int e = 0; e < executors; ++e)
      shared->slots[e].state.store(ExecutorSlot::kReady);
  }
  std::unique_ptr<ExecutorShared> shared;
};

constexpr uint64_t kSecond = 1'000'000'000;

TEST_CASE("an executor's share follows the chips that go busy and idle") {
  Host host(4, 2);
  CountingBackend backend(2);  // ATen's default: two threads
  ThreadShare share(host.shared.get(), 0, /*fixed=*/0, &backend);
  ExecutorSlot* slots = host.shared->slots;
  CHECK(slots[0].intra_op_threads.load() == 2);
  CHECK(slots[0].intra_op_threads_max.load() == 2);

  uint64_t now = 10 * kSecond;
  share.Worked(now);
  share.Apply(now);  // alone: every core, nothing to change
  CHECK(backend.sets.empty());

  // Three more chips start working: one thread each.
  for (int e = 1; e < 4; ++e) slots[e].last_work_ns.store(now);
  now += kBusyWindowNs / 2;
  share.Apply(now);
  CHECK(backend.sets == std::vector<int>{1});
  CHECK(slots[0].intra_op_threads.load() == 1);
  share.Apply(now + 1000);  // unchanged: no call
  CHECK(backend.sets.size() == 1);

  // They stop; chip 2 is still inside a long op, so still busy.
  slots[2].op_started_ns.store(now);
  now += 2 * kBusyWindowNs;
  share.Apply(now);
  CHECK(backend.sets.size() == 1);
  CHECK(share.Wanted(now) == 1);

  // Its op ends and its window passes: alone again, all cores back.
  slots[2].op_started_ns.store(0);
  slots[2].last_work_ns.store(now);
  now += 2 * kBusyWindowNs;
  share.Apply(now);
  CHECK(backend.sets == std::vector<int>{1, 2});
  CHECK(slots[0].intra_op_threads.load() == 2);

  // A dead executor is not busy, whatever its slot last said.
  slots[3].last_work_ns.store(now);
  slots[3].state.store(ExecutorSlot::kDead);
  CHECK(share.Wanted(now) == 2);
}

TEST_CASE("automatic never exceeds the backend's default nor the cores") {
  SECTION("more cores than the backend's default") {
    Host host(2, 16);
    CountingBackend backend(4);
    ThreadShare share(host.shared.get(), 1, 0, &backend);
    CHECK(share.Wanted(kSecond) == 4);
    host.shared->slots[0].last_work_ns.store(kSecond);
    CHECK(share.Wanted(kSecond) == 4);  // 16 cores / 2 busy, capped at 4
  }
  SECTION("fewer cores than the backend's default") {
    Host host(2, 3);
    CountingBackend backend(8);
    ThreadShare share(host.shared.get(), 1, 0, &backend);
    CHECK(host.shared->slots[1].intra_op_threads_max.load() == 3);
    share.Apply(kSecond);
    CHECK(backend.sets == std::vector<int>{3});
    host.shared->slots[0].last_work_ns.store(kSecond);
    CHECK(share.Wanted(kSecond) == 1);  // the remainder goes to executor 0
  }
}

TEST_CASE("an explicit count and a backend without one are left alone") {
  Host host(4, 2);
  for (int e = 0; e < 4; ++e) host.shared->slots[e].last_work_ns.store(kSecond);
  CountingBackend fixed_backend(2);
  ThreadShare fixed(host.shared.get(), 0, /*fixed=*/2, &fixed_backend);
  fixed.Apply(kSecond);
  CHECK(fixed_backend.sets.empty());
  CHECK(host.shared->slots[0].intra_op_threads_max.load() == 2);

  CountingBackend none(0);  // PJRT: tpud does not set its threads
  ThreadShare share(host.shared.get(), 1, 0, &none);
  share.Apply(kSecond);
  CHECK(none.sets.empty());
  CHECK(host.shared->slots[1].intra_op_threads.load() == 0);
}

}  // namespace
}  // namespace tpud
