// What tpud exports to Prometheus (--metrics_address), built at scrape time
// from the same figures `tpuctl status` shows. Names follow Prometheus's
// conventions: base units (bytes, seconds), `_total` for counters, and
// labels with bounded values (chips, links, executors, status codes; a
// session's series exist while it is open). docs/metrics.md lists them.
#ifndef TPUD_DAEMON_METRICS_TPUD_METRICS_H_
#define TPUD_DAEMON_METRICS_TPUD_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/runtime_core.h"
#include "daemon/executor/executor_pool.h"
#include "daemon/metrics/rpc_status_counts.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "proto/tpud.pb.h"

namespace tpud {

// Everything one scrape reports.
struct MetricsInputs {
  v1::GetStatusResponse status;  // as AdminService::GetStatus fills it
  std::vector<ExecutorInfo>
      executors;  // latency histograms, queue depth, op errors
  RuntimeCore::SessionCounts sessions;
  std::array<uint64_t, RpcStatusCounts::kCodes> rpc_statuses{};
  std::map<uint64_t, std::string>
      pod_uids;  // session id -> Kubernetes pod UID, when known
  double start_unix_seconds = 0;
};

std::vector<prometheus::MetricFamily> BuildMetricFamilies(
    const MetricsInputs& in);

// The UID of the Kubernetes pod a process runs in, from its /proc/PID/cgroup
// text (cgroupfs "…/pod<uid>/…" or systemd
// "…-pod<uid_with_underscores>.slice"), or "" when it is in none.
std::string PodUidFromCgroup(absl::string_view cgroup_text);

// A prometheus::Collectable over `gather`, which runs on every scrape.
// Pod UIDs are looked up once per session (by pid) and cached.
class TpudCollector : public prometheus::Collectable {
 public:
  explicit TpudCollector(std::function<MetricsInputs()> gather)
      : gather_(std::move(gather)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;
  // The text exposition (format 0.0.4) of one scrape.
  std::string Render() const;

 private:
  std::function<MetricsInputs()> gather_;
  mutable absl::Mutex mu_;
  mutable std::map<uint64_t, std::string> pods_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tpud

#endif  // TPUD_DAEMON_METRICS_TPUD_METRICS_H_
