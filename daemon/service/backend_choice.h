// What runs the ops: the simulated chips, or the devices of a PJRT plugin.
//
// A PJRT plugin is probed in a child process first: its devices are the
// host's chips, and it is loaded for good only by the one executor that
// drives them all.
#ifndef TPUD_DAEMON_SERVICE_BACKEND_CHOICE_H_
#define TPUD_DAEMON_SERVICE_BACKEND_CHOICE_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/service/config.h"
#include "daemon/service/grpc_services.h"
#include "daemon/topology/topology.h"

namespace tpud {

struct ChosenBackend {
  // The configured topology; on PJRT without --hbm_bytes, with the HBM the
  // devices report.
  Topology topology;
  BackendStatus status;  // for clients and tpuctl status
  // PJRT: each segment is a PJRT buffer on its device (the arena its host
  // copy); tpud must tell the executor when memory is released.
  bool device_memory = false;
  // PJRT: one executor serves every chip (libtpu allows one process per
  // host); otherwise one executor per chip.
  bool one_executor = false;
  // Makes the chip backend, in the executor process after the fork; null
  // when it cannot (the reason is logged).
  std::function<std::unique_ptr<ChipBackend>()> make_backend;
};

// For PJRT, probes the plugin and checks its devices against the topology
// (a count that differs fails; coordinates that differ are logged), and
// refuses --pjrt_memory=host on a plugin whose devices are not the host's.
// Fails with the message tpud prints.
absl::StatusOr<ChosenBackend> ChooseBackend(const TpudConfig& config);

}  // namespace tpud

#endif  // TPUD_DAEMON_SERVICE_BACKEND_CHOICE_H_
