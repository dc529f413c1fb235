#include "daemon/executor/fair_queue.h"

#include <cstdlib>
#include <map>

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

// Runs `rounds` picks; each session's ring costs `cost[session]` ns per pick
// and is pushed back at once (always has work). Returns busy ns per session.
std::map<uint64_t, uint64_t> Simulate(FairQueue& q,
                                      const std::map<uint64_t, uint64_t>& cost,
                                      int rounds) {
  std::map<uint64_t, uint64_t> busy;
  for (int i = 0; i < rounds; ++i) {
    std::optional<FairQueue::Pick> p = q.Pop();
    REQUIRE(p.has_value());
    const uint64_t c = cost.at(p->session);
    busy[p->session] += c;
    q.Charge(p->session, c);
    q.Push(p->session, p->ring);
  }
  return busy;
}

TEST_CASE("equal sessions get equal chip time") {
  FairQueue q;
  std::map<uint64_t, uint64_t> cost;
  for (uint64_t s = 1; s <= 64; ++s) {
    q.Push(s, static_cast<int>(s));
    cost[s] = 1000;
  }
  auto busy = Simulate(q, cost, 64 * 100);
  for (const auto& [s, b] : busy) CHECK(b == 100 * 1000);
}

TEST_CASE("a light session gets its share beside a heavy one") {
  FairQueue q;
  q.Push(1, 1);  // heavy: 100 us per pick
  q.Push(2, 2);  // light: 1 us per pick
  auto busy = Simulate(q, {{1, 100000}, {2, 1000}}, 2000);
  // Chip time is split evenly, so the light session runs ~100x more often.
  const double share =
      static_cast<double>(busy[2]) / static_cast<double>(busy[1] + busy[2]);
  CHECK(share > 0.45);
  CHECK(share < 0.55);
}

TEST_CASE("a returning session is served at once but cannot bank idle time") {
  FairQueue q;
  q.Push(1, 1);
  // Session 1 runs alone for a long time.
  Simulate(q, {{1, 1000000}}, 100);
  // Session 2 arrives: it is picked next (no waiting behind session 1) ...
  q.Push(2, 2);
  std::optional<FairQueue::Pick> p = q.Pop();
  REQUIRE(p.has_value());
  CHECK(p->session == 2);
  q.Charge(2, 1000000);
  q.Push(2, 2);
  // ... yet it does not get the 100 ms session 1 used as a head start: the
  // two now alternate.
  auto busy = Simulate(q, {{1, 1000000}, {2, 1000000}}, 100);
  CHECK(busy[1] >= 45 * 1000000);
  CHECK(busy[2] >= 45 * 1000000);
}

TEST_CASE(
    "rings of one session take turns; a forgotten session leaves the queue") {
  FairQueue q;
  q.Push(7, 10);
  q.Push(7, 11);
  q.Push(8, 20);
  std::map<int, int> picks;
  for (int i = 0; i < 30; ++i) {
    auto p = q.Pop();
    REQUIRE(p.has_value());
    ++picks[p->ring];
    q.Charge(p->session, 1000);
    q.Push(p->session, p->ring);
  }
  CHECK(std::abs(picks[10] - picks[11]) <= 1);
  CHECK(picks[20] >= 14);
  q.Forget(7);
  for (int i = 0; i < 5; ++i) {
    auto p = q.Pop();
    REQUIRE(p.has_value());
    CHECK(p->session == 8);
    q.Push(p->session, p->ring);
  }
  q.Forget(8);
  CHECK(q.empty());
  CHECK(!q.Pop().has_value());
}

}  // namespace
}  // namespace tpud
