// WaitAdvisor: how tpud's waiting parties (executors and clients) should
// wait, from how busy the host's cores are.
//
// Thread-safety: not thread-safe; DataPlane's advisor thread owns one.
#ifndef TPUD_DAEMON_DATAPLANE_WAIT_ADVISOR_H_
#define TPUD_DAEMON_DATAPLANE_WAIT_ADVISOR_H_

#include <cstdint>

#include "tpu/shm_layout.h"

namespace tpud {

// How waiting parties should wait (tpu::WaitAdvice). Pure logic, fed one
// sample per period. CUDA's rule made host-aware: tpud's active parties
// (sessions with recent work, each counted as one client thread, and
// executors awake) must not outnumber the cores, and the rest of the host's
// runnable threads ("others", a moving average over about four samples) must
// fit in the cores left over: spin on below `free + 0.5`, off above
// `free + 0.75`. Not spinning, waiters yield while others stay below 0.5 (on)
// / 0.75 (off): only tpud's parties compete, and a yield hands the core to
// one of them. Otherwise they sleep at once: a thread that yields to a busy
// loop waits out the loop's whole time slice, while one woken from a futex
// gets the core back at once.
class WaitAdvisor {
 public:
  explicit WaitAdvisor(int num_cpus) : num_cpus_(num_cpus) {}
  // `runnable`: the host's runnable threads, not counting the sampler.
  uint32_t Update(int active_parties, int runnable);
  // The host was idle for tpud: the next sample starts the average afresh.
  void Restart() { fresh_ = true; }
  uint32_t advice() const { return advice_; }

 private:
  const int num_cpus_;
  double others_ = 0;  // runnable threads that are not tpud's parties
  bool fresh_ = true;
  uint32_t advice_ = tpu::kWaitSleep;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_DATAPLANE_WAIT_ADVISOR_H_
