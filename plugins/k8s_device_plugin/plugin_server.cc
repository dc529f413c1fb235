#include "plugins/k8s_device_plugin/plugin_server.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "proto/protocol.h"

namespace tpud::k8s {
namespace {

constexpr char kApiVersion[] = "v1beta1";

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

ino_t InodeOf(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

DevicePluginServer::DevicePluginServer(const TpuResource* resource,
                                       const ChipHealthWatcher* health,
                                       ChipClaims* claims, TpudAdmin* tpud,
                                       PluginOptions options)
    : resource_(resource),
      health_(health),
      claims_(claims),
      tpud_(tpud),
      options_(std::move(options)) {}

DevicePluginServer::~DevicePluginServer() { Stop(); }

std::string DevicePluginServer::socket_path() const {
  return absl::StrCat(options_.device_plugin_dir, "/",
                      resource_->socket_name());
}

absl::Status DevicePluginServer::Start() {
  const std::string path = socket_path();
  unlink(path.c_str());  // a stale socket from an earlier run
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("unix:", path),
                           grpc::InsecureServerCredentials());
  builder.RegisterService(this);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve the ", resource_->resource_name(), " device plugin on ",
        path, "; is --device_plugin_dir (", options_.device_plugin_dir,
        ") the kubelet's device-plugins directory, and writable?"));
  }
  socket_inode_ = InodeOf(path);
  spdlog::info("{}: serving on {}", resource_->resource_name(), path);
  return absl::OkStatus();
}

void DevicePluginServer::Stop() {
  if (server_ == nullptr) return;
  stopping_ = true;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server_.reset();
  const std::string path = socket_path();
  if (socket_inode_ != 0 && InodeOf(path) == socket_inode_)
    unlink(path.c_str());
  socket_inode_ = 0;
  stopping_ = false;
}

bool DevicePluginServer::SocketPresent() const {
  return socket_inode_ != 0 && InodeOf(socket_path()) == socket_inode_;
}

absl::Status DevicePluginServer::Register(
    const std::string& kubelet_socket) const {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("unix:", kubelet_socket),
                          grpc::InsecureChannelCredentials());
  std::unique_ptr<v1beta1::Registration::Stub> stub =
      v1beta1::Registration::NewStub(channel);
  v1beta1::RegisterRequest req;
  req.set_version(kApiVersion);
  req.set_endpoint(resource_->socket_name());
  req.set_resource_name(resource_->resource_name());
  req.mutable_options()->set_get_preferred_allocation_available(true);
  v1beta1::Empty resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Status st = stub->Register(&ctx, req, &resp);
  if (!st.ok()) {
    return absl::Status(FromGrpcStatus(st).code(),
                        absl::StrCat("registering ", resource_->resource_name(),
                                     " with the kubelet at ", kubelet_socket,
                                     " failed: ", st.error_message()));
  }
  spdlog::info("{}: registered with the kubelet at {}",
               resource_->resource_name(), kubelet_socket);
  return absl::OkStatus();
}

grpc::Status DevicePluginServer::GetDevicePluginOptions(
    grpc::ServerContext*, const v1beta1::Empty*,
    v1beta1::DevicePluginOptions* resp) {
  resp->set_get_preferred_allocation_available(true);
  return grpc::Status::OK;
}

v1beta1::ListAndWatchResponse DevicePluginServer::DeviceList(
    const std::vector<ChipState>& chips) const {
  v1beta1::ListAndWatchResponse resp;
  const std::vector<bool> healthy = resource_->Health(chips);
  // A chip the other resource holds is not offered (ChipClaims).
  const std::vector<bool> taken =
      claims_->HeldByOthers(resource_->resource_name());
  for (size_t i = 0; i < resource_->devices().size(); ++i) {
    const Device& dev = resource_->devices()[i];
    const bool free =
        dev.chip < static_cast<int>(taken.size()) && !taken[dev.chip];
    v1beta1::Device* d = resp.add_devices();
    d->set_id(dev.id);
    d->set_health(healthy[i] && free ? "Healthy" : "Unhealthy");
  }
  return resp;
}

grpc::Status DevicePluginServer::ListAndWatch(
    grpc::ServerContext* ctx, const v1beta1::Empty*,
    grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) {
  ChipHealthWatcher::Snapshot snap = health_->Current();
  std::string sent;
  while (!ctx->IsCancelled() && !stopping_) {
    const v1beta1::ListAndWatchResponse list = DeviceList(snap.chips);
    const std::string bytes = list.SerializeAsString();
    if (bytes != sent) {
      if (!writer->Write(list)) break;  // the kubelet went away
      sent = bytes;
    }
    // Short waits, so a stopping server or a gone kubelet ends the stream.
    snap = health_->WaitForChange(snap.version, absl::Milliseconds(200));
  }
  return grpc::Status::OK;
}

grpc::Status DevicePluginServer::GetPreferredAllocation(
    grpc::ServerContext*, const v1beta1::PreferredAllocationRequest* req,
    v1beta1::PreferredAllocationResponse* resp) {
  for (const v1beta1::ContainerPreferredAllocationRequest& c :
       req->container_requests()) {
    std::vector<std::string> available(c.available_deviceids().begin(),
                                       c.available_deviceids().end());
    std::vector<std::string> must(c.must_include_deviceids().begin(),
                                  c.must_include_deviceids().end());
    absl::StatusOr<std::vector<std::string>> picked =
        resource_->Preferred(available, must, c.allocation_size());
    if (!picked.ok()) return ToGrpcStatus(picked.status());
    v1beta1::ContainerPreferredAllocationResponse* out =
        resp->add_container_responses();
    for (const std::string& id : *picked) out->add_deviceids(id);
  }
  return grpc::Status::OK;
}

grpc::Status DevicePluginServer::Allocate(grpc::ServerContext*,
                                          const v1beta1::AllocateRequest* req,
                                          v1beta1::AllocateResponse* resp) {
  // Every container's devices are checked before tpud is asked for anything.
  std::vector<AllocationPlan> plans;
  std::vector<std::vector<std::string>> ids;
  for (const v1beta1::ContainerAllocateRequest& c : req->container_requests()) {
    ids.emplace_back(c.devices_ids().begin(), c.devices_ids().end());
    absl::StatusOr<AllocationPlan> plan = resource_->Plan(ids.back());
    if (!plan.ok()) return ToGrpcStatus(plan.status());
    plans.push_back(*std::move(plan));
  }
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < plans.size(); ++i) {
    // The kubelet gives a device again only once its last pod is gone (or,
    // with the same devices, to the next container of one pod: init
    // containers pass theirs on), so the allocations that held these devices
    // are over, unless one held exactly these: that one serves again.
    std::set<std::string> superseded;
    for (const std::string& id : ids[i]) {
      auto it = token_of_device_.find(id);
      if (it != token_of_device_.end()) superseded.insert(it->second);
    }
    const std::set<std::string> wanted(ids[i].begin(), ids[i].end());
    std::string reuse;
    bool all_held = true;
    for (const std::string& id : wanted)
      all_held = all_held && token_of_device_.count(id) > 0;
    if (superseded.size() == 1 && all_held) {
      const std::string& token = *superseded.begin();
      size_t held = 0;
      for (const auto& [id, t] : token_of_device_) held += t == token ? 1 : 0;
      auto alloc = allocation_of_token_.find(token);
      if (held == wanted.size() && alloc != allocation_of_token_.end())
        reuse = token;
    }
    if (!reuse.empty()) {
      AnswerContainer(plans[i], reuse, allocation_of_token_[reuse].id,
                      resp->add_container_responses());
      continue;
    }
    // The chips, claimed before anything else changes: a chip the other
    // resource holds refuses the container here.
    const std::string name = absl::StrCat(resource_->resource_name(), ": ",
                                          absl::StrJoin(ids[i], ","));
    if (absl::Status st =
            claims_->Claim(name, resource_->resource_name(), plans[i].chips);
        !st.ok()) {
      spdlog::warn("{}: refused {}: {}", resource_->resource_name(),
                   absl::StrJoin(ids[i], ","), std::string(st.message()));
      return ToGrpcStatus(st);
    }
    for (const std::string& token : superseded) ReleaseLocked(token);
    absl::StatusOr<tpu::CreatedAllocation> created =
        tpud_->CreateAllocation(plans[i].chips, plans[i].quota_bytes, name);
    if (!created.ok()) {
      claims_->Drop(name);
      return ToGrpcStatus(absl::Status(
          created.status().code(),
          absl::StrCat(
              "tpud (", tpud_->admin_socket(), ") refused the allocation for ",
              absl::StrJoin(ids[i], ","), ": ", created.status().message())));
    }
    for (const std::string& id : ids[i]) token_of_device_[id] = created->token;
    allocation_of_token_[created->token] = {created->id, name, absl::Now()};
    spdlog::info("{}: allocation {} for {} (chips {})",
                 resource_->resource_name(), created->id,
                 absl::StrJoin(ids[i], ","),
                 absl::StrJoin(plans[i].chips, ","));
    AnswerContainer(plans[i], created->token, created->id,
                    resp->add_container_responses());
  }
  return grpc::Status::OK;
}

void DevicePluginServer::ReleaseLocked(const std::string& token) {
  auto held = allocation_of_token_.find(token);
  if (held != allocation_of_token_.end()) {
    claims_->Drop(held->second.name);
    allocation_of_token_.erase(held);
  }
  absl::Status st = tpud_->ReleaseAllocation(token);
  if (!st.ok() && st.code() != absl::StatusCode::kNotFound) {
    spdlog::warn("{}: releasing an earlier allocation failed: {}",
                 resource_->resource_name(), st.ToString());
  }
  for (auto it = token_of_device_.begin(); it != token_of_device_.end();) {
    it = it->second == token ? token_of_device_.erase(it) : std::next(it);
  }
}

int DevicePluginServer::ReleaseGone(const std::set<std::string>& held,
                                    absl::Duration grace) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<std::string> gone;
  for (const auto& [token, a] : allocation_of_token_) {
    if (now - a.created < grace) continue;
    bool listed = false;
    for (const auto& [id, t] : token_of_device_) {
      if (t == token && held.count(id) > 0) listed = true;
    }
    if (!listed) gone.push_back(token);
  }
  for (const std::string& token : gone) {
    spdlog::info(
        "{}: allocation {} ({}) released: the kubelet lists no pod "
        "holding its devices",
        resource_->resource_name(), allocation_of_token_[token].id,
        allocation_of_token_[token].name);
    ReleaseLocked(token);
  }
  return static_cast<int>(gone.size());
}

int DevicePluginServer::ReleaseOrphans(
    const std::vector<tpu::AllocationInfo>& listed,
    const std::set<std::string>& held, absl::Duration grace) {
  absl::MutexLock lock(&mu_);
  const std::string prefix = absl::StrCat(resource_->resource_name(), ": ");
  const double now = absl::ToUnixSeconds(absl::Now());
  std::set<uint64_t> known;
  for (const auto& [token, a] : allocation_of_token_) known.insert(a.id);
  int released = 0;
  for (const tpu::AllocationInfo& a : listed) {
    if (!absl::StartsWith(a.name, prefix) || known.count(a.id) > 0 ||
        now - a.created_unix_seconds < absl::ToDoubleSeconds(grace)) {
      continue;
    }
    bool listed_by_kubelet = false;
    for (absl::string_view id :
         absl::StrSplit(absl::string_view(a.name).substr(prefix.size()), ',')) {
      if (held.count(std::string(id)) > 0) listed_by_kubelet = true;
    }
    if (listed_by_kubelet) continue;
    absl::Status st = tpud_->ReleaseAllocationById(a.id);
    if (!st.ok() && st.code() != absl::StatusCode::kNotFound) {
      spdlog::warn("{}: releasing allocation {} failed: {}",
                   resource_->resource_name(), a.id, st.ToString());
      continue;
    }
    spdlog::info(
        "{}: allocation {} ({}) released: made before this plugin started, "
        "and the kubelet lists no pod holding its devices",
        resource_->resource_name(), a.id, a.name);
    ++released;
  }
  return released;
}

void DevicePluginServer::AnswerContainer(
    const AllocationPlan& plan, const std::string& token,
    uint64_t allocation_id, v1beta1::ContainerAllocateResponse* out) const {
  (*out->mutable_envs())["TPUD_SOCKET"] = options_.container_tpud_socket;
  (*out->mutable_envs())["TPU_VISIBLE_CHIPS"] = absl::StrJoin(plan.chips, ",");
  (*out->mutable_envs())["TPUD_TOKEN"] = token;
  (*out->mutable_annotations())["tpud.io/allocation-id"] =
      absl::StrCat(allocation_id);
  v1beta1::Mount* m = out->add_mounts();
  m->set_container_path(Dirname(options_.container_tpud_socket));
  m->set_host_path(options_.host_tpud_socket_dir);
  m->set_read_only(false);  // connecting to a unix socket writes to it
}

grpc::Status DevicePluginServer::PreStartContainer(
    grpc::ServerContext*, const v1beta1::PreStartContainerRequest*,
    v1beta1::PreStartContainerResponse*) {
  return grpc::Status::OK;
}

}  // namespace tpud::k8s
