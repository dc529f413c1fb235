// tpud: the per-host TPU runtime daemon.
//
// With no flags it serves a simulated v6e-4 host on the default sockets.
// Start-up reads as its steps: flags -> config (config.h) -> the backend
// (backend_choice.h) -> the runtime core -> the executor processes
// (executors.h) -> the servers (servers.h) -> serve until a signal.
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/allocation_state.h"
#include "daemon/core/runtime_core.h"
#include "daemon/service/backend_choice.h"
#include "daemon/service/config.h"
#include "daemon/service/executors.h"
#include "daemon/service/servers.h"
#include "daemon/topology/topology.h"
#include "proto/protocol.h"
#include "tpu/units.h"

// The defaults live in TpudFlags (config.h), which the config's test uses too.
ABSL_FLAG(std::string, topology, tpud::TpudFlags().topology,
          "host preset to serve: v5e-1, v5e-4, v5e-8, v5p-4, v6e-1, v6e-4, "
          "v6e-8, v7x-4");
ABSL_FLAG(
    std::string, socket, tpud::TpudFlags().socket,
    "runtime socket (default $TPUD_SOCKET, /run/tpud/tpud.sock as root, else "
    "$XDG_RUNTIME_DIR/tpud/tpud.sock)");
ABSL_FLAG(std::string, admin_socket, tpud::TpudFlags().admin_socket,
          "admin socket (default $TPUD_ADMIN_SOCKET, or admin.sock beside the "
          "runtime "
          "socket's default)");
ABSL_FLAG(
    std::string, socket_group, tpud::TpudFlags().socket_group,
    "group that owns the runtime socket (mode 0660); empty keeps the daemon's");
ABSL_FLAG(std::string, hbm_bytes, tpud::TpudFlags().hbm_bytes,
          "HBM per chip, e.g. 256MiB; 0 uses the generation's real capacity");
ABSL_FLAG(
    std::string, session_quota_bytes, tpud::TpudFlags().session_quota_bytes,
    "default per-chip HBM quota of every session, e.g. 8GiB; 0 means none");
ABSL_FLAG(std::string, log_level, tpud::TpudFlags().log_level,
          "trace, debug, info, warn or error");
ABSL_FLAG(int, intra_op_threads, tpud::TpudFlags().intra_op_threads,
          "threads each op may use on the simulated chips (ATen's intra-op "
          "pool, one per executor); 0 = automatic: the cores tpud may use "
          "(CPU affinity, cgroup quota) shared among the chips busy now, all "
          "of them for one busy chip, at least 1 each, adjusted between ops; "
          "N > 0 = exactly N per executor, whatever the load");
ABSL_FLAG(std::string, pinned_pool_bytes, tpud::TpudFlags().pinned_pool_bytes,
          "default size of a session's pinned host pool (shared memory)");
ABSL_FLAG(std::string, max_pinned_pool_bytes,
          tpud::TpudFlags().max_pinned_pool_bytes,
          "largest pinned host pool a session may ask for");
ABSL_FLAG(std::string, staging_bytes, tpud::TpudFlags().staging_bytes,
          "per-session staging area for pageable host<->device copies");
ABSL_FLAG(std::string, ring_bytes, tpud::TpudFlags().ring_bytes,
          "op ring size per stream and chip (a power of two)");
ABSL_FLAG(std::string, small_pool_bytes, tpud::TpudFlags().small_pool_bytes,
          "segment size clients carve allocations under 1MiB from (0: a "
          "segment per allocation; always 0 with --pjrt_memory=device)");
ABSL_FLAG(absl::Duration, op_timeout, tpud::TpudFlags().op_timeout,
          "an op running longer is deemed hung: its executor is restarted and "
          "its session "
          "ended (0 = never)");
ABSL_FLAG(
    absl::Duration, executor_spin, tpud::TpudFlags().executor_spin,
    "how long an idle executor spins for new work while a core is free for it");
ABSL_FLAG(absl::Duration, executor_yield, tpud::TpudFlags().executor_yield,
          "how long an idle executor yields its core (and looks for new work) "
          "when no core "
          "is free, before it sleeps");
ABSL_FLAG(bool, executor_unrung, tpud::TpudFlags().executor_unrung,
          "while the cores are oversubscribed, executors that ran work lately "
          "sleep at most 2 ms and look for new work themselves, and clients "
          "publish plain op records without ringing: one wake-up per few "
          "ops saved, where each wake-up preempts a client (false: every "
          "record that finds its executor asleep rings)");
ABSL_FLAG(absl::Duration, executor_quantum, tpud::TpudFlags().executor_quantum,
          "how long an executor serves one stream while others wait");
ABSL_FLAG(absl::Duration, executor_heap_keep,
          tpud::TpudFlags().executor_heap_keep,
          "how long an idle executor keeps the memory its runs freed (for the "
          "next run, which then finds it mapped) before it hands it back to "
          "the system; 0: freed memory goes back at once, as glibc does "
          "by default");
ABSL_FLAG(int, executor_nice, tpud::TpudFlags().executor_nice,
          "nice value of the executor processes (below tpud's own needs "
          "CAP_SYS_NICE; without it they keep tpud's)");
ABSL_FLAG(int, max_communicators, tpud::TpudFlags().max_communicators,
          "communicators (torch.distributed process groups, per host rank "
          "set) that may exist on this host at once; each reserves ~2 MiB of "
          "address space, backed only while used");
ABSL_FLAG(int, max_connections_per_uid,
          tpud::TpudFlags().max_connections_per_uid,
          "connections one user may hold on the runtime socket");
ABSL_FLAG(int, max_sessions_per_uid, tpud::TpudFlags().max_sessions_per_uid,
          "sessions one user may hold at once (0 = no limit)");
ABSL_FLAG(absl::Duration, handshake_timeout,
          tpud::TpudFlags().handshake_timeout,
          "a new connection must send its greeting (gRPC preface or data-plane "
          "hello) within "
          "this time");

ABSL_FLAG(std::string, backend, tpud::TpudFlags().backend,
          "what runs the ops: simulated (ATen CPU kernels on daemon-owned HBM) "
          "or pjrt (the "
          "devices of the PJRT plugin given by --pjrt_plugin, e.g. libtpu.so)");
ABSL_FLAG(std::string, pjrt_plugin, tpud::TpudFlags().pjrt_plugin,
          "path of the PJRT plugin for --backend=pjrt");
ABSL_FLAG(
    std::vector<std::string>, pjrt_option, tpud::TpudFlags().pjrt_option,
    "a client create option of the PJRT plugin, name=value (repeat the flag "
    "for more); "
    "the value's type is inferred, or given as int64:, string:, bool:, float:");
ABSL_FLAG(absl::Duration, pjrt_probe_timeout,
          tpud::TpudFlags().pjrt_probe_timeout,
          "how long the PJRT plugin may take to come up at start-up");
ABSL_FLAG(std::string, pjrt_memory, tpud::TpudFlags().pjrt_memory,
          "where the PJRT backend keeps tensors: host (ops compute on tpud's "
          "HBM arena, which "
          "the plugin's devices must be able to address: XLA's CPU plugin), "
          "device (each "
          "segment is a PJRT buffer on its device, the arena its host copy; as "
          "on libtpu), or "
          "auto (host on a plugin whose platform is cpu, else device)");
ABSL_FLAG(
    int, pjrt_program_cache, tpud::TpudFlags().pjrt_program_cache,
    "compiled programs the PJRT backend keeps (least recently used go first)");
ABSL_FLAG(bool, pjrt_graphs, tpud::TpudFlags().pjrt_graphs,
          "with device memory, run each captured graph (torch.compile) as one "
          "StableHLO module; "
          "false: its ops one by one, as eager ops");
ABSL_FLAG(std::string, compile_cache_dir, tpud::TpudFlags().compile_cache_dir,
          "keep the PJRT backend's compiled programs in this directory too "
          "(made with mode 0700; one others may write is refused), so that a "
          "restarted tpud loads them instead of compiling them again; empty: "
          "programs live only as long as tpud");
ABSL_FLAG(std::string, compile_cache_bytes,
          tpud::TpudFlags().compile_cache_bytes,
          "the most --compile_cache_dir may hold; past it the least recently "
          "used programs are removed");

ABSL_FLAG(std::string, metrics_address, tpud::TpudFlags().metrics_address,
          "serve Prometheus metrics (GET /metrics) on this loopback HOST:PORT "
          "(127.0.0.1:9464) or unix socket path; empty: no metrics endpoint");

ABSL_FLAG(std::string, allocation_state, tpud::TpudFlags().allocation_state,
          "keep the device plugin's allocations (tokens, chips, HBM quotas) "
          "in this file, so that a restarted tpud honours the tokens its pods "
          "hold; empty: allocations end with tpud");

namespace tpud {
namespace {

// Every --pjrt_option=..., in order (absl keeps only the last occurrence).
std::vector<std::string>& PjrtOptionArgs() {
  static auto* v = new std::vector<std::string>;
  return *v;
}

TpudFlags FlagsFromCommandLine() {
  TpudFlags f;
  f.topology = absl::GetFlag(FLAGS_topology);
  f.socket = absl::GetFlag(FLAGS_socket);
  f.admin_socket = absl::GetFlag(FLAGS_admin_socket);
  f.socket_group = absl::GetFlag(FLAGS_socket_group);
  f.hbm_bytes = absl::GetFlag(FLAGS_hbm_bytes);
  f.session_quota_bytes = absl::GetFlag(FLAGS_session_quota_bytes);
  f.log_level = absl::GetFlag(FLAGS_log_level);
  f.intra_op_threads = absl::GetFlag(FLAGS_intra_op_threads);
  f.pinned_pool_bytes = absl::GetFlag(FLAGS_pinned_pool_bytes);
  f.max_pinned_pool_bytes = absl::GetFlag(FLAGS_max_pinned_pool_bytes);
  f.staging_bytes = absl::GetFlag(FLAGS_staging_bytes);
  f.ring_bytes = absl::GetFlag(FLAGS_ring_bytes);
  f.small_pool_bytes = absl::GetFlag(FLAGS_small_pool_bytes);
  f.op_timeout = absl::GetFlag(FLAGS_op_timeout);
  f.executor_spin = absl::GetFlag(FLAGS_executor_spin);
  f.executor_yield = absl::GetFlag(FLAGS_executor_yield);
  f.executor_unrung = absl::GetFlag(FLAGS_executor_unrung);
  f.executor_quantum = absl::GetFlag(FLAGS_executor_quantum);
  f.executor_heap_keep = absl::GetFlag(FLAGS_executor_heap_keep);
  f.executor_nice = absl::GetFlag(FLAGS_executor_nice);
  f.max_communicators = absl::GetFlag(FLAGS_max_communicators);
  f.max_connections_per_uid = absl::GetFlag(FLAGS_max_connections_per_uid);
  f.max_sessions_per_uid = absl::GetFlag(FLAGS_max_sessions_per_uid);
  f.handshake_timeout = absl::GetFlag(FLAGS_handshake_timeout);
  f.backend = absl::GetFlag(FLAGS_backend);
  f.pjrt_plugin = absl::GetFlag(FLAGS_pjrt_plugin);
  // From the command line every occurrence; from a flagfile, the last.
  f.pjrt_option = PjrtOptionArgs();
  if (f.pjrt_option.empty()) f.pjrt_option = absl::GetFlag(FLAGS_pjrt_option);
  f.pjrt_probe_timeout = absl::GetFlag(FLAGS_pjrt_probe_timeout);
  f.pjrt_memory = absl::GetFlag(FLAGS_pjrt_memory);
  f.pjrt_program_cache = absl::GetFlag(FLAGS_pjrt_program_cache);
  f.pjrt_graphs = absl::GetFlag(FLAGS_pjrt_graphs);
  f.compile_cache_dir = absl::GetFlag(FLAGS_compile_cache_dir);
  f.compile_cache_bytes = absl::GetFlag(FLAGS_compile_cache_bytes);
  f.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  f.allocation_state = absl::GetFlag(FLAGS_allocation_state);
  return f;
}

int Fail(const absl::Status& status) {
  const std::string message(status.message());
  spdlog::critical("{}", message);
  sd_notifyf(0, "STATUS=failed: %s", message.c_str());
  return 1;
}

// Sessions hold several descriptors each (sockets, doorbells): use all the
// system lets us.
void RaiseOpenFileLimit() {
  rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 &&
      nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
}

// SIGTERM and SIGINT are taken synchronously by the main thread (sigwait);
// every thread started later (gRPC's included) inherits the blocked mask.
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return signals;
}

// Loads the allocations saved at `path` (if any) into `core` and saves every
// change from now on. A file that cannot be read or is not a state file for
// this host stops tpud: starting without its allocations would refuse every
// pod's token.
absl::Status KeepAllocations(const std::string& path, RuntimeCore* core) {
  if (path.empty()) return absl::OkStatus();
  const std::string aside = absl::StrCat(
      " (tpud did not start: the pods of this host hold tokens from it. To "
      "start without them, move the file aside; pods holding its tokens must "
      "then be restarted)");
  absl::StatusOr<std::optional<std::string>> text = ReadStateFile(path);
  if (!text.ok())
    return absl::FailedPreconditionError(
        absl::StrCat(text.status().message(), aside));
  if (text->has_value()) {
    const Topology& t = core->topology();
    absl::StatusOr<AllocationState> state =
        DecodeAllocationState(**text, path, t.name(), t.num_chips());
    if (!state.ok())
      return absl::FailedPreconditionError(
          absl::StrCat(state.status().message(), aside));
    if (absl::Status st = core->RestoreAllocations(*state); !st.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": ", st.message(), aside));
    }
    spdlog::info("{}: {} allocations restored", path,
                 state->allocations.size());
  }
  // Saved once now, so that a path tpud cannot write fails here, not at the
  // first allocation.
  return core->SetAllocationSaver([path](const AllocationState& state) {
    return WriteStateFileAtomically(path, EncodeAllocationState(state));
  });
}

int Run() {
  absl::StatusOr<TpudConfig> config = ConfigFromFlags(FlagsFromCommandLine());
  if (!config.ok()) return Fail(config.status());
  spdlog::set_level(config->log_level);

  absl::StatusOr<ChosenBackend> backend = ChooseBackend(*config);
  if (!backend.ok()) return Fail(backend.status());
  RaiseOpenFileLimit();

  RuntimeCore::Options options;
  options.default_quota_bytes_per_chip = config->session_quota_bytes;
  options.max_sessions_per_uid = config->max_sessions_per_uid;
  absl::StatusOr<std::unique_ptr<RuntimeCore>> core =
      RuntimeCore::Create(backend->topology, options);
  if (!core.ok()) return Fail(core.status());
  if (absl::Status st =
          KeepAllocations(config->allocation_state_path, core->get());
      !st.ok()) {
    return Fail(st);
  }

  // Executor processes run every op; their zygote is forked now, before
  // this process has threads.
  absl::StatusOr<std::unique_ptr<ExecutorProcesses>> executors =
      ExecutorProcesses::Create(*config, *backend, core->get());
  if (!executors.ok()) return Fail(executors.status());

  const sigset_t signals = BlockShutdownSignals();
  absl::StatusOr<std::unique_ptr<Servers>> servers =
      Servers::Start(*config, *backend, core->get(), executors->get());
  if (!servers.ok()) return Fail(servers.status());

  const Topology& t = (*core)->topology();
  spdlog::info(
      "tpud {} serving a {} host on {} ({} chips, {} HBM each, {} executor "
      "processes) on {} "
      "(admin {})",
      kDaemonVersion, t.name(), backend->status.description, t.num_chips(),
      tpu::FormatBytes(t.hbm_bytes_per_chip()),
      (*executors)->pool()->num_executors(), config->socket_path,
      config->admin_socket_path);
  if (config->backend == BackendKind::kSimulated) {
    spdlog::info(
        "intra-op threads per executor: {}",
        DescribeThreadPolicy(config->intra_op_threads, (*executors)->cores()));
  }
  sd_notifyf(0, "READY=1\nSTATUS=serving %s on %s\nMAINPID=%d",
             t.name().c_str(), config->socket_path.c_str(),
             static_cast<int>(getpid()));

  int sig = 0;
  while (sigwait(&signals, &sig) != 0) {
  }
  spdlog::info("received {}, shutting down",
               sig == SIGTERM ? "SIGTERM" : "SIGINT");
  sd_notify(0, "STOPPING=1");
  (*servers)->Stop();
  // Sessions were told (the data plane answered their waits with "tpud is
  // shutting down", and their connections closed). Their HBM goes back with
  // this process (ending them one by one would wait on the stopped
  // executors); the log says how much that was.
  ReclaimResult reclaimed;
  for (const SessionSnapshot& s : (*core)->Sessions()) {
    ++reclaimed.sessions;
    reclaimed.bytes += s.total_bytes();
  }
  spdlog::info(
      "tpud stopped; sockets removed; {} sessions ended, {} of HBM reclaimed",
      reclaimed.sessions, tpu::FormatBytes(reclaimed.bytes));
  return 0;
}

}  // namespace
}  // namespace tpud

int main(int argc, char** argv) {
  // Lock-order cycle detection walks a graph on every lock: too dear for a
  // per-op path. Lock order is documented and tested instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "tpud: per-host TPU runtime daemon.\n  tpud [--topology=v6e-4] "
      "[--socket=PATH] "
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
