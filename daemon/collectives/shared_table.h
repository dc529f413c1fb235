// The collective table: the shared memory where the ranks of communicators
// meet (see registry.h for how communicators form, groups.h for how their
// operations meet, algorithms.h for how the data moves).
//
// Every chip of the host lives in tpud, and every executor maps every chip's
// HBM, so ranks of a communicator (one per chip and session) exchange data
// without sockets: when the last rank of an operation arrives, its executor
// checks what every rank passed and moves the data itself, along the ICI
// torus (rings or bidirectional rings over the host's links), counting the
// bytes each link carries.
//
// Shared state lives in one CollectiveTable that tpud owns and every
// executor maps read-write (never clients):
//  - tpud forms communicators (CommunicatorRegistry, registry.h), writes
//    their members and ring, and fails them when a member's session ends;
//  - executors post their ranks' operation groups into the rank's slot and
//    run what has met (groups.h), under the communicator's robust
//    process-shared mutex (an executor that dies holding it leaves it to be
//    recovered).
//
// A group is what one kCollective record carries: collectives (every rank
// posts the same sequence of operations) or point-to-point operations
// (send/recv, matched pairwise in order per (source, destination)). A rank
// has at most kSlotsPerRank groups posted at once (from different streams);
// the ring that posted one waits until it is done.
//
// The layout is shared between processes of one tpud build only (tpud and
// the executors it forks); kCollectiveTableMagic marks it.
//
// Thread-safety: fields marked atomic are read without the mutex; the rest
// only under CommSlot::mu.
#ifndef TPUD_DAEMON_COLLECTIVES_SHARED_TABLE_H_
#define TPUD_DAEMON_COLLECTIVES_SHARED_TABLE_H_

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tpu/op_record.h"

namespace tpud {

// Communicator slots in the table: tpud's --max_communicators, at most
// kMaxCommunicatorsLimit (each slot reserves ~2 MiB of the memfd, backed
// only where used).
inline constexpr int kDefaultCommunicators = 256;
inline constexpr int kMaxCommunicatorsLimit = 4096;
inline constexpr int kMaxCommRanks = static_cast<int>(tpu::kMaxCommRanks);
inline constexpr int kMaxGroupOps = static_cast<int>(tpu::kMaxGroupOps);
inline constexpr int kMaxIciLinks = 64;
// Links on the route between two ring neighbours (a few hops at most on a
// host's torus).
inline constexpr int kMaxRouteLinks = 8;
inline constexpr uint64_t kCollectiveTableMagic =
    0x314c4f43445550ULL;  // "TPUDCOL1"
inline constexpr size_t kCommMessageBytes = 512;

// One posted operation of a rank.
struct PostedOp {
  tpu::CollectiveKind kind;
  tpu::ReduceOp reduce;
  int8_t dtype;  // wire code (tpu::Code of a tpu::DType)
  uint8_t done;  // point-to-point: matched and moved
  int32_t peer;
  uint64_t count;
  uint64_t send;
  uint64_t recv;
  uint64_t pair_index;  // point-to-point: the n-th between this pair in this
                        // direction
};

// A rank may have a few groups outstanding at once (on different streams:
// FSDP gathers on one and reduces on another); each takes a slot.
inline constexpr int kSlotsPerRank = 8;

struct GroupSlot {
  enum State : uint32_t { kFree = 0, kPosted = 1, kDone = 2 };
  std::atomic<uint32_t> state;
  uint32_t num_ops;
  uint32_t p2p;   // the group is point-to-point
  uint32_t ring;  // the poster's ring and record, so a re-post is recognised
  uint64_t record_sequence;
  uint64_t index;  // collectives: the rank's n-th collective group (from 1)
  uint64_t posted_ns;
  int32_t code;  // absl::StatusCode of the result (kDone)
  uint32_t pad;
  char message[kCommMessageBytes];
  int64_t send_counts[kMaxCommRanks];  // the group's all_to_all, if any
  int64_t recv_counts[kMaxCommRanks];
  PostedOp ops[kMaxGroupOps];
};

struct CommMember {
  uint64_t session_id;
  uint32_t tag;
  int32_t chip;
  int32_t pid;
  int32_t executor;  // the executor of its chip (to wake)
};

struct alignas(64) CommSlot {
  enum State : uint32_t { kUnused = 0, kReady = 1, kFailed = 2 };
  pthread_mutex_t mu;
  std::atomic<uint32_t> state;
  std::atomic<uint64_t> id;  // 0: slot unused
  uint32_t size;
  uint32_t pad;
  uint64_t timeout_ns;
  CommMember members[kMaxCommRanks];
  // Ranks in the order of a ring along the torus (see Routes).
  int32_t ring[kMaxCommRanks];
  // Why the communicator failed (kFailed); every pending and later group
  // fails with it.
  char failure[kCommMessageBytes];
  std::atomic<uint64_t> groups_done;
  std::atomic<uint64_t> bytes_moved;
  // Last: only the ranks in use are touched.
  GroupSlot slots[kMaxCommRanks][kSlotsPerRank];
};

struct LinkCounter {
  int32_t a;  // chips; a < b
  int32_t b;
  int32_t axis;
  int32_t pad;
  std::atomic<uint64_t> bytes[2];  // a -> b, b -> a
};

inline constexpr int kMaxTableChips = 16;  // tpu::kMaxChipsPerHost

struct CollectiveTable {
  uint64_t magic;
  uint32_t num_links;
  uint32_t num_chips;
  LinkCounter links[kMaxIciLinks];
  // Shortest route from chip u to chip v: entries link * 2 + direction
  // (0: a -> b), -1 terminated. Written by tpud at start-up.
  int16_t routes[kMaxTableChips][kMaxTableChips][kMaxRouteLinks];
  std::atomic<uint64_t> collectives_run;
  uint32_t num_comms;  // slots that follow the table (CommAt)
  uint32_t pad;
};

// Where the communicator slots start: right after the table, aligned.
inline constexpr size_t kCommSlotsOffset =
    (sizeof(CollectiveTable) + alignof(CommSlot) - 1) / alignof(CommSlot) *
    alignof(CommSlot);

// Bytes of a table with `num_comms` communicator slots.
inline constexpr size_t CollectiveTableBytes(int num_comms) {
  return kCommSlotsOffset + sizeof(CommSlot) * static_cast<size_t>(num_comms);
}

// Communicator slot i (REQUIRES: i < t->num_comms).
inline CommSlot* CommAt(CollectiveTable* t, int i) {
  return reinterpret_cast<CommSlot*>(reinterpret_cast<char*>(t) +
                                     kCommSlotsOffset) +
         i;
}
inline const CommSlot* CommAt(const CollectiveTable* t, int i) {
  return CommAt(const_cast<CollectiveTable*>(t), i);
}

// A zeroed table with `num_comms` slots on the heap (tests; tpud's lives in
// a memfd it shares with the executors).
struct HeapTableDeleter {
  void operator()(CollectiveTable* t) const {
    t->~CollectiveTable();
    ::operator delete(t, std::align_val_t(alignof(CommSlot)));
  }
};
inline std::unique_ptr<CollectiveTable, HeapTableDeleter>
NewHeapCollectiveTable(int num_comms) {
  const size_t bytes = CollectiveTableBytes(num_comms);
  void* p = ::operator new(bytes, std::align_val_t(alignof(CommSlot)));
  std::memset(p, 0, bytes);
  auto* t = new (p) CollectiveTable;
  t->num_comms = static_cast<uint32_t>(num_comms);
  return std::unique_ptr<CollectiveTable, HeapTableDeleter>(t);
}

// ---- the communicator's robust, process-shared mutex ----

// Initialises a robust, process-shared mutex in shared memory.
void InitSharedMutex(pthread_mutex_t* mu);
// Locks it; returns true if its previous owner died holding it (the state
// it guards may be half-written; the caller decides).
bool LockShared(pthread_mutex_t* mu);

// ---- groups' results, and failure ----

// Wakes executor `executor` through its eventfd in `wake_fds`, unless it is
// `self` or not an executor.
void WakeExecutor(const std::vector<int>& wake_fds, int executor, int self);

// Under comm->mu: finishes rank's posted group with `status` (a first
// error sticks) and, if `wake`, wakes its executor (through wake_fds,
// unless it is `self`).
void FinishRankSlot(CommSlot* comm, int rank, int slot,
                    const absl::Status& status,
                    const std::vector<int>& wake_fds, int self,
                    bool wake = true);
// Under comm->mu: the communicator fails for good; every posted group
// finishes with `why`, and every member's executor is woken. Returns false
// if it had failed already (the first reason stays).
bool FailCommunicator(CommSlot* comm, const std::string& why,
                      const std::vector<int>& wake_fds, int self);

// Writes `status` (code and message, cut to fit) into the slot.
void SetSlotMessage(GroupSlot& slot, const absl::Status& status);

// The slot a communicator id names, or null.
inline CommSlot* CommOf(CollectiveTable* t, uint64_t id) {
  if (id == 0) return nullptr;
  CommSlot* c = CommAt(t, static_cast<int>(id % t->num_comms));
  return c->id.load(std::memory_order_acquire) == id ? c : nullptr;
}

// ---- link traffic ----

// Adds `bytes` to every link on the route from rank a's chip to rank b's.
void CountRoute(CollectiveTable* table, const CommSlot* comm, int rank_a,
                int rank_b, uint64_t bytes);

}  // namespace tpud

#endif  // TPUD_DAEMON_COLLECTIVES_SHARED_TABLE_H_
