// The gRPC face of tpud: Runtime and Admin services.
//
// Transport only: each handler finds the connection the call arrived on,
// unpacks the request, calls RuntimeCore and converts absl::Status to
// grpc::Status. No rules live here.
#ifndef TPUD_DAEMON_SERVICE_GRPC_SERVICES_H_
#define TPUD_DAEMON_SERVICE_GRPC_SERVICES_H_

#include <functional>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/collectives/registry.h"
#include "daemon/core/connection_table.h"
#include "daemon/core/runtime_core.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/executor/executor_pool.h"
#include "proto/tpud.grpc.pb.h"

namespace tpud {

// What runs the ops, for clients and tpuctl status.
struct BackendStatus {
  std::string kind;
  std::string description;
  std::string plugin_path;
  std::string pjrt_api_version;
  std::string platform;
  std::vector<std::string> device_kinds;
  std::vector<std::string> lowered_ops;  // pjrt: the ATen ops lowered whole
  bool fuses = false;  // runs of ops compile as one program (Topology.fuses)
};

class RuntimeServiceImpl final : public v1::Runtime::Service {
 public:
  RuntimeServiceImpl(RuntimeCore* core, const ConnectionTable* connections,
                     DataPlane* data_plane)
      : core_(core), connections_(connections), data_plane_(data_plane) {}

  grpc::Status GetTopology(grpc::ServerContext* ctx,
                           const v1::GetTopologyRequest* req,
                           v1::GetTopologyResponse* resp) override;
  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           const v1::OpenSessionRequest* req,
                           v1::OpenSessionResponse* resp) override;
  grpc::Status CloseSession(grpc::ServerContext* ctx,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse* resp) override;
  grpc::Status AllocateSegment(grpc::ServerContext* ctx,
                               const v1::AllocateSegmentRequest* req,
                               v1::AllocateSegmentResponse* resp) override;
  grpc::Status FreeSegment(grpc::ServerContext* ctx,
                           const v1::FreeSegmentRequest* req,
                           v1::FreeSegmentResponse* resp) override;
  grpc::Status GetMemoryStats(grpc::ServerContext* ctx,
                              const v1::GetMemoryStatsRequest* req,
                              v1::GetMemoryStatsResponse* resp) override;
  grpc::Status GetPrograms(grpc::ServerContext* ctx,
                           const v1::GetProgramsRequest* req,
                           v1::GetProgramsResponse* resp) override;
  grpc::Status JoinCommunicator(grpc::ServerContext* ctx,
                                const v1::JoinCommunicatorRequest* req,
                                v1::JoinCommunicatorResponse* resp) override;
  grpc::Status LeaveCommunicator(grpc::ServerContext* ctx,
                                 const v1::LeaveCommunicatorRequest* req,
                                 v1::LeaveCommunicatorResponse* resp) override;

  void set_communicators(CommunicatorRegistry* comms) { comms_ = comms; }
  void set_backend(BackendStatus backend) { backend_ = std::move(backend); }

 private:
  RuntimeCore* core_;
  const ConnectionTable* connections_;
  DataPlane* data_plane_;
  CommunicatorRegistry* comms_ = nullptr;
  BackendStatus backend_;
};

class AdminServiceImpl final : public v1::Admin::Service {
 public:
  // `hangup` closes a connection whose session an administrator killed.
  AdminServiceImpl(RuntimeCore* core, const ConnectionTable* connections,
                   DataPlane* data_plane, const ExecutorPool* pool,
                   std::function<void(ConnectionId)> hangup)
      : core_(core),
        connections_(connections),
        data_plane_(data_plane),
        pool_(pool),
        hangup_(std::move(hangup)),
        started_(absl::Now()) {}

  void set_backend(BackendStatus backend) { backend_ = std::move(backend); }

  grpc::Status GetStatus(grpc::ServerContext* ctx,
                         const v1::GetStatusRequest* req,
                         v1::GetStatusResponse* resp) override;
  grpc::Status ListSessions(grpc::ServerContext* ctx,
                            const v1::ListSessionsRequest* req,
                            v1::ListSessionsResponse* resp) override;
  grpc::Status KillSession(grpc::ServerContext* ctx,
                           const v1::KillSessionRequest* req,
                           v1::KillSessionResponse* resp) override;
  grpc::Status SetQuota(grpc::ServerContext* ctx,
                        const v1::SetQuotaRequest* req,
                        v1::SetQuotaResponse* resp) override;
  grpc::Status DrainChip(grpc::ServerContext* ctx,
                         const v1::DrainChipRequest* req,
                         v1::DrainChipResponse* resp) override;
  grpc::Status UndrainChip(grpc::ServerContext* ctx,
                           const v1::UndrainChipRequest* req,
                           v1::UndrainChipResponse* resp) override;
  grpc::Status Health(grpc::ServerContext* ctx, const v1::HealthRequest* req,
                      v1::HealthResponse* resp) override;
  grpc::Status CreateAllocation(grpc::ServerContext* ctx,
                                const v1::CreateAllocationRequest* req,
                                v1::CreateAllocationResponse* resp) override;
  grpc::Status ReleaseAllocation(grpc::ServerContext* ctx,
                                 const v1::ReleaseAllocationRequest* req,
                                 v1::ReleaseAllocationResponse* resp) override;
  grpc::Status ListAllocations(grpc::ServerContext* ctx,
                               const v1::ListAllocationsRequest* req,
                               v1::ListAllocationsResponse* resp) override;
  grpc::Status Watch(
      grpc::ServerContext* ctx, const v1::WatchRequest* req,
      grpc::ServerWriter<v1::GetStatusResponse>* writer) override;
  // Ends every Watch stream now (tpud is stopping).
  void StopWatches() { stopping_.Notify(); }
  // What GetStatus answers (also read by the metrics endpoint).
  void FillStatus(v1::GetStatusResponse* resp);
  absl::Time started() const { return started_; }

 private:
  grpc::Status CheckAdmin(grpc::ServerContext* ctx) const;
  BackendStatus backend_;
  absl::Notification stopping_;

 public:
  void set_communicators(const CommunicatorRegistry* comms) { comms_ = comms; }

 private:
  const CommunicatorRegistry* comms_ = nullptr;

  RuntimeCore* core_;
  const ConnectionTable* connections_;
  DataPlane* data_plane_;
  const ExecutorPool* pool_;  // may be null (no executor figures)
  std::function<void(ConnectionId)> hangup_;
  absl::Time started_;
};

// Fills a TopologyInfo with the topology, the backend and the chips'
// current state (`data_plane` may be null: no activity figures; `comms`
// null: no link counters).
void FillTopology(const RuntimeCore& core, DataPlane* data_plane,
                  const CommunicatorRegistry* comms,
                  const BackendStatus& backend, v1::TopologyInfo* out);

}  // namespace tpud

#endif  // TPUD_DAEMON_SERVICE_GRPC_SERVICES_H_
