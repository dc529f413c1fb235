// tpud: the per-host TPU runtime daemon.
//
// With no flags it serves a simulated v6e-4 host on the default sockets.
#include <grp.h>
#include <signal.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/chip_backend.h"
#include "daemon/connection_table.h"
#include "daemon/data_plane.h"
#include "daemon/grpc_services.h"
#include "daemon/runtime_core.h"
#include "daemon/simulated_chip.h"
#include "daemon/socket_server.h"
#include "daemon/topology.h"
#include "proto/protocol.h"
#include "tpu/paths.h"
#include "tpu/units.h"

ABSL_FLAG(std::string, topology, "v6e-4",
          "host preset to serve: v5e-1, v5e-4, v5e-8, v5p-4, v6e-1, v6e-4, v6e-8, v7x-4");
ABSL_FLAG(std::string, socket, "",
          "runtime socket (default $TPUD_SOCKET, /run/tpud/tpud.sock as root, else "
          "$XDG_RUNTIME_DIR/tpud/tpud.sock)");
ABSL_FLAG(std::string, admin_socket, "",
          "admin socket (default $TPUD_ADMIN_SOCKET, or admin.sock beside the runtime "
          "socket's default)");
ABSL_FLAG(std::string, socket_group, "",
          "group that owns the runtime socket (mode 0660); empty keeps the daemon's");
ABSL_FLAG(std::string, hbm_bytes, "0",
          "HBM per chip, e.g. 256MiB; 0 uses the generation's real capacity");
ABSL_FLAG(std::string, session_quota_bytes, "0",
          "default per-chip HBM quota of every session, e.g. 8GiB; 0 means none");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn or error");
ABSL_FLAG(int, intra_op_threads, 0,
          "threads each op may use on the simulated chips (process-wide); 0 = ATen's default");
ABSL_FLAG(std::string, pinned_pool_bytes, "256MiB",
          "default size of a session's pinned host pool (shared memory)");
ABSL_FLAG(std::string, max_pinned_pool_bytes, "4GiB",
          "largest pinned host pool a session may ask for");
ABSL_FLAG(std::string, staging_bytes, "64MiB",
          "per-session staging area for pageable host<->device copies");
ABSL_FLAG(std::string, ring_bytes, "1MiB", "per-stream op ring size (a power of two)");

namespace tpud {
namespace {

int Fail(const std::string& message) {
  spdlog::critical("{}", message);
  sd_notifyf(0, "STATUS=failed: %s", message.c_str());
  return 1;
}

int Run() {
  const std::string level = absl::GetFlag(FLAGS_log_level);
  spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return Fail(absl::StrCat("unknown --log_level=", level));
  }
  spdlog::set_level(lvl);

  absl::StatusOr<uint64_t> hbm = tpu::ParseBytes(absl::GetFlag(FLAGS_hbm_bytes));
  if (!hbm.ok()) return Fail(absl::StrCat("--hbm_bytes: ", hbm.status().message()));
  absl::StatusOr<uint64_t> quota =
      tpu::ParseBytes(absl::GetFlag(FLAGS_session_quota_bytes));
  if (!quota.ok()) {
    return Fail(absl::StrCat("--session_quota_bytes: ", quota.status().message()));
  }
  absl::StatusOr<Topology> topology =
      Topology::FromPreset(absl::GetFlag(FLAGS_topology), *hbm);
  if (!topology.ok()) return Fail(std::string(topology.status().message()));

  DataPlaneOptions dp_options;
  for (auto [flag, target] : {std::pair{absl::GetFlag(FLAGS_pinned_pool_bytes),
                                        &dp_options.default_pinned_bytes},
                              std::pair{absl::GetFlag(FLAGS_max_pinned_pool_bytes),
                                        &dp_options.max_pinned_bytes},
                              std::pair{absl::GetFlag(FLAGS_staging_bytes),
                                        &dp_options.staging_bytes},
                              std::pair{absl::GetFlag(FLAGS_ring_bytes),
                                        &dp_options.ring_bytes}}) {
    absl::StatusOr<uint64_t> v = tpu::ParseBytes(flag);
    if (!v.ok()) return Fail(std::string(v.status().message()));
    *target = *v;
  }
  if ((dp_options.ring_bytes & (dp_options.ring_bytes - 1)) != 0 ||
      dp_options.ring_bytes < 4096) {
    return Fail("--ring_bytes must be a power of two of at least 4KiB");
  }

  RuntimeCore::Options options;
  options.default_quota_bytes_per_chip = *quota;
  absl::StatusOr<std::unique_ptr<RuntimeCore>> core =
      RuntimeCore::Create(*std::move(topology), options);
  if (!core.ok()) return Fail(std::string(core.status().message()));

  std::string socket_path = absl::GetFlag(FLAGS_socket);
  if (socket_path.empty()) socket_path = tpu::RuntimeSocketPath();
  std::string admin_path = absl::GetFlag(FLAGS_admin_socket);
  if (admin_path.empty()) admin_path = tpu::AdminSocketPath();
  gid_t group = static_cast<gid_t>(-1);
  if (const std::string name = absl::GetFlag(FLAGS_socket_group); !name.empty()) {
    struct group* g = getgrnam(name.c_str());
    if (g == nullptr) return Fail(absl::StrCat("--socket_group: no group named ", name));
    group = g->gr_gid;
  }

  // Signals are taken synchronously by the main thread; every other thread
  // (gRPC's included) inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::unique_ptr<ChipBackend> backend =
      SimulatedChip::Create(absl::GetFlag(FLAGS_intra_op_threads));
  DataPlane data_plane(core->get(), backend.get(), dp_options);
  (*core)->SetSessionEndHook([&data_plane](uint64_t id) { data_plane.Detach(id); });

  ConnectionTable connections;
  std::unique_ptr<SocketServer> sockets;
  RuntimeServiceImpl runtime_service(core->get(), &connections, &data_plane);
  AdminServiceImpl admin_service(core->get(), &connections, &data_plane,
                                 [&sockets](ConnectionId id) {
    if (sockets != nullptr) sockets->Hangup(id);
  });

  // Servers without listening ports: connections arrive through SocketServer.
  constexpr int kMaxMessageBytes = 4 << 20;  // control plane only, never bulk data
  grpc::ServerBuilder runtime_builder;
  runtime_builder.RegisterService(&runtime_service);
  runtime_builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  std::unique_ptr<grpc::Server> runtime_server = runtime_builder.BuildAndStart();
  grpc::ServerBuilder admin_builder;
  admin_builder.RegisterService(&admin_service);
  admin_builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  std::unique_ptr<grpc::Server> admin_server = admin_builder.BuildAndStart();
  if (runtime_server == nullptr || admin_server == nullptr) {
    return Fail("could not start the gRPC servers");
  }

  RuntimeCore* core_ptr = core->get();
  auto on_hangup = [core_ptr](const ConnectionInfo& conn) {
    absl::Time start = absl::Now();
    ReclaimResult r = conn.data_plane ? core_ptr->EndSession(conn.session_id)
                                      : core_ptr->EndConnection(conn.id);
    if (r.sessions > 0) {
      spdlog::info(
          "session of pid {} ended: connection closed; reclaimed {} in {} segments "
          "in {:.3f} ms",
          conn.peer.pid, tpu::FormatBytes(r.bytes), r.segments,
          absl::ToDoubleMilliseconds(absl::Now() - start));
    }
  };
  std::vector<ListenerSpec> listeners(2);
  listeners[0].path = socket_path;
  listeners[0].mode = 0660;
  listeners[0].group = group;
  listeners[0].server = runtime_server.get();
  listeners[1].path = admin_path;
  listeners[1].mode = 0600;
  listeners[1].server = admin_server.get();
  listeners[1].admin = true;
  absl::StatusOr<std::unique_ptr<SocketServer>> created =
      SocketServer::Create(std::move(listeners), &connections, on_hangup);
  if (!created.ok()) return Fail(std::string(created.status().message()));
  sockets = *std::move(created);
  sockets->SetDataPlaneHandler([&data_plane](uint64_t session_id, absl::string_view token,
                                             const PeerIdentity& peer, uint64_t pinned) {
    return data_plane.Attach(session_id, token, peer, pinned);
  });
  sockets->Start();

  const Topology& t = core_ptr->topology();
  spdlog::info("tpud {} serving a simulated {} host ({} chips, {} HBM each) on {} (admin {})",
               kDaemonVersion, t.name(), t.num_chips(),
               tpu::FormatBytes(t.hbm_bytes_per_chip()), socket_path, admin_path);
  sd_notifyf(0, "READY=1\nSTATUS=serving %s on %s\nMAINPID=%d", t.name().c_str(),
             socket_path.c_str(), static_cast<int>(getpid()));

  int sig = 0;
  while (sigwait(&signals, &sig) != 0) {
  }
  spdlog::info("received {}, shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  sd_notify(0, "STOPPING=1");
  sockets->Stop();
  data_plane.StopAll();
  runtime_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  admin_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  spdlog::info("tpud stopped; sockets removed");
  return 0;
}

}  // namespace
}  // namespace tpud

int main(int argc, char** argv) {
  // Lock-order cycle detection walks a graph on every lock: too dear for a
  // per-op path. Lock order is documented and tested instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "tpud: per-host TPU runtime daemon.\n  tpud [--topology=v6e-4] [--socket=PATH] "
      "[--admin_socket=PATH] [--hbm_bytes=SIZE] [--session_quota_bytes=SIZE]");
  absl::ParseCommandLine(argc, argv);
  auto logger = spdlog::stderr_color_mt("tpud");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ [tpud] %v");
  return tpud::Run();
}
