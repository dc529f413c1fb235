#include "daemon/chip_scheduler.h"

#include <algorithm>
#include <limits>

#include "tpu/shm_layout.h"

namespace tpud {

ChipScheduler::ChipScheduler(int num_chips) : chips_(num_chips) {
  const uint64_t now = tpu::MonotonicNanos();
  for (Chip& c : chips_) c.window_start_ns = now;
}

double ChipScheduler::MinVtimeLocked(const Chip& c) const {
  double min = std::numeric_limits<double>::max();
  for (const Waiter* w : c.waiters) {
    auto it = c.vtime.find(w->session);
    if (it != c.vtime.end()) min = std::min(min, it->second);
  }
  return min == std::numeric_limits<double>::max() ? 0 : min;
}

void ChipScheduler::Acquire(int chip, uint64_t session) {
  absl::MutexLock lock(&mu_);
  Chip& c = chips_[chip];
  if (!c.busy && c.waiters.empty()) {
    c.busy = true;
    return;
  }
  // Returning from idle: no credit for the time away.
  auto [it, inserted] = c.vtime.emplace(session, 0.0);
  bool others_waiting = false;
  for (const Waiter* w : c.waiters) others_waiting |= w->session != session;
  if (others_waiting) it->second = std::max(it->second, MinVtimeLocked(c));
  (void)inserted;
  Waiter me{session};
  c.waiters.push_back(&me);
  mu_.Await(absl::Condition(
      +[](Waiter* w) { return w->granted; }, &me));
}

void ChipScheduler::Release(int chip, uint64_t session, uint64_t busy_ns) {
  absl::MutexLock lock(&mu_);
  Chip& c = chips_[chip];
  c.vtime[session] += static_cast<double>(busy_ns);
  c.busy_ns += busy_ns;
  c.ops += 1;
  const uint64_t now = tpu::MonotonicNanos();
  RollWindowLocked(c, now);
  c.window_busy_ns += busy_ns;
  if (c.waiters.empty()) {
    c.busy = false;
    return;
  }
  // Least served first; among equals, the longest waiting (FIFO order).
  size_t best = 0;
  double best_v = std::numeric_limits<double>::max();
  for (size_t i = 0; i < c.waiters.size(); ++i) {
    double v = c.vtime[c.waiters[i]->session];
    if (v < best_v) {
      best_v = v;
      best = i;
    }
  }
  Waiter* next = c.waiters[best];
  c.waiters.erase(c.waiters.begin() + best);
  next->granted = true;  // the chip passes straight to it; busy stays true
}

void ChipScheduler::RollWindowLocked(Chip& c, uint64_t now) {
  if (now - c.window_start_ns >= kWindowNs) {
    const uint64_t span = now - c.window_start_ns;
    c.last_duty = std::min(1.0, static_cast<double>(c.window_busy_ns) / span);
    c.window_start_ns = now;
    c.window_busy_ns = 0;
  }
}

void ChipScheduler::ForgetSession(uint64_t session) {
  absl::MutexLock lock(&mu_);
  for (Chip& c : chips_) c.vtime.erase(session);
}

ChipUsage ChipScheduler::Usage(int chip) {
  absl::MutexLock lock(&mu_);
  Chip& c = chips_[chip];
  const uint64_t now = tpu::MonotonicNanos();
  RollWindowLocked(c, now);
  return {c.busy_ns, c.ops, c.last_duty};
}

}  // namespace tpud
