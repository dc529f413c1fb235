// ChipScheduler: who runs next on a chip.
//
// A chip runs one op at a time. Streams that want it queue here; when the
// chip frees up it goes to the waiting session that has used the chip least
// (measured busy time), so a client with a stream of heavy ops cannot starve
// a light one. A session that starts (or returns from idle) is credited with
// the current minimum, so it cannot bank idle time and then monopolise the
// chip. When the chip frees up and the least served session is not waiting
// at that instant but ran a moment ago (its next op is on its way), the chip
// is reserved for it briefly, so many small ops are not interleaved one for
// one with another session's large ones.
//
// Thread-safety: thread-safe.
#ifndef TPUD_DAEMON_CHIP_SCHEDULER_H_
#define TPUD_DAEMON_CHIP_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tpud {

struct ChipUsage {
  uint64_t busy_ns = 0;         // since start
  uint64_t ops = 0;
  double duty_cycle = 0;        // busy fraction over the last full window
};

class ChipScheduler {
 public:
  explicit ChipScheduler(int num_chips);

  // Blocks until `session` may run on `chip`.
  void Acquire(int chip, uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives the chip back after `busy_ns` of work for `session`. `more_work`:
  // the caller has another op queued right behind this one.
  // `now_ns`: the caller's MonotonicNanos() at the end of the work (0: read
  // the clock here).
  void Release(int chip, uint64_t session, uint64_t busy_ns, bool more_work,
               uint64_t now_ns = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets a session's accounting (it ended).
  void ForgetSession(uint64_t session) ABSL_LOCKS_EXCLUDED(mu_);

  ChipUsage Usage(int chip) ABSL_LOCKS_EXCLUDED(mu_);

  // Window over which duty cycles are measured.
  static constexpr uint64_t kWindowNs = 1000000000;
  // How long a chip waits for the session it is reserved for.
  static constexpr uint64_t kReservationNs = 300000;
  // A session that released the chip this recently counts as competing.
  static constexpr uint64_t kActiveNs = 2000000;

 private:
  struct Waiter {
    uint64_t session;
    bool granted = false;
  };
  struct Chip {
    bool busy = false;
    uint64_t holder = 0;        // session running now (when busy)
    uint64_t reserved_for = 0;  // session that may take the chip next
    uint64_t reserved_until = 0;
    std::vector<Waiter*> waiters;
    std::map<uint64_t, double> vtime;         // per session: busy ns
    std::map<uint64_t, uint64_t> last_seen;   // per session: last release
    uint64_t busy_ns = 0;
    uint64_t ops = 0;
    uint64_t window_start_ns = 0;
    uint64_t window_busy_ns = 0;
    double last_duty = 0;
  };
  double MinVtimeLocked(const Chip& c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands the (free) chip to the least served waiter, or marks it idle.
  void GrantNextLocked(Chip& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RollWindowLocked(Chip& c, uint64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::vector<Chip> chips_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tpud

#endif  // TPUD_DAEMON_CHIP_SCHEDULER_H_
