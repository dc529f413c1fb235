#include "plugins/k8s_device_plugin/tpud_admin.h"

#include "absl/time/time.h"

namespace tpud::k8s {

template <typename T, typename F>
absl::StatusOr<T> TpudAdmin::Call(F call) {
  absl::MutexLock lock(&mu_);
  absl::Status last;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (client_ == nullptr) {
      absl::StatusOr<std::unique_ptr<tpu::AdminClient>> c =
          tpu::AdminClient::Connect(admin_socket_, absl::Seconds(10));
      if (!c.ok()) return c.status();
      client_ = *std::move(c);
    }
    absl::StatusOr<T> r = call(*client_);
    if (r.ok() || r.status().code() != absl::StatusCode::kUnavailable) return r;
    last = r.status();
    client_.reset();
  }
  return last;
}

absl::StatusOr<tpu::DaemonStatus> TpudAdmin::GetStatus() {
  return Call<tpu::DaemonStatus>(
      [](tpu::AdminClient& c) { return c.GetStatus(); });
}

absl::StatusOr<tpu::HealthReport> TpudAdmin::Health() {
  return Call<tpu::HealthReport>(
      [](tpu::AdminClient& c) { return c.Health(); });
}

absl::StatusOr<tpu::CreatedAllocation> TpudAdmin::CreateAllocation(
    const std::vector<int>& chips, const std::vector<uint64_t>& quota_bytes,
    const std::string& name) {
  return Call<tpu::CreatedAllocation>([&](tpu::AdminClient& c) {
    return c.CreateAllocation(chips, quota_bytes, name);
  });
}

namespace {

// A call that returns only a status, in the form Call takes.
template <typename F>
auto StatusOnly(F call) {
  return [call](tpu::AdminClient& c) -> absl::StatusOr<bool> {
    absl::Status st = call(c);
    if (!st.ok()) return st;
    return true;
  };
}

}  // namespace

absl::Status TpudAdmin::ReleaseAllocation(const std::string& token) {
  return Call<bool>(StatusOnly([&](tpu::AdminClient& c) {
           return c.ReleaseAllocation(token);
         }))
      .status();
}

absl::Status TpudAdmin::ReleaseAllocationById(uint64_t id) {
  return Call<bool>(StatusOnly([&](tpu::AdminClient& c) {
           return c.ReleaseAllocationById(id);
         }))
      .status();
}

absl::StatusOr<std::vector<tpu::AllocationInfo>> TpudAdmin::ListAllocations() {
  return Call<std::vector<tpu::AllocationInfo>>(
      [](tpu::AdminClient& c) { return c.ListAllocations(); });
}

}  // namespace tpud::k8s
