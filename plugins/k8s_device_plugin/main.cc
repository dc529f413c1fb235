// tpud-device-plugin: tpud's chips for Kubernetes (kubelet device plugin API
// v1beta1), laid out like NVIDIA's k8s-device-plugin: a plugin server per
// resource, a health watcher, re-registration when the kubelet restarts.
//
//   tpud.io/chip        whole chips ("chip-N")
//   tpud.io/chip-share  --shares_per_chip shares per chip ("chip-N-share-K"),
//                       each with chip HBM / shares (or --share_quota_bytes)
//
// Allocate asks tpud (--admin_socket) for an allocation with the devices'
// chips and HBM quotas and hands the container its token (TPUD_TOKEN): tpud
// holds every session that presents it to those chips and quotas.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "plugins/k8s_device_plugin/chip_claims.h"
#include "plugins/k8s_device_plugin/devices.h"
#include "plugins/k8s_device_plugin/health_watcher.h"
#include "plugins/k8s_device_plugin/plugin_server.h"
#include "plugins/k8s_device_plugin/podresources.grpc.pb.h"
#include "plugins/k8s_device_plugin/tpud_admin.h"
#include "tpu/units.h"

ABSL_FLAG(std::string, admin_socket, "/run/tpud/admin.sock",
          "tpud's admin socket");
ABSL_FLAG(std::string, device_plugin_dir, "/var/lib/kubelet/device-plugins",
          "the kubelet's device-plugins directory: its kubelet.sock, and this "
          "plugin's sockets");
ABSL_FLAG(int, shares_per_chip, 4, "tpud.io/chip-share devices per chip");
ABSL_FLAG(
    std::string, share_quota_bytes, "0",
    "HBM quota of one chip share (e.g. 8GiB); 0: chip HBM / --shares_per_chip");
ABSL_FLAG(std::string, resources, "chip,chip-share",
          "resources to advertise: chip (tpud.io/chip), chip-share "
          "(tpud.io/chip-share) or both");
ABSL_FLAG(std::string, container_tpud_socket, "/run/tpud/tpud.sock",
          "TPUD_SOCKET given to containers: tpud's runtime socket inside them");
ABSL_FLAG(std::string, host_tpud_socket_dir, "/run/tpud",
          "host directory of tpud's runtime socket, mounted at "
          "--container_tpud_socket's "
          "directory");
ABSL_FLAG(absl::Duration, health_interval, absl::Seconds(1),
          "how often tpud's health is polled");
ABSL_FLAG(absl::Duration, kubelet_check_interval, absl::Milliseconds(500),
          "how often kubelet.sock and this plugin's sockets are checked "
          "(kubelet restarts)");
ABSL_FLAG(std::string, pod_resources_socket,
          "/var/lib/kubelet/pod-resources/kubelet.sock",
          "the kubelet's pod-resources API: which pods hold which devices (a "
          "chip held whole is not offered as shares and the other way round; "
          "allocations of pods that are gone are released); empty: not used");
ABSL_FLAG(absl::Duration, pod_resources_interval, absl::Seconds(2),
          "how often the kubelet's pod-resources API is read");
ABSL_FLAG(absl::Duration, release_grace, absl::Seconds(30),
          "an allocation is released when the kubelet has listed no pod "
          "holding its devices for this long after it was made");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn or error");

namespace tpud::k8s {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

// Tells when kubelet.sock was created anew in the device-plugins directory
// (inotify). A deleted file's inode number may come back at once for the new
// one, so comparing inodes alone can miss a restart; the caller does that
// too, in case inotify is unavailable.
class KubeletSocketWatch {
 public:
  explicit KubeletSocketWatch(const std::string& dir) {
    fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd_ >= 0 &&
        inotify_add_watch(fd_, dir.c_str(), IN_CREATE | IN_MOVED_TO) < 0) {
      spdlog::warn(
          "cannot watch {} with inotify ({}); polling kubelet.sock only", dir,
          std::strerror(errno));
      close(fd_);
      fd_ = -1;
    }
  }
  ~KubeletSocketWatch() {
    if (fd_ >= 0) close(fd_);
  }
  // Whether kubelet.sock was created since the last call.
  bool Recreated() {
    bool created = false;
    alignas(inotify_event) char buf[4096];
    while (fd_ >= 0) {
      const ssize_t n = read(fd_, buf, sizeof(buf));
      if (n <= 0) break;
      for (ssize_t off = 0; off < n;) {
        const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
        if (ev->len > 0 && std::strcmp(ev->name, "kubelet.sock") == 0)
          created = true;
        off += sizeof(inotify_event) + ev->len;
      }
    }
    return created;
  }

 private:
  int fd_ = -1;
};

// Reads the kubelet's pod-resources API every interval: the chips each of
// this plugin's resources has on live pods (ChipClaims' kubelet view), and
// the allocations whose pods are gone (released).
class PodResourcesPoller {
 public:
  PodResourcesPoller(std::string socket, absl::Duration interval,
                     absl::Duration grace, ChipClaims* claims, TpudAdmin* tpud,
                     std::vector<DevicePluginServer*> servers)
      : socket_(std::move(socket)),
        interval_(interval),
        grace_(grace),
        claims_(claims),
        tpud_(tpud),
        servers_(std::move(servers)) {}
  ~PodResourcesPoller() { Stop(); }

  void Start() {
    thread_ = std::thread([this] {
      while (!g_stop && !stop_) {
        PollOnce();
        const absl::Time next = absl::Now() + interval_;
        while (!g_stop && !stop_ && absl::Now() < next)
          absl::SleepFor(absl::Milliseconds(50));
      }
    });
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  void PollOnce() {
    if (stub_ == nullptr) {
      stub_ = v1::PodResourcesLister::NewStub(grpc::CreateChannel(
          absl::StrCat("unix:", socket_), grpc::InsecureChannelCredentials()));
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    v1::ListPodResourcesResponse resp;
    grpc::Status st = stub_->List(&ctx, v1::ListPodResourcesRequest(), &resp);
    if (!st.ok()) {
      // Nothing is released on a failed read: the kubelet may be restarting.
      if (!warned_) {
        spdlog::warn(
            "the kubelet's pod-resources API at {} does not answer ({}); "
            "allocations end only when their devices are given again",
            socket_, st.error_message());
      }
      warned_ = true;
      stub_.reset();
      return;
    }
    if (warned_) spdlog::info("the kubelet's pod-resources API answers again");
    warned_ = false;
    std::map<std::string, std::set<std::string>> held;  // resource -> ids
    for (const v1::PodResources& pod : resp.pod_resources()) {
      for (const v1::ContainerResources& c : pod.containers()) {
        for (const v1::ContainerDevices& d : c.devices()) {
          held[d.resource_name()].insert(d.device_ids().begin(),
                                         d.device_ids().end());
        }
      }
    }
    std::map<std::string, std::set<int>> view;
    for (DevicePluginServer* s : servers_) {
      const TpuResource& r = s->resource();
      std::set<int>& chips = view[r.resource_name()];
      for (const std::string& id : held[r.resource_name()]) {
        const int chip = r.ChipOf(id);
        if (chip >= 0) chips.insert(chip);
      }
    }
    claims_->SetKubeletView(std::move(view));
    for (DevicePluginServer* s : servers_) {
      s->ReleaseGone(held[s->resource().resource_name()], grace_);
    }
    // Allocations from before this plugin started (tokens lost), once their
    // pods are gone too.
    absl::StatusOr<std::vector<tpu::AllocationInfo>> listed =
        tpud_->ListAllocations();
    if (!listed.ok()) return;
    for (DevicePluginServer* s : servers_) {
      s->ReleaseOrphans(*listed, held[s->resource().resource_name()], grace_);
    }
  }

  const std::string socket_;
  const absl::Duration interval_;
  const absl::Duration grace_;
  ChipClaims* const claims_;
  TpudAdmin* const tpud_;
  const std::vector<DevicePluginServer*> servers_;
  std::unique_ptr<v1::PodResourcesLister::Stub> stub_;
  bool warned_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

int Fail(const std::string& message) {
  spdlog::error("{}", message);
  return 1;
}

// The host's chips, once tpud answers (it may start after the plugin).
absl::StatusOr<std::vector<HostChip>> WaitForChips(TpudAdmin& tpud) {
  bool logged = false;
  while (!g_stop) {
    absl::StatusOr<tpu::DaemonStatus> status = tpud.GetStatus();
    if (status.ok()) {
      std::vector<HostChip> chips;
      for (const tpu::ChipInfo& c : status->topology.chips) {
        chips.push_back({c.id, c.coords, c.neighbors, c.hbm_total_bytes});
      }
      spdlog::info("tpud {} serves {} ({} chips)", status->daemon_version,
                   status->topology.name, chips.size());
      return chips;
    }
    if (status.status().code() != absl::StatusCode::kUnavailable)
      return status.status();
    if (!logged)
      spdlog::warn("waiting for tpud: {}", status.status().ToString());
    logged = true;
    absl::SleepFor(absl::Seconds(1));
  }
  return absl::CancelledError("stopped");
}

int Run() {
  const std::string level = absl::GetFlag(FLAGS_log_level);
  spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return Fail(absl::StrCat("unknown --log_level=", level));
  }
  spdlog::set_level(lvl);
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);

  absl::StatusOr<uint64_t> share_quota =
      tpu::ParseBytes(absl::GetFlag(FLAGS_share_quota_bytes));
  if (!share_quota.ok()) {
    return Fail(
        absl::StrCat("--share_quota_bytes: ", share_quota.status().message()));
  }
  const std::string want = absl::GetFlag(FLAGS_resources);
  bool want_chips = false, want_shares = false;
  for (absl::string_view r : absl::StrSplit(want, ',')) {
    if (r == "chip") {
      want_chips = true;
    } else if (r == "chip-share") {
      want_shares = true;
    } else {
      return Fail(absl::StrCat("--resources=", want,
                               ": give chip, chip-share or both"));
    }
  }

  TpudAdmin tpud(absl::GetFlag(FLAGS_admin_socket));
  absl::StatusOr<std::vector<HostChip>> chips = WaitForChips(tpud);
  if (!chips.ok()) return g_stop ? 0 : Fail(chips.status().ToString());

  std::vector<std::unique_ptr<TpuResource>> resources;
  if (want_chips) {
    absl::StatusOr<TpuResource> r = TpuResource::WholeChips(*chips);
    if (!r.ok()) return Fail(r.status().ToString());
    resources.push_back(std::make_unique<TpuResource>(*std::move(r)));
  }
  if (want_shares) {
    absl::StatusOr<TpuResource> r = TpuResource::ChipShares(
        *chips, absl::GetFlag(FLAGS_shares_per_chip), *share_quota);
    if (!r.ok()) return Fail(r.status().ToString());
    spdlog::info("{}: {} per chip, {} of HBM each", r->resource_name(),
                 absl::GetFlag(FLAGS_shares_per_chip),
                 tpu::FormatBytes(r->share_quota_bytes()));
    resources.push_back(std::make_unique<TpuResource>(*std::move(r)));
  }

  const int num_chips = static_cast<int>(chips->size());
  ChipHealthWatcher health(
      num_chips,
      [&tpud]() -> absl::StatusOr<std::vector<ChipState>> {
        absl::StatusOr<tpu::HealthReport> h = tpud.Health();
        if (!h.ok()) return h.status();
        std::vector<ChipState> out;
        for (const tpu::ChipHealth& c : h->chips) {
          if (c.chip >= static_cast<int>(out.size())) out.resize(c.chip + 1);
          out[c.chip] = {c.healthy, c.drained, c.detail};
        }
        return out;
      },
      absl::GetFlag(FLAGS_health_interval));
  health.Start();
  // Both resources' servers share one view of which chips each holds.
  ChipClaims claims(num_chips, [&health] { health.Notify(); });

  PluginOptions options;
  options.device_plugin_dir = absl::GetFlag(FLAGS_device_plugin_dir);
  options.container_tpud_socket = absl::GetFlag(FLAGS_container_tpud_socket);
  options.host_tpud_socket_dir = absl::GetFlag(FLAGS_host_tpud_socket_dir);
  std::vector<std::unique_ptr<DevicePluginServer>> servers;
  for (const auto& r : resources) {
    servers.push_back(std::make_unique<DevicePluginServer>(
        r.get(), &health, &claims, &tpud, options));
  }
  std::unique_ptr<PodResourcesPoller> pod_resources;
  if (!absl::GetFlag(FLAGS_pod_resources_socket).empty()) {
    std::vector<DevicePluginServer*> raw;
    for (auto& s : servers) raw.push_back(s.get());
    pod_resources = std::make_unique<PodResourcesPoller>(
        absl::GetFlag(FLAGS_pod_resources_socket),
        absl::GetFlag(FLAGS_pod_resources_interval),
        absl::GetFlag(FLAGS_release_grace), &claims, &tpud, std::move(raw));
    pod_resources->Start();
  }

  // The main loop: (re)start servers whose socket is gone, and register
  // every server again whenever kubelet.sock is a new file (the kubelet
  // restarted) or the server was restarted.
  const std::string kubelet_socket =
      options.device_plugin_dir + "/kubelet.sock";
  std::vector<bool> registered(servers.size(), false);
  ino_t kubelet_inode = 0;
  bool warned_no_kubelet = false;
  KubeletSocketWatch watch(options.device_plugin_dir);
  while (!g_stop) {
    const bool recreated = watch.Recreated();
    const ino_t now_inode = InodeOf(kubelet_socket);
    if (now_inode != kubelet_inode || (recreated && now_inode != 0)) {
      if (kubelet_inode != 0)
        spdlog::info("kubelet.sock changed: registering again");
      kubelet_inode = now_inode;
      registered.assign(servers.size(), false);
    }
    for (size_t i = 0; i < servers.size(); ++i) {
      DevicePluginServer& s = *servers[i];
      if (!s.SocketPresent()) {
        s.Stop();
        if (absl::Status st = s.Start(); !st.ok()) {
          spdlog::error("{}", st.ToString());
          continue;
        }
        registered[i] = false;
      }
      if (!registered[i] && kubelet_inode != 0) {
        absl::Status st = s.Register(kubelet_socket);
        registered[i] = st.ok();
        if (!st.ok()) spdlog::warn("{}", st.ToString());
      }
    }
    if (kubelet_inode == 0 && !warned_no_kubelet) {
      spdlog::warn("no kubelet socket at {} yet; waiting", kubelet_socket);
    }
    warned_no_kubelet = kubelet_inode == 0;
    const absl::Time next =
        absl::Now() + absl::GetFlag(FLAGS_kubelet_check_interval);
    while (!g_stop && absl::Now() < next)
      absl::SleepFor(absl::Milliseconds(50));
  }
  spdlog::info("stopping");
  if (pod_resources != nullptr) pod_resources->Stop();
  for (auto& s : servers) s->Stop();
  health.Stop();
  return 0;
}

}  // namespace
}  // namespace tpud::k8s

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "tpud's Kubernetes device plugin: advertises tpud.io/chip and "
      "tpud.io/chip-share to the "
      "kubelet and turns each container's devices into a tpud allocation");
  absl::ParseCommandLine(argc, argv);
  return tpud::k8s::Run();
}
