// Which chips of the node each resource holds, so that a chip given whole
// (tpud.io/chip) is never given as shares (tpud.io/chip-share) and the other
// way round, on one node, without separate node pools.
//
// A chip is held by a resource when one of the plugin's live allocations of
// that resource is on it (a claim, made before tpud is asked and dropped when
// the allocation ends) or when the kubelet says a live pod holds one of that
// resource's devices on it (the kubelet's pod-resources API: it knows what
// pods hold even after this plugin restarted). The plugin servers refuse an
// allocation on a chip another resource holds, and advertise such devices as
// Unhealthy so that the kubelet places pods elsewhere.
//
// Thread-safety: thread-safe; `on_change` is called without the lock held.
#ifndef TPUD_PLUGINS_K8S_DEVICE_PLUGIN_CHIP_CLAIMS_H_
#define TPUD_PLUGINS_K8S_DEVICE_PLUGIN_CHIP_CLAIMS_H_

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tpud::k8s {

class ChipClaims {
 public:
  // `on_change` runs after every change of what is held (the plugin wakes
  // its ListAndWatch streams with it).
  ChipClaims(int num_chips, std::function<void()> on_change);

  // Claims `chips` for `resource` under `key` (unique among live
  // allocations: the allocation's name). FAILED_PRECONDITION, naming the
  // chips and the resource that holds them, when another resource holds any
  // of them; nothing changes then. Claiming a key again replaces its chips.
  absl::Status Claim(const std::string& key, const std::string& resource,
                     const std::vector<int>& chips) ABSL_LOCKS_EXCLUDED(mu_);
  void Drop(const std::string& key) ABSL_LOCKS_EXCLUDED(mu_);

  // The kubelet's view: per resource, the chips live pods hold devices on.
  void SetKubeletView(std::map<std::string, std::set<int>> view)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Per chip, whether a resource other than `resource` holds it.
  std::vector<bool> HeldByOthers(const std::string& resource) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Claimed {
    std::string resource;
    std::vector<int> chips;
  };
  // The resource other than `resource` that holds `chip`, or "".
  std::string OtherHolderLocked(const std::string& resource, int chip) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int num_chips_;
  const std::function<void()> on_change_;
  mutable absl::Mutex mu_;
  std::map<std::string, Claimed> claims_ ABSL_GUARDED_BY(mu_);  // by key
  std::map<std::string, std::set<int>> kubelet_view_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tpud::k8s

#endif  // TPUD_PLUGINS_K8S_DEVICE_PLUGIN_CHIP_CLAIMS_H_
