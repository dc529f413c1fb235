// What serves clients once the executors exist: the data plane, the gRPC
// runtime and admin services behind tpud's two sockets, and the metrics
// endpoint.
#ifndef TPUD_DAEMON_SERVICE_SERVERS_H_
#define TPUD_DAEMON_SERVICE_SERVERS_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/core/connection_table.h"
#include "daemon/core/runtime_core.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/metrics/http_endpoint.h"
#include "daemon/metrics/rpc_status_counts.h"
#include "daemon/metrics/tpud_metrics.h"
#include "daemon/service/backend_choice.h"
#include "daemon/service/config.h"
#include "daemon/service/executors.h"
#include "daemon/service/grpc_services.h"
#include "daemon/service/socket_server.h"

namespace tpud {

class Servers {
 public:
  // Starts, in this order: the data plane and the hooks that tie sessions
  // to it, the executors (their handlers reach the data plane and the
  // sockets), the gRPC services, the metrics endpoint, and last the
  // sockets, so that once tpud answers, everything behind it does.
  // REQUIRES: SIGTERM and SIGINT blocked (threads started here inherit the
  // mask); `core` and `executors` outlive the result.
  static absl::StatusOr<std::unique_ptr<Servers>> Start(
      const TpudConfig& config, const ChosenBackend& backend, RuntimeCore* core,
      ExecutorProcesses* executors);

  // Stops taking work (metrics, sockets, data plane), then the executors,
  // then the gRPC services (giving RPCs in flight two seconds).
  void Stop();

 private:
  Servers(RuntimeCore* core, ExecutorProcesses* executors)
      : core_(core),
        pool_(executors->pool()),
        communicators_(executors->communicators()) {}

  absl::Status StartDataPlaneAndExecutors(const TpudConfig& config,
                                          const ChosenBackend& backend,
                                          ExecutorShared* shared);
  absl::Status StartGrpcServices(const ChosenBackend& backend);
  absl::Status StartMetrics(const MetricsAddress& address);
  absl::Status StartSockets(const TpudConfig& config, gid_t group);

  RuntimeCore* const core_;
  ExecutorPool* const pool_;
  CommunicatorRegistry* const communicators_;

  // Destroyed in reverse order of declaration, which is the order of
  // starting.
  std::unique_ptr<DataPlane> data_plane_;
  ConnectionTable connections_;
  std::unique_ptr<SocketServer> sockets_;  // null until StartSockets
  std::unique_ptr<RuntimeServiceImpl> runtime_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  RpcStatusCounts rpc_statuses_;  // every RPC's status, for tpud_errors_total
  std::unique_ptr<grpc::Server> runtime_server_;
  std::unique_ptr<grpc::Server> admin_server_;
  std::unique_ptr<TpudCollector> metrics_;
  std::unique_ptr<HttpEndpoint> metrics_endpoint_;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_SERVICE_SERVERS_H_
