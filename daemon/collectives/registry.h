// CommunicatorRegistry: tpud's side of collectives (see shared_table.h for
// the table the ranks meet in, groups.h for how they meet, algorithms.h for
// how the data moves).
//
// A communicator forms when every one of its ranks has joined under the same
// key (a token its job shares through torch.distributed's store): rank r is
// one chip of one session. The registry gives it a slot in the shared
// CollectiveTable, orders its ranks along a ring of the host's torus, and
// fails it when the session of a member ends, so that no rank waits for a
// peer that is gone. It also sets up the table's links and routes from the
// topology, and reads back the bytes each link carried.
//
// Thread-safety: thread-safe. Join blocks its caller until the communicator
// forms or the join deadline passes.
#ifndef TPUD_DAEMON_COLLECTIVES_REGISTRY_H_
#define TPUD_DAEMON_COLLECTIVES_REGISTRY_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/collectives/shared_table.h"
#include "daemon/topology/topology.h"

namespace tpud {

struct JoinRequest {
  uint64_t session_id = 0;
  uint32_t tag = 0;
  int32_t pid = 0;
  std::string key;
  int size = 0;
  int rank = 0;
  int chip = 0;
  // How long an operation may wait for its peers before the communicator
  // fails naming the ranks that never came.
  absl::Duration op_timeout = absl::Minutes(30);
  // How long this join waits for the other ranks.
  absl::Duration join_timeout = absl::Minutes(5);
};

struct LinkStats {
  int a = 0, b = 0, axis = 0;
  uint64_t bytes_a_to_b = 0, bytes_b_to_a = 0;
};

struct CommunicatorInfo {
  uint64_t id = 0;
  int size = 0;
  bool failed = false;
  std::string failure;
  std::vector<int> chips;  // by rank
  std::vector<uint64_t> sessions;
  std::vector<int> ring;  // ranks in ring order
  uint64_t groups_done = 0;
  uint64_t bytes_moved = 0;
};

class CommunicatorRegistry {
 public:
  // `table` is zeroed shared memory executors map; `executor_of_chip` and
  // `wake_fds` say whom to wake.
  CommunicatorRegistry(CollectiveTable* table, const Topology& topology,
                       std::vector<int> executor_of_chip,
                       std::vector<int> wake_fds);

  // Returns the communicator's id once all ranks joined. INVALID_ARGUMENT
  // for a bad size, rank or chip, or one that disagrees with earlier joiners
  // (the others then fail too); ALREADY_EXISTS for a rank taken twice;
  // DEADLINE_EXCEEDED naming the ranks that never joined;
  // RESOURCE_EXHAUSTED when the host has no free communicator slot.
  absl::StatusOr<uint64_t> Join(const JoinRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session's ranks leave; the slot is freed when no member is left.
  absl::Status Leave(uint64_t session_id, uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails every communicator with a rank of the session (its peers' pending
  // and later operations fail naming it), then lets the session's ranks go.
  void OnSessionEnd(uint64_t session_id) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<LinkStats> Links() const;
  std::vector<CommunicatorInfo> Communicators() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t collectives_run() const;

  // Chips of the host in the order of a ring through the torus (exposed for
  // tests).
  const std::vector<int>& host_ring() const { return host_ring_; }

 private:
  struct Forming {
    int size = 0;
    std::vector<bool> joined;
    std::vector<CommMember> members;
    absl::Duration op_timeout;
    uint64_t id = 0;    // set once formed
    std::string error;  // set if forming failed
    int waiting = 0;
  };
  void ReleaseLocked(int index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The processes holding communicator slots, most slots first (for the
  // table-full error).
  std::string HoldersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int NumComms() const { return static_cast<int>(table_->num_comms); }

  CollectiveTable* const table_;
  const std::vector<int> executor_of_chip_;
  const std::vector<int> wake_fds_;
  std::vector<int> host_ring_;
  std::vector<int> ring_position_;  // by chip

  mutable absl::Mutex mu_;
  absl::CondVar formed_;
  std::map<std::string, Forming> forming_ ABSL_GUARDED_BY(mu_);
  // Per slot: which members (by rank) are still here.
  std::vector<std::vector<bool>> present_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_COLLECTIVES_REGISTRY_H_
