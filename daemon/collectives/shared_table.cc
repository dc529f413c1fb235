#include "daemon/collectives/shared_table.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace tpud {

void InitSharedMutex(pthread_mutex_t* mu) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(mu, &attr);
  pthread_mutexattr_destroy(&attr);
}

bool LockShared(pthread_mutex_t* mu) {
  const int r = pthread_mutex_lock(mu);
  if (r == EOWNERDEAD) {
    pthread_mutex_consistent(mu);
    return true;
  }
  return false;
}

void WakeExecutor(const std::vector<int>& wake_fds, int executor, int self) {
  if (executor < 0 || executor >= static_cast<int>(wake_fds.size()) ||
      executor == self)
    return;
  const uint64_t one = 1;
  (void)!write(wake_fds[executor], &one, sizeof(one));
}

void SetSlotMessage(GroupSlot& slot, const absl::Status& status) {
  slot.code = static_cast<int32_t>(status.code());
  const size_t n = std::min(status.message().size(), kCommMessageBytes - 1);
  std::memcpy(slot.message, status.message().data(), n);
  slot.message[n] = '\0';
}

void FinishRankSlot(CommSlot* comm, int rank, int k, const absl::Status& status,
                    const std::vector<int>& wake_fds, int self, bool wake) {
  GroupSlot& slot = comm->slots[rank][k];
  if (slot.code == 0) SetSlotMessage(slot, status);
  slot.state.store(GroupSlot::kDone, std::memory_order_seq_cst);
  comm->groups_done.fetch_add(1, std::memory_order_relaxed);
  if (wake) WakeExecutor(wake_fds, comm->members[rank].executor, self);
}

bool FailCommunicator(CommSlot* comm, const std::string& why,
                      const std::vector<int>& wake_fds, int self) {
  if (comm->state.load() == CommSlot::kFailed) return false;
  const size_t n = std::min(why.size(), kCommMessageBytes - 1);
  std::memcpy(comm->failure, why.data(), n);
  comm->failure[n] = '\0';
  comm->state.store(CommSlot::kFailed, std::memory_order_release);
  const absl::Status st = absl::AbortedError(why);
  for (uint32_t r = 0; r < comm->size; ++r) {
    for (int k = 0; k < kSlotsPerRank; ++k) {
      if (comm->slots[r][k].state.load() == GroupSlot::kPosted) {
        FinishRankSlot(comm, static_cast<int>(r), k, st, wake_fds, self);
      }
    }
  }
  for (uint32_t r = 0; r < comm->size; ++r) {
    WakeExecutor(wake_fds, comm->members[r].executor, self);
  }
  return true;
}

void CountRoute(CollectiveTable* table, const CommSlot* comm, int rank_a,
                int rank_b, uint64_t bytes) {
  if (bytes == 0) return;
  const int u = comm->members[rank_a].chip;
  const int v = comm->members[rank_b].chip;
  if (u == v || u < 0 || v < 0 || u >= kMaxTableChips || v >= kMaxTableChips)
    return;
  for (int k = 0; k < kMaxRouteLinks; ++k) {
    const int16_t e = table->routes[u][v][k];
    if (e < 0) break;
    const int link = e / 2;
    if (link >= static_cast<int>(table->num_links)) break;
    table->links[link].bytes[e % 2].fetch_add(bytes, std::memory_order_relaxed);
  }
}

}  // namespace tpud
