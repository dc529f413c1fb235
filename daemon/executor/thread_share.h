// ThreadShare: how many threads each op of an executor may use (ATen's
// intra-op pool on the simulated chip), so that busy chips share the host's
// cores instead of each taking all of them.
//
// Every executor is a process with an intra-op pool of its own. Left at
// ATen's default, each uses every core, and four busy chips on two cores run
// eight threads that preempt one another at every parallel region: a 4-rank
// FSDP step took 11.8 s so, 1.9 s with one thread per executor. So by default
// (--intra_op_threads=0, "automatic") the cores tpud may use are shared among
// the executors that are busy now: one busy alone gets them all (never more
// than its backend's own default), n busy get cores / n each, at least one,
// the remainder going to the lowest-numbered. An explicit
// --intra_op_threads=N is N for every executor, whatever the load.
//
// An executor is busy while it is inside an op, and for kBusyWindowNs after
// it last ran work. Executors publish both in their ExecutorSlot
// (op_started_ns, last_work_ns), so each counts the busy ones by reading two
// words per executor, about once a millisecond while it works, and applies a
// changed count between ops: no system call, no message, nothing per op.
//
// Thread-safety: the free functions are thread-safe; a ThreadShare belongs
// to its executor's one thread.
#ifndef TPUD_DAEMON_EXECUTOR_THREAD_SHARE_H_
#define TPUD_DAEMON_EXECUTOR_THREAD_SHARE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/core/shared_regions.h"

namespace tpud {

// How long after its last work an executor still counts as busy: longer than
// the gaps between a training step's ops (a rank waiting for its peers'
// collective), so counts change as chips start and stop, not op by op.
inline constexpr uint64_t kBusyWindowNs = 100'000'000;

// The threads an executor's ops get. `fixed` > 0: exactly that. Otherwise
// `cores` shared among `busy` busy executors, this one the `position`-th of
// them (0-based, in executor order): cores / busy, plus one for the first
// cores % busy of them, and at least 1. `busy` counts this executor.
int IntraOpThreadsFor(int fixed, int cores, int busy, int position);

// Whether the executor of `slot` counts as busy at `now` (CLOCK_MONOTONIC).
bool ExecutorBusy(const ExecutorSlot& slot, uint64_t now);

// The cores tpud's processes may use.
struct HostCores {
  int cores = 1;     // min(affinity, quota when there is one)
  int affinity = 1;  // CPUs in the process's affinity mask
  int quota = 0;     // the cgroup's CPU quota in cores, rounded up; 0: none
};
// Reads sched_getaffinity and the CPU quota of the process's cgroup and
// its ancestors (cgroup v2 cpu.max, v1 cpu.cfs_quota_us), the smallest.
HostCores AvailableCores();
// Cores a cgroup v2 cpu.max ("max 100000", "150000 100000") allows, rounded
// up; 0 for no limit or text it cannot read.
int CpuMaxCores(absl::string_view cpu_max);
// The same for cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us (quota
// -1: no limit).
int CfsQuotaCores(int64_t quota_us, int64_t period_us);
// "automatic: 2 cores (CPU affinity 2, no cgroup quota) shared among busy
// chips" or "4 per executor (--intra_op_threads)", for the start-up log.
std::string DescribeThreadPolicy(int fixed, const HostCores& cores);

// An executor's side: publishes its activity and keeps its backend's
// thread count at its share.
class ThreadShare {
 public:
  // `fixed`: --intra_op_threads. Reads the backend's count now (its
  // default) and publishes it; a backend without one (0) is left alone.
  ThreadShare(ExecutorShared* shared, int index, int fixed,
              ChipBackend* backend);

  // The executor ran work until `now`.
  void Worked(uint64_t now) {
    slot_->last_work_ns.store(now, std::memory_order_relaxed);
  }
  // The count its ops should use at `now`.
  int Wanted(uint64_t now) const;
  // Sets the backend's count to Wanted(now) when it differs. Between ops.
  void Apply(uint64_t now);

 private:
  ExecutorShared* const shared_;
  ExecutorSlot* const slot_;
  const int index_;
  const int fixed_;
  ChipBackend* const backend_;
  int ceiling_ = 0;  // alone on the host; 0: the backend has no count
  int wanted_ = 0;   // the count last asked of the backend
  int applied_ = 0;  // what the backend said it uses then
};

}  // namespace tpud

#endif  // TPUD_DAEMON_EXECUTOR_THREAD_SHARE_H_
