// tpud's configuration: the command line as given (TpudFlags) and the
// checked, parsed form the rest of start-up uses (TpudConfig).
//
// main.cc defines the absl flags (so `tpud --help` lists them) and copies
// their values into a TpudFlags; ConfigFromFlags does every check that
// needs nothing but the flags. What needs the machine (probing a PJRT
// plugin, looking up --socket_group, binding addresses) is checked later,
// where it is used.
#ifndef TPUD_DAEMON_SERVICE_CONFIG_H_
#define TPUD_DAEMON_SERVICE_CONFIG_H_

#include <spdlog/common.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/backends/pjrt/pjrt_plugin.h"
#include "daemon/metrics/http_endpoint.h"
#include "daemon/topology/topology.h"

namespace tpud {

// One member per flag, holding its text or value before any check. The
// member initialisers are the flags' defaults: main.cc's ABSL_FLAG lines take
// them from here, so there is one place to change a default.
struct TpudFlags {
  std::string topology = "v6e-4";
  std::string socket;        // empty: tpu::RuntimeSocketPath()
  std::string admin_socket;  // empty: tpu::AdminSocketPath()
  std::string socket_group;  // empty: the daemon's group
  std::string hbm_bytes = "0";
  std::string session_quota_bytes = "0";
  std::string log_level = "info";
  int intra_op_threads = 0;
  std::string pinned_pool_bytes = "256MiB";
  std::string max_pinned_pool_bytes = "4GiB";
  std::string staging_bytes = "64MiB";
  std::string ring_bytes = "1MiB";
  std::string small_pool_bytes = "2MiB";
  absl::Duration op_timeout = absl::Minutes(10);
  absl::Duration executor_spin = absl::Microseconds(50);
  absl::Duration executor_yield = absl::Microseconds(50);
  bool executor_unrung = true;
  absl::Duration executor_quantum = absl::Microseconds(200);
  absl::Duration executor_heap_keep = absl::Seconds(10);
  int executor_nice = -10;
  int max_communicators = 256;  // tpud::kDefaultCommunicators
  int max_connections_per_uid = 1024;
  int max_sessions_per_uid = 512;
  absl::Duration handshake_timeout = absl::Seconds(5);

  std::string backend = "simulated";
  std::string pjrt_plugin;
  std::vector<std::string> pjrt_option;  // every --pjrt_option, in order
  absl::Duration pjrt_probe_timeout = absl::Seconds(60);
  std::string pjrt_memory = "auto";
  int pjrt_program_cache = 4096;
  bool pjrt_graphs = true;
  std::string compile_cache_dir;  // empty: compiled programs live in memory
  std::string compile_cache_bytes = "4GiB";

  std::string metrics_address;   // empty: no metrics endpoint
  std::string allocation_state;  // empty: allocations are not kept
};

enum class BackendKind { kSimulated, kPjrt };
// "simulated" or "pjrt", as --backend spells it.
const char* BackendName(BackendKind kind);

// Where the PJRT backend keeps tensors (--pjrt_memory).
enum class PjrtMemory { kAuto, kHost, kDevice };

// Every flag checked and parsed. Sizes are bytes; counts are clamped to
// what the daemon accepts (at least one connection per user, at least one
// cached program).
struct TpudConfig {
  // The --topology preset, with --hbm_bytes applied (0 keeps the
  // generation's capacity; the PJRT backend may replace it with what the
  // devices report).
  Topology topology;
  std::string topology_preset;
  uint64_t hbm_bytes = 0;  // 0: not given

  spdlog::level::level_enum log_level = spdlog::level::info;

  // Sessions.
  uint64_t session_quota_bytes = 0;     // per chip; 0: none
  uint32_t max_sessions_per_uid = 512;  // 0: no limit

  // Data plane.
  uint64_t pinned_pool_bytes = 0;
  uint64_t max_pinned_pool_bytes = 0;
  uint64_t staging_bytes = 0;
  uint64_t ring_bytes = 0;  // a power of two, at least 4 KiB
  // Segment size clients carve allocations under 1 MiB from; 0: none.
  uint64_t small_pool_bytes = 0;

  // Executors.
  // Per executor; 0: the cores shared among busy chips
  // (executor/thread_share.h).
  int intra_op_threads = 0;
  absl::Duration op_timeout = absl::Minutes(10);
  absl::Duration executor_spin = absl::Microseconds(50);
  absl::Duration executor_yield = absl::Microseconds(50);
  // Oversubscribed cores: executors sleep at most kBoundedSleepNanos and
  // look at their rings, and clients skip the doorbell for plain ops.
  bool executor_unrung = true;
  absl::Duration executor_quantum = absl::Microseconds(200);
  // How long an idle executor keeps freed memory in its heap (0: none).
  absl::Duration executor_heap_keep = absl::Seconds(10);
  // Executors' nice value (-20..19): ahead of the client processes they
  // serve, so that a host full of clients does not starve the one process
  // every client waits for.
  int executor_nice = -10;
  // Communicator slots of the collective table (process groups formed on
  // this host at once).
  int max_communicators = 256;

  // Backend. The pjrt_* members matter only for BackendKind::kPjrt.
  BackendKind backend = BackendKind::kSimulated;
  std::string pjrt_plugin;
  std::vector<pjrt::CreateOption> pjrt_options;
  absl::Duration pjrt_probe_timeout = absl::Seconds(60);
  PjrtMemory pjrt_memory = PjrtMemory::kAuto;
  int pjrt_program_cache = 4096;  // at least 1
  bool pjrt_graphs = true;
  // Compiled programs kept on disk too, across restarts; empty: not kept.
  std::string compile_cache_dir;
  uint64_t compile_cache_bytes = 0;

  // Sockets, with the defaults resolved.
  std::string socket_path;
  std::string admin_socket_path;
  std::string socket_group;  // a name, looked up when the socket is made
  int max_connections_per_uid = 1024;  // at least 1
  absl::Duration handshake_timeout = absl::Seconds(5);

  std::optional<MetricsAddress> metrics_address;

  // The device plugin's allocations, kept across restarts; empty: not kept.
  std::string allocation_state_path;
};

// Checks `flags` one by one, in the order tpud has always checked them, and
// fails with the message tpud prints for the first bad one (INVALID_ARGUMENT,
// or the code of the parser that refused it).
absl::StatusOr<TpudConfig> ConfigFromFlags(const TpudFlags& flags);

}  // namespace tpud

#endif  // TPUD_DAEMON_SERVICE_CONFIG_H_
