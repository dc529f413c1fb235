// Collectives inside tpud: communicators, and how their operations meet.
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
//  - tpud forms communicators (CommunicatorRegistry in daemon/), writes their
//    members and ring, and fails them when a member's session ends;
//  - executors post their ranks' operation groups into the rank's slot and
//    run what has met, under the communicator's robust process-shared
//    mutex (an executor that dies holding it leaves it to be recovered).
//
// A group is what one kCollective record carries: collectives (every rank
// posts the same sequence of operations) or point-to-point operations
// (send/recv, matched pairwise in order per (source, destination)). A rank
// has at most one group posted; its ring waits until the group is done.
//
// Thread-safety: fields marked atomic are read without the mutex; the rest
// only under CommSlot::mu.
#ifndef TPUD_DAEMON_COLLECTIVES_COLLECTIVES_H_
#define TPUD_DAEMON_COLLECTIVES_COLLECTIVES_H_

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tpu/op_record.h"

namespace tpud {

inline constexpr int kMaxCommunicators = 64;
inline constexpr int kMaxCommRanks = static_cast<int>(tpu::kMaxCommRanks);
inline constexpr int kMaxGroupOps = static_cast<int>(tpu::kMaxGroupOps);
inline constexpr int kMaxIciLinks = 64;
// Links on the route between two ring neighbours (a few hops at most on a
// host's torus).
inline constexpr int kMaxRouteLinks = 8;
inline constexpr uint64_t kCollectiveTableMagic = 0x314c4f43445550ULL;  // "TPUDCOL1"
inline constexpr size_t kCommMessageBytes = 512;

// One posted operation of a rank.
struct PostedOp {
  tpu::CollectiveKind kind;
  tpu::ReduceOp reduce;
  int8_t dtype;
  uint8_t done;  // point-to-point: matched and moved
  int32_t peer;
  uint64_t count;
  uint64_t send;
  uint64_t recv;
  uint64_t pair_index;  // point-to-point: the n-th between this pair in this direction
};

// A rank may have a few groups outstanding at once (on different streams:
// FSDP gathers on one and reduces on another); each takes a slot.
inline constexpr int kSlotsPerRank = 8;

struct GroupSlot {
  enum State : uint32_t { kFree = 0, kPosted = 1, kDone = 2 };
  std::atomic<uint32_t> state;
  uint32_t num_ops;
  uint32_t p2p;  // the group is point-to-point
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
  CommSlot comms[kMaxCommunicators];
};

// Initialises a robust, process-shared mutex in shared memory.
void InitSharedMutex(pthread_mutex_t* mu);
// Locks it; returns true if its previous owner died holding it (the state
// it guards may be half-written; the caller decides).
bool LockShared(pthread_mutex_t* mu);

// Under comm->mu: finishes rank's posted group with `status` (a first
// error sticks) and, if `wake`, wakes its executor (through wake_fds,
// unless it is `self`).
void FinishRankSlot(CommSlot* comm, int rank, int slot, const absl::Status& status,
                    const std::vector<int>& wake_fds, int self, bool wake = true);
// Under comm->mu: the communicator fails for good; every posted group
// finishes with `why`, and every member's executor is woken. Returns false
// if it had failed already (the first reason stays).
bool FailCommunicator(CommSlot* comm, const std::string& why, const std::vector<int>& wake_fds,
                      int self);

// "float32", "bfloat16", ... for a c10 dtype value, for messages.
const char* DtypeName(int8_t dtype);
// Writes `status` (code and message, cut to fit) into the slot.
void SetSlotMessage(GroupSlot& slot, const absl::Status& status);

// The slot a communicator id names, or null.
inline CommSlot* CommOf(CollectiveTable* t, uint64_t id) {
  if (id == 0) return nullptr;
  CommSlot* c = &t->comms[id % kMaxCommunicators];
  return c->id.load(std::memory_order_acquire) == id ? c : nullptr;
}

// Element arithmetic for reductions, by c10 dtype: dst[i] = dst[i] op src[i]
// for i < count. INVALID_ARGUMENT when the dtype cannot be reduced with op.
absl::Status CheckReducible(int8_t dtype, tpu::ReduceOp op);
void ReduceInto(int8_t dtype, tpu::ReduceOp op, char* dst, const char* src, uint64_t count);
// dst[i] /= n (the last step of avg).
void DivideBy(int8_t dtype, char* dst, uint64_t count, uint64_t n);

// What an executor needs to run operations that met.
struct CollectiveContext {
  CollectiveTable* table = nullptr;
  std::vector<char*> chip_bases;  // host view of every chip's HBM
};

// Moves the data of one collective operation (ops[r] for each rank r, all
// already checked to match). `host_send[r]`, `host_recv[r]` are the host
// views of rank r's buffers (null where the kind has none). Counts the
// bytes each link carries.
void RunCollective(CollectiveTable* table, CommSlot* comm, const std::vector<const PostedOp*>& ops,
                   const std::vector<char*>& host_send, const std::vector<char*>& host_recv,
                   const std::vector<const int64_t*>& send_counts,
                   const std::vector<const int64_t*>& recv_counts, std::vector<char>* scratch);

// Counts, on the links and in the communicator's bytes moved, what
// RunCollective's schedule would move for `op` (ops[0] of every rank), for
// an operation a backend ran as its own program (which picks its own
// schedule on the device; these are the torus schedule's figures).
void CountCollectiveTraffic(CollectiveTable* table, CommSlot* comm, const PostedOp& op,
                            const std::vector<const int64_t*>& send_counts);

// Bytes the buffers of one op span on its rank (send, recv), for the
// communicator's size `n`; INVALID_ARGUMENT on overflow or absurd counts.
absl::Status BufferBytes(const PostedOp& op, const int64_t* send_counts,
                         const int64_t* recv_counts, int n, int rank, uint64_t* send_bytes,
                         uint64_t* recv_bytes);

// Adds `bytes` to every link on the route from rank a's chip to rank b's.
void CountRoute(CollectiveTable* table, const CommSlot* comm, int rank_a, int rank_b,
                uint64_t bytes);

}  // namespace tpud

#endif  // TPUD_DAEMON_COLLECTIVES_COLLECTIVES_H_
