// The layout of a session's shared memory (one memfd made by tpud, mapped by
// the client and by tpud's executors), and the wake-up protocol on its words.
//
//   [ShmHeader][DaemonHints][RingControl x num_rings][EventSlot x kMaxEvents]
//   [ring 0][ring 1]...[ring num_rings-1][staging area][pinned pool]
//
// A session has kStreamsPerChip streams (CUDA's streams: 0 is the default).
// Each stream has one op ring per chip, so that every ring is consumed by the
// executor of one chip: ring = chip * kStreamsPerChip + stream. The client
// keeps a stream's order across chips itself (an event wait on the previous
// chip's ring whenever the stream moves to another chip).
//
// A ring: the client produces records (tpu/op_record.h) and publishes `tail`;
// the executor consumes them and publishes `head` and `completed` (the
// sequence number of the last record done). Wake-ups:
//  - the executor polls a ring while it expects work and otherwise sets
//    `consumer_sleeping` (bumping `sleep_epoch` first); a producer that sees
//    the flag after publishing writes the ring's chip doorbell (an eventfd
//    sent with the memfd), once per sleep epoch (an executor woken for work
//    it had already done starts a new epoch);
//  - a waiting client spins on `completed` while DaemonHints::wait_advice
//    says a core is free for it (or yields the core for a moment while only
//    tpud's parties compete), then counts itself in `waiters`, lowers
//    `wake_at` to the sequence it waits for, and sleeps on
//    `completion_futex`. The executor bumps and wakes that word when
//    `completed` reaches `wake_at` (resetting it to ~0: whoever still waits
//    sets it again), not on every record: a client waiting for the last of
//    thousands of queued ops is woken once. A dead ring wakes everyone;
//  - a producer facing a full ring sets `wanted_head` (a quarter of the ring
//    past what it needs, so it is not woken for every record) and
//    `producer_waiting`, and sleeps on `head_futex`, which the executor bumps
//    once head reaches `wanted_head`.
//
// Nothing in here is trusted by the daemon: executors read the client-written
// words (tail, ring bytes) once and validate them, and keep their own copies
// of head and sequence. A client that scribbles here harms only itself.
#ifndef TPU_SHM_LAYOUT_H_
#define TPU_SHM_LAYOUT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace tpu {

inline constexpr uint64_t kShmMagic = 0x324d485344555054ULL;  // "TPUDSHM2"
// Version of the data plane as a whole: this layout, the hello below and the
// record format of tpu/op_record.h. Both ends must speak the same one.
inline constexpr uint32_t kDataPlaneVersion = 6;
inline constexpr int kStreamsPerChip = 8;
inline constexpr int kMaxChipsPerHost = 16;
inline constexpr int kMaxEvents = 1024;
inline constexpr uint32_t kErrorMessageBytes = 2048;
inline constexpr uint32_t kWarningMessageBytes = 512;
inline constexpr int kMaxResults = 16;

constexpr int RingIndex(int chip, int stream) {
  return chip * kStreamsPerChip + stream;
}
constexpr int RingChip(int ring) { return ring / kStreamsPerChip; }
constexpr int RingStream(int ring) { return ring % kStreamsPerChip; }

// Written once by the daemon before the memfd is handed over.
struct ShmHeader {
  uint64_t magic;
  uint32_t layout_version;  // kDataPlaneVersion
  uint32_t num_chips;
  uint32_t streams_per_chip;
  uint32_t num_rings;  // num_chips * streams_per_chip
  uint64_t total_bytes;
  uint64_t hints_offset;
  uint64_t rings_control_offset;
  uint64_t events_offset;
  uint64_t rings_offset;
  uint64_t ring_bytes;  // per ring, power of two
  uint64_t staging_offset;
  uint64_t staging_bytes;
  uint64_t pinned_offset;
  uint64_t pinned_bytes;
};

// How a waiting party (executor or client) should wait, as tpud advises now.
enum WaitAdvice : uint32_t {
  // Block on the futex at once: threads that are not tpud's need the cores,
  // and a yielding waiter would queue behind them for a whole time slice.
  kWaitSleep = 0,
  // Spin: tpud's active parties and everything else fit in the cores.
  kWaitSpin = 1,
  // Yield the core for a moment, then block: tpud's own parties outnumber
  // the cores and nothing else competes (CUDA's automatic schedule yields).
  kWaitYield = 2,
};

// With tpud --executor_unrung, while the host's cores are oversubscribed
// (advice other than kWaitSpin), an executor that ran work recently sleeps at
// most this long and then looks at its armed rings itself; it says so in
// RingControl::sleep_bounded. A producer then need not ring the doorbell for a
// plain op record: the work waits at most this long, or until the producer
// waits for a result (which rings). Waking an executor per few ops, each wake
// preempting a client, costs more than the ops.
inline constexpr uint64_t kBoundedSleepNanos = 2000000;

// Advice the daemon keeps current for every client.
struct alignas(64) DaemonHints {
  std::atomic<uint32_t> wait_advice;  // a WaitAdvice
};

// A returned value of a synchronous op (see tpud's ChipBackend::Run).
inline constexpr int kResultDims = 64;  // tpu::kMaxDims (tpu/op_record.h)
struct ShmResult {
  uint8_t kind;  // 0 none, 1 int, 2 double, 3 bool, 4 complex, 5 tensor,
                 // 6 uint (i's bits)
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
  int64_t sizes[kResultDims];
  int64_t strides[kResultDims];
};

struct alignas(64) RingControl {
  // Producer (client) side.
  alignas(64) std::atomic<uint64_t> tail;  // bytes ever published
  std::atomic<uint64_t> submitted;         // last sequence published
  std::atomic<uint32_t> producer_waiting;  // a producer sleeps on head_futex
  std::atomic<uint64_t> wanted_head;       // ... until head reaches this
  // Consumer (executor) side.
  alignas(64) std::atomic<uint64_t> head;  // bytes ever consumed
  std::atomic<uint32_t>
      consumer_sleeping;              // ring the doorbell after publishing
  std::atomic<uint32_t> sleep_epoch;  // bumped each time the flag is set
  std::atomic<uint32_t>
      head_futex;  // bumped when head moves and a producer waits
  // The executor's sleep ends within kBoundedSleepNanos and it then looks
  // at this ring: a producer may leave plain op records unrung.
  std::atomic<uint32_t> sleep_bounded;
  // Completion.
  alignas(64) std::atomic<uint64_t> completed;  // last sequence done
  std::atomic<uint32_t> completion_futex;  // futex word, bumped on progress
  std::atomic<uint32_t> waiters;           // clients sleeping on it
  std::atomic<uint64_t> wake_at;  // the least sequence one of them waits for
  // Sticky error of this ring: the first failure since the client last
  // cleared it. error_sequence != 0 means set; the daemon writes the rest
  // before publishing error_sequence.
  alignas(64) std::atomic<uint64_t> error_sequence;
  // Set when the ring can make no more progress (a malformed record, the
  // session ending): waiters stop waiting and report error_message.
  std::atomic<uint32_t> dead;
  uint32_t error_code;   // absl::StatusCode
  uint32_t error_count;  // failures since cleared
  uint32_t error_kind;   // tpu::AtenError (tpu/op_error.h)
  char error_message[kErrorMessageBytes];
  // The first warning an op of this ring raised (ATen's TORCH_WARN) since
  // the client last took one; warning_sequence != 0 means set. The daemon
  // writes only while it is 0, the rest before publishing it; the client
  // copies the message, then clears it.
  alignas(64) std::atomic<uint64_t> warning_sequence;
  uint32_t warning_count;        // warnings since cleared
  uint32_t warning_deprecation;  // 1: a DeprecationWarning
  char warning_message[kWarningMessageBytes];
  // Response of the last synchronous op (valid once completed >= its
  // sequence).
  alignas(64) uint64_t response_sequence;
  uint32_t response_code;  // absl::StatusCode of that op
  uint32_t response_kind;  // tpu::AtenError of that op's failure
  uint32_t num_results;
  ShmResult results[kMaxResults];
  char response_message[kErrorMessageBytes];
};

struct alignas(16) EventSlot {
  std::atomic<uint64_t> sequence;  // ring sequence the event waits for
  std::atomic<uint64_t>
      completed_ns;  // CLOCK_MONOTONIC when it completed; 0 pending
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics");

inline ShmHeader* HeaderOf(void* base) { return static_cast<ShmHeader*>(base); }
inline DaemonHints* HintsOf(void* base, const ShmHeader& h) {
  return reinterpret_cast<DaemonHints*>(static_cast<char*>(base) +
                                        h.hints_offset);
}
inline RingControl* RingControlOf(void* base, const ShmHeader& h, int ring) {
  return reinterpret_cast<RingControl*>(static_cast<char*>(base) +
                                        h.rings_control_offset) +
         ring;
}
inline EventSlot* EventOf(void* base, const ShmHeader& h, int event) {
  return reinterpret_cast<EventSlot*>(static_cast<char*>(base) +
                                      h.events_offset) +
         event;
}
inline char* RingOf(void* base, const ShmHeader& h, int ring) {
  return static_cast<char*>(base) + h.rings_offset + h.ring_bytes * ring;
}

// The data-plane connection: a second connection to the runtime socket that
// opens with a DataPlaneHello (instead of gRPC's HTTP/2 preface). tpud answers
// with a DataPlaneReply and, on success, the session's memfd followed by one
// doorbell eventfd per chip (SCM_RIGHTS). The session also ends when this
// connection closes.
//
// The magic carries the data-plane version ("TPUDDP" and two digits), so a
// client of another version is told so by name, whatever else changed; the
// reply's layout is the same in every version.
inline constexpr char kDataPlaneMagicPrefix[6] = {'T', 'P', 'U', 'D', 'D', 'P'};
inline constexpr char kDataPlaneMagic[8] = {'T', 'P', 'U', 'D',
                                            'D', 'P', '0', '6'};
static_assert((kDataPlaneMagic[6] - '0') * 10 + (kDataPlaneMagic[7] - '0') ==
                  kDataPlaneVersion,
              "the hello's magic names kDataPlaneVersion");

struct DataPlaneHello {
  char magic[8];
  uint64_t session_id;
  uint8_t token[16];
  uint64_t pinned_bytes;  // 0: the daemon's default
};

struct DataPlaneReply {
  uint32_t code;            // absl::StatusCode
  uint32_t daemon_version;  // the daemon's kDataPlaneVersion
  uint64_t shm_bytes;
  char message[496];
};

// The data-plane version a hello's magic names; -1 if it is no hello.
int DataPlaneVersionOf(const char magic[8]);

// Futex helpers on shared (not process-private) words.
// Sleeps while *word == expected, at most timeout_ns (<= 0: no timeout).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               int64_t timeout_ns);
void FutexWakeAll(std::atomic<uint32_t>* word);

uint64_t MonotonicNanos();

}  // namespace tpu

#endif  // TPU_SHM_LAYOUT_H_
