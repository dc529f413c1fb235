// libtpuclient: the C++ API of a tpud session.
//
// A Session is one client connection to tpud on its runtime socket. The daemon
// learns who the client is from the socket itself, and when the connection
// closes (Close(), destruction, exit, crash, kill -9) the session ends and the
// daemon reclaims all of its HBM at once.
//
// Every call returns absl::Status; codes follow their documented meaning:
// RESOURCE_EXHAUSTED (out of HBM, over quota), PERMISSION_DENIED (another
// session's memory), INVALID_ARGUMENT (malformed input), FAILED_PRECONDITION
// (drained chip, no common protocol version), UNAVAILABLE (no daemon / daemon
// gone), NOT_FOUND (the session ended).
//
// Thread-safety: a Session and an AdminClient may be used from several threads.
#ifndef TPU_CLIENT_H_
#define TPU_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tpu/op_record.h"

namespace tpu {

struct GenerationInfo {
  std::string name;  // "v6e"
  uint64_t hbm_bytes_per_chip = 0;
  double hbm_bandwidth_gbytes_per_s = 0;
  double ici_bandwidth_gbytes_per_s = 0;
  double peak_bf16_tflops = 0;
  int tensorcores_per_chip = 0;
  int torus_dims = 0;
};

struct ChipInfo {
  int id = 0;
  std::vector<int> coords;
  std::vector<int> neighbors;
  uint64_t hbm_total_bytes = 0;
  uint64_t hbm_used_bytes = 0;
  uint64_t hbm_peak_bytes = 0;
  uint64_t hbm_largest_free_block = 0;
  uint64_t segment_count = 0;
  int session_count = 0;
  bool healthy = true;
  bool drained = false;
  double duty_cycle = 0;  // fraction of the last second spent running ops
  double busy_seconds = 0;
  uint64_t ops_executed = 0;
};

// One ICI link (a < b), with the bytes collectives moved over it each way.
struct IciLinkInfo {
  int a = 0, b = 0, axis = 0;
  uint64_t bytes_a_to_b = 0, bytes_b_to_a = 0;
};

struct TopologyInfo {
  std::string name;  // "v6e-4"
  GenerationInfo generation;
  std::vector<int> shape;
  std::vector<bool> wraparound;
  std::vector<ChipInfo> chips;
  std::vector<IciLinkInfo> links;
  bool simulated = false;
  std::string backend;  // "simulated" or "pjrt" (empty: an older daemon)
  // pjrt: the ATen ops the backend lowers whole (see the proto).
  std::vector<std::string> lowered_ops;
  // pjrt with device memory: a run of ops compiles as one program (fused
  // eager is torch_tpu's default there).
  bool fuses = false;
  std::string ShapeString() const;  // "2x2"
};

struct Segment {
  uint64_t address = 0;  // device address (see tpu/device_address.h)
  int chip = 0;
  uint64_t offset = 0;
  uint64_t size = 0;  // granted, rounded up to the daemon's granularity
  uint64_t requested_bytes = 0;
};

struct ChipMemoryStats {
  int chip = 0;
  uint64_t session_bytes = 0;
  uint64_t session_peak_bytes = 0;
  uint64_t session_segments = 0;
  uint64_t chip_used_bytes = 0;
  uint64_t chip_total_bytes = 0;
  uint64_t chip_free_bytes = 0;
  uint64_t chip_largest_free_block = 0;
  uint64_t chip_peak_bytes = 0;
  bool drained = false;
};

struct MemoryStats {
  std::vector<ChipMemoryStats> chips;
  uint64_t quota_bytes_per_chip = 0;  // 0: none
};

// A point in a stream's work (CUDA's event): recorded on one stream, waited on
// by others, queried, timed.
// The slot of an event made by EventAt: it has none.
inline constexpr uint32_t kUntimedEventSlot = 0xffffffffu;

struct Event {
  uint32_t slot = 0;
  int ring = 0;  // the ring (stream and chip) it was recorded on
  uint64_t sequence = 0;
};

// A value returned by a synchronous op (Session::RunSync).
// A captured program (Session::BeginCapture/EndCapture): its records live in
// the session's shared memory until ReleaseProgram.
struct Program {
  uint32_t id = 0;
  int chip = 0;
  uint64_t offset = 0;  // in the session's shared memory
  uint64_t bytes = 0;
  uint32_t num_records = 0;
  std::string name;
  void* memory = nullptr;  // its pinned block
};

struct OpResult {
  enum class Kind : uint8_t {
    kNone = 0,
    kInt,
    kDouble,
    kBool,
    kComplex,
    kTensor,
    kUInt  // an unsigned 64-bit value, in i's bits
  };
  Kind kind = Kind::kNone;
  int64_t i = 0;
  double d = 0;
  double d_imag = 0;
  bool b = false;
  // kTensor: either a new segment of this session holding the data
  // (contiguous; the caller owns it and frees it with Session::Free), or,
  // when the op returned one of its arguments, that argument's reference.
  TensorRef tensor;
  uint64_t nbytes = 0;
};

// Streams of a session (CUDA's streams; 0 is the default). A stream keeps its
// order across chips: its work may go to any chip, one op at a time.
inline constexpr int kNumStreams = 8;

struct ClientOptions {
  // Empty: $TPUD_SOCKET, else the default (see tpu/paths.h).
  std::string socket_path;
  // Informational name shown by `tpuctl sessions`.
  std::string client_name;
  // An allocation's token (from the Kubernetes device plugin): the session
  // gets its chips and quotas. Empty: $TPUD_TOKEN, else none.
  std::string allocation_token;
  // Size of this session's pinned host pool; 0: the daemon's default.
  uint64_t pinned_pool_bytes = 0;
  // Deadline of each control-plane call, so a wedged daemon never hangs us.
  absl::Duration call_timeout = absl::Seconds(30);
};

// A captured program (or a session's fused eager runs, id ~0u) a session
// ran on a chip: its calls, chip time, compiles and why the latest was.
struct ProgramInfo {
  uint32_t id = 0;
  std::string name;
  int chip = 0;
  uint32_t records = 0;
  uint64_t calls = 0;
  double busy_seconds = 0;
  uint64_t compiles = 0;     // runs whose module tpud compiled
  std::string last_compile;  // why the latest was
};

class Session {
 public:
  // Connects and opens a session. No daemon: UNAVAILABLE naming the socket,
  // the errno text and how to start tpud.
  static absl::StatusOr<std::unique_ptr<Session>> Open(
      ClientOptions options = {});
  ~Session();  // closes the session if still open

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id() const;
  uint32_t protocol_version() const;
  const std::string& daemon_version() const;
  const std::string& socket_path() const;
  // The segment size tpud asks this client to carve small allocations from
  // (0: one segment per allocation).
  uint64_t small_pool_bytes() const;

  absl::StatusOr<TopologyInfo> GetTopology();

  // Allocates `bytes` of HBM on `chip`.
  absl::StatusOr<Segment> Allocate(int chip, uint64_t bytes);
  // Frees a segment by the address Allocate returned.
  absl::Status Free(uint64_t address);
  absl::StatusOr<MemoryStats> GetMemoryStats();
  // This session's captured programs and fused eager runs (the most run, per
  // chip; id ~0u: the fused eager runs), as tpuctl programs shows them:
  // calls, chip time, compiles and why the latest compile happened.
  absl::StatusOr<std::vector<ProgramInfo>> GetPrograms();

  // Ends the session; the daemon frees everything it still holds. Idempotent.
  absl::Status Close();

  // ---- collectives (one rank per chip and session; see tpud's
  // daemon/collectives/groups.h) ----

  // Joins communicator `key` as rank `rank` of `size`, on `chip`; returns its
  // id once every rank has joined (blocks up to `join_timeout`). An
  // operation waits at most `op_timeout` for its peers; then the
  // communicator fails on every rank, naming the ranks that never came.
  absl::StatusOr<uint64_t> JoinCommunicator(
      const std::string& key, int size, int rank, int chip,
      absl::Duration op_timeout = absl::Minutes(30),
      absl::Duration join_timeout = absl::Minutes(5));
  absl::Status LeaveCommunicator(uint64_t communicator);
  // Enqueues a group of collective (or of point-to-point) operations on
  // `stream` of `chip`, run as one: the stream goes on once the whole group
  // completed with its peers. Errors (mismatched calls across ranks, a peer
  // that died, a timeout) surface at the stream's next synchronisation, on
  // every rank. Returns the record's sequence.
  absl::StatusOr<uint64_t> EnqueueCollective(int stream, int chip,
                                             uint64_t communicator,
                                             const CollectiveEntry* ops,
                                             size_t num_ops);

  // ---- data plane: op streams over shared memory, CUDA's semantics ----
  // Streams are 0..kNumStreams-1; each runs its work in order, streams run
  // concurrently. Enqueueing returns at once; an op's own failure surfaces
  // at the next Synchronize of its stream, naming the op.

  // Interns a full operator schema ("aten::add.Tensor(Tensor self, Tensor
  // other, *, Scalar alpha=1) -> Tensor") once per session. If the daemon's
  // torch has a different schema under that name, ops using the id fail with
  // INVALID_ARGUMENT naming both schemas.
  absl::StatusOr<uint32_t> DefineOp(absl::string_view schema);

  // Enqueues an op. Returned tensors that are not arguments are written into
  // `outputs` (allocated by the caller). Returns the record's sequence.
  // `flags`: kOpFlagDefaultDtypeMask bits (tpu/op_record.h) or 0.
  // `issued_at` (a Python file:line, say): where the op came from, added to
  // the error of a fused eager run that fails at this op.
  absl::StatusOr<uint64_t> EnqueueOp(int stream, uint32_t op_id,
                                     const OpArg* args, size_t num_args,
                                     const TensorRef* outputs,
                                     size_t num_outputs, uint32_t flags = 0,
                                     absl::string_view issued_at = {});

  // EnqueueOp, then waits for that op and reports (and clears) the first
  // error its ring holds: the op's own failure (with its tpu::AtenError
  // payload), or an earlier op's there (without).
  // For an op whose arguments were never seen before: its argument errors
  // then reach the caller at the call, as a CPU kernel's do. While the
  // stream captures (BeginCapture) it only enqueues.
  absl::Status RunChecked(int stream, uint32_t op_id, const OpArg* args,
                          size_t num_args, const TensorRef* outputs,
                          size_t num_outputs, uint32_t flags = 0);

  // Runs an op after the stream's earlier work and waits for its values:
  // scalars, and tensors whose shape depends on data (those come back in
  // new segments of this session). One round trip through shared memory.
  absl::StatusOr<std::vector<OpResult>> RunSync(
      int stream, uint32_t op_id, const OpArg* args, size_t num_args,
      const TensorRef* outputs, size_t num_outputs, uint32_t flags = 0);

  // Host to device. From pinned memory (AllocatePinned) it is one copy by the
  // daemon and asynchronous: keep `src` unchanged until the stream
  // synchronises. From pageable memory it goes through staging, chunked and
  // pipelined, and returns once `src` may be reused.
  absl::Status CopyToDevice(int stream, uint64_t dst_address, const void* src,
                            uint64_t bytes);
  // Device to host; returns when the data is in `dst` (after the stream's
  // earlier work).
  absl::Status CopyToHost(int stream, void* dst, uint64_t src_address,
                          uint64_t bytes);
  // Device to device, same chip or across chips; asynchronous.
  absl::Status CopyOnDevice(int stream, uint64_t dst_address,
                            uint64_t src_address, uint64_t bytes);

  // Pinned host memory: part of the session's shared memory, so a copy from
  // or to it is a single memcpy in the daemon.
  absl::StatusOr<void*> AllocatePinned(uint64_t bytes);
  absl::Status FreePinned(void* ptr);
  bool IsPinned(const void* ptr) const;

  absl::StatusOr<Event> RecordEvent(int stream);
  // An event that completes with the record `sequence` enqueued on `stream`
  // of `chip` (as EnqueueOp and EnqueueCollective return it), without a
  // record of its own. It has no timestamp (ElapsedMillis refuses it);
  // ReleaseEvent of it does nothing.
  Event EventAt(int stream, int chip, uint64_t sequence) const;
  // Makes `stream` wait (on the device side) until `event` completed.
  absl::Status WaitEvent(int stream, const Event& event);
  bool EventDone(const Event& event);
  absl::Status SynchronizeEvent(const Event& event);
  // Milliseconds between two completed events.
  absl::StatusOr<double> ElapsedMillis(const Event& start, const Event& end);
  void ReleaseEvent(const Event& event);

  // Waits for all work enqueued on `stream`, then reports (and clears) the
  // first error an op of that stream hit since the last synchronisation.
  absl::Status Synchronize(int stream);
  absl::Status SynchronizeAll();

  // Warnings the daemon's kernels raised (ATen's TORCH_WARN): at every
  // synchronising call, the first one of each ring since the last is given
  // to `handler` (message, whether it is a DeprecationWarning) on the
  // calling thread. Set it before running ops; without one they are dropped.
  void SetWarningHandler(
      std::function<void(absl::string_view message, bool deprecation)> handler);
  // Waits for all enqueued work of every stream without taking the streams'
  // errors (they stay for the next Synchronize). For freeing memory that
  // queued work may still use.
  absl::Status WaitIdle();

  // Fused eager: while on, ops that nobody waits for at once are held on
  // their stream and sent as one program run (ChipBackend::RunProgram
  // compiles it whole where it can) when the stream synchronises, copies,
  // records or waits for an event, runs a collective or a program, moves to
  // another chip, enqueues an op someone waits for, or holds `run_ops` ops
  // (at most kMaxFusedRecords, the first bound; 0 keeps the bound; fewer let
  // tpud run a long stretch of ops while the caller issues more). Errors
  // surface where they would without it: at the stream's next synchronisation.
  // Turning it off sends what is held.
  void SetEagerFusion(bool on, uint32_t run_ops = 0);
  bool eager_fusion() const;
  // Fused eager: a number naming the run of ops `stream` holds now, 0 while
  // it holds none. A run, once sent, is never named again (an allocator
  // keeps blocks freed during a run out of that run, so that its tensors'
  // sharing of segments, part of what tpud compiles, is the same each time).
  // Lock-free, for deleters.
  uint64_t HeldRun(int stream) const;
  // The segment at `address` was freed while `stream` held run `run`
  // (HeldRun's number): nothing reads it after that run, so tpud need not
  // keep what the run writes there. False (and nothing noted) where the run
  // was sent already.
  bool FreedInRun(int stream, uint64_t run, uint64_t address);

  // ---- programs: a stream's work captured once, then run by one record ----
  // As CUDA's stream capture: between BeginCapture and EndCapture, ops and
  // device-to-device copies enqueued on `stream` are recorded, not run.
  // Work that cannot be replayed (synchronous ops, copies with the host,
  // events, collectives, a second chip) fails with FAILED_PRECONDITION and
  // spoils the capture. Ops keep the device addresses they were given:
  // RunProgram moves the ranges it binds (inputs, outputs) and leaves the
  // rest (the program's own intermediates, which the caller must keep
  // allocated and unused by others while the program lives).
  absl::Status BeginCapture(int stream);
  // Ends the capture of `stream`: the program, written once into the
  // session's shared memory; or why the capture failed (nothing kept).
  absl::StatusOr<Program> EndCapture(int stream, const std::string& name);
  // Enqueues one run of `program` on `stream`: its records run back to back
  // in tpud, every address inside bindings[i].from + [0, bytes) moved to
  // bindings[i].to; seed != 0 reseeds its random ops. Returns the record's
  // sequence. An op's failure stops the run, poisons what the rest would
  // have written, and surfaces at the stream's next synchronisation naming
  // the program and the op.
  absl::StatusOr<uint64_t> RunProgram(
      int stream, const Program& program,
      const std::vector<ProgramBinding>& bindings, uint64_t seed);
  // Frees the program's shared memory. REQUIRES: no run of it is queued.
  absl::Status ReleaseProgram(const Program& program);

 private:
  struct Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------- admin

struct SessionInfo {
  uint64_t id = 0;
  uint64_t allocation_id = 0;  // 0: opened without an allocation token
  int pid = 0;
  uint32_t uid = 0;
  std::string command;
  std::string client_name;
  uint64_t hbm_bytes = 0;
  std::map<int, uint64_t> hbm_bytes_per_chip;
  uint64_t quota_bytes_per_chip = 0;
  uint32_t protocol_version = 0;
  double opened_unix_seconds = 0;
  uint64_t segment_count = 0;
  double busy_seconds = 0;  // chip time this session's ops used
  uint64_t ops_executed = 0;
  using Program = ProgramInfo;
  std::vector<Program> programs;  // captured programs it ran
};

// An executor process of tpud: where the ops of its chips run. A kernel that
// crashes or hangs takes down only its executor, which tpud replaces.
struct ExecutorInfo {
  int index = 0;
  std::vector<int> chips;
  int pid = 0;
  bool ready = false;
  uint64_t restarts = 0;
  double busy_seconds = 0;
  uint64_t ops_executed = 0;
  // Times it found op records that no producer rang for (they may skip the
  // doorbell while the cores are oversubscribed): wake-ups saved.
  uint64_t unrung_wakes = 0;
  double duty_cycle = 0;
  // Backends that compile ops into programs (PJRT): per chip, in `chips`
  // order; empty otherwise.
  struct Compile {
    int chip = 0;
    uint64_t compiles = 0;
    double compile_seconds = 0;
    uint64_t cache_hits = 0;
    uint64_t collective_programs = 0;  // collectives run as one program
    uint64_t graph_programs = 0;       // captured graphs run as one module
    // The compilation cache on disk (--compile_cache_dir): programs loaded
    // from it instead of compiled, programs written to it, and the compile
    // time those loads saved.
    uint64_t disk_hits = 0;
    uint64_t disk_stores = 0;
    double compile_seconds_saved = 0;
  };
  std::vector<Compile> compile;
  uint64_t programs_cached = 0;
  uint64_t device_buffer_bytes =
      0;  // held in device buffers (PJRT device memory)
  // The compilation cache on disk (--compile_cache_dir), as this executor
  // sees it (executors may share one directory). rejected: entries refused
  // when read (torn, corrupt, or written for another plugin build) and
  // removed; write_errors: writes that failed (a full disk, say).
  struct DiskCache {
    bool enabled = false;
    uint64_t entries = 0;    // programs in the directory now
    uint64_t bytes = 0;      // their size on disk
    uint64_t max_bytes = 0;  // the bound (--compile_cache_bytes)
    uint64_t rejected = 0;
    uint64_t write_errors = 0;
  } disk_cache;
  // Threads each of its ops may use now and at most (alone on the host); 0
  // where the backend keeps its own (PJRT).
  int intra_op_threads = 0;
  int intra_op_threads_max = 0;
  bool busy = false;  // inside an op, or ran work within the last 100 ms
};

// One replacement of an executor: why, and whose op was running.
struct ExecutorRestart {
  double unix_seconds = 0;
  int executor = 0;
  std::vector<int> chips;
  int pid = 0;              // the process that died
  std::string reason;       // "SIGSEGV (segmentation fault)", ...
  uint64_t session_id = 0;  // 0: no op was running (nobody's session ended)
  std::string op;
  int stream = 0;
  int chip = 0;
  uint64_t sequence = 0;
};

// A communicator of collectives (one rank per chip and session).
struct CommunicatorInfo {
  uint64_t id = 0;
  int size = 0;
  std::vector<int> chips;          // by rank
  std::vector<uint64_t> sessions;  // by rank
  std::vector<int> ring;           // ranks in ring order
  bool failed = false;
  std::string failure;
  uint64_t groups_done = 0;
  uint64_t bytes_moved = 0;
};

// What runs the daemon's ops (tpud --backend).
struct BackendInfo {
  std::string kind;  // "simulated" or "pjrt"
  std::string
      description;  // "PJRT (xla_cpu_pjrt.so: PJRT API 0.81, platform cpu)"
  std::string plugin_path;
  std::string pjrt_api_version;  // "0.81"
  std::string platform;
};

struct DaemonStatus {
  TopologyInfo topology;
  BackendInfo backend;
  std::vector<SessionInfo> sessions;
  std::string daemon_version;
  double uptime_seconds = 0;
  int daemon_pid = 0;
  uint64_t default_quota_bytes_per_chip = 0;
  std::vector<ExecutorInfo> executors;
  std::vector<ExecutorRestart> executor_restarts;  // oldest first
  bool spin_ok = false;
  std::string wait_advice;  // "spin", "yield" or "sleep"
  std::vector<CommunicatorInfo> communicators;
  uint64_t collectives_run = 0;
};

struct ChipHealth {
  int chip = 0;
  bool healthy = false;
  bool drained = false;
  std::string detail;
};

// Chips and quotas set aside for one consumer (a Kubernetes container);
// sessions that present its token get them.
struct AllocationInfo {
  uint64_t id = 0;
  std::string name;
  struct Chip {
    int chip = 0;
    uint64_t quota_bytes = 0;  // 0: none
  };
  std::vector<Chip> chips;
  double created_unix_seconds = 0;
  int session_count = 0;  // open sessions that presented its token
};

struct CreatedAllocation {
  uint64_t id = 0;
  std::string token;
};

struct HealthReport {
  bool serving = false;
  std::vector<ChipHealth> chips;
  std::string daemon_version;
};

// The administrative API, served only on the admin socket (root only).
class AdminClient {
 public:
  // Empty path: $TPUD_ADMIN_SOCKET, else the default.
  static absl::StatusOr<std::unique_ptr<AdminClient>> Connect(
      std::string admin_socket_path = "",
      absl::Duration call_timeout = absl::Seconds(30));
  ~AdminClient();

  absl::StatusOr<DaemonStatus> GetStatus();
  // The status now and then every `interval_seconds` (0: 1 s), streamed
  // (tpuctl top, tpuctl watch), to `on_update` until it returns false,
  // `count` updates came (0: no limit) or tpud stops.
  absl::Status Watch(double interval_seconds, uint32_t count,
                     const std::function<bool(const DaemonStatus&)>& on_update);
  absl::StatusOr<std::vector<SessionInfo>> ListSessions();
  // Ends a session and reclaims its HBM; returns the bytes reclaimed.
  absl::StatusOr<uint64_t> KillSession(uint64_t session_id);
  // Per-chip quota for one session; 0 removes it.
  absl::Status SetSessionQuota(uint64_t session_id,
                               uint64_t quota_bytes_per_chip);
  // Per-chip quota for sessions opened from now on; 0 removes it.
  absl::Status SetDefaultQuota(uint64_t quota_bytes_per_chip);
  absl::Status DrainChip(int chip);
  absl::Status UndrainChip(int chip);
  absl::StatusOr<HealthReport> Health();
  // Sets `chips` aside with a quota per chip (one entry per chip; 0: none)
  // under a new token, which sessions present (TPUD_TOKEN).
  absl::StatusOr<CreatedAllocation> CreateAllocation(
      const std::vector<int>& chips, const std::vector<uint64_t>& quota_bytes,
      const std::string& name);
  absl::Status ReleaseAllocation(const std::string& token);
  absl::Status ReleaseAllocationById(uint64_t id);
  absl::StatusOr<std::vector<AllocationInfo>> ListAllocations();

 private:
  struct Impl;
  explicit AdminClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tpu

#endif  // TPU_CLIENT_H_
