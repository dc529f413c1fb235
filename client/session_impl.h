// libtpuclient internals shared by client.cc (control plane) and
// data_plane_client.cc (op streams). Not installed; not part of the API.
#ifndef TPU_CLIENT_SESSION_IMPL_H_
#define TPU_CLIENT_SESSION_IMPL_H_

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/tpud.grpc.pb.h"
#include "tpu/client.h"
#include "tpu/op_record.h"
#include "tpu/shm_layout.h"

namespace tpu {
namespace internal {

inline void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::microseconds(absl::ToInt64Microseconds(timeout)));
}

// A failed call's status; unreachable-daemon errors name the socket path.
absl::Status Annotate(const grpc::Status& status, const std::string& path);

// Whether the peer of a connected socket has hung up (never blocks).
bool PeerGone(int fd);

// Connects a unix stream socket; errors name the path, errno and a remedy.
absl::StatusOr<int> ConnectUnix(const std::string& path, bool admin);

// The producer side of one ring (one stream on one chip).
struct RingProducer {
  uint64_t next_sequence = 1;
  uint64_t tail = 0;
  // Ops whose definition this ring already carried: each ring's executor
  // learns a schema from the ring itself, so no ring runs an op whose
  // definition is still queued on another.
  std::vector<bool> defined;
  // The executor's sleep epoch this producer last rang the doorbell for.
  uint32_t rung_epoch = ~0u;
};

// A stream: its ring on every chip, and the chip its last work went to. The
// stream's order across chips is kept here: work that moves to another chip
// first waits (on the device side) for the previous chip's ring.
struct StreamProducer {
  absl::Mutex mu;
  RecordWriter writer ABSL_GUARDED_BY(mu);
  std::vector<RingProducer> rings ABSL_GUARDED_BY(mu);  // by chip
  int last_chip ABSL_GUARDED_BY(mu) = -1;
  // Staging slots of this stream: the ring and sequence of the last copy
  // that used each.
  std::vector<std::pair<int, uint64_t>> slot_use ABSL_GUARDED_BY(mu);
  size_t next_slot ABSL_GUARDED_BY(mu) = 0;
  // One synchronous op at a time per stream (a ring's response area is
  // shared by its records).
  absl::Mutex sync_mu;
  // Capture (Session::BeginCapture): records go here instead of a ring.
  bool capturing ABSL_GUARDED_BY(mu) = false;
  std::string captured ABSL_GUARDED_BY(mu);
  uint32_t captured_records ABSL_GUARDED_BY(mu) = 0;
  int capture_chip ABSL_GUARDED_BY(mu) = -1;
  absl::Status capture_error ABSL_GUARDED_BY(mu);
  // Fused eager (Session::SetEagerFusion): ops held here, to go to `fused_ring`
  // as one program run when the stream next synchronises or does anything
  // but enqueue an op (Session::Impl::FlushLocked).
  bool defer_next ABSL_GUARDED_BY(mu) = false;  // the record being written
  std::string fused ABSL_GUARDED_BY(mu);
  uint32_t fused_records ABSL_GUARDED_BY(mu) = 0;
  int fused_ring ABSL_GUARDED_BY(mu) = -1;
  uint32_t fused_first_op ABSL_GUARDED_BY(mu) = 0;  // of the held run
  uint64_t fused_first_bytes ABSL_GUARDED_BY(mu) = 0;
  // Session::HeldRun: the held run's number (0: none), and the last given.
  std::atomic<uint64_t> held_run{0};
  uint64_t runs ABSL_GUARDED_BY(mu) = 0;
  // Segments freed while the run was held (Session::FreedInRun).
  std::vector<uint64_t> fused_dead ABSL_GUARDED_BY(mu);
  // Shared memory of program runs flushed so far: freed once their ring
  // completed them.
  struct FusedMemory {
    void* memory;
    int ring;
    uint64_t sequence;
  };
  std::vector<FusedMemory> fused_memory ABSL_GUARDED_BY(mu);
  // Where each held op was issued (EnqueueOp's issued_at; most empty), and
  // the next op's.
  std::vector<std::string> fused_issued ABSL_GUARDED_BY(mu);
  std::string next_issued ABSL_GUARDED_BY(mu);
};

}  // namespace internal

struct Session::Impl {
  // Set once, before ops run (Session::SetWarningHandler).
  std::function<void(absl::string_view, bool)> warning_handler;
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel ABSL_GUARDED_BY(mu);
  std::shared_ptr<tpud::v1::Runtime::Stub> stub ABSL_GUARDED_BY(mu);
  uint64_t id = 0;
  uint32_t protocol_version = 0;
  std::string daemon_version;
  uint64_t small_pool_bytes = 0;
  absl::Mutex mu;
  bool open ABSL_GUARDED_BY(mu) = false;

  // ---- data plane ----
  int data_plane_fd = -1;  // the connection; closing it ends the session
  char* shm = nullptr;
  uint64_t shm_bytes = 0;
  ShmHeader layout{};
  int num_chips = 0;
  std::vector<int> doorbells;  // eventfd per chip: wakes that chip's executor
  internal::StreamProducer streams[kStreamsPerChip];
  uint64_t staging_slot_bytes = 0;
  int staging_slots = 0;

  absl::Mutex ops_mu;
  absl::flat_hash_map<std::string, uint32_t> op_ids ABSL_GUARDED_BY(ops_mu);
  std::vector<std::string> op_schemas ABSL_GUARDED_BY(ops_mu);  // by id

  absl::Mutex pinned_mu;
  std::map<uint64_t, uint64_t> pinned_free
      ABSL_GUARDED_BY(pinned_mu);  // offset -> size
  std::map<uint64_t, uint64_t> pinned_used ABSL_GUARDED_BY(pinned_mu);

  // Per communicator: collective groups and point-to-point operations
  // issued so far, to number them in issue order.
  struct CommCounters {
    uint64_t groups = 0;
    std::map<int, uint64_t> sends, recvs;  // by peer
  };
  absl::Mutex comm_mu;
  std::map<uint64_t, CommCounters> comm_counters ABSL_GUARDED_BY(comm_mu);

  absl::Mutex events_mu;
  std::vector<uint32_t> free_events ABSL_GUARDED_BY(events_mu);

  ~Impl();

  grpc::ClientContext* Prepare(grpc::ClientContext* ctx) {
    internal::SetDeadline(ctx, options.call_timeout);
    return ctx;
  }

  // A control-plane call of this session, registered while in flight so that
  // the liveness watcher can cancel it the moment tpud goes away (gRPC alone
  // may take seconds to give up on a dead connection).
  class Call {
   public:
    explicit Call(Impl* impl);
    ~Call();
    grpc::ClientContext* ctx() { return &ctx_; }

   private:
    Impl* impl_;
    grpc::ClientContext ctx_;
  };
  // A failed call's status; UNAVAILABLE naming the socket once tpud is gone.
  absl::Status Annotate(const grpc::Status& status);
  // UNAVAILABLE for a session tpud is gone from: why tpud ended it where it
  // said so on the session's rings before it hung up (an executor crash,
  // device memory lost), else that the connection is lost.
  absl::Status Gone();
  // The reason tpud wrote on the session's rings when it ended it; empty
  // while the session is alive (or where tpud gave none).
  std::string EndedWhy();

  // Watches the data-plane connection (one thread, blocked in poll): when
  // tpud goes away it marks the session and cancels every call in flight.
  void StartWatcher();
  void StopWatcher();
  std::atomic<bool> daemon_gone{false};
  absl::Mutex calls_mu;
  std::set<grpc::ClientContext*> calls ABSL_GUARDED_BY(calls_mu);
  std::thread watcher;
  int watcher_stop_fd = -1;

  // The stub while the session is open; calls in flight keep it alive. A
  // session whose daemon is gone fails at once (UNAVAILABLE): gRPC may take
  // seconds to give up on a dead connection.
  absl::StatusOr<std::shared_ptr<tpud::v1::Runtime::Stub>> Stub()
      ABSL_LOCKS_EXCLUDED(mu) {
    if (daemon_gone.load() ||
        (data_plane_fd >= 0 && internal::PeerGone(data_plane_fd))) {
      return Gone();
    }
    absl::MutexLock lock(&mu);
    if (!open) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", id, " is closed; open a new one"));
    }
    return stub;
  }

  // Connects the data plane with the token from OpenSession and maps the
  // session's shared memory.
  absl::Status AttachDataPlane(const std::string& token);

  RingControl* Control(int ring) { return RingControlOf(shm, layout, ring); }
  // Wakes the executor of `ring`'s chip.
  void RingDoorbell(int ring) {
    const uint64_t one = 1;
    (void)!write(doorbells[RingChip(ring)], &one, sizeof(one));
  }
  // Whether a published record may skip the doorbell of a sleeping
  // executor (RingControl::sleep_bounded).
  bool MayLeaveUnrung(RingControl* ctl, const RecordHeader& h,
                      absl::string_view record);
  uint32_t WaitAdvice() {
    return HintsOf(shm, layout)->wait_advice.load(std::memory_order_relaxed);
  }
  absl::Status CheckStream(int stream) const;
  // The chip of a device address on this host, or INVALID_ARGUMENT.
  absl::StatusOr<int> ChipOfAddress(uint64_t address, const char* what) const;
  // The ring of `stream` on `chip`, after making it wait for the stream's
  // previous chip when the stream moves. REQUIRES: p.mu held.
  absl::StatusOr<int> RouteLocked(int stream, internal::StreamProducer& p,
                                  int chip) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Appends the record built in p.writer (Begin() already called with the
  // ring's next sequence) to `ring`. REQUIRES: p.mu held.
  absl::Status Publish(int ring, internal::StreamProducer& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Begins a record of `kind` on `ring`; returns its sequence. Ops held
  // for fusion go first (FlushLocked), unless this is an op that joins them
  // (`defer`: it is held too, on the same ring) or an op's definition.
  uint64_t BeginLocked(int ring, internal::StreamProducer& p, RecordKind kind,
                       bool defer = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Fused eager: sends the ops held on this stream as one program run (one
  // op alone as itself), and frees the shared memory of earlier runs the
  // ring has completed. REQUIRES: p.mu held.
  absl::Status FlushLocked(internal::StreamProducer& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Whether ops are held for fusion, and how many make a run at most
  // (Session::SetEagerFusion).
  std::atomic<bool> fuse_eager{false};
  std::atomic<uint32_t> fuse_run_ops{kMaxFusedRecords};
  // Where the ops of recent eager runs were issued, by ring and the run's
  // sequence (runs with none are not kept): TakeError adds it to an error
  // that names "op K of a fused eager run".
  struct IssuedRun {
    int ring;
    uint64_t sequence;
    std::vector<std::string> issued_at;
  };
  absl::Mutex issued_mu;
  std::deque<IssuedRun> issued_runs ABSL_GUARDED_BY(issued_mu);
  // Pinned pool blocks (Session::AllocatePinned and FreePinned).
  absl::StatusOr<void*> AllocatePinned(uint64_t bytes);
  absl::Status FreePinned(void* ptr);
  // Waits until `ring` completed `sequence` (or died, or the daemon left).
  absl::Status WaitCompleted(int ring, uint64_t sequence);
  // The ring's sticky error, cleared; OK when none. Takes its warning too
  // (TakeWarning).
  absl::Status TakeError(int ring);
  // Adds where the op was issued to an error of a fused eager run (the
  // run's ring and sequence) that names the op, where it is known.
  void AddIssuedAt(int ring, uint64_t sequence, std::string* text);
  // Hands the ring's pending warning, if any, to warning_handler and clears
  // it.
  void TakeWarning(int ring);
  // The first sticky error of any of the stream's rings (all cleared).
  absl::Status TakeStreamError(int stream);
  // Builds and publishes an op record (and the op's definition, the first
  // time its ring carries it), on the ring of the chip of its first tensor.
  // Returns its sequence; *ring_out: the ring it went to.
  absl::StatusOr<uint64_t> EnqueueOpLocked(
      int stream, internal::StreamProducer& p, uint32_t op_id, uint32_t flags,
      const OpArg* args, size_t num_args, const TensorRef* outputs,
      size_t num_outputs, int* ring_out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Publishes a copy record on `ring`. Returns its sequence.
  absl::StatusOr<uint64_t> EnqueueCopyLocked(int ring,
                                             internal::StreamProducer& p,
                                             CopyKind kind, uint64_t src,
                                             uint64_t dst, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Offset of `ptr` in the shared memory if [ptr, ptr+bytes) lies in the
  // pinned pool.
  bool PinnedOffset(const void* ptr, uint64_t bytes, uint64_t* offset) const;
  // Start of `stream`'s part of the staging area.
  uint64_t StagingBase(int stream) const {
    return layout.staging_offset +
           stream * (layout.staging_bytes / kStreamsPerChip);
  }
};

}  // namespace tpu

#endif  // TPU_CLIENT_SESSION_IMPL_H_
