// FairQueue: which ring an executor runs next.
//
// Among the rings that have work, the executor serves one of the session that
// has used the chip least (measured busy time, its "virtual time"); the rings
// of one session take turns. A session that becomes active again is charged
// at least the virtual time of the session served last, less a small credit:
// it cannot bank idle time and then monopolise the chip, yet a light,
// interactive session is served at once beside heavy ones.
//
// Rings are the caller's small integer handles; the queue only orders them.
//
// Thread-safety: not thread-safe (one executor thread owns it).
#ifndef TPUD_DAEMON_EXECUTOR_FAIR_QUEUE_H_
#define TPUD_DAEMON_EXECUTOR_FAIR_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>

namespace tpud {

class FairQueue {
 public:
  // How much virtual time a returning session may be ahead of the others.
  static constexpr double kReturnCreditNs = 2e6;

  struct Pick {
    uint64_t session = 0;
    int ring = 0;
  };

  // Queues `ring` of `session` (REQUIRES: not queued already).
  void Push(uint64_t session, int ring);
  // The ring to run next, removed from the queue; nullopt when none.
  std::optional<Pick> Pop();
  // Charges `busy_ns` of chip time to `session`.
  void Charge(uint64_t session, uint64_t busy_ns);
  // Forgets a session and drops its queued rings.
  void Forget(uint64_t session);

  bool empty() const { return order_.empty(); }
  size_t queued_sessions() const { return order_.size(); }
  double vtime(uint64_t session) const;

 private:
  struct SessionEntry {
    double vtime = 0;
    std::deque<int> rings;
  };
  void Reorder(uint64_t session, SessionEntry& e, double new_vtime);

  std::unordered_map<uint64_t, SessionEntry> sessions_;
  std::set<std::pair<double, uint64_t>> order_;  // sessions with queued rings
  double now_ = 0;  // virtual time of the session served last
};

}  // namespace tpud

#endif  // TPUD_DAEMON_EXECUTOR_FAIR_QUEUE_H_
