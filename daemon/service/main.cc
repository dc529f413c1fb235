// tpud: the per-host TPU runtime daemon.
//
// With no flags it serves a simulated v6e-4 host on the default sockets.
#include <grp.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>
#include <memory>
#include <optional>
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
#include "absl/time/time.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/core/connection_table.h"
#include "daemon/collectives/communicators.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/executor/executor_main.h"
#include "daemon/executor/executor_pool.h"
#include "daemon/core/shared_regions.h"
#include "daemon/service/grpc_services.h"
#include "daemon/metrics/http_endpoint.h"
#include "daemon/metrics/rpc_status_counts.h"
#include "daemon/metrics/tpud_metrics.h"
#include "daemon/backends/pjrt/pjrt_chip.h"
#include "daemon/backends/pjrt/pjrt_probe.h"
#include "daemon/core/runtime_core.h"
#include "daemon/backends/simulated/simulated_chip.h"
#include "daemon/service/socket_server.h"
#include "daemon/topology/topology.h"
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
ABSL_FLAG(std::string, ring_bytes, "1MiB",
          "op ring size per stream and chip (a power of two)");
ABSL_FLAG(absl::Duration, op_timeout, absl::Minutes(10),
          "an op running longer is deemed hung: its executor is restarted and its session "
          "ended (0 = never)");
ABSL_FLAG(absl::Duration, executor_spin, absl::Microseconds(50),
          "how long an idle executor spins for new work while a core is free for it");
ABSL_FLAG(absl::Duration, executor_yield, absl::Microseconds(50),
          "how long an idle executor yields its core (and looks for new work) when no core "
          "is free, before it sleeps");
ABSL_FLAG(absl::Duration, executor_quantum, absl::Microseconds(200),
          "how long an executor serves one stream while others wait");
ABSL_FLAG(int, max_connections_per_uid, 1024,
          "connections one user may hold on the runtime socket");
ABSL_FLAG(int, max_sessions_per_uid, 512, "sessions one user may hold at once (0 = no limit)");
ABSL_FLAG(absl::Duration, handshake_timeout, absl::Seconds(5),
          "a new connection must send its greeting (gRPC preface or data-plane hello) within "
          "this time");

ABSL_FLAG(std::string, backend, "simulated",
          "what runs the ops: simulated (ATen CPU kernels on daemon-owned HBM) or pjrt (the "
          "devices of the PJRT plugin given by --pjrt_plugin, e.g. libtpu.so)");
ABSL_FLAG(std::string, pjrt_plugin, "", "path of the PJRT plugin for --backend=pjrt");
ABSL_FLAG(std::vector<std::string>, pjrt_option, {},
          "a client create option of the PJRT plugin, name=value (repeat the flag for more); "
          "the value's type is inferred, or given as int64:, string:, bool:, float:");
ABSL_FLAG(absl::Duration, pjrt_probe_timeout, absl::Seconds(60),
          "how long the PJRT plugin may take to come up at start-up");
ABSL_FLAG(std::string, pjrt_memory, "auto",
          "where the PJRT backend keeps tensors: host (ops compute on tpud's HBM arena, which "
          "the plugin's devices must be able to address: XLA's CPU plugin), device (each "
          "segment is a PJRT buffer on its device, the arena its host copy; as on libtpu), or "
          "auto (host on a plugin whose platform is cpu, else device)");
ABSL_FLAG(int, pjrt_program_cache, 4096,
          "compiled programs the PJRT backend keeps (least recently used go first)");
ABSL_FLAG(bool, pjrt_graphs, true,
          "with device memory, run each captured graph (torch.compile) as one StableHLO module; "
          "false: its ops one by one, as eager ops");

ABSL_FLAG(std::string, metrics_address, "",
          "serve Prometheus metrics (GET /metrics) on this loopback HOST:PORT "
          "(127.0.0.1:9464) or unix socket path; empty: no metrics endpoint");

namespace tpud {
namespace {

// Every --pjrt_option=..., in order (absl keeps only the last occurrence).
std::vector<std::string>& PjrtOptionArgs() {
  static auto* v = new std::vector<std::string>;
  return *v;
}

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
  std::optional<MetricsAddress> metrics_address;
  if (const std::string m = absl::GetFlag(FLAGS_metrics_address); !m.empty()) {
    absl::StatusOr<MetricsAddress> parsed = ParseMetricsAddress(m);
    if (!parsed.ok()) return Fail(std::string(parsed.status().message()));
    metrics_address = *parsed;
  }
  absl::StatusOr<Topology> topology =
      Topology::FromPreset(absl::GetFlag(FLAGS_topology), *hbm);
  if (!topology.ok()) return Fail(std::string(topology.status().message()));

  // The backend. A PJRT plugin is probed in a child process first: its
  // devices are the host's chips, and it is loaded for good only by the one
  // executor that drives them all.
  const std::string backend = absl::GetFlag(FLAGS_backend);
  BackendStatus backend_status;
  backend_status.kind = backend;
  std::vector<pjrt::CreateOption> pjrt_options;
  const std::string pjrt_plugin = absl::GetFlag(FLAGS_pjrt_plugin);
  bool device_memory = false;
  if (backend == "pjrt") {
    const std::string memory = absl::GetFlag(FLAGS_pjrt_memory);
    if (memory != "auto" && memory != "host" && memory != "device") {
      return Fail(absl::StrCat("unknown --pjrt_memory=", memory, " (auto, host or device)"));
    }
    if (pjrt_plugin.empty()) return Fail("--backend=pjrt needs --pjrt_plugin=PATH");
    std::vector<std::string> texts = PjrtOptionArgs();
    if (texts.empty()) texts = absl::GetFlag(FLAGS_pjrt_option);
    for (const std::string& text : texts) {
      absl::StatusOr<pjrt::CreateOption> o = pjrt::ParseCreateOption(text);
      if (!o.ok()) return Fail(std::string(o.status().message()));
      pjrt_options.push_back(*std::move(o));
    }
    absl::StatusOr<pjrt::ProbeResult> probe = pjrt::ProbePlugin(
        pjrt_plugin, pjrt_options, absl::GetFlag(FLAGS_pjrt_probe_timeout));
    if (!probe.ok()) return Fail(std::string(probe.status().message()));
    const int devices = static_cast<int>(probe->devices.size());
    if (devices != topology->num_chips()) {
      return Fail(absl::StrCat("the PJRT plugin has ", devices, " devices; --topology=",
                               topology->name(), " has ", topology->num_chips(),
                               " chips (pick a topology with as many chips, or set the "
                               "plugin's device count with --pjrt_option)"));
    }
    // Devices with coordinates are chips in torus order (PjrtPlugin): they
    // must be where the topology has its chips.
    for (int i = 0; i < devices; ++i) {
      const std::vector<int64_t>& at = probe->devices[i].coords;
      if (at.empty()) continue;
      const std::vector<int>& want = topology->coords(i);
      bool same = true;
      for (size_t a = 0; a < std::max(at.size(), want.size()); ++a) {
        const int64_t have = a < at.size() ? at[a] : 0;
        const int64_t need = a < want.size() ? want[a] : 0;
        same = same && have == need;
      }
      if (!same) {
        spdlog::warn("PJRT device {} (chip {}) is at ({}), where --topology={} has chip {} at ({}): ICI "
                     "figures follow the topology, not the device",
                     probe->devices[i].id, i, absl::StrJoin(at, ","), topology->name(), i, absl::StrJoin(want, ","));
      }
    }
    // HBM: what the devices report, unless --hbm_bytes says.
    int64_t limit = 0;
    for (const pjrt::DeviceInfo& d : probe->devices) {
      if (d.bytes_limit > 0 && (limit == 0 || d.bytes_limit < limit)) limit = d.bytes_limit;
    }
    if (*hbm == 0 && limit > 0) {
      topology = Topology::FromPreset(absl::GetFlag(FLAGS_topology), static_cast<uint64_t>(limit));
      if (!topology.ok()) return Fail(std::string(topology.status().message()));
    }
    // Computing on the arena needs devices that address host memory.
    device_memory = memory == "device" || (memory == "auto" && probe->platform != "cpu");
    if (memory == "host" && probe->platform != "cpu") {
      return Fail(absl::StrCat("--pjrt_memory=host needs a plugin whose devices are the host's (platform cpu); this one's "
                               "platform is ", probe->platform));
    }
    backend_status.description = absl::StrCat("PJRT (", probe->description, ")",
                                              device_memory ? ", tensors in device buffers" : "");
    backend_status.plugin_path = pjrt_plugin;
    backend_status.pjrt_api_version = absl::StrCat(probe->api_major, ".", probe->api_minor);
    backend_status.platform = probe->platform;
    for (const pjrt::DeviceInfo& d : probe->devices) backend_status.device_kinds.push_back(d.kind);
    backend_status.lowered_ops = pjrt::LoweredOpNames();
  } else if (backend == "simulated") {
    backend_status.description = "simulated (ATen CPU kernels on daemon-owned HBM)";
  } else {
    return Fail(absl::StrCat("unknown --backend=", backend, " (simulated or pjrt)"));
  }
  const bool one_executor = backend == "pjrt";

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

  if (topology->num_chips() > tpu::kMaxChipsPerHost) {
    return Fail(absl::StrCat("topology ", topology->name(), " has ", topology->num_chips(),
                             " chips; tpud serves at most ", tpu::kMaxChipsPerHost, " per host"));
  }
  // Sessions hold several descriptors each (sockets, doorbells): use all the
  // system lets us.
  rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }

  RuntimeCore::Options options;
  options.default_quota_bytes_per_chip = *quota;
  options.max_sessions_per_uid = static_cast<uint32_t>(
      std::max(0, absl::GetFlag(FLAGS_max_sessions_per_uid)));
  absl::StatusOr<std::unique_ptr<RuntimeCore>> core =
      RuntimeCore::Create(*std::move(topology), options);
  if (!core.ok()) return Fail(std::string(core.status().message()));
  const int num_chips = (*core)->topology().num_chips();

  // Executor processes (one per chip) run every op. Everything they map is
  // made now, and their zygote is forked before this process has threads.
  absl::StatusOr<SharedMapping> shared_memory =
      SharedMapping::Create("tpud-executors", sizeof(ExecutorShared), /*seal=*/false);
  if (!shared_memory.ok()) return Fail(std::string(shared_memory.status().message()));
  shared_memory->CloseFd();
  auto* shared = new (shared_memory->data()) ExecutorShared();
  shared->magic = kExecutorSharedMagic;
  // One executor per chip; on the PJRT backend one for all (the plugin is
  // loaded by one process).
  const int num_executors = one_executor ? 1 : num_chips;
  shared->num_executors = static_cast<uint32_t>(num_executors);
  ExecutorProcessConfig exec_config;
  exec_config.shared = shared;
  std::vector<int> wake_fds;
  std::vector<int> executor_of_chip;
  exec_config.chips_of.resize(num_executors);
  for (int c = 0; c < num_chips; ++c) {
    const int e = one_executor ? 0 : c;
    exec_config.chips_of[e].push_back(c);
    executor_of_chip.push_back(e);
    exec_config.chip_bases.push_back((*core)->ChipHostBase(c));
    exec_config.chip_capacities.push_back((*core)->topology().hbm_bytes_per_chip());
    exec_config.owner_tables.push_back((*core)->OwnerTableMemory(c));
  }
  for (int e = 0; e < num_executors; ++e) {
    const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) return Fail("eventfd for the executors failed");
    wake_fds.push_back(fd);
  }
  exec_config.wake_fds = wake_fds;
  // Communicators: one table every executor maps (collectives.h); the
  // registry sets up its links and routes now, before the fork.
  absl::StatusOr<SharedMapping> collective_memory =
      SharedMapping::Create("tpud-collectives", sizeof(CollectiveTable), /*seal=*/false);
  if (!collective_memory.ok()) return Fail(std::string(collective_memory.status().message()));
  collective_memory->CloseFd();
  // Default-initialised on the memfd's zero pages: writing nothing keeps
  // the table's unused communicator slots (most of its size) unbacked.
  auto* collective_table = new (collective_memory->data()) CollectiveTable;
  CommunicatorRegistry communicators(collective_table, (*core)->topology(), executor_of_chip,
                                     wake_fds);
  exec_config.collectives = collective_table;
  exec_config.spin_ns = absl::ToInt64Nanoseconds(absl::GetFlag(FLAGS_executor_spin));
  exec_config.yield_ns = absl::ToInt64Nanoseconds(absl::GetFlag(FLAGS_executor_yield));
  exec_config.quantum_ns = absl::ToInt64Nanoseconds(absl::GetFlag(FLAGS_executor_quantum));
  const int intra_op_threads = absl::GetFlag(FLAGS_intra_op_threads);
  const int cache_entries = std::max(1, absl::GetFlag(FLAGS_pjrt_program_cache));
  const bool graphs = absl::GetFlag(FLAGS_pjrt_graphs);
  exec_config.make_backend = [intra_op_threads, backend, pjrt_plugin, pjrt_options,
                              cache_entries, device_memory, graphs]() -> std::unique_ptr<ChipBackend> {
    if (backend == "pjrt") {
      absl::StatusOr<std::unique_ptr<pjrt::PjrtChip>> chip = pjrt::PjrtChip::Create(
          pjrt_plugin, pjrt_options, static_cast<size_t>(cache_entries), device_memory);
      if (!chip.ok()) {
        spdlog::critical("{}", std::string(chip.status().message()));
        return nullptr;
      }
      (*chip)->set_graphs(graphs);
      return *std::move(chip);
    }
    return SimulatedChip::Create(intra_op_threads);
  };
  ExecutorPoolOptions pool_options;
  pool_options.chips_of = exec_config.chips_of;
  pool_options.op_timeout = absl::GetFlag(FLAGS_op_timeout);
  absl::StatusOr<std::unique_ptr<ExecutorPool>> pool = ExecutorPool::Create(
      pool_options, shared, wake_fds, [exec_config](int index, int control_fd) {
        return RunExecutorProcess(exec_config, index, control_fd);
      });
  if (!pool.ok()) return Fail(std::string(pool.status().message()));

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

  DataPlane data_plane(core->get(), pool->get(), shared, dp_options);
  (*core)->SetSessionEndHook([&data_plane, &communicators](uint64_t id) {
    // Its peers' collectives fail naming it, before its memory goes.
    communicators.OnSessionEnd(id);
    data_plane.Detach(id);
  });
  ExecutorPool* pool_ptr = pool->get();
  (*core)->SetMemoryFence([pool_ptr](uint32_t tag) { pool_ptr->Fence(tag); });
  if (device_memory) {
    (*core)->SetReleaseHook([pool_ptr](uint64_t address, uint64_t bytes) { pool_ptr->Released(address, bytes); });
  }

  ConnectionTable connections;
  std::unique_ptr<SocketServer> sockets;
  RuntimeCore* const core_for_pool = core->get();
  pool_ptr->SetHandlers(
      [core_for_pool](uint64_t session, int chip, uint64_t bytes) -> absl::StatusOr<uint64_t> {
        absl::StatusOr<SegmentGrant> g = core_for_pool->AllocateForResult(session, chip, bytes);
        if (!g.ok()) return g.status();
        return g->address;
      },
      [core_for_pool](uint64_t session, uint64_t address) {
        core_for_pool->FreeResult(session, address);
      },
      [core_for_pool, &data_plane, &sockets](uint64_t session, const std::string& message) {
        // Its client reads why first; then the session ends like a killed one.
        data_plane.FailSession(session, absl::AbortedError(message));
        const ConnectionId conn = core_for_pool->ConnectionOf(session);
        ReclaimResult r = core_for_pool->EndSession(session, RuntimeCore::EndReason::kFailed);
        spdlog::warn("session {} ended: {} (reclaimed {})", session, message,
                     tpu::FormatBytes(r.bytes));
        if (sockets != nullptr && conn != 0) sockets->Hangup(conn);
      });
  if (absl::Status st = pool_ptr->Start(absl::Seconds(60)); !st.ok()) {
    return Fail(absl::StrCat("starting executors: ", st.message()));
  }
  data_plane.Start();
  RuntimeServiceImpl runtime_service(core->get(), &connections, &data_plane);
  AdminServiceImpl admin_service(core->get(), &connections, &data_plane, pool_ptr,
                                 [&sockets](ConnectionId id) {
    if (sockets != nullptr) sockets->Hangup(id);
  });
  runtime_service.set_communicators(&communicators);
  admin_service.set_communicators(&communicators);
  runtime_service.set_backend(backend_status);
  admin_service.set_backend(backend_status);

  // Servers without listening ports: connections arrive through SocketServer.
  constexpr int kMaxMessageBytes = 4 << 20;  // control plane only, never bulk data
  // Every RPC's status is counted for tpud_errors_total (both services).
  RpcStatusCounts rpc_statuses;
  auto count_statuses = [&rpc_statuses] {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
    v.push_back(CountRpcStatuses(&rpc_statuses));
    return v;
  };
  grpc::ServerBuilder runtime_builder;
  runtime_builder.RegisterService(&runtime_service);
  runtime_builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  runtime_builder.experimental().SetInterceptorCreators(count_statuses());
  std::unique_ptr<grpc::Server> runtime_server = runtime_builder.BuildAndStart();
  grpc::ServerBuilder admin_builder;
  admin_builder.RegisterService(&admin_service);
  admin_builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  admin_builder.experimental().SetInterceptorCreators(count_statuses());
  std::unique_ptr<grpc::Server> admin_server = admin_builder.BuildAndStart();
  if (runtime_server == nullptr || admin_server == nullptr) {
    return Fail("could not start the gRPC servers");
  }

  RuntimeCore* core_ptr = core->get();
  // Metrics before the sockets: once tpud answers, so does its endpoint.
  std::unique_ptr<TpudCollector> metrics;
  std::unique_ptr<HttpEndpoint> metrics_endpoint;
  if (metrics_address.has_value()) {
    metrics = std::make_unique<TpudCollector>([&admin_service, pool_ptr, core_ptr,
                                               &rpc_statuses] {
      MetricsInputs in;
      admin_service.FillStatus(&in.status);
      in.executors = pool_ptr->Executors();
      in.sessions = core_ptr->session_counts();
      in.rpc_statuses = rpc_statuses.Snapshot();
      in.start_unix_seconds = absl::ToDoubleSeconds(admin_service.started() - absl::UnixEpoch());
      return in;
    });
    absl::StatusOr<std::unique_ptr<HttpEndpoint>> endpoint =
        HttpEndpoint::Start(*metrics_address, [m = metrics.get()] { return m->Render(); });
    if (!endpoint.ok()) return Fail(std::string(endpoint.status().message()));
    metrics_endpoint = *std::move(endpoint);
    spdlog::info("Prometheus metrics on {}", metrics_endpoint->url());
  }

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
  ConnectionLimits limits;
  limits.max_per_uid = std::max(1, absl::GetFlag(FLAGS_max_connections_per_uid));
  limits.handshake_timeout = absl::GetFlag(FLAGS_handshake_timeout);
  absl::StatusOr<std::unique_ptr<SocketServer>> created =
      SocketServer::Create(std::move(listeners), &connections, on_hangup, limits);
  if (!created.ok()) return Fail(std::string(created.status().message()));
  sockets = *std::move(created);
  sockets->SetDataPlaneHandler(
      [&data_plane](uint64_t session_id, absl::string_view token, const PeerIdentity& peer,
                    uint64_t pinned) -> absl::StatusOr<DataPlaneAttachment> {
        absl::StatusOr<DataPlaneGrant> g = data_plane.Attach(session_id, token, peer, pinned);
        if (!g.ok()) return g.status();
        return DataPlaneAttachment{g->memfd, g->shm_bytes, g->doorbells};
      });
  sockets->Start();

  const Topology& t = core_ptr->topology();
  spdlog::info(
      "tpud {} serving a {} host on {} ({} chips, {} HBM each, {} executor processes) on {} "
      "(admin {})",
      kDaemonVersion, t.name(), backend_status.description, t.num_chips(),
      tpu::FormatBytes(t.hbm_bytes_per_chip()), pool_ptr->num_executors(), socket_path,
      admin_path);
  sd_notifyf(0, "READY=1\nSTATUS=serving %s on %s\nMAINPID=%d", t.name().c_str(),
             socket_path.c_str(), static_cast<int>(getpid()));

  int sig = 0;
  while (sigwait(&signals, &sig) != 0) {
  }
  spdlog::info("received {}, shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  sd_notify(0, "STOPPING=1");
  metrics_endpoint.reset();
  sockets->Stop();
  data_plane.StopAll();
  pool_ptr->Stop();
  admin_service.StopWatches();
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
  for (int i = 1; i < argc; ++i) {
    constexpr char kOption[] = "--pjrt_option=";
    if (std::strncmp(argv[i], kOption, sizeof(kOption) - 1) == 0) {
      tpud::PjrtOptionArgs().push_back(argv[i] + sizeof(kOption) - 1);
    }
  }
  absl::ParseCommandLine(argc, argv);
  auto logger = spdlog::stderr_color_mt("tpud");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ [tpud] %v");
  return tpud::Run();
}
