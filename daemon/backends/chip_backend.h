// ChipBackend: how the executor runs work on a chip.
//
// The executor decodes and validates records, resolves every tensor reference
// to memory it has checked belongs to the session, and hands the op here.
// The default backend is the simulated chip (ATen CPU kernels on HBM viewed
// as CPU tensors); a hardware backend (a PJRT plugin) would implement the same
// interface. Nothing above this interface may assume the simulated chip.
//
// Thread-safety: one thread calls it. Each executor process makes its own
// backend after the fork (ExecutorProcessConfig::make_backend) and calls
// every method from the one thread that runs Executor::Run, for every chip
// that executor serves (one chip on the simulated backend, all of the
// host's on PJRT); the streams of all sessions are interleaved by that
// thread's scheduler (FairQueue), never run concurrently. So an
// implementation needs no locks for the executor's sake; it may use threads
// of its own inside a call (ATen's intra-op pool, a PJRT plugin's), and may
// promise more in its own header.
#ifndef TPUD_DAEMON_BACKENDS_CHIP_BACKEND_H_
#define TPUD_DAEMON_BACKENDS_CHIP_BACKEND_H_

#include <complex>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "tpu/op_record.h"

namespace tpud {

// A backend's executable handle for one operator schema.
class BackendOp {
 public:
  virtual ~BackendOp() = default;
  virtual const std::string& schema() const = 0;
  // Whether the op writes argument `index` (in-place and out= arguments), so
  // a failure can poison what it may have half-written.
  virtual bool WritesArgument(size_t index) const { return false; }
  // Whether the op writes argument `index` without reading its values (an
  // out= tensor; the target of fill_, zero_, copy_ or a random fill), so
  // poison on it is no reason to fail and the op's success clears it.
  virtual bool OverwritesArgument(size_t index) const { return false; }
};

// Where one TensorRef of an op lives, as checked by the executor: the
// segment that contains the tensor's whole footprint.
struct ResolvedTensor {
  char* segment_host_base = nullptr;  // host view of the segment's first byte
  uint64_t segment_address = 0;       // device address of that byte
  uint64_t segment_bytes = 0;
  uint64_t owner = 0;  // the session whose segment it is (its id)
};

// Storage for results the host needs but the client could not allocate in
// advance (outputs whose shape depends on data). Allocated in the session's
// HBM, charged to its quota.
class ResultAllocator {
 public:
  virtual ~ResultAllocator() = default;
  struct Block {
    uint64_t address = 0;
    char* host = nullptr;
  };
  virtual absl::StatusOr<Block> Allocate(uint64_t bytes) = 0;
};

// One value an op returned, for the synchronous path.
struct ResultValue {
  // kUInt: an unsigned 64-bit value in i's bits (uint64 above INT64_MAX).
  enum class Kind : uint8_t {
    kNone,
    kInt,
    kDouble,
    kBool,
    kComplex,
    kTensor,
    kUInt
  };
  Kind kind = Kind::kNone;
  int64_t i = 0;
  double d = 0;
  double d_imag = 0;
  bool b = false;
  // kTensor: where its data now lives and its layout (contiguous).
  tpu::TensorRef tensor;
};

// Programs a compiling backend built for one chip (PJRT), for tpuctl.
struct CompileStats {
  uint64_t compiles = 0;    // programs compiled (failed compiles included)
  uint64_t compile_ns = 0;  // time spent compiling
  uint64_t hits = 0;        // ops that found their program compiled
  uint64_t collectives =
      0;                // collective operations run as programs on this chip
  uint64_t graphs = 0;  // captured graphs run as one program of their own
  // The compilation cache on disk (--compile_cache_dir): programs loaded
  // from it instead of compiled, programs written to it, and the compile
  // time those loads saved (each entry's recorded compile time less the
  // time its load took).
  uint64_t disk_hits = 0;
  uint64_t disk_stores = 0;
  uint64_t saved_ns = 0;
};

// The compilation cache on disk as a whole (a compiling backend with one).
struct DiskCacheStats {
  bool enabled = false;
  uint64_t entries = 0;    // programs in the directory now
  uint64_t bytes = 0;      // their size on disk
  uint64_t max_bytes = 0;  // the bound (--compile_cache_bytes)
  // Entries refused when read (torn, corrupt, written for another plugin
  // build or options; each is removed) and writes that failed (a full disk).
  uint64_t rejected = 0;
  uint64_t write_errors = 0;
};

// One op of a captured graph (a program of the op stream), resolved and
// checked by the executor as for Run.
struct ProgramOp {
  const BackendOp* op = nullptr;  // null: a copy between device addresses
  const tpu::DecodedOp* decoded = nullptr;
  // An op's tensors as for Run; a copy's source and destination segments.
  const std::vector<ResolvedTensor>* tensors = nullptr;
  const tpu::DecodedCopy* copy = nullptr;
};

// One collective operation whose ranks have all met and been checked
// (daemon/collectives/groups.h): each rank's buffers lie inside segments
// of that rank's session, on its chip.
struct CollectiveRank {
  int chip = 0;
  uint64_t send = 0;  // device addresses; a side with no bytes is unused
  uint64_t send_bytes = 0;
  uint64_t recv = 0;
  uint64_t recv_bytes = 0;
  ResolvedTensor
      send_segment;  // the segments they lie in (owner: the rank's session)
  ResolvedTensor recv_segment;
  char* host_send = nullptr;  // their place in the arena
  char* host_recv = nullptr;
};
struct CollectiveCall {
  tpu::CollectiveKind kind = tpu::CollectiveKind::kAllReduce;
  tpu::ReduceOp reduce = tpu::ReduceOp::kSum;
  int8_t dtype = 0;  // c10 ScalarType
  uint64_t count = 0;
  int root = 0;                       // broadcast, reduce
  std::vector<CollectiveRank> ranks;  // by rank
  // all_to_all: elements rank i sends to rank j, send_counts[i][j]
  std::vector<std::vector<int64_t>> send_counts;
};

class ChipBackend {
 public:
  virtual ~ChipBackend() = default;

  // Whether ops are compiled into programs (then the figures below count).
  virtual bool Compiles() const { return false; }
  virtual CompileStats compile_stats(int chip) const { return {}; }
  virtual uint64_t programs_cached() const { return 0; }
  virtual DiskCacheStats disk_cache_stats() const { return {}; }
  // Bytes of segments held in device memory of the backend's own.
  virtual uint64_t device_buffer_bytes() const { return 0; }

  // Backends whose memory is the device's own (PJRT buffers, not the arena's
  // bytes) keep the arena as the host's copy of each segment, brought up to
  // date when the host side touches it. The executor calls HostAccess before
  // it reads device bytes [address, +bytes) on the host (copies out,
  // collectives) and, with `write`, before it writes them there, for the
  // session `owner` (a device copy another session left there is dropped,
  // never copied out); Released
  // when tpud frees a segment (its device memory goes, and a later owner of
  // those pages sees the arena's zeros). Both are no-ops on backends that
  // compute on the arena itself.
  virtual absl::Status HostAccess(uint64_t address, uint64_t bytes, bool write,
                                  uint64_t owner) {
    return absl::OkStatus();
  }
  virtual void Released(uint64_t address, uint64_t bytes) {}
  virtual bool DeviceMemory() const { return false; }

  // Runs a collective as the backend's own program across the ranks' chips
  // (PJRT: one replicated program, its all_reduce on the devices
  // themselves) and returns true; or returns false, touching nothing, when
  // the executor is to move the data in the arena (every kind on the
  // simulated chip). An error is the operation's, for every rank.
  virtual absl::StatusOr<bool> RunCollective(const CollectiveCall& call) {
    return false;
  }

  // Runs a captured graph's ops (in order, all on one chip) as one program
  // of the backend's own and returns true; or returns false, running
  // nothing, when the executor is to run them one by one through Run. On an
  // error, `*failed` is the op it belongs to: the ops before it completed,
  // what it and the ops after it write is not valid. Declining, it says why
  // in `*declined`, and `*failed` is the first op it could not take
  // (ops.size() where it declined the program as a whole). `dead`: device
  // addresses (sorted) of segments nothing reads after these ops (a fused
  // eager run's freed tensors), whose writes it need not keep.
  virtual absl::StatusOr<bool> RunProgram(const std::vector<ProgramOp>& ops,
                                          absl::Span<const uint64_t> dead,
                                          size_t* failed,
                                          std::string* declined) {
    return false;
  }

  // The first warning the last Run on this thread raised (ATen's
  // TORCH_WARN; `deprecation`: a DeprecationWarning), for the client to
  // raise again; false when there was none. Warnings go nowhere else: a
  // client cannot fill tpud's log with them.
  // Why the module of this thread's last RunProgram was compiled (which op
  // of the nearest earlier module it parts from, and how), for tpuctl and
  // the client; empty when it was not compiled. Clears it.
  virtual std::string TakeCompileNote() { return {}; }

  virtual bool TakeWarning(std::string* message, bool* deprecation) {
    return false;
  }

  // Threads one op may use (ATen's intra-op pool on the simulated chip); 0
  // for a backend whose thread use tpud does not set (PJRT). The executor
  // shares the host's cores among busy chips through these
  // (executor/thread_share.h), calling the setter between ops only, and only
  // when the count changes. REQUIRES: n > 0.
  virtual int intra_op_threads() const { return 0; }
  virtual void set_intra_op_threads(int n) {}

  // Name for logs and tpuctl ("simulated (ATen CPU)").
  virtual std::string Describe() const = 0;

  // Resolves a full schema string ("aten::add.Tensor(Tensor self, ...) ->
  // Tensor"). INVALID_ARGUMENT when no such operator exists, or when this
  // backend's schema for that name differs: the message names the op and
  // both schemas.
  virtual absl::StatusOr<std::shared_ptr<const BackendOp>> LookupOp(
      absl::string_view schema) = 0;

  // Runs `op` with `decoded.args[0, decoded.num_args)`.
  //
  // `tensors` holds one ResolvedTensor per TensorRef in the record, in
  // record order: args in order (a list's elements in order, absent optional
  // list entries skipped), then decoded.outputs.
  //
  // Each tensor the op returns that is not one of its arguments (same data
  // and layout) is copied into decoded.outputs[i]; a mismatch in dtype or
  // shape is INVALID_ARGUMENT naming the output. When `results` is non-null
  // (the synchronous path) every returned value is also reported there, and
  // returned tensors without an output are copied into memory from
  // `result_allocator`.
  //
  // Errors (a kernel's exception included) come back as a status whose
  // message names the op; no exception escapes.
  virtual absl::Status Run(const BackendOp& op, const tpu::DecodedOp& decoded,
                           const std::vector<ResolvedTensor>& tensors,
                           std::vector<ResultValue>* results,
                           ResultAllocator* result_allocator) = 0;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_BACKENDS_CHIP_BACKEND_H_
