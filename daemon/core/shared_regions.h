// Memory that tpud shares with its executor processes, never with clients.
//
// Op execution runs in executor processes (daemon/executor/executor_pool.h),
// so that a kernel that crashes or hangs takes down only the executor, never
// tpud and the HBM it owns. Everything an executor needs to pick up where a
// crashed one stopped lives in memory tpud owns:
//
//  - ExecutorShared: one slot per executor (what it runs now, for crash
//    reports and for the memory fence; activity figures) and the host's
//    spin advice;
//  - PageOwnerTable: per chip, which session owns each 4 KiB page of HBM and
//    where its segment starts. tpud writes it when it grants or frees a
//    segment; executors check every tensor an op touches against it (they
//    map it read-only);
//  - SessionState: per session, each ring's trusted head and sequence, the
//    operators the session defined, what failed ops poisoned, and activity.
//
// The memory fence (PageOwnerTable + ExecutorSlot::in_op_tag): an executor
// publishes the tag of the session whose op it starts *before* it reads the
// owner table, and clears it after the op; tpud clears a segment's pages
// *before* it reads the slots, and waits until no executor is inside an op of
// that session before the pages go back to the allocator. Either the
// executor sees the pages gone, or tpud sees the executor inside the op and
// waits for it (both sides use sequentially consistent accesses).
//
// Thread-safety: the words documented as atomic are; the rest has one
// writer, named beside each field.
#ifndef TPUD_DAEMON_CORE_SHARED_REGIONS_H_
#define TPUD_DAEMON_CORE_SHARED_REGIONS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tpu/shm_layout.h"

namespace tpu {
struct RingControl;
}

namespace tpud {

inline constexpr int kMaxExecutors = 16;
inline constexpr uint64_t kPageBytes = 4096;

// A shared mapping of a memfd. Owns the mapping and, until ReleaseFd(), the
// descriptor.
class SharedMapping {
 public:
  SharedMapping() = default;
  ~SharedMapping();
  SharedMapping(SharedMapping&& other) noexcept;
  SharedMapping& operator=(SharedMapping&& other) noexcept;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  // A new memfd of `bytes` (zero-filled, sparse), mapped read-write.
  // `seal`: no one may shrink or grow it afterwards (a peer's shrink would
  // make our accesses fault).
  static absl::StatusOr<SharedMapping> Create(const std::string& name,
                                              uint64_t bytes, bool seal);
  // Maps an existing memfd of `bytes` (its size is checked). Takes the fd.
  static absl::StatusOr<SharedMapping> Map(int fd, uint64_t bytes,
                                           bool writable);

  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // Closes the descriptor; the mapping stays.
  void CloseFd();
  bool valid() const { return data_ != nullptr; }

 private:
  char* data_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;
};

// ---------------------------------------------------------------- executors

// Upper bounds of the op latency histogram's buckets
// (ExecutorSlot::op_latency), 1 µs to 10 s; one more bucket takes the rest.
inline constexpr uint64_t kOpLatencyBoundsNs[] = {
    1'000,       2'500,       5'000,         10'000,        25'000,
    50'000,      100'000,     250'000,       500'000,       1'000'000,
    2'500'000,   5'000'000,   10'000'000,    25'000'000,    50'000'000,
    100'000'000, 250'000'000, 1'000'000'000, 10'000'000'000};
inline constexpr int kOpLatencyBuckets =
    static_cast<int>(sizeof(kOpLatencyBoundsNs) /
                     sizeof(kOpLatencyBoundsNs[0])) +
    1;
// absl::StatusCode values 0..16.
inline constexpr int kStatusCodes = 17;

// Adds to a counter only one thread writes (a relaxed load and store: no
// locked instruction on the op path).
inline void BumpSingleWriter(std::atomic<uint64_t>& c, uint64_t n = 1) {
  c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

// The bucket of kOpLatencyBoundsNs a duration falls in.
inline int OpLatencyBucket(uint64_t ns) {
  int b = 0;
  while (b < kOpLatencyBuckets - 1 && ns > kOpLatencyBoundsNs[b]) ++b;
  return b;
}

// What an executor is doing, written by that executor (and reset by tpud
// after the executor died).
struct alignas(64) ExecutorSlot {
  enum State : uint32_t { kStopped = 0, kStarting = 1, kReady = 2, kDead = 3 };
  std::atomic<uint32_t> state;
  std::atomic<int32_t> pid;
  // Memory fence (see top of file): the tag of the session whose op runs
  // now, 0 between ops.
  alignas(64) std::atomic<uint32_t> in_op_tag;
  std::atomic<uint32_t>
      op_epoch;  // futex word: bumped after an op if fence_waiters
  std::atomic<uint32_t>
      fence_waiters;  // tpud threads waiting for the op to end
  std::atomic<uint64_t> op_started_ns;  // CLOCK_MONOTONIC; 0 between ops
  // A collective touches the memory of every rank's session: their tags,
  // published like in_op_tag for the same fence (0: unused entries).
  std::atomic<uint32_t> collective_tags[64];
  // The record running now, for crash reports (valid while op_started_ns != 0).
  std::atomic<uint64_t> current_session;
  std::atomic<uint32_t> current_ring;
  std::atomic<uint64_t> current_sequence;
  char current_op[192];
  // Written by the crash handler just before the executor dies.
  std::atomic<int32_t> crash_signal;
  std::atomic<uint64_t> crash_address;
  // Idle: sleeping for a doorbell or a control message.
  alignas(64) std::atomic<uint32_t> sleeping;
  std::atomic<uint32_t>
      active_sessions;            // sessions it ran work of in the last 2 ms
  std::atomic<uint64_t> busy_ns;  // chip time, since this executor started
  std::atomic<uint64_t> ops;
  // Bounded sleeps (tpu::kBoundedSleepNanos) that ended with work no
  // producer had rung for: each one a wake-up the producers saved.
  std::atomic<uint64_t> unrung_wakes;
  std::atomic<uint64_t> duty_permille;  // busy share of the last full second
  // CLOCK_MONOTONIC at the end of its last turn at a ring: with
  // op_started_ns, whether it counts as busy (executor/thread_share.h).
  std::atomic<uint64_t> last_work_ns;
  // Threads its ops may use now (ChipBackend::intra_op_threads), and the
  // most it gives them (alone on the host); 0: the backend has no count.
  std::atomic<uint32_t> intra_op_threads;
  std::atomic<uint32_t> intra_op_threads_max;
  // A compiling backend's figures (ChipBackend::compile_stats), by position
  // in this executor's chips; since this executor started.
  std::atomic<uint32_t> compiles_ops;  // 1: the backend compiles
  std::atomic<uint64_t> programs_cached;
  std::atomic<uint64_t> device_buffer_bytes;
  // The compilation cache on disk (ChipBackend::disk_cache_stats; 0: none).
  std::atomic<uint32_t> disk_cache_enabled;
  std::atomic<uint64_t> disk_cache_entries;
  std::atomic<uint64_t> disk_cache_bytes;
  std::atomic<uint64_t> disk_cache_max_bytes;
  std::atomic<uint64_t> disk_cache_rejected;
  std::atomic<uint64_t> disk_cache_write_errors;
  std::atomic<uint64_t> compiles[tpu::kMaxChipsPerHost];
  std::atomic<uint64_t> compile_ns[tpu::kMaxChipsPerHost];
  std::atomic<uint64_t> program_hits[tpu::kMaxChipsPerHost];
  // Programs loaded from / written to the cache on disk, and the compile
  // time the loads saved.
  std::atomic<uint64_t> disk_hits[tpu::kMaxChipsPerHost];
  std::atomic<uint64_t> disk_stores[tpu::kMaxChipsPerHost];
  std::atomic<uint64_t> saved_ns[tpu::kMaxChipsPerHost];
  std::atomic<uint64_t> collective_programs[tpu::kMaxChipsPerHost];
  std::atomic<uint64_t> graph_programs[tpu::kMaxChipsPerHost];
  // For metrics (daemon/metrics): counters since this executor started, by
  // position in its chips. Single writer (this executor): it adds with a
  // relaxed load and store.
  // Records run, by how long each took on the chip (kOpLatencyBoundsNs;
  // the last bucket is everything above), and their total time.
  alignas(64) std::atomic<uint64_t> op_latency[tpu::kMaxChipsPerHost]
                                              [kOpLatencyBuckets];
  std::atomic<uint64_t> op_latency_sum_ns[tpu::kMaxChipsPerHost];
  // Records published by clients and not yet done, per chip (sampled about
  // every millisecond while busy, and before the executor sleeps).
  std::atomic<uint64_t> queue_depth[tpu::kMaxChipsPerHost];
  // Op records that failed, by absl::StatusCode (sessions failed for a
  // malformed record included).
  std::atomic<uint64_t> op_errors[kStatusCodes];
  // kReleased messages tpud sent this executor (counted after each is
  // queued): an executor keeping device memory per segment reads them all
  // before it resolves memory, so pages freed and handed out again never
  // meet the old segment's device copy.
  std::atomic<uint64_t> releases_sent;
};

struct ExecutorShared {
  uint64_t magic;
  uint32_t num_executors;
  // The cores tpud's processes may use (CPU affinity, cgroup quota), which
  // busy executors share (executor/thread_share.h). Written before the fork.
  uint32_t num_cpus;
  // Wait advice (tpu::WaitAdvice) for executors; clients get theirs in
  // DaemonHints.
  alignas(64) std::atomic<uint32_t> wait_advice;
  std::atomic<uint32_t> sampler_futex;  // bumped to wake a sleeping sampler
  std::atomic<uint32_t> sampler_sleeping;
  ExecutorSlot slots[kMaxExecutors];
};

inline constexpr uint64_t kExecutorSharedMagic =
    0x31584543445550ULL;  // "TPUDCEX1"

// ---------------------------------------------------------------- page owners

// Which session owns each page of one chip's HBM. Sessions are named by a
// small tag (unique among live sessions, never 0).
class PageOwnerTable {
 public:
  // Bytes of shared memory a table for `capacity` bytes of HBM needs.
  static uint64_t BytesFor(uint64_t capacity);
  // A view over such memory (not owned).
  PageOwnerTable(char* memory, uint64_t capacity);
  PageOwnerTable() = default;

  // tpud only. REQUIRES: page-aligned range inside the chip, not owned.
  void Assign(uint64_t offset, uint64_t bytes, uint32_t tag);
  // tpud only. Sequentially consistent, for the memory fence.
  void Clear(uint64_t offset, uint64_t bytes);

  struct Segment {
    uint64_t offset = 0;  // first byte of the segment
    uint64_t bytes = 0;
  };
  // The segment of `tag` that wholly contains [offset, offset + bytes)
  // (bytes 0: the byte at offset), or nullopt.
  std::optional<Segment> Find(uint64_t offset, uint64_t bytes,
                              uint32_t tag) const;
  // Tag of the page holding `offset` (0: free or out of range).
  uint32_t OwnerOf(uint64_t offset) const;

 private:
  std::atomic<uint64_t>* entries_ = nullptr;  // tag << 32 | first page
  uint32_t* pages_ = nullptr;  // at a segment's first page: its length
  uint64_t capacity_ = 0;
  uint64_t num_pages_ = 0;
};

// ---------------------------------------------------------------- sessions

inline constexpr uint32_t kMaxOpIds = 16384;
inline constexpr uint32_t kOpArenaBytes = 1 << 20;
inline constexpr uint32_t kMaxPoisoned = 2048;
inline constexpr uint32_t kPoisonCauses = 128;
inline constexpr uint32_t kPoisonCauseBytes = 512;
inline constexpr uint64_t kSessionStateMagic =
    0x31545353445550ULL;  // "TPUDSST1"

// Per ring, written by the executor of the ring's chip.
struct alignas(64) TrustedRing {
  std::atomic<uint64_t> head;           // bytes consumed and done
  std::atomic<uint64_t> last_sequence;  // last record done
  // Executors parked on this ring's progress (bit per executor): the ring's
  // executor wakes them when it completes records.
  std::atomic<uint64_t> watchers;
  // The sequence of a collective record that the executor which ran its
  // group completed for this ring (executor/collective_steps.cc), while it
  // still sits at the ring's head; 0 when none.
  std::atomic<uint64_t> completed_early;
};

struct PoisonEntry {
  uint64_t begin;  // device addresses
  uint64_t end;
  uint64_t cause;  // PoisonCause id
};

struct PoisonCause {
  uint64_t id;
  char text[kPoisonCauseBytes];
};

// What failed ops wrote on one chip, written by that chip's executor only and
// read by others (copies across chips) under `version` (a seqlock: odd while
// being written).
struct PoisonTable {
  std::atomic<uint64_t> version;
  uint32_t count;
  uint32_t next_victim;  // when full, the entry replaced next
  uint64_t next_cause;
  PoisonEntry entries[kMaxPoisoned];
  PoisonCause causes[kPoisonCauses];
};

struct OpTableEntry {
  uint32_t offset;  // into the arena; 0 length: not defined
  uint32_t length;
};

// Per chip of a session, written by that chip's executor.
// A captured program this session ran on a chip (kRunProgram), for tpuctl:
// written by the chip's executor, read by tpud.
inline constexpr int kMaxProgramStats = 16;
// The entry of a session's fused eager runs (tpu::kEagerProgramId), named
// by them "eager".
inline constexpr uint32_t kEagerProgramStatId = ~0u;
struct ProgramStat {
  std::atomic<uint32_t> id;  // 0: unused
  uint32_t records;
  std::atomic<uint64_t> calls;
  std::atomic<uint64_t> busy_ns;
  char name[48];
  // Runs whose module was compiled (ChipBackend::TakeCompileNote), and why
  // the latest was: SetCompileWhy / CompileWhy.
  std::atomic<uint64_t> compiles;
  std::atomic<uint32_t> why_seq;  // odd while `why` is written
  std::atomic<uint64_t> why[24];  // 192 bytes, NUL-padded
};
// The latest compile's reason (cut to 191 bytes), written by the stat's
// executor; read by tpud (empty while it is being written).
void SetCompileWhy(ProgramStat* stat, absl::string_view why);
std::string CompileWhy(const ProgramStat& stat);

struct SessionChipState {
  std::atomic<uint64_t> busy_ns;
  std::atomic<uint64_t> ops;
  std::atomic<uint64_t> last_active_ns;
  uint32_t op_arena_used;
  uint32_t pad;
  OpTableEntry op_table[kMaxOpIds];
  char op_arena[kOpArenaBytes];
  PoisonTable poison;
  // The programs run most, a slot per program (the least called gives way).
  ProgramStat programs[kMaxProgramStats];
};

struct SessionStateHeader {
  uint64_t magic;
  uint64_t session_id;
  uint32_t tag;
  uint32_t num_chips;
  uint32_t num_rings;
  // Set by tpud when the session ends, and by an executor when a malformed
  // record fails its data plane: executors run nothing more for it.
  std::atomic<uint32_t> dead;
  uint64_t rings_offset;
  uint64_t chips_offset;
};

// Layout helpers for one session's state region.
class SessionStateView {
 public:
  static uint64_t BytesFor(int num_chips);
  SessionStateView() = default;
  explicit SessionStateView(char* base) : base_(base) {}
  // Writes a fresh header (tpud).
  static void Initialize(char* base, uint64_t session_id, uint32_t tag,
                         int num_chips);

  SessionStateHeader* header() const {
    return reinterpret_cast<SessionStateHeader*>(base_);
  }
  TrustedRing* ring(int r) const {
    return reinterpret_cast<TrustedRing*>(base_ + header()->rings_offset) + r;
  }
  SessionChipState* chip(int c) const {
    return reinterpret_cast<SessionChipState*>(base_ + header()->chips_offset) +
           c;
  }
  bool valid() const { return base_ != nullptr; }

 private:
  char* base_ = nullptr;
};

// Records `status` as the ring's sticky error (the first one sticks) at
// `sequence`.
// Keeps the first warning since the client last took one (tpu/shm_layout.h);
// later ones only count.
void RecordRingWarning(tpu::RingControl* ctl, uint64_t sequence,
                       absl::string_view message, bool deprecation);
void RecordRingError(tpu::RingControl* ctl, uint64_t sequence,
                     const absl::Status& status);
// Ends a ring for its client: its error becomes `status`, it is marked dead
// and every waiter (completion or ring space) is woken.
void KillRing(tpu::RingControl* ctl, const absl::Status& status);

}  // namespace tpud

#endif  // TPUD_DAEMON_CORE_SHARED_REGIONS_H_
