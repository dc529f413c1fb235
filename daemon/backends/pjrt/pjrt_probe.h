// Learns what a PJRT plugin offers (its API version, platform and devices)
// without loading it into tpud itself: a child process loads it, reports,
// and exits. Only the executor that drives the devices keeps the plugin
// loaded (libtpu allows one process per host), and a plugin that hangs or
// crashes while starting costs tpud nothing but a clear error.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_PJRT_PROBE_H_
#define TPUD_DAEMON_BACKENDS_PJRT_PJRT_PROBE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/backends/pjrt/pjrt_plugin.h"

namespace tpud::pjrt {

struct ProbeResult {
  std::string description;  // PjrtPlugin::Describe()
  int api_major = 0;
  int api_minor = 0;
  std::string platform;
  std::vector<DeviceInfo> devices;
};

// Fails with the plugin's own message, or DEADLINE_EXCEEDED when it does
// not come up within `timeout` (the child is killed).
absl::StatusOr<ProbeResult> ProbePlugin(
    const std::string& path, const std::vector<CreateOption>& options,
    absl::Duration timeout);

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_PJRT_PROBE_H_
