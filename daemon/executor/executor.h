// Executor: the loop of one executor process. It serves the rings of its
// chips for every session: it takes records from their rings in order,
// checks each against the session's own memory, runs ops through the chip
// backend and publishes completion.
//
// One thread does all of it, whatever the number of sessions: which ring
// runs next is FairQueue's choice; a ring without work costs nothing (the
// executor polls it for a moment while it expects more, then arms the
// ring's doorbell and forgets it); a ring waiting for an event of another
// ring is parked and woken when that ring progresses; an idle executor spins
// only while the host's spin advice says a core is free, then sleeps in
// epoll on its doorbells, its control channel and its wake-up eventfd.
//
// Its state lives where a replacement can pick it up (shared_regions.h):
// records are consumed only once done, ops are named by the session's op
// table, and poison sits in the session's state. If the process dies in an
// op, tpud ends that op's session and starts another executor, which
// continues every other session's rings where they stood.
//
// A failing op records its error on its ring (reported at the client's next
// synchronisation) and poisons what it would have written; a malformed
// record fails the session's data plane for good. Nothing a client writes can
// reach another session's memory or stop the executor.
//
// Thread-safety: Run() on one thread; nothing else. That thread is the only
// caller of config.backend (see chip_backend.h).
#ifndef TPUD_DAEMON_EXECUTOR_EXECUTOR_H_
#define TPUD_DAEMON_EXECUTOR_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "daemon/backends/chip_backend.h"
#include "daemon/collectives/shared_table.h"
#include "daemon/core/shared_regions.h"
#include "daemon/executor/control_channel.h"
#include "daemon/executor/fair_queue.h"
#include "daemon/executor/thread_share.h"
#include "tpu/op_record.h"
#include "tpu/shm_layout.h"

namespace tpud {

struct ExecutorConfig {
  int index = 0;           // slot in ExecutorShared
  std::vector<int> chips;  // chips this executor serves
  int control_fd = -1;     // its end of the control channel
  ExecutorShared* shared = nullptr;
  // Every chip of the host: HBM (read-write) and page owners (read-only).
  std::vector<char*> chip_bases;
  std::vector<PageOwnerTable> owners;
  // Every executor's wake-up eventfd, by index (to wake a parked ring's
  // executor).
  std::vector<int> wake_fds;
  // Communicators and their meeting places (collectives/shared_table.h);
  // null: no collectives on this host.
  CollectiveTable* collectives = nullptr;
  ChipBackend* backend = nullptr;
  // How long an idle executor spins (when a core is free) or yields
  // (otherwise) before it sleeps.
  uint64_t spin_ns = 50000;
  uint64_t yield_ns = 50000;
  // While the advice is not to spin and work ran within the last 100 ms,
  // sleep at most tpu::kBoundedSleepNanos, look at the rings, and let
  // producers skip the doorbell (RingControl::sleep_bounded).
  bool unrung = false;
  // A ring runs at most this long while others wait.
  uint64_t quantum_ns = 200000;
  // A ring without work is polled this long before its doorbell is armed.
  uint64_t poll_ns = 2000000;
  // Freed memory stays in the executor process's heap (executor_main.cc)
  // until it has been idle this long; 0: glibc's default (none stays).
  uint64_t heap_keep_ns = 0;
  // Threads each op may use: > 0 exactly that; 0 the host's cores shared
  // among busy chips (thread_share.h).
  int intra_op_threads = 0;
};

class Executor {
 public:
  explicit Executor(ExecutorConfig config);
  ~Executor();

  // Serves until tpud says stop or goes away. Returns the exit code.
  int Run();

 private:
  struct Session;
  struct Ring {
    enum class State { kArmed, kPolled, kQueued, kParked, kDone };
    Session* session = nullptr;
    int index = 0;  // ring index in the session
    int chip = 0;
    int handle = 0;  // FairQueue handle
    tpu::RingControl* ctl = nullptr;
    char* data = nullptr;
    TrustedRing* trusted = nullptr;
    State state = State::kArmed;
    uint64_t polled_since = 0;
    // kParked: waiting until ring `wait_ring` completed `wait_sequence`.
    int wait_ring = -1;
    uint64_t wait_sequence = 0;
    // A collective group at the head: posted (or waiting for its rank's
    // slot), parked until it is done.
    bool in_collective = false;
    bool collective_posted = false;
    uint64_t collective_sequence = 0;
    uint64_t collective_comm = 0;
    int collective_rank = -1;
    int collective_slot = -1;
  };
  struct OpSlot {
    std::shared_ptr<const BackendOp> op;
    absl::Status status;  // why its schema could not be resolved
    bool resolved = false;
  };
  // A captured program, copied out of the session's shared memory and
  // checked once: its records, in order.
  struct Program {
    uint64_t offset = 0;  // where it was read from
    uint64_t bytes = 0;
    std::string name;
    std::string data;
    std::vector<std::pair<size_t, size_t>> records;  // (offset, length) in data
    // A fused eager run's segments nothing reads after it (sorted).
    std::vector<uint64_t> dead;
    uint64_t calls = 0;
    // The backend declined to run it whole (ChipBackend::RunProgram): its
    // records run one by one from now on.
    bool one_by_one = false;
  };
  struct Session {
    uint64_t id = 0;
    uint32_t tag = 0;
    SharedMapping shm;
    SharedMapping state_map;
    SessionStateView state;
    tpu::ShmHeader
        layout{};  // our own copy: the client can write the shared one
    int doorbell_fd = -1;
    uint64_t epoll_key = 0;
    std::vector<std::unique_ptr<Ring>>
        rings;                             // the rings of this executor's chips
    std::vector<std::vector<OpSlot>> ops;  // per chip index in config.chips
    uint64_t last_active_ns = 0;
    bool failed = false;
    // Captured programs this session ran, parsed once (by program id).
    std::unordered_map<uint32_t, std::shared_ptr<Program>> programs;
  };
  class ResultAllocatorImpl;

  // ---- control ----
  void HandleControl();
  // Reads every kReleased message tpud has sent (ExecutorSlot::releases_sent)
  // and passes it to the backend; other messages wait in pending_control_.
  // Called before memory is resolved, by backends with device memory only.
  void SyncReleases();
  void Attach(const ControlMessage& msg, std::vector<int>& fds);
  void Detach(uint64_t session_id);
  // Waits for tpud's answer to a request (other messages are queued).
  bool AwaitReply(uint64_t request_id, ControlMessage* reply);

  // ---- scheduling ----
  void MakeRunnable(Ring& ring);
  // Sets the ring's consumer_sleeping flag (a new sleep epoch).
  void ArmDoorbell(Ring& ring);
  void PollRings(uint64_t now);
  bool HasWork(const Ring& ring) const;
  bool ParkedReady(const Ring& ring) const;
  void Sleep(int timeout_ms);
  // Tells every ring (RingControl::sleep_bounded) whether our sleeps are
  // bounded now; when they no longer are, makes each armed ring with work
  // runnable.
  void SetSleepBounded(bool bounded);
  // Whether it found any.
  bool WakeArmedWithWork();
  void DrainDoorbells(int timeout_ms);
  void RunRing(Ring& ring);
  void UpdateActivity(uint64_t now);
  // Errors for metrics (ExecutorSlot::op_errors): every failed record, and
  // the record's ring error with it.
  void CountError(const absl::Status& status);
  void RecordOpError(tpu::RingControl* ctl, uint64_t sequence,
                     const absl::Status& status);

  // ---- records ----
  // Handles the record at the ring's head. Returns false when the ring
  // cannot go on now (parked, or its session failed).
  bool Step(Ring& ring);
  absl::Status HandleDefineOp(Ring& ring, absl::string_view record);
  absl::Status RunOp(Ring& ring, uint64_t sequence);
  absl::Status RunCopy(Ring& ring, const tpu::DecodedCopy& copy);
  // OK: satisfied; kUnavailable-free "not yet" is reported through *wait.
  absl::Status CheckEventWait(Ring& ring, uint64_t sequence,
                              const tpu::DecodedEventWait& wait, bool* ready);
  absl::Status ResolveTensors(Ring& ring);
  // ---- captured programs (captured_programs.cc) ----
  // Runs a captured program's records back to back (kRunProgram).
  absl::Status RunProgram(Ring& ring, uint64_t sequence,
                          const tpu::DecodedRunProgram& run);
  // The last fused eager run read, kept so that the next one reuses its
  // buffers (no allocation per run) when nothing holds it any more.
  std::shared_ptr<Program> eager_scratch_;
  absl::StatusOr<std::shared_ptr<Program>> ProgramOf(
      Session& s, const tpu::DecodedRunProgram& run);
  // ---- collectives (collective_steps.cc) ----
  // Handles a kCollective record at the ring's head: posts its group (once),
  // runs whatever met, and reports whether the group is done (*done; then
  // the status is its result).
  absl::Status StepCollective(Ring& ring, uint64_t sequence,
                              absl::string_view record, bool* done,
                              bool* malformed);
  bool CollectiveReady(const Ring& ring, uint64_t now) const;
  absl::Status PostGroup(Ring& ring, CommSlot* comm, int rank,
                         uint64_t sequence, bool* posted);
  // Under the communicator's mutex: runs the collective instance or the
  // point-to-point pairs that have met, after rank's slot k was posted.
  void RunMet(CommSlot* comm, int rank, int k);
  void RunP2P(CommSlot* comm, int a, int ka, int ia, int b, int kb, int ib);
  // Fails every posted group of the communicator, and the communicator.
  void FailComm(CommSlot* comm, const std::string& why);
  void FinishSlot(CommSlot* comm, int rank, int k, const absl::Status& status);
  // Completes another rank's group record on its ring for it, and finishes
  // its slot (see the .cc).
  void FinishPeerSlot(CommSlot* comm, int rank, int k,
                      const absl::Status& status);
  // The rank's ring control when its record was completed, else null.
  tpu::RingControl* CompleteForRank(CommSlot* comm, int rank, int k);
  // After a ring's completed sequence moved: its client's waiters and the
  // executors parked on it.
  void WakeCompletionWaiters(TrustedRing* trusted, tpu::RingControl* ctl);
  void WakeRank(const CommSlot* comm, int rank);
  // Host view of a rank's buffer, checked against that rank's session;
  // `segment` (if given) gets the segment it lies in. With `host_access`,
  // a backend with memory of its own first brings the arena's copy up to
  // date (input) or drops its own (output).
  absl::StatusOr<char*> RankRange(const CommSlot* comm, int rank,
                                  uint64_t address, uint64_t bytes,
                                  const char* what, bool input,
                                  ResolvedTensor* segment = nullptr,
                                  bool host_access = true);
  void PoisonCollectiveOutputs(Ring& ring, const std::string& cause,
                               bool clear);
  // Ends the memory fence of a collective over `ranks` ranks (their session
  // tags published in slot_->collective_tags) and wakes its waiters.
  void EndCollectiveFence(int ranks);
  const OpSlot& LookupOp(Ring& ring, uint32_t op_id);
  void Complete(Ring& ring, uint64_t length, uint64_t sequence);
  void FailSession(Session& s, const absl::Status& status);
  void BeginOp(Ring& ring, uint64_t sequence, const char* what,
               size_t what_len);
  void EndOp();
  int ChipSlot(int chip) const;
  // The op's name without its signature ("aten::add.Tensor"), for messages.
  static std::string OpName(const BackendOp* op);

  // ---- poison (per chip, in the session's state) ----
  // The cause when [begin, end) overlaps poisoned memory of `chip`.
  bool FindPoison(Session& s, int chip, uint64_t begin, uint64_t end,
                  std::string* cause) const;
  void AddPoison(Session& s, int chip, uint64_t begin, uint64_t end,
                 const std::string& cause);
  void ClearPoison(Session& s, int chip, uint64_t begin, uint64_t end);
  void PoisonOutputs(Ring& ring, const BackendOp* op, const std::string& cause);
  void UnpoisonOutputs(Ring& ring, const BackendOp& op);
  absl::Status CheckInputPoison(Ring& ring, const BackendOp& op);

  // Host view of a checked device range of the session; INVALID_ARGUMENT or
  // PERMISSION_DENIED naming it otherwise.
  absl::StatusOr<char*> DeviceRange(Session& s, uint64_t address,
                                    uint64_t bytes, const char* what);
  absl::StatusOr<char*> HostRange(Session& s, uint64_t offset, uint64_t bytes);

  ExecutorConfig config_;
  ExecutorSlot* slot_;
  ThreadShare threads_;  // applied in UpdateActivity, between ops
  int epoll_fd_ = -1;
  bool stopping_ = false;
  uint64_t next_key_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Session>> sessions_;  // by id
  std::unordered_map<uint64_t, Session*> by_key_;  // by epoll key
  std::vector<Ring*> handles_;  // FairQueue handle -> ring (nullptr when freed)
  std::vector<int> free_handles_;
  FairQueue queue_;
  std::vector<Ring*> polled_;
  std::vector<Ring*> parked_;
  int armed_count_ = 0;
  // When a ring last ran work (RunRing), and whether the armed rings were
  // last told that our sleep is bounded (tpu::kBoundedSleepNanos).
  uint64_t last_run_ns_ = 0;
  bool sleep_bounded_ = false;
  std::deque<std::pair<ControlMessage, std::vector<int>>> pending_control_;
  uint64_t releases_seen_ = 0;
  uint64_t next_request_ = 1;
  bool wake_pending_ = false;

  // Scratch for the record being handled (one at a time).
  std::string record_;
  tpu::DecodedOp op_;
  tpu::DecodedRunProgram run_;
  std::vector<const tpu::TensorRef*> refs_;
  std::vector<ResolvedTensor> resolved_;
  std::vector<ResultValue> results_;
  // A program's ops, decoded and resolved, for a backend that runs it whole.
  std::vector<tpu::DecodedOp> whole_ops_;
  std::vector<tpu::DecodedCopy> whole_copies_;
  std::vector<std::vector<ResolvedTensor>> whole_tensors_;
  // Segments a fused eager run's records touch (hoisted_fills' scan).
  absl::flat_hash_set<uint64_t> touched_;
  size_t bad_ref_ = 0;
  bool bad_ref_foreign_ = false;
  std::string poison_root_;
  tpu::DecodedCollective collective_;
  std::vector<char> collective_scratch_;

  // Activity window.
  uint64_t window_start_ns_ = 0;
  uint64_t window_busy_ns_ = 0;
  uint64_t last_activity_update_ = 0;
  // Freed memory stays in the heap while work goes on (executor_main.cc):
  // when work last ran, and whether the heap was trimmed since.
  uint64_t last_work_ns_ = 0;
  bool heap_trimmed_ = true;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_EXECUTOR_EXECUTOR_H_
