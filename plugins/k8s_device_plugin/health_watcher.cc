#include "plugins/k8s_device_plugin/health_watcher.h"

#include <spdlog/spdlog.h>

#include <string>

namespace tpud::k8s {

ChipHealthWatcher::ChipHealthWatcher(int num_chips, Poll poll,
                                     absl::Duration interval)
    : num_chips_(num_chips), poll_(std::move(poll)), interval_(interval) {
  current_.chips.assign(num_chips_, ChipState{});
}

ChipHealthWatcher::~ChipHealthWatcher() { Stop(); }

void ChipHealthWatcher::Start() {
  PollOnce();
  thread_ = std::thread([this] {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        const absl::Time next = absl::Now() + interval_;
        while (!stopping_ && !cv_.WaitWithDeadline(&mu_, next)) {
        }
        if (stopping_) return;
      }
      PollOnce();
    }
  });
}

void ChipHealthWatcher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

ChipHealthWatcher::Snapshot ChipHealthWatcher::Current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

ChipHealthWatcher::Snapshot ChipHealthWatcher::WaitForChange(
    uint64_t seen, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + timeout;
  while (current_.version == seen && !stopping_) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;  // timed out
  }
  return current_;
}

void ChipHealthWatcher::Notify() {
  absl::MutexLock lock(&mu_);
  ++current_.version;
  cv_.SignalAll();
}

void ChipHealthWatcher::PollOnce() {
  absl::StatusOr<std::vector<ChipState>> polled = poll_();
  std::vector<ChipState> chips;
  if (polled.ok()) {
    chips = *std::move(polled);
    // A chip tpud no longer reports is unhealthy.
    chips.resize(num_chips_, ChipState{false, false, "not reported by tpud"});
  } else {
    chips.assign(num_chips_, ChipState{false, false,
                                       std::string(polled.status().message())});
  }
  absl::MutexLock lock(&mu_);
  if (chips == current_.chips) return;
  for (int c = 0; c < num_chips_; ++c) {
    const ChipState& was = current_.chips[c];
    const ChipState& now = chips[c];
    if (was.healthy != now.healthy || was.drained != now.drained) {
      spdlog::warn("chip {}: {}{} ({})", c,
                   now.healthy ? "healthy" : "UNHEALTHY",
                   now.drained ? ", drained" : "", now.detail);
    }
  }
  current_.chips = std::move(chips);
  ++current_.version;
  cv_.SignalAll();
}

}  // namespace tpud::k8s
