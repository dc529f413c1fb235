// The layout of a session's shared memory (one memfd made by tpud, mapped by
// both ends), and the wake-up protocol on its shared words.
//
//   [ShmHeader][StreamControl x kMaxStreams][EventSlot x kMaxEvents]
//   [ring 0][ring 1]...[ring kMaxStreams-1][staging area][pinned pool]
//
// Each stream has an op ring: the client produces records (tpu/op_record.h)
// and publishes `tail`; the daemon consumes and publishes `head`, then
// `completed` (the sequence number of the last record done). Wake-ups: the
// consumer spins a while on an empty ring, then sets `consumer_sleeping` and
// sleeps on `doorbell` (futex); the producer rings the doorbell only when the
// consumer said it sleeps. A waiting client spins briefly on `completed`, then
// counts itself in `waiters` and sleeps on `completion_futex`.
//
// Nothing in here is trusted by the daemon: it reads the client-written words
// (tail, ring bytes, doorbell) once and validates them.
#ifndef TPU_SHM_LAYOUT_H_
#define TPU_SHM_LAYOUT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace tpu {

inline constexpr uint64_t kShmMagic = 0x314d485344555054ULL;  // "TPUDSHM1"
inline constexpr int kMaxStreams = 8;
inline constexpr int kMaxEvents = 1024;
inline constexpr uint32_t kErrorMessageBytes = 2048;
inline constexpr int kMaxResults = 16;

// Written once by the daemon before the memfd is handed over.
struct ShmHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t num_streams;
  uint64_t total_bytes;
  uint64_t streams_offset;
  uint64_t events_offset;
  uint64_t rings_offset;
  uint64_t ring_bytes;  // per stream, power of two
  uint64_t staging_offset;
  uint64_t staging_bytes;
  uint64_t pinned_offset;
  uint64_t pinned_bytes;
};

// A returned value of a synchronous op (see tpud's ChipBackend::Run).
struct ShmResult {
  uint8_t kind;  // 0 none, 1 int, 2 double, 3 bool, 4 complex, 5 tensor
  int8_t dtype;
  uint8_t ndim;
  uint8_t pad[5];
  int64_t i;
  double d;
  double d_imag;
  uint64_t address;  // tensor storage: a new segment of the session, or
                     // (when the op returned one of its arguments) that
                     // argument's storage
  uint64_t nbytes;
  int64_t storage_offset;
  int64_t sizes[25];
  int64_t strides[25];
};

struct alignas(64) StreamControl {
  // Producer (client) side.
  alignas(64) std::atomic<uint64_t> tail;       // bytes ever published
  std::atomic<uint64_t> submitted;              // last sequence published
  // Consumer (daemon) side.
  alignas(64) std::atomic<uint64_t> head;       // bytes ever consumed
  std::atomic<uint32_t> consumer_sleeping;
  std::atomic<uint32_t> doorbell;               // futex word
  // Completion.
  alignas(64) std::atomic<uint64_t> completed;  // last sequence done
  std::atomic<uint32_t> completion_futex;       // futex word, bumped on progress
  std::atomic<uint32_t> waiters;                // clients sleeping on it
  // Sticky error of this stream: the first failure since the client last
  // cleared it. error_sequence != 0 means set; the daemon writes the rest
  // before publishing error_sequence.
  alignas(64) std::atomic<uint64_t> error_sequence;
  // Set when the stream can make no more progress (a malformed record, the
  // session ending): waiters stop waiting and report error_message.
  std::atomic<uint32_t> dead;
  uint32_t error_code;  // absl::StatusCode
  uint32_t error_count; // failures since cleared
  char error_message[kErrorMessageBytes];
  // Response of the last synchronous op (valid once completed >= its
  // sequence).
  alignas(64) uint64_t response_sequence;
  uint32_t response_code;  // absl::StatusCode of that op
  uint32_t num_results;
  ShmResult results[kMaxResults];
  char response_message[kErrorMessageBytes];
};

struct alignas(16) EventSlot {
  std::atomic<uint64_t> sequence;     // stream sequence the event waits for
  std::atomic<uint64_t> completed_ns; // CLOCK_MONOTONIC when it completed; 0 pending
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics");

inline ShmHeader* HeaderOf(void* base) { return static_cast<ShmHeader*>(base); }
inline StreamControl* StreamOf(void* base, const ShmHeader& h, int stream) {
  return reinterpret_cast<StreamControl*>(static_cast<char*>(base) + h.streams_offset) + stream;
}
inline EventSlot* EventOf(void* base, const ShmHeader& h, int event) {
  return reinterpret_cast<EventSlot*>(static_cast<char*>(base) + h.events_offset) + event;
}
inline char* RingOf(void* base, const ShmHeader& h, int stream) {
  return static_cast<char*>(base) + h.rings_offset + h.ring_bytes * stream;
}

// The data-plane connection: a second connection to the runtime socket that
// opens with a DataPlaneHello (instead of gRPC's HTTP/2 preface). tpud answers
// with a DataPlaneReply carrying the session's memfd (SCM_RIGHTS) on success.
// The session also ends when this connection closes.
inline constexpr char kDataPlaneMagic[8] = {'T', 'P', 'U', 'D', 'D', 'P', '0', '1'};

struct DataPlaneHello {
  char magic[8];
  uint64_t session_id;
  uint8_t token[16];
  uint64_t pinned_bytes;  // 0: the daemon's default
};

struct DataPlaneReply {
  uint32_t code;  // absl::StatusCode
  uint32_t reserved;
  uint64_t shm_bytes;
  char message[496];
};

// Futex helpers on shared (not process-private) words.
// Sleeps while *word == expected, at most timeout_ns (<= 0: no timeout).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);
void FutexWakeAll(std::atomic<uint32_t>* word);

uint64_t MonotonicNanos();

}  // namespace tpu

#endif  // TPU_SHM_LAYOUT_H_
