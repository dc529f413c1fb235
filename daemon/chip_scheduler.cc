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
  if (!c.busy) {
    const bool reserved_elsewhere = c.reserved_for != 0 && c.reserved_for != session &&
                                    tpu::MonotonicNanos() < c.reserved_until;
    if (c.reserved_for == session || (!reserved_elsewhere && c.waiters.empty())) {
      c.busy = true;
      c.holder = session;
      c.reserved_for = 0;
      return;
    }
  }
  // Returning from idle: no credit for the time away. The floor is the
  // least served of those competing now (waiters and the holder).
  double floor = MinVtimeLocked(c);
  const uint64_t competitor = c.busy ? c.holder : c.reserved_for;
  if (competitor != 0 && competitor != session) {
    const double cv = c.vtime[competitor];
    floor = c.waiters.empty() ? cv : std::min(floor, cv);
  }
  double& v = c.vtime[session];
  v = std::max(v, floor);
  Waiter me{session};
  c.waiters.push_back(&me);
  while (!me.granted) {
    // A reservation whose session did not come back lapses.
    if (!c.busy && c.reserved_for != 0 && tpu::MonotonicNanos() >= c.reserved_until) {
      c.reserved_for = 0;
      GrantNextLocked(c);
      continue;
    }
    mu_.AwaitWithTimeout(absl::Condition(&me.granted), absl::Microseconds(200));
  }
}

void ChipScheduler::GrantNextLocked(Chip& c) {
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
  c.busy = true;
  c.holder = next->session;
  next->granted = true;
}

void ChipScheduler::Release(int chip, uint64_t session, uint64_t busy_ns, bool more_work,
                            uint64_t now_ns) {
  absl::MutexLock lock(&mu_);
  Chip& c = chips_[chip];
  double& v = c.vtime[session];
  v += static_cast<double>(busy_ns);
  c.busy_ns += busy_ns;
  c.ops += 1;
  const uint64_t now = now_ns != 0 ? now_ns : tpu::MonotonicNanos();
  c.last_seen[session] = now;
  RollWindowLocked(c, now);
  c.window_busy_ns += busy_ns;
  // The least served among those competing: the waiters, this session if it
  // has more work, and sessions that ran a moment ago (their next op is
  // likely being decoded right now).
  uint64_t best = 0;
  double best_v = std::numeric_limits<double>::max();
  bool best_waits = false;
  for (const Waiter* w : c.waiters) {
    const double wv = c.vtime[w->session];
    if (wv < best_v) {
      best_v = wv;
      best = w->session;
      best_waits = true;
    }
  }
  if (more_work && v <= best_v) {
    best_v = v;
    best = session;
    best_waits = false;
  }
  for (const auto& [other, seen] : c.last_seen) {
    if (other == session || now - seen > kActiveNs) continue;
    const double ov = c.vtime[other];
    if (ov < best_v) {
      best_v = ov;
      best = other;
      best_waits = false;
    }
  }
  if (best == 0 || best_waits) {
    GrantNextLocked(c);
    return;
  }
  c.busy = false;
  c.reserved_for = best;
  c.reserved_until = now + kReservationNs;
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
  for (Chip& c : chips_) {
    c.vtime.erase(session);
    c.last_seen.erase(session);
  }
}

ChipUsage ChipScheduler::Usage(int chip) {
  absl::MutexLock lock(&mu_);
  Chip& c = chips_[chip];
  const uint64_t now = tpu::MonotonicNanos();
  RollWindowLocked(c, now);
  return {c.busy_ns, c.ops, c.last_duty};
}

}  // namespace tpud
