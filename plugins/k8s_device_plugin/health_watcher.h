// Watches the chips' health: polls tpud (Admin.Health) every interval and
// keeps the latest states with a version that changes whenever any chip's
// state does, so each plugin server's ListAndWatch can wait for a change.
// When tpud cannot be reached every chip counts as unhealthy (pods must not
// land on a node whose daemon is gone).
//
// Thread-safety: thread-safe.
#ifndef TPUD_PLUGINS_K8S_DEVICE_PLUGIN_HEALTH_WATCHER_H_
#define TPUD_PLUGINS_K8S_DEVICE_PLUGIN_HEALTH_WATCHER_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "plugins/k8s_device_plugin/devices.h"

namespace tpud::k8s {

class ChipHealthWatcher {
 public:
  // Returns every chip's state, indexed by chip id.
  using Poll = std::function<absl::StatusOr<std::vector<ChipState>>()>;

  ChipHealthWatcher(int num_chips, Poll poll, absl::Duration interval);
  ~ChipHealthWatcher();  // stops polling

  // Polls once now, then every interval on a thread of its own.
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  struct Snapshot {
    uint64_t version = 0;
    std::vector<ChipState> chips;
  };
  Snapshot Current() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the version differs from `seen`, or `timeout` passed;
  // returns the states then.
  Snapshot WaitForChange(uint64_t seen, absl::Duration timeout) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Polls once (for the loop and for tests).
  void PollOnce() ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes every WaitForChange (a new version, the same states): something
  // else the device lists depend on changed (ChipClaims).
  void Notify() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int num_chips_;
  const Poll poll_;
  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  mutable absl::CondVar cv_;  // signalled on every change and on Stop
  Snapshot current_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tpud::k8s

#endif  // TPUD_PLUGINS_K8S_DEVICE_PLUGIN_HEALTH_WATCHER_H_
