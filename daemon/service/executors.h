// The executor processes that run every op, and the shared memory they map:
// the executors' table and the communicators' table.
//
// Everything they map is made here, and their zygote is forked here, so
// this must run before tpud has threads.
#ifndef TPUD_DAEMON_SERVICE_EXECUTORS_H_
#define TPUD_DAEMON_SERVICE_EXECUTORS_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/collectives/registry.h"
#include "daemon/core/runtime_core.h"
#include "daemon/core/shared_regions.h"
#include "daemon/executor/executor_pool.h"
#include "daemon/executor/thread_share.h"
#include "daemon/service/backend_choice.h"
#include "daemon/service/config.h"

namespace tpud {

class ExecutorProcesses {
 public:
  // One executor per chip of `core`, or one for all when the backend says
  // so. The pool is created, not started: its handlers need the data plane
  // (Servers starts it).
  static absl::StatusOr<std::unique_ptr<ExecutorProcesses>> Create(
      const TpudConfig& config, const ChosenBackend& backend,
      RuntimeCore* core);

  ExecutorShared* shared() const { return shared_; }
  ExecutorPool* pool() const { return pool_.get(); }
  CommunicatorRegistry* communicators() const { return communicators_.get(); }
  // The cores the executors share (ExecutorShared::num_cpus).
  const HostCores& cores() const { return cores_; }

 private:
  ExecutorProcesses() = default;

  // Destroyed in reverse: the pool before the tables its processes map.
  SharedMapping shared_memory_;
  ExecutorShared* shared_ = nullptr;  // in shared_memory_
  HostCores cores_;
  SharedMapping collective_memory_;
  std::unique_ptr<CommunicatorRegistry> communicators_;
  std::unique_ptr<ExecutorPool> pool_;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_SERVICE_EXECUTORS_H_
