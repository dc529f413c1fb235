// ExecutorPool: tpud's executor processes, and their supervision.
//
// Ops run in executor processes so that a kernel that crashes or hangs ends
// only the session whose op it was (daemon/executor/executor.h). tpud forks a
// small "zygote" at start-up, before it has any threads; the zygote forks
// executors on demand, so every executor (and every replacement) starts from
// the same clean, single-threaded image: HBM, page-owner tables and the
// executor region are already mapped, and torch is loaded.
//
// The pool's supervisor thread watches each executor's control channel: it
// answers result-memory requests, notices a death at once (the channel
// closes; the zygote reports how the process ended), kills an executor whose
// op runs past the deadline, and starts a replacement, which is handed every
// live session again. The session whose op was running when an executor died
// is handed to the crash handler (tpud ends it with an error naming the op
// and the signal); no other session loses anything.
//
// Thread-safety: thread-safe, except Create (see there).
#ifndef TPUD_DAEMON_EXECUTOR_EXECUTOR_POOL_H_
#define TPUD_DAEMON_EXECUTOR_EXECUTOR_POOL_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/core/shared_regions.h"
#include "daemon/executor/control_channel.h"

namespace tpud {

struct ExecutorPoolOptions {
  // Executor e serves chips_of[e]; every chip is served by exactly one.
  std::vector<std::vector<int>> chips_of;
  // An op running longer than this gets its executor killed (0: never).
  absl::Duration op_timeout = absl::Minutes(10);
  // The executors keep tensors in memory of their own (PJRT device buffers,
  // the arena only a host copy brought up to date when the host reads): an
  // executor that dies takes the only copy of its sessions' data with it,
  // so every session attached to it ends, not only the one whose op was
  // running (which with data in the arena is all that must).
  bool device_memory = false;
};

// Why an executor was replaced, and whose op it was running.
struct ExecutorRestart {
  absl::Time when;
  int executor = 0;
  std::vector<int> chips;
  int pid = 0;
  std::string reason;       // "SIGSEGV (segmentation fault)", "ran past the op
                            // deadline", ...
  uint64_t session_id = 0;  // 0: no op was running
  std::string op;
  int ring = 0;
  uint64_t sequence = 0;
};

struct ExecutorInfo {
  int index = 0;
  std::vector<int> chips;
  int pid = 0;
  bool ready = false;
  uint64_t restarts = 0;
  uint64_t busy_ns = 0;  // since the daemon started (across restarts)
  uint64_t ops = 0;
  uint64_t unrung_wakes = 0;  // ExecutorSlot::unrung_wakes, across restarts
  double duty_cycle = 0;
  // A compiling backend's figures (since this executor process started),
  // one per chip in `chips` order; empty for backends that do not compile.
  std::vector<CompileStats> compile;
  uint64_t programs_cached = 0;
  uint64_t device_buffer_bytes = 0;
  // The compilation cache on disk (since this executor process started,
  // for its counters); enabled false: none, or a backend that does not
  // compile.
  DiskCacheStats disk_cache;
  // Threads each of its ops may use now, and at most (alone on the host);
  // 0: the backend's own business (thread_share.h). Busy: inside an op, or
  // it ran work within the last kBusyWindowNs.
  int intra_op_threads = 0;
  int intra_op_threads_max = 0;
  bool busy = false;
  // For metrics, since the daemon started (across restarts), by position in
  // `chips`: records run per latency bucket (kOpLatencyBoundsNs; not
  // cumulative) and their total time; and records waiting now.
  std::vector<std::array<uint64_t, kOpLatencyBuckets>> op_latency;
  std::vector<uint64_t> op_latency_sum_ns;
  std::vector<uint64_t> queue_depth;
  // Failed op records by absl::StatusCode, across restarts.
  std::array<uint64_t, kStatusCodes> op_errors{};
};

class ExecutorPool {
 public:
  // Runs in a new executor process: serve as executor `index` on
  // `control_fd`; the return value is the process's exit code.
  using ExecutorEntry = std::function<int(int index, int control_fd)>;
  // Result memory for the synchronous path: a device address, or why not.
  using AllocHandler = std::function<absl::StatusOr<uint64_t>(
      uint64_t session_id, int chip, uint64_t bytes)>;
  using FreeHandler =
      std::function<void(uint64_t session_id, uint64_t address)>;
  // An executor died in an op of `session_id`; `message` says which and how.
  using CrashHandler =
      std::function<void(uint64_t session_id, const std::string& message)>;

  // Forks the zygote. REQUIRES: the process has no other thread yet, and
  // everything executors map (HBM, owner tables, `shared`, wake fds) exists.
  static absl::StatusOr<std::unique_ptr<ExecutorPool>> Create(
      ExecutorPoolOptions options, ExecutorShared* shared,
      std::vector<int> wake_fds, ExecutorEntry entry);
  ~ExecutorPool();

  void SetHandlers(AllocHandler alloc, FreeHandler free, CrashHandler crash);

  // Starts every executor and the supervisor; waits until all are ready.
  absl::Status Start(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the executors and the zygote.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Hands a session to every executor (and to every replacement later). Takes
  // the descriptors: shm, state, and one doorbell eventfd per executor.
  void Attach(uint64_t session_id, uint32_t tag, int shm_fd, uint64_t shm_bytes,
              int state_fd, uint64_t state_bytes, std::vector<int> doorbells)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Detach(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Returns once no executor is inside an op of the session tagged `tag`
  // (pages cleared before the call are then unused; see shared_regions.h).
  void Fence(uint32_t tag);
  // Tells every executor that the segment [address, +bytes) was freed.
  void Released(uint64_t address, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  int num_executors() const {
    return static_cast<int>(options_.chips_of.size());
  }
  int ExecutorOfChip(int chip) const;
  std::vector<ExecutorInfo> Executors() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<ExecutorRestart> Restarts() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Worker {
    int control_fd = -1;  // tpud's end; -1 while not running
    int pid = 0;
    bool ready = false;
    bool hung = false;  // killed for running past the deadline
    uint64_t generation = 0;
    uint64_t restarts = 0;
    uint64_t busy_base_ns = 0;  // from earlier incarnations
    uint64_t ops_base = 0;
    uint64_t unrung_base = 0;
    // Metrics counters of earlier incarnations (see ExecutorInfo).
    std::array<std::array<uint64_t, kOpLatencyBuckets>, tpu::kMaxChipsPerHost>
        latency_base{};
    std::array<uint64_t, tpu::kMaxChipsPerHost> latency_sum_base{};
    std::array<uint64_t, kStatusCodes> errors_base{};
    absl::Time next_start = absl::InfinitePast();
    bool start_pending = false;
  };
  struct SessionFds {
    uint32_t tag = 0;
    int shm_fd = -1;
    uint64_t shm_bytes = 0;
    int state_fd = -1;
    uint64_t state_bytes = 0;
    std::vector<int> doorbells;
    bool doomed = false;  // its op crashed an executor: never attached again
  };

  ExecutorPool(ExecutorPoolOptions options, ExecutorShared* shared,
               std::vector<int> wake_fds);
  static int RunZygote(int fd, const ExecutorEntry& entry);
  // Asks the zygote for executor `e`. REQUIRES: mu_ held.
  bool SpawnLocked(int e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AttachLocked(int e, uint64_t id, const SessionFds& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Supervise();
  void OnZygoteMessage();
  void OnWorkerMessage(int e);
  void OnWorkerDeath(int e, int wait_status) ABSL_LOCKS_EXCLUDED(mu_);
  void CheckDeadlines();
  static void CloseSession(SessionFds& s);

  const ExecutorPoolOptions options_;
  ExecutorShared* const shared_;
  const std::vector<int> wake_fds_;
  std::vector<int> executor_of_chip_;
  int zygote_fd_ = -1;
  int zygote_pid_ = 0;
  bool zygote_gone_ = false;  // supervisor thread only
  int epoll_fd_ = -1;
  int stop_fd_ = -1;
  std::thread supervisor_;
  std::thread reaper_;
  std::atomic<bool> stopping_{false};

  AllocHandler alloc_;
  FreeHandler free_;
  CrashHandler crash_;

  mutable absl::Mutex mu_;
  std::vector<Worker> workers_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, SessionFds> sessions_ ABSL_GUARDED_BY(mu_);
  std::vector<ExecutorRestart> restarts_ ABSL_GUARDED_BY(mu_);
  std::map<int, int> exit_status_
      ABSL_GUARDED_BY(mu_);  // pid -> wait status (from the zygote)
  // Sessions to end after a crash, for the reaper thread (ending a session
  // waits on executors, which the supervisor must stay free to answer).
  std::vector<std::pair<uint64_t, std::string>> doomed_ ABSL_GUARDED_BY(mu_);
  absl::CondVar doomed_cv_;
};

// What a signal is, for messages: "SIGSEGV (segmentation fault)".
std::string SignalDescription(int sig);

}  // namespace tpud

#endif  // TPUD_DAEMON_EXECUTOR_EXECUTOR_POOL_H_
