// DataPlane: tpud's side of the sessions' shared-memory op streams.
//
// When a client attaches its data-plane connection, tpud creates the
// session's shared memory (a sealed memfd; layout in tpu/shm_layout.h), its
// state region (daemon/core/shared_regions.h) and one doorbell eventfd
// per executor, hands all of it to the executors (ExecutorPool) and returns
// the memfd and the doorbells for the client. Executors do the rest; tpud
// never runs an op.
//
// It also keeps the host's wait advice current (WaitAdvisor): waiting parties
// (executors and clients) spin only while tpud's active parties fit in the
// cores and a core is free for them, yield for a moment while only tpud's own
// parties compete, and otherwise block at once.
//
// Thread-safety: thread-safe.
#ifndef TPUD_DAEMON_DATAPLANE_DATA_PLANE_H_
#define TPUD_DAEMON_DATAPLANE_DATA_PLANE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/runtime_core.h"
#include "daemon/core/shared_regions.h"
#include "daemon/dataplane/wait_advisor.h"
#include "daemon/executor/executor_pool.h"
#include "tpu/shm_layout.h"

namespace tpud {

struct DataPlaneOptions {
  uint64_t ring_bytes = 1 << 20;      // per ring; power of two
  uint64_t staging_bytes = 64 << 20;  // per session, split among streams
  uint64_t default_pinned_bytes = 256 << 20;
  uint64_t max_pinned_bytes = uint64_t{4} << 30;
};

struct ProgramActivity {
  uint32_t id = 0;
  int chip = 0;
  std::string name;
  uint32_t records = 0;
  uint64_t calls = 0;
  uint64_t busy_ns = 0;
  uint64_t compiles = 0;     // runs whose module was compiled
  std::string last_compile;  // why the latest was
};

struct SessionActivity {
  uint64_t busy_ns = 0;
  uint64_t ops = 0;
  std::vector<ProgramActivity> programs;  // captured programs it ran
};

struct ChipUsage {
  uint64_t busy_ns = 0;  // since start
  uint64_t ops = 0;
  double duty_cycle = 0;  // busy fraction over the last full second
};

// What the client gets for its data plane (the caller sends and closes them).
struct DataPlaneGrant {
  int memfd = -1;
  uint64_t shm_bytes = 0;
  std::vector<int> doorbells;  // one per chip
};

class DataPlane {
 public:
  DataPlane(RuntimeCore* core, ExecutorPool* pool, ExecutorShared* shared,
            DataPlaneOptions options);
  ~DataPlane();

  // Creates the session's shared memory and state and hands them to the
  // executors.
  absl::StatusOr<DataPlaneGrant> Attach(uint64_t session_id,
                                        absl::string_view token,
                                        const PeerIdentity& peer,
                                        uint64_t pinned_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Marks the session dead, tells its client (every ring fails with a
  // "session ended" error) and detaches it from the executors. Called by
  // RuntimeCore (session end hook) before the session's HBM is reclaimed.
  void Detach(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails every ring of the session with `status` (before it is ended), so
  // its client learns why.
  void FailSession(uint64_t session_id, const absl::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);

  SessionActivity Activity(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);
  ChipUsage ChipActivity(int chip);
  // The wait advice (tpu::WaitAdvice) in force now.
  uint32_t wait_advice() const { return wait_advice_.load(); }

  // Starts keeping the wait advice current (one thread, asleep while the
  // host is idle).
  void Start();
  // Stops everything (daemon shutdown).
  void StopAll() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct SessionPlane {
    SharedMapping shm;
    SharedMapping state;
    tpu::ShmHeader layout{};
  };
  static void FailRings(SessionPlane& plane, const absl::Status& status);
  void AdviseLoop();
  void PublishWaitAdvice(uint32_t advice) ABSL_LOCKS_EXCLUDED(mu_);

  RuntimeCore* const core_;
  ExecutorPool* const pool_;
  ExecutorShared* const shared_;
  const DataPlaneOptions options_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint32_t> wait_advice_{tpu::kWaitSleep};
  std::thread advisor_;
  absl::Mutex mu_;
  std::map<uint64_t, std::unique_ptr<SessionPlane>> sessions_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tpud

#endif  // TPUD_DAEMON_DATAPLANE_DATA_PLANE_H_
