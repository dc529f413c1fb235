// The device plugin's line to tpud's admin socket: one AdminClient, made
// again after tpud restarted (a dropped connection fails every later call).
//
// Thread-safety: thread-safe; calls are serialised.
#ifndef TPUD_PLUGINS_K8S_DEVICE_PLUGIN_TPUD_ADMIN_H_
#define TPUD_PLUGINS_K8S_DEVICE_PLUGIN_TPUD_ADMIN_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tpu/client.h"

namespace tpud::k8s {

class TpudAdmin {
 public:
  explicit TpudAdmin(std::string admin_socket)
      : admin_socket_(std::move(admin_socket)) {}

  const std::string& admin_socket() const { return admin_socket_; }

  absl::StatusOr<tpu::DaemonStatus> GetStatus() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<tpu::HealthReport> Health() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<tpu::CreatedAllocation> CreateAllocation(
      const std::vector<int>& chips, const std::vector<uint64_t>& quota_bytes,
      const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReleaseAllocation(const std::string& token)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReleaseAllocationById(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<tpu::AllocationInfo>> ListAllocations()
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Runs `call` on a connected client; connects first if needed, and once
  // more after UNAVAILABLE (tpud restarted since the last call).
  template <typename T, typename F>
  absl::StatusOr<T> Call(F call) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string admin_socket_;
  absl::Mutex mu_;
  std::unique_ptr<tpu::AdminClient> client_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tpud::k8s

#endif  // TPUD_PLUGINS_K8S_DEVICE_PLUGIN_TPUD_ADMIN_H_
