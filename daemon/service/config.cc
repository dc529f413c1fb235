#include "daemon/service/config.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/collectives/shared_table.h"
#include "tpu/paths.h"
#include "tpu/shm_layout.h"
#include "tpu/units.h"

namespace tpud {

const char* BackendName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kSimulated:
      return "simulated";
    case BackendKind::kPjrt:
      return "pjrt";
  }
  return "?";
}

absl::StatusOr<TpudConfig> ConfigFromFlags(const TpudFlags& flags) {
  // spdlog reads any unknown name as "off".
  const spdlog::level::level_enum log_level =
      spdlog::level::from_str(flags.log_level);
  if (log_level == spdlog::level::off && flags.log_level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown --log_level=", flags.log_level));
  }

  absl::StatusOr<uint64_t> hbm = tpu::ParseBytes(flags.hbm_bytes);
  if (!hbm.ok()) {
    return absl::Status(hbm.status().code(),
                        absl::StrCat("--hbm_bytes: ", hbm.status().message()));
  }
  absl::StatusOr<uint64_t> quota = tpu::ParseBytes(flags.session_quota_bytes);
  if (!quota.ok()) {
    return absl::Status(
        quota.status().code(),
        absl::StrCat("--session_quota_bytes: ", quota.status().message()));
  }
  std::optional<MetricsAddress> metrics_address;
  if (!flags.metrics_address.empty()) {
    absl::StatusOr<MetricsAddress> parsed =
        ParseMetricsAddress(flags.metrics_address);
    if (!parsed.ok()) return parsed.status();
    metrics_address = *std::move(parsed);
  }
  absl::StatusOr<Topology> topology =
      Topology::FromPreset(flags.topology, *hbm);
  if (!topology.ok()) return topology.status();

  TpudConfig config{*std::move(topology)};
  config.topology_preset = flags.topology;
  config.hbm_bytes = *hbm;
  config.log_level = log_level;
  config.session_quota_bytes = *quota;
  config.metrics_address = std::move(metrics_address);
  if (!flags.allocation_state.empty() && flags.allocation_state[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("--allocation_state=", flags.allocation_state,
                     ": give an absolute path (e.g. "
                     "/var/lib/tpud/allocations.state)"));
  }
  config.allocation_state_path = flags.allocation_state;

  if (flags.backend == "pjrt") {
    config.backend = BackendKind::kPjrt;
    if (flags.pjrt_memory == "auto") {
      config.pjrt_memory = PjrtMemory::kAuto;
    } else if (flags.pjrt_memory == "host") {
      config.pjrt_memory = PjrtMemory::kHost;
    } else if (flags.pjrt_memory == "device") {
      config.pjrt_memory = PjrtMemory::kDevice;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown --pjrt_memory=", flags.pjrt_memory,
                       " (auto, host or device)"));
    }
    if (flags.pjrt_plugin.empty()) {
      return absl::InvalidArgumentError(
          "--backend=pjrt needs --pjrt_plugin=PATH");
    }
    config.pjrt_plugin = flags.pjrt_plugin;
    for (const std::string& text : flags.pjrt_option) {
      absl::StatusOr<pjrt::CreateOption> option = pjrt::ParseCreateOption(text);
      if (!option.ok()) return option.status();
      config.pjrt_options.push_back(*std::move(option));
    }
  } else if (flags.backend == "simulated") {
    config.backend = BackendKind::kSimulated;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown --backend=", flags.backend, " (simulated or pjrt)"));
  }
  config.pjrt_probe_timeout = flags.pjrt_probe_timeout;
  config.pjrt_program_cache = std::max(1, flags.pjrt_program_cache);
  config.pjrt_graphs = flags.pjrt_graphs;
  if (!flags.compile_cache_dir.empty() && flags.compile_cache_dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("--compile_cache_dir=", flags.compile_cache_dir,
                     ": give an absolute path"));
  }
  config.compile_cache_dir = flags.compile_cache_dir;
  {
    absl::StatusOr<uint64_t> bytes = tpu::ParseBytes(flags.compile_cache_bytes);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--compile_cache_bytes: ", bytes.status().message()));
    }
    if (*bytes == 0) {
      return absl::InvalidArgumentError(
          "--compile_cache_bytes must be above 0 (leave --compile_cache_dir "
          "empty for no cache on disk)");
    }
    config.compile_cache_bytes = *bytes;
  }

  // These messages name no flag: the parser's message is all tpud has ever
  // printed for them.
  for (auto [text, target] :
       {std::pair{&flags.pinned_pool_bytes, &config.pinned_pool_bytes},
        std::pair{&flags.max_pinned_pool_bytes, &config.max_pinned_pool_bytes},
        std::pair{&flags.staging_bytes, &config.staging_bytes},
        std::pair{&flags.ring_bytes, &config.ring_bytes},
        std::pair{&flags.small_pool_bytes, &config.small_pool_bytes}}) {
    absl::StatusOr<uint64_t> bytes = tpu::ParseBytes(*text);
    if (!bytes.ok()) return bytes.status();
    *target = *bytes;
  }
  if ((config.ring_bytes & (config.ring_bytes - 1)) != 0 ||
      config.ring_bytes < 4096) {
    return absl::InvalidArgumentError(
        "--ring_bytes must be a power of two of at least 4KiB");
  }
  if (config.small_pool_bytes != 0 &&
      (config.small_pool_bytes % 4096 != 0 ||
       config.small_pool_bytes < (uint64_t{1} << 20) ||
       config.small_pool_bytes > (uint64_t{1} << 30))) {
    return absl::InvalidArgumentError(
        "--small_pool_bytes must be 0 or whole pages from 1MiB to 1GiB");
  }

  if (config.topology.num_chips() > tpu::kMaxChipsPerHost) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topology ", config.topology.name(), " has ",
        config.topology.num_chips(), " chips; tpud serves at most ",
        tpu::kMaxChipsPerHost, " per host"));
  }

  config.max_sessions_per_uid =
      static_cast<uint32_t>(std::max(0, flags.max_sessions_per_uid));
  config.intra_op_threads = std::max(0, flags.intra_op_threads);
  config.op_timeout = flags.op_timeout;
  config.executor_spin = flags.executor_spin;
  config.executor_yield = flags.executor_yield;
  config.executor_unrung = flags.executor_unrung;
  config.executor_quantum = flags.executor_quantum;
  if (flags.executor_heap_keep < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--executor_heap_keep=", absl::FormatDuration(flags.executor_heap_keep),
        " is negative: give how long an idle executor keeps freed memory "
        "(10s, the default), or 0 to keep none"));
  }
  config.executor_heap_keep = flags.executor_heap_keep;
  if (flags.executor_nice < -20 || flags.executor_nice > 19) {
    return absl::InvalidArgumentError(
        absl::StrCat("--executor_nice=", flags.executor_nice,
                     " is not a nice value (-20 to 19)"));
  }
  config.executor_nice = flags.executor_nice;
  if (flags.max_communicators < 1 ||
      flags.max_communicators > kMaxCommunicatorsLimit) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_communicators=", flags.max_communicators,
                     " is not in [1, ", kMaxCommunicatorsLimit, "]"));
  }
  config.max_communicators = flags.max_communicators;

  config.socket_path =
      flags.socket.empty() ? tpu::RuntimeSocketPath() : flags.socket;
  config.admin_socket_path =
      flags.admin_socket.empty() ? tpu::AdminSocketPath() : flags.admin_socket;
  config.socket_group = flags.socket_group;
  config.max_connections_per_uid = std::max(1, flags.max_connections_per_uid);
  config.handshake_timeout = flags.handshake_timeout;
  return config;
}

}  // namespace tpud
