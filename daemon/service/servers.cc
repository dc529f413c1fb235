#include "daemon/service/servers.h"

#include <grp.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tpu/units.h"

namespace tpud {
namespace {

// Servers without listening ports: connections arrive through SocketServer.
std::unique_ptr<grpc::Server> BuildServer(grpc::Service* service,
                                          RpcStatusCounts* statuses) {
  constexpr int kMaxMessageBytes =
      4 << 20;  // control plane only, never bulk data
  grpc::ServerBuilder builder;
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      counters;
  counters.push_back(CountRpcStatuses(statuses));
  builder.experimental().SetInterceptorCreators(std::move(counters));
  return builder.BuildAndStart();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Servers>> Servers::Start(
    const TpudConfig& config, const ChosenBackend& backend, RuntimeCore* core,
    ExecutorProcesses* executors) {
  gid_t group = static_cast<gid_t>(-1);
  if (!config.socket_group.empty()) {
    struct group* g = getgrnam(config.socket_group.c_str());
    if (g == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--socket_group: no group named ", config.socket_group));
    }
    group = g->gr_gid;
  }
  std::unique_ptr<Servers> s(new Servers(core, executors));
  if (absl::Status st =
          s->StartDataPlaneAndExecutors(config, backend, executors->shared());
      !st.ok()) {
    return st;
  }
  if (absl::Status st = s->StartGrpcServices(backend); !st.ok()) return st;
  // Metrics before the sockets: once tpud answers, so does its endpoint.
  if (config.metrics_address.has_value()) {
    if (absl::Status st = s->StartMetrics(*config.metrics_address); !st.ok())
      return st;
  }
  if (absl::Status st = s->StartSockets(config, group); !st.ok()) return st;
  return s;
}

absl::Status Servers::StartDataPlaneAndExecutors(const TpudConfig& config,
                                                 const ChosenBackend& backend,
                                                 ExecutorShared* shared) {
  DataPlaneOptions options;
  options.default_pinned_bytes = config.pinned_pool_bytes;
  options.max_pinned_bytes = config.max_pinned_pool_bytes;
  options.staging_bytes = config.staging_bytes;
  options.ring_bytes = config.ring_bytes;
  data_plane_ = std::make_unique<DataPlane>(core_, pool_, shared, options);
  core_->SetSessionEndHook([this](uint64_t id) {
    // Its peers' collectives fail naming it, before its memory goes.
    communicators_->OnSessionEnd(id);
    data_plane_->Detach(id);
  });
  ExecutorPool* pool = pool_;
  core_->SetMemoryFence([pool](uint32_t tag) { pool->Fence(tag); });
  // Tensors in device buffers are one segment each: carving several into one
  // buffer would turn whole-buffer results into partial writes.
  core_->SetSmallPoolBytes(backend.device_memory ? 0 : config.small_pool_bytes);
  if (backend.device_memory) {
    core_->SetReleaseHook([pool](uint64_t address, uint64_t bytes) {
      pool->Released(address, bytes);
    });
  }

  RuntimeCore* core = core_;
  pool_->SetHandlers(
      [core](uint64_t session, int chip,
             uint64_t bytes) -> absl::StatusOr<uint64_t> {
        absl::StatusOr<SegmentGrant> g =
            core->AllocateForResult(session, chip, bytes);
        if (!g.ok()) return g.status();
        return g->address;
      },
      [core](uint64_t session, uint64_t address) {
        core->FreeResult(session, address);
      },
      [this](uint64_t session, const std::string& message) {
        // Its client reads why first; then the session ends like a killed one.
        data_plane_->FailSession(session, absl::AbortedError(message));
        const ConnectionId conn = core_->ConnectionOf(session);
        ReclaimResult r =
            core_->EndSession(session, RuntimeCore::EndReason::kFailed);
        spdlog::warn("session {} ended: {} (reclaimed {})", session, message,
                     tpu::FormatBytes(r.bytes));
        if (sockets_ != nullptr && conn != 0) sockets_->Hangup(conn);
      });
  if (absl::Status st = pool_->Start(absl::Seconds(60)); !st.ok()) {
    return absl::Status(st.code(),
                        absl::StrCat("starting executors: ", st.message()));
  }
  data_plane_->Start();
  return absl::OkStatus();
}

absl::Status Servers::StartGrpcServices(const ChosenBackend& backend) {
  runtime_service_ = std::make_unique<RuntimeServiceImpl>(core_, &connections_,
                                                          data_plane_.get());
  admin_service_ = std::make_unique<AdminServiceImpl>(
      core_, &connections_, data_plane_.get(), pool_, [this](ConnectionId id) {
        if (sockets_ != nullptr) sockets_->Hangup(id);
      });
  runtime_service_->set_communicators(communicators_);
  admin_service_->set_communicators(communicators_);
  runtime_service_->set_backend(backend.status);
  admin_service_->set_backend(backend.status);

  runtime_server_ = BuildServer(runtime_service_.get(), &rpc_statuses_);
  admin_server_ = BuildServer(admin_service_.get(), &rpc_statuses_);
  if (runtime_server_ == nullptr || admin_server_ == nullptr) {
    return absl::InternalError("could not start the gRPC servers");
  }
  return absl::OkStatus();
}

absl::Status Servers::StartMetrics(const MetricsAddress& address) {
  metrics_ = std::make_unique<TpudCollector>([this] {
    MetricsInputs in;
    admin_service_->FillStatus(&in.status);
    in.executors = pool_->Executors();
    in.sessions = core_->session_counts();
    in.rpc_statuses = rpc_statuses_.Snapshot();
    in.start_unix_seconds =
        absl::ToDoubleSeconds(admin_service_->started() - absl::UnixEpoch());
    return in;
  });
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> endpoint = HttpEndpoint::Start(
      address, [m = metrics_.get()] { return m->Render(); });
  if (!endpoint.ok()) return endpoint.status();
  metrics_endpoint_ = *std::move(endpoint);
  spdlog::info("Prometheus metrics on {}", metrics_endpoint_->url());
  return absl::OkStatus();
}

absl::Status Servers::StartSockets(const TpudConfig& config, gid_t group) {
  RuntimeCore* core = core_;
  auto on_hangup = [core](const ConnectionInfo& conn) {
    absl::Time start = absl::Now();
    ReclaimResult r = conn.data_plane ? core->EndSession(conn.session_id)
                                      : core->EndConnection(conn.id);
    if (r.sessions > 0) {
      spdlog::info(
          "session of pid {} ended: connection closed; reclaimed {} in {} "
          "segments "
          "in {:.3f} ms",
          conn.peer.pid, tpu::FormatBytes(r.bytes), r.segments,
          absl::ToDoubleMilliseconds(absl::Now() - start));
    }
  };
  std::vector<ListenerSpec> listeners(2);
  listeners[0].path = config.socket_path;
  listeners[0].mode = 0660;
  listeners[0].group = group;
  listeners[0].server = runtime_server_.get();
  listeners[1].path = config.admin_socket_path;
  listeners[1].mode = 0600;
  listeners[1].server = admin_server_.get();
  listeners[1].admin = true;
  ConnectionLimits limits;
  limits.max_per_uid = config.max_connections_per_uid;
  limits.handshake_timeout = config.handshake_timeout;
  absl::StatusOr<std::unique_ptr<SocketServer>> created = SocketServer::Create(
      std::move(listeners), &connections_, on_hangup, limits);
  if (!created.ok()) return created.status();
  sockets_ = *std::move(created);
  DataPlane* data_plane = data_plane_.get();
  sockets_->SetDataPlaneHandler(
      [data_plane](uint64_t session_id, absl::string_view token,
                   const PeerIdentity& peer,
                   uint64_t pinned) -> absl::StatusOr<DataPlaneAttachment> {
        absl::StatusOr<DataPlaneGrant> g =
            data_plane->Attach(session_id, token, peer, pinned);
        if (!g.ok()) return g.status();
        return DataPlaneAttachment{g->memfd, g->shm_bytes, g->doorbells};
      });
  sockets_->Start();
  return absl::OkStatus();
}

void Servers::Stop() {
  metrics_endpoint_.reset();
  sockets_->Stop();
  data_plane_->StopAll();
  pool_->Stop();
  admin_service_->StopWatches();
  runtime_server_->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::seconds(2));
  admin_server_->Shutdown(std::chrono::system_clock::now() +
                          std::chrono::seconds(2));
}

}  // namespace tpud
