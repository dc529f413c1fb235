#include "daemon/service/backend_choice.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backends/pjrt/pjrt_chip.h"
#include "daemon/backends/pjrt/pjrt_probe.h"
#include "daemon/backends/simulated/simulated_chip.h"

namespace tpud {
namespace {

// The factory captures copies: it runs in the executor process.
std::function<std::unique_ptr<ChipBackend>()> BackendFactory(
    const TpudConfig& config, bool device_memory) {
  if (config.backend == BackendKind::kPjrt) {
    return [plugin = config.pjrt_plugin, options = config.pjrt_options,
            cache_entries = static_cast<size_t>(config.pjrt_program_cache),
            device_memory, graphs = config.pjrt_graphs,
            disk_dir = config.compile_cache_dir,
            disk_bytes =
                config.compile_cache_bytes]() -> std::unique_ptr<ChipBackend> {
      absl::StatusOr<std::unique_ptr<pjrt::PjrtChip>> chip =
          pjrt::PjrtChip::Create(plugin, options, cache_entries, device_memory);
      if (!chip.ok()) {
        spdlog::critical("{}", std::string(chip.status().message()));
        return nullptr;
      }
      (*chip)->set_graphs(graphs);
      if (!disk_dir.empty()) {
        // Without it tpud still serves: every program is compiled.
        absl::Status st = (*chip)->OpenDiskCache(disk_dir, disk_bytes, options);
        if (!st.ok()) {
          spdlog::error("compile cache off: {}", std::string(st.message()));
        } else {
          const DiskCacheStats d = (*chip)->disk_cache_stats();
          spdlog::info("compile cache {}: {} programs, {} bytes of {}",
                       disk_dir, d.entries, d.bytes, d.max_bytes);
        }
      }
      return *std::move(chip);
    };
  }
  return [intra_op_threads =
              config.intra_op_threads]() -> std::unique_ptr<ChipBackend> {
    return SimulatedChip::Create(intra_op_threads);
  };
}

absl::StatusOr<ChosenBackend> ChoosePjrt(const TpudConfig& config) {
  absl::StatusOr<pjrt::ProbeResult> probe = pjrt::ProbePlugin(
      config.pjrt_plugin, config.pjrt_options, config.pjrt_probe_timeout);
  if (!probe.ok()) return probe.status();
  ChosenBackend chosen{config.topology};
  const Topology& topology = config.topology;
  const int devices = static_cast<int>(probe->devices.size());
  if (devices != topology.num_chips()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the PJRT plugin has ", devices,
        " devices; --topology=", topology.name(), " has ", topology.num_chips(),
        " chips (pick a topology with as many chips, or set the "
        "plugin's device count with --pjrt_option)"));
  }
  // Devices with coordinates are chips in torus order (PjrtPlugin): they
  // must be where the topology has its chips.
  for (int i = 0; i < devices; ++i) {
    const std::vector<int64_t>& at = probe->devices[i].coords;
    if (at.empty()) continue;
    const std::vector<int>& want = topology.coords(i);
    bool same = true;
    for (size_t a = 0; a < std::max(at.size(), want.size()); ++a) {
      const int64_t have = a < at.size() ? at[a] : 0;
      const int64_t need = a < want.size() ? want[a] : 0;
      same = same && have == need;
    }
    if (!same) {
      spdlog::warn(
          "PJRT device {} (chip {}) is at ({}), where --topology={} has chip "
          "{} at ({}): ICI "
          "figures follow the topology, not the device",
          probe->devices[i].id, i, absl::StrJoin(at, ","), topology.name(), i,
          absl::StrJoin(want, ","));
    }
  }
  // HBM: what the devices report, unless --hbm_bytes says.
  int64_t limit = 0;
  for (const pjrt::DeviceInfo& d : probe->devices) {
    if (d.bytes_limit > 0 && (limit == 0 || d.bytes_limit < limit))
      limit = d.bytes_limit;
  }
  if (config.hbm_bytes == 0 && limit > 0) {
    absl::StatusOr<Topology> resized = Topology::FromPreset(
        config.topology_preset, static_cast<uint64_t>(limit));
    if (!resized.ok()) return resized.status();
    chosen.topology = *std::move(resized);
  }
  // Computing on the arena needs devices that address host memory.
  const PjrtMemory memory = config.pjrt_memory;
  chosen.device_memory =
      memory == PjrtMemory::kDevice ||
      (memory == PjrtMemory::kAuto && probe->platform != "cpu");
  if (memory == PjrtMemory::kHost && probe->platform != "cpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--pjrt_memory=host needs a plugin whose devices are the "
                     "host's (platform cpu); this "
                     "one's platform is ",
                     probe->platform));
  }
  chosen.one_executor = true;
  BackendStatus& status = chosen.status;
  status.kind = BackendName(config.backend);
  status.description =
      absl::StrCat("PJRT (", probe->description, ")",
                   chosen.device_memory ? ", tensors in device buffers" : "");
  status.plugin_path = config.pjrt_plugin;
  status.pjrt_api_version =
      absl::StrCat(probe->api_major, ".", probe->api_minor);
  status.platform = probe->platform;
  for (const pjrt::DeviceInfo& d : probe->devices)
    status.device_kinds.push_back(d.kind);
  status.lowered_ops = pjrt::LoweredOpNames();
  status.fuses = chosen.device_memory && config.pjrt_graphs;
  chosen.make_backend = BackendFactory(config, chosen.device_memory);
  return chosen;
}

}  // namespace

absl::StatusOr<ChosenBackend> ChooseBackend(const TpudConfig& config) {
  if (config.backend == BackendKind::kPjrt) return ChoosePjrt(config);
  ChosenBackend chosen{config.topology};
  chosen.status.kind = BackendName(config.backend);
  chosen.status.description =
      "simulated (ATen CPU kernels on daemon-owned HBM)";
  chosen.make_backend = BackendFactory(config, /*device_memory=*/false);
  return chosen;
}

}  // namespace tpud
