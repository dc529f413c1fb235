// One kubelet device plugin (API v1beta1) per resource: it serves the
// DevicePlugin service on its own unix socket in the kubelet's
// device-plugins directory and registers that socket with the kubelet.
//
//   ListAndWatch            the resource's devices, healthy when their chip is
//                           healthy and not drained (ChipHealthWatcher), sent
//                           again whenever that changes;
//   GetPreferredAllocation  TpuResource::Preferred (contiguous chips, packed
//                           shares);
//   Allocate                per container: tpud's CreateAllocation with the
//                           devices' chips and quotas, answered with
//                           TPUD_SOCKET, TPU_VISIBLE_CHIPS, TPUD_TOKEN and a
//                           mount of tpud's socket directory.
//
// The kubelet never tells a device plugin when a container's devices are free
// again; it allocates a device anew once its previous pod is gone. So an
// allocation lasts until one of its devices is allocated again, or until the
// kubelet's pod-resources API no longer lists any of its devices
// (ReleaseGone), and is released then; the same devices allocated again (the
// next container of the pod: init containers hand theirs on) get the same
// allocation and token.
//
// A chip is given whole or as shares, never both (ChipClaims, shared by the
// servers of both resources): an allocation on a chip the other resource
// holds is refused, and such devices are listed Unhealthy.
//
// Thread-safety: gRPC calls its handlers from many threads; Start, Stop and
// Register must come from one thread (the plugin's main loop).
#ifndef TPUD_PLUGINS_K8S_DEVICE_PLUGIN_PLUGIN_SERVER_H_
#define TPUD_PLUGINS_K8S_DEVICE_PLUGIN_PLUGIN_SERVER_H_

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "plugins/k8s_device_plugin/api.grpc.pb.h"
#include "plugins/k8s_device_plugin/chip_claims.h"
#include "plugins/k8s_device_plugin/devices.h"
#include "plugins/k8s_device_plugin/health_watcher.h"
#include "plugins/k8s_device_plugin/tpud_admin.h"

namespace tpud::k8s {

// The inode of `path`, 0 if it does not exist (a socket recreated has a new
// one, though the number may come back).
ino_t InodeOf(const std::string& path);

struct PluginOptions {
  std::string device_plugin_dir;      // the kubelet's; its sockets live here
  std::string container_tpud_socket;  // TPUD_SOCKET inside the container
  std::string
      host_tpud_socket_dir;  // mounted at the container socket's directory
};

class DevicePluginServer final : public v1beta1::DevicePlugin::Service {
 public:
  DevicePluginServer(const TpuResource* resource,
                     const ChipHealthWatcher* health, ChipClaims* claims,
                     TpudAdmin* tpud, PluginOptions options);
  ~DevicePluginServer() override;

  const TpuResource& resource() const { return *resource_; }
  std::string socket_path() const;

  // Serves on socket_path() (a stale file there is removed first).
  absl::Status Start();
  // Ends every stream and stops serving; removes the socket.
  void Stop();
  // Whether the socket this server made is still there (the kubelet deletes
  // the plugins' sockets when it restarts).
  bool SocketPresent() const;
  // Registers with the kubelet serving Registration at `kubelet_socket`.
  absl::Status Register(const std::string& kubelet_socket) const;

  // Releases the allocations none of whose devices is in `held` (the
  // device IDs of this resource that live pods hold, from the kubelet) and
  // that are older than `grace` (a pod is listed only once the kubelet has
  // its Allocate answer). Returns how many were released.
  int ReleaseGone(const std::set<std::string>& held, absl::Duration grace)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same for allocations of this resource that tpud lists (`listed`)
  // and this server does not know: made before the plugin restarted, their
  // tokens are lost, so they are released by id. Their devices come from
  // the allocation's name ("<resource>: <id>,<id>").
  int ReleaseOrphans(const std::vector<tpu::AllocationInfo>& listed,
                     const std::set<std::string>& held, absl::Duration grace)
      ABSL_LOCKS_EXCLUDED(mu_);

  grpc::Status GetDevicePluginOptions(
      grpc::ServerContext* ctx, const v1beta1::Empty* req,
      v1beta1::DevicePluginOptions* resp) override;
  grpc::Status ListAndWatch(
      grpc::ServerContext* ctx, const v1beta1::Empty* req,
      grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) override;
  grpc::Status GetPreferredAllocation(
      grpc::ServerContext* ctx, const v1beta1::PreferredAllocationRequest* req,
      v1beta1::PreferredAllocationResponse* resp) override;
  grpc::Status Allocate(grpc::ServerContext* ctx,
                        const v1beta1::AllocateRequest* req,
                        v1beta1::AllocateResponse* resp) override;
  grpc::Status PreStartContainer(
      grpc::ServerContext* ctx, const v1beta1::PreStartContainerRequest* req,
      v1beta1::PreStartContainerResponse* resp) override;

 private:
  v1beta1::ListAndWatchResponse DeviceList(
      const std::vector<ChipState>& chips) const;
  // What a container gets: TPUD_SOCKET, TPU_VISIBLE_CHIPS, TPUD_TOKEN, the
  // socket directory's mount, the allocation's id as an annotation.
  void AnswerContainer(const AllocationPlan& plan, const std::string& token,
                       uint64_t allocation_id,
                       v1beta1::ContainerAllocateResponse* out) const;

  const TpuResource* resource_;
  const ChipHealthWatcher* health_;
  ChipClaims* claims_;
  TpudAdmin* tpud_;
  const PluginOptions options_;

  std::unique_ptr<grpc::Server> server_;
  ino_t socket_inode_ = 0;
  std::atomic<bool> stopping_{false};

  absl::Mutex mu_;  // serialises Allocate calls
  // The token of the allocation each device was last given to.
  std::map<std::string, std::string> token_of_device_ ABSL_GUARDED_BY(mu_);
  // Per live allocation (by token): its tpud id, its name (the claim's key)
  // and when it was made.
  struct Held {
    uint64_t id = 0;
    std::string name;
    absl::Time created;
  };
  std::map<std::string, Held> allocation_of_token_ ABSL_GUARDED_BY(mu_);
  // Ends the allocation of `token`: tpud releases it, its claim is dropped.
  void ReleaseLocked(const std::string& token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace tpud::k8s

#endif  // TPUD_PLUGINS_K8S_DEVICE_PLUGIN_PLUGIN_SERVER_H_
