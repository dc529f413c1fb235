#include "daemon/data_plane.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <new>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tpu/device_address.h"
#include "tpu/op_record.h"
#include "tpu/shm_layout.h"
#include "tpu/units.h"

namespace tpud {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint32_t kMaxOpIds = 1 << 16;

uint64_t RoundUpPage(uint64_t n) { return (n + kPage - 1) & ~(kPage - 1); }

bool IsPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

}  // namespace

// One session's shared memory and executors.
class SessionDataPlane {
 public:
  SessionDataPlane(RuntimeCore* core, ChipBackend* backend, ChipScheduler* scheduler,
                   std::shared_ptr<SessionMemory> memory, const DataPlaneOptions& options)
      : core_(core),
        backend_(backend),
        scheduler_(scheduler),
        memory_(std::move(memory)),
        session_id_(memory_->session_id),
        options_(options) {}

  ~SessionDataPlane() {
    Stop();
    if (base_ != nullptr) munmap(base_, layout_.total_bytes);
    if (memfd_ >= 0) close(memfd_);
  }

  absl::Status Create(uint64_t pinned_bytes);
  void Start();
  void Stop();
  int memfd() const { return memfd_; }
  SessionActivity Activity() const { return {busy_ns_.load(), ops_.load()}; }

 private:
  struct OpEntry {
    std::shared_ptr<const BackendOp> op;
    absl::Status status;  // why the schema could not be resolved
  };
  struct Poisoned {
    uint64_t end;
    std::string cause;
  };
  // Per-stream executor state (touched only by that stream's thread).
  struct StreamState {
    int index = 0;
    tpu::StreamControl* ctl = nullptr;
    char* ring = nullptr;
    uint64_t head = 0;
    uint64_t last_sequence = 0;
    std::string record;  // private copy of the record being handled
    tpu::DecodedOp op;
    std::vector<const tpu::TensorRef*> refs;
    std::vector<ResolvedTensor> resolved;
    std::vector<ResultValue> results;
    size_t bad_ref = 0;  // set when ResolveTensors finds a tensor outside the session
    const BackendOp* current_op = nullptr;
    std::shared_ptr<const BackendOp> current_op_holder;
  };
  class PendingResults;

  void Run(int stream);
  bool WaitForRecord(StreamState& st);
  // Handles one record. A non-ok return means the record (or the stream)
  // is broken: the stream dies with that error.
  absl::Status Handle(StreamState& st, const tpu::RecordHeader& header);
  absl::Status HandleDefineOp(absl::string_view record);
  absl::Status RunOp(StreamState& st, uint64_t sequence);
  absl::Status RunCopy(const tpu::DecodedCopy& copy);
  // Holds the stream until another stream completed a sequence. A wait that
  // could never end (on this stream's own later work, or on work the other
  // stream has not even been given) is an error instead of a stall.
  absl::Status WaitEvent(const StreamState& st, uint64_t sequence,
                         const tpu::DecodedEventWait& wait);
  // Checks every tensor of st.op against the session's segments.
  // REQUIRES: memory_->mu held as reader.
  absl::Status ResolveTensors(StreamState& st, int* chip);
  absl::Status CheckPoison(const StreamState& st);
  void Unpoison(const StreamState& st, const BackendOp& op);
  void ClearPoison(uint64_t begin, uint64_t end);
  void ClearPoisonLocked(uint64_t begin, uint64_t end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(poison_mu_);
  // Marks what a failed op may have written (its outputs and written
  // arguments) so later readers fail with `cause`.
  void Poison(const StreamState& st, const BackendOp* op, const std::string& cause);
  void PoisonRef(const tpu::TensorRef& t, const std::string& cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(poison_mu_);
  // Host views of the two sides of a copy; INVALID_ARGUMENT naming the range
  // when it lies outside the session's segments (device) or its staging
  // area and pinned pool (host).
  absl::StatusOr<char*> DeviceRange(uint64_t address, uint64_t bytes);
  absl::StatusOr<char*> HostRange(uint64_t offset, uint64_t bytes);
  void RecordError(StreamState& st, uint64_t sequence, const absl::Status& status) {
    RecordError(st.ctl, sequence, status);
  }
  static void RecordError(tpu::StreamControl* ctl, uint64_t sequence,
                          const absl::Status& status);
  // Marks every stream of the session dead with `status` and wakes waiters.
  void FailAllStreams(const absl::Status& status);
  void Complete(StreamState& st, uint64_t sequence);
  void Kill(StreamState& st, const absl::Status& status);

  RuntimeCore* const core_;
  ChipBackend* const backend_;
  ChipScheduler* const scheduler_;
  const std::shared_ptr<SessionMemory> memory_;
  const uint64_t session_id_;
  const DataPlaneOptions options_;

  tpu::ShmHeader layout_{};  // our own copy: the client can write the shared one
  char* base_ = nullptr;
  int memfd_ = -1;
  std::vector<char*> chip_bases_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  absl::Mutex fail_mu_;
  std::atomic<uint64_t> busy_ns_{0};
  std::atomic<uint64_t> ops_{0};

  absl::Mutex ops_mu_;
  std::vector<OpEntry> op_table_ ABSL_GUARDED_BY(ops_mu_);
  absl::Mutex poison_mu_;
  std::map<uint64_t, Poisoned> poisoned_ ABSL_GUARDED_BY(poison_mu_);
  std::atomic<bool> any_poisoned_{false};
  // Root cause found by the last CheckPoison of a thread's op.
  static thread_local std::string poison_root_;
};

absl::Status SessionDataPlane::Create(uint64_t pinned_bytes) {
  if (!IsPowerOfTwo(options_.ring_bytes) || options_.ring_bytes < kPage) {
    return absl::InvalidArgumentError("ring size must be a power of two of at least 4 KiB");
  }
  tpu::ShmHeader& h = layout_;
  h.magic = tpu::kShmMagic;
  h.layout_version = 1;
  h.num_streams = tpu::kMaxStreams;
  h.streams_offset = kPage;
  h.events_offset = h.streams_offset + RoundUpPage(sizeof(tpu::StreamControl) * tpu::kMaxStreams);
  h.rings_offset = h.events_offset + RoundUpPage(sizeof(tpu::EventSlot) * tpu::kMaxEvents);
  h.ring_bytes = options_.ring_bytes;
  h.staging_offset = h.rings_offset + h.ring_bytes * tpu::kMaxStreams;
  h.staging_bytes = RoundUpPage(options_.staging_bytes / tpu::kMaxStreams) * tpu::kMaxStreams;
  h.pinned_offset = h.staging_offset + h.staging_bytes;
  h.pinned_bytes = RoundUpPage(pinned_bytes);
  h.total_bytes = h.pinned_offset + h.pinned_bytes;

  memfd_ = memfd_create(absl::StrCat("tpud-session-", session_id_).c_str(),
                        MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create for session ", session_id_, ": ", std::strerror(errno)));
  }
  if (ftruncate(memfd_, h.total_bytes) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot size shared memory to ", tpu::FormatBytes(h.total_bytes), ": ",
        std::strerror(errno)));
  }
  // Sealed: the client cannot shrink the file under us (our accesses would
  // fault) nor grow it.
  if (fcntl(memfd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(absl::StrCat("sealing shared memory: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, h.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mapping shared memory: ", std::strerror(errno)));
  }
  base_ = static_cast<char*>(p);
  std::memcpy(base_, &h, sizeof(h));
  for (int s = 0; s < tpu::kMaxStreams; ++s) new (tpu::StreamOf(base_, h, s)) tpu::StreamControl();
  for (int e = 0; e < tpu::kMaxEvents; ++e) new (tpu::EventOf(base_, h, e)) tpu::EventSlot();
  for (int c = 0; c < core_->topology().num_chips(); ++c) {
    chip_bases_.push_back(core_->ChipHostBase(c));
    if (chip_bases_.back() == nullptr) {
      return absl::FailedPreconditionError("chips are not backed by memory");
    }
  }
  return absl::OkStatus();
}

void SessionDataPlane::Start() {
  for (int s = 0; s < tpu::kMaxStreams; ++s) threads_.emplace_back([this, s] { Run(s); });
}

void SessionDataPlane::Stop() {
  if (stopping_.exchange(true)) return;
  for (int s = 0; s < tpu::kMaxStreams && base_ != nullptr; ++s) {
    tpu::StreamControl* ctl = tpu::StreamOf(base_, layout_, s);
    ctl->doorbell.fetch_add(1);
    tpu::FutexWakeAll(&ctl->doorbell);
    // Executors waiting on another stream's events sleep on its completions.
    ctl->completion_futex.fetch_add(1);
    tpu::FutexWakeAll(&ctl->completion_futex);
  }
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  scheduler_->ForgetSession(session_id_);
  // Clients still waiting on a stream learn that it is over.
  if (base_ != nullptr) {
    FailAllStreams(absl::UnavailableError(absl::StrCat(
        "session ", session_id_,
        " ended (closed, killed, or its connection dropped); its queued work was "
        "discarded")));
  }
}

bool SessionDataPlane::WaitForRecord(StreamState& st) {
  tpu::StreamControl* ctl = st.ctl;
  // A busy ring: no clock read, no syscall.
  if (ctl->tail.load(std::memory_order_acquire) != st.head) return true;
  const uint64_t spin_until = tpu::MonotonicNanos() + options_.spin_ns;
  int spins = 0;
  while (!stopping_.load(std::memory_order_relaxed) && !failed_.load(std::memory_order_relaxed)) {
    if (ctl->tail.load(std::memory_order_acquire) != st.head) return true;
    if (++spins < 64 || tpu::MonotonicNanos() < spin_until) {
      __builtin_ia32_pause();
      continue;
    }
    // Tell the producer we sleep, then look once more before sleeping so a
    // record published in between is never missed.
    const uint32_t bell = ctl->doorbell.load();
    ctl->consumer_sleeping.store(1);
    if (ctl->tail.load() != st.head || stopping_.load()) {
      ctl->consumer_sleeping.store(0);
      continue;
    }
    tpu::FutexWait(&ctl->doorbell, bell, 200 * 1000 * 1000);
    ctl->consumer_sleeping.store(0);
    return !stopping_.load() && ctl->tail.load(std::memory_order_acquire) != st.head;
  }
  return false;
}

void SessionDataPlane::Run(int stream) {
  StreamState st;
  st.index = stream;
  st.ctl = tpu::StreamOf(base_, layout_, stream);
  st.ring = tpu::RingOf(base_, layout_, stream);
  const uint64_t ring_bytes = layout_.ring_bytes;
  while (!stopping_.load(std::memory_order_relaxed) && !failed_.load()) {
    if (!WaitForRecord(st)) continue;
    if (failed_.load()) return;
    const uint64_t tail = st.ctl->tail.load(std::memory_order_acquire);
    if (tail - st.head > ring_bytes || tail < st.head) {
      Kill(st, absl::InvalidArgumentError(absl::StrFormat(
                   "stream %d: ring tail %d is not within one ring (%d bytes) of head %d",
                   stream, tail, ring_bytes, st.head)));
      return;
    }
    const uint64_t pos = st.head & (ring_bytes - 1);
    const uint64_t available = std::min(tail - st.head, ring_bytes - pos);
    if (available < sizeof(tpu::RecordHeader)) {
      Kill(st, absl::InvalidArgumentError(absl::StrFormat(
                   "stream %d: %d bytes published at ring offset %d, less than a record "
                   "header",
                   stream, available, pos)));
      return;
    }
    tpu::RecordHeader header;
    std::memcpy(&header, st.ring + pos, sizeof(header));
    if (header.kind == static_cast<uint16_t>(tpu::RecordKind::kPad)) {
      // Filler to the end of the ring; nothing to run, no sequence.
      if (header.length != ring_bytes - pos) {
        Kill(st, absl::InvalidArgumentError(
                     absl::StrFormat("stream %d: pad record of %d bytes at offset %d does not "
                                     "reach the ring's end",
                                     stream, header.length, pos)));
        return;
      }
      st.head += header.length;
      st.ctl->head.store(st.head, std::memory_order_release);
      continue;
    }
    if (absl::Status s = tpu::CheckHeader(header, available); !s.ok()) {
      Kill(st, absl::InvalidArgumentError(
                   absl::StrCat("stream ", stream, ": malformed record: ", s.message())));
      return;
    }
    if (header.sequence != st.last_sequence + 1) {
      Kill(st, absl::InvalidArgumentError(absl::StrFormat(
                   "stream %d: record sequence %d after %d (sequences count up by one)",
                   stream, header.sequence, st.last_sequence)));
      return;
    }
    // Work on a private copy: the client could rewrite the ring meanwhile.
    st.record.assign(st.ring + pos, header.length);
    st.head += header.length;
    st.ctl->head.store(st.head, std::memory_order_release);
    if (absl::Status s = Handle(st, header); !s.ok()) {
      Kill(st, s);
      return;
    }
    Complete(st, header.sequence);
  }
}

void SessionDataPlane::Complete(StreamState& st, uint64_t sequence) {
  st.last_sequence = sequence;
  st.ctl->completed.store(sequence);
  if (st.ctl->waiters.load() > 0) {
    st.ctl->completion_futex.fetch_add(1);
    tpu::FutexWakeAll(&st.ctl->completion_futex);
  }
}

void SessionDataPlane::RecordError(tpu::StreamControl* ctl, uint64_t sequence,
                                   const absl::Status& status) {
  ctl->error_count += 1;
  if (ctl->error_sequence.load() != 0) return;  // the first error sticks
  ctl->error_code = static_cast<uint32_t>(status.code());
  std::string msg(status.message());
  msg.resize(std::min<size_t>(msg.size(), tpu::kErrorMessageBytes - 1));
  std::memcpy(ctl->error_message, msg.c_str(), msg.size() + 1);
  ctl->error_sequence.store(sequence);
}

void SessionDataPlane::Kill(StreamState& st, const absl::Status& status) {
  // A malformed record fails the whole session's data plane: the client is
  // broken or hostile. The daemon and every other session go on.
  spdlog::warn("session {} failed on stream {}: {}", session_id_, st.index,
               std::string(status.message()));
  failed_.store(true);
  FailAllStreams(absl::Status(status.code(), absl::StrCat("session failed: ", status.message())));
}

void SessionDataPlane::FailAllStreams(const absl::Status& status) {
  absl::MutexLock lock(&fail_mu_);
  for (int s = 0; s < tpu::kMaxStreams; ++s) {
    tpu::StreamControl* ctl = tpu::StreamOf(base_, layout_, s);
    if (ctl->dead.load() == 0) {
      ctl->error_sequence.store(0);
      RecordError(ctl, ctl->completed.load() + 1, status);
      ctl->dead.store(1);
    }
    ctl->completion_futex.fetch_add(1);
    tpu::FutexWakeAll(&ctl->completion_futex);
    ctl->doorbell.fetch_add(1);
    tpu::FutexWakeAll(&ctl->doorbell);
  }
}

absl::Status SessionDataPlane::Handle(StreamState& st, const tpu::RecordHeader& header) {
  const absl::string_view record(st.record);
  switch (static_cast<tpu::RecordKind>(header.kind)) {
    case tpu::RecordKind::kDefineOp:
      return HandleDefineOp(record);
    case tpu::RecordKind::kOp: {
      if (absl::Status s = tpu::DecodeOp(record, &st.op); !s.ok()) return s;
      poison_root_.clear();
      absl::Status s = RunOp(st, header.sequence);
      if (!s.ok()) {
        // Outputs of an op that failed on a poisoned input carry the root
        // cause, not a chain of "produced by an op that failed" prefixes.
        Poison(st, st.current_op, poison_root_.empty() ? std::string(s.message()) : poison_root_);
        RecordError(st, header.sequence, s);
      }
      return absl::OkStatus();
    }
    case tpu::RecordKind::kCopy: {
      tpu::DecodedCopy copy;
      if (absl::Status s = tpu::DecodeCopy(record, &copy); !s.ok()) return s;
      absl::Status s = RunCopy(copy);
      if (!s.ok()) RecordError(st, header.sequence, s);
      return absl::OkStatus();
    }
    case tpu::RecordKind::kEventRecord: {
      uint32_t slot = 0;
      if (absl::Status s = tpu::DecodeEventRecord(record, &slot); !s.ok()) return s;
      if (slot >= static_cast<uint32_t>(tpu::kMaxEvents)) {
        return absl::InvalidArgumentError(absl::StrCat("event slot ", slot, " out of range"));
      }
      tpu::EventSlot* ev = tpu::EventOf(base_, layout_, slot);
      ev->sequence.store(header.sequence);
      ev->completed_ns.store(tpu::MonotonicNanos());
      return absl::OkStatus();
    }
    case tpu::RecordKind::kEventWait: {
      tpu::DecodedEventWait wait;
      if (absl::Status s = tpu::DecodeEventWait(record, &wait); !s.ok()) return s;
      absl::Status s = WaitEvent(st, header.sequence, wait);
      if (!s.ok()) RecordError(st, header.sequence, s);
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown record kind ", header.kind));
  }
}

absl::Status SessionDataPlane::HandleDefineOp(absl::string_view record) {
  tpu::DecodedDefineOp def;
  if (absl::Status s = tpu::DecodeDefineOp(record, &def); !s.ok()) return s;
  if (def.op_id >= kMaxOpIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("op id ", def.op_id, " out of range (at most ", kMaxOpIds - 1, ")"));
  }
  OpEntry entry;
  absl::StatusOr<std::shared_ptr<const BackendOp>> op = backend_->LookupOp(def.schema);
  if (op.ok()) {
    entry.op = *std::move(op);
  } else {
    // Not fatal: the ops that use this id fail with the reason.
    entry.status = op.status();
  }
  absl::MutexLock lock(&ops_mu_);
  if (op_table_.size() <= def.op_id) op_table_.resize(def.op_id + 1);
  op_table_[def.op_id] = std::move(entry);
  return absl::OkStatus();
}

absl::StatusOr<char*> SessionDataPlane::DeviceRange(uint64_t address, uint64_t bytes) {
  const SegmentGrant* seg = memory_->FindContaining(address, bytes);
  if (seg == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "copy of %d bytes: device range at 0x%x is not inside one of this session's "
        "segments",
        bytes, address));
  }
  return chip_bases_[seg->chip] + seg->offset + (address - seg->address);
}

absl::StatusOr<char*> SessionDataPlane::HostRange(uint64_t offset, uint64_t bytes) {
  // Host sides of copies must lie in the staging area or the pinned pool.
  const uint64_t begin = layout_.staging_offset;
  const uint64_t end = layout_.pinned_offset + layout_.pinned_bytes;
  if (offset < begin || offset > end || bytes > end - offset) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "host range [0x%x, +%d) is outside the session's staging area and pinned pool", offset,
        bytes));
  }
  return base_ + offset;
}

absl::Status SessionDataPlane::ResolveTensors(StreamState& st, int* chip) {
  st.refs.clear();
  const tpu::DecodedOp& op = st.op;
  for (size_t a = 0; a < op.num_args; ++a) {
    const tpu::OpArg& arg = op.args[a];
    if (arg.tag == tpu::ArgTag::kTensor) {
      st.refs.push_back(&arg.tensor);
    } else if (arg.tag == tpu::ArgTag::kTensorList) {
      for (const tpu::TensorRef& t : arg.tensors) st.refs.push_back(&t);
    } else if (arg.tag == tpu::ArgTag::kOptionalTensorList) {
      for (size_t i = 0; i < arg.tensors.size(); ++i) {
        if (arg.tensor_present[i]) st.refs.push_back(&arg.tensors[i]);
      }
    }
  }
  for (const tpu::TensorRef& t : op.outputs) st.refs.push_back(&t);
  st.resolved.resize(st.refs.size());
  *chip = -1;
  for (size_t i = 0; i < st.refs.size(); ++i) {
    const tpu::TensorRef& t = *st.refs[i];
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(t);
    if (!fp.ok()) return fp.status();
    if (fp->end == 0 && t.address == 0) {
      st.resolved[i] = ResolvedTensor{};  // empty tensor without storage
      continue;
    }
    const int c = tpu::DeviceAddressChip(t.address);
    const SegmentGrant* seg = memory_->FindContaining(t.address, fp->end);
    if (seg == nullptr) {
      st.bad_ref = i;
      return absl::NotFoundError("");  // classified by the caller, without the lock
    }
    if (*chip == -1) {
      *chip = c;
    } else if (*chip != c) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensors of one op must be on one chip: chips %d and %d; copy one first", *chip, c));
    }
    st.resolved[i] = ResolvedTensor{chip_bases_[c] + seg->offset, seg->address, seg->size};
  }
  return absl::OkStatus();
}

absl::Status SessionDataPlane::CheckPoison(const StreamState& st) {
  if (!any_poisoned_.load(std::memory_order_relaxed)) return absl::OkStatus();
  absl::MutexLock lock(&poison_mu_);
  for (const tpu::TensorRef* t : st.refs) {
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(*t);
    if (!fp.ok() || fp->end == fp->begin) continue;
    const uint64_t begin = t->address + fp->begin, end = t->address + fp->end;
    auto it = poisoned_.upper_bound(begin);
    if (it != poisoned_.begin()) {
      auto prev = std::prev(it);
      if (prev->second.end > begin) it = prev;
    }
    if (it != poisoned_.end() && it->first < end) {
      poison_root_ = it->second.cause;
      return absl::FailedPreconditionError(absl::StrCat(
          "an input was produced by an op that failed earlier: ", it->second.cause));
    }
  }
  return absl::OkStatus();
}

void SessionDataPlane::PoisonRef(const tpu::TensorRef& t, const std::string& cause) {
  absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(t);
  if (!fp.ok() || fp->end == fp->begin) return;
  poisoned_[t.address + fp->begin] = Poisoned{t.address + fp->end, cause};
  any_poisoned_.store(true);
}

void SessionDataPlane::Poison(const StreamState& st, const BackendOp* op,
                              const std::string& cause) {
  absl::MutexLock lock(&poison_mu_);
  for (const tpu::TensorRef& t : st.op.outputs) PoisonRef(t, cause);
  if (op == nullptr) return;
  for (size_t a = 0; a < st.op.num_args; ++a) {
    if (!op->WritesArgument(a)) continue;
    const tpu::OpArg& arg = st.op.args[a];
    if (arg.tag == tpu::ArgTag::kTensor) PoisonRef(arg.tensor, cause);
    if (arg.tag == tpu::ArgTag::kTensorList) {
      for (const tpu::TensorRef& t : arg.tensors) PoisonRef(t, cause);
    }
  }
}

void SessionDataPlane::ClearPoisonLocked(uint64_t begin, uint64_t end) {
  // Whatever overlaps a freshly written range is good again (memory that a
  // failed op poisoned is often reused by the client's allocator).
  auto it = poisoned_.upper_bound(begin);
  if (it != poisoned_.begin() && std::prev(it)->second.end > begin) --it;
  while (it != poisoned_.end() && it->first < end) it = poisoned_.erase(it);
}

void SessionDataPlane::ClearPoison(uint64_t begin, uint64_t end) {
  if (!any_poisoned_.load(std::memory_order_relaxed)) return;
  absl::MutexLock lock(&poison_mu_);
  ClearPoisonLocked(begin, end);
  if (poisoned_.empty()) any_poisoned_.store(false);
}

void SessionDataPlane::Unpoison(const StreamState& st, const BackendOp& op) {
  // A successful op rewrites its outputs: they are good again.
  absl::MutexLock lock(&poison_mu_);
  auto clear = [&](const tpu::TensorRef& t) {
    absl::StatusOr<tpu::Footprint> fp = tpu::TensorFootprint(t);
    if (!fp.ok() || fp->end == fp->begin) return;
    ClearPoisonLocked(t.address + fp->begin, t.address + fp->end);
  };
  for (const tpu::TensorRef& t : st.op.outputs) clear(t);
  for (size_t a = 0; a < st.op.num_args; ++a) {
    if (op.WritesArgument(a) && st.op.args[a].tag == tpu::ArgTag::kTensor) {
      clear(st.op.args[a].tensor);
    }
  }
  if (poisoned_.empty()) any_poisoned_.store(false);
}

class SessionDataPlane::PendingResults : public ResultAllocator {
 public:
  PendingResults(RuntimeCore* core, uint64_t session, int chip, char* chip_base)
      : core_(core), session_(session), chip_(chip), chip_base_(chip_base) {}
  absl::StatusOr<Block> Allocate(uint64_t bytes) override {
    absl::StatusOr<SegmentGrant> g = core_->AllocateUnlisted(session_, chip_, std::max<uint64_t>(bytes, 1));
    if (!g.ok()) return g.status();
    grants_.push_back(*g);
    return Block{g->address, chip_base_ + g->offset};
  }
  // Lists the new segments. REQUIRES: SessionMemory::mu not held.
  void Publish() {
    for (const SegmentGrant& g : grants_) core_->ListSegment(session_, g);
    grants_.clear();
  }
  void Discard() {
    for (const SegmentGrant& g : grants_) core_->FreeUnlisted(session_, g);
    grants_.clear();
  }

 private:
  RuntimeCore* core_;
  uint64_t session_;
  int chip_;
  char* chip_base_;
  std::vector<SegmentGrant> grants_;
};

absl::Status SessionDataPlane::RunOp(StreamState& st, uint64_t sequence) {
  std::shared_ptr<const BackendOp> op;
  {
    absl::MutexLock lock(&ops_mu_);
    if (st.op.op_id >= op_table_.size() ||
        (op_table_[st.op.op_id].op == nullptr && op_table_[st.op.op_id].status.ok())) {
      return absl::InvalidArgumentError(
          absl::StrCat("op id ", st.op.op_id, " was never defined on this session"));
    }
    if (!op_table_[st.op.op_id].status.ok()) return op_table_[st.op.op_id].status;
    op = op_table_[st.op.op_id].op;
  }
  st.current_op_holder = op;
  st.current_op = op.get();
  const bool sync = (st.op.flags & tpu::kOpFlagSync) != 0;
  tpu::StreamControl* ctl = st.ctl;
  absl::Status status;
  int chip = -1;
  std::unique_ptr<PendingResults> pending;
  {
    absl::ReaderMutexLock memory_lock(&memory_->mu);
    status = ResolveTensors(st, &chip);
    if (status.ok()) status = CheckPoison(st);
    if (status.ok()) {
      // Ops without tensors (rare) run on chip 0's queue.
      const int run_chip = chip < 0 ? 0 : chip;
      pending = std::make_unique<PendingResults>(core_, session_id_, run_chip,
                                                 chip_bases_[run_chip]);
      st.results.clear();
      scheduler_->Acquire(run_chip, session_id_);
      const uint64_t start = tpu::MonotonicNanos();
      status = backend_->Run(*op, st.op, st.resolved, sync ? &st.results : nullptr,
                             pending.get());
      const uint64_t end = tpu::MonotonicNanos();
      const uint64_t busy = end - start;
      scheduler_->Release(run_chip, session_id_, busy,
                          ctl->tail.load(std::memory_order_relaxed) != st.head, end);
      busy_ns_.fetch_add(busy, std::memory_order_relaxed);
      ops_.fetch_add(1, std::memory_order_relaxed);
      if (status.ok() && any_poisoned_.load(std::memory_order_relaxed)) Unpoison(st, *op);
    }
  }
  if (pending != nullptr) {
    if (status.ok()) {
      pending->Publish();
    } else {
      pending->Discard();  // a failed op's results go straight back
    }
  }
  if (!status.ok() && status.code() == absl::StatusCode::kNotFound) {
    // A tensor outside the session's own segments: tell forged from foreign.
    const size_t index = st.bad_ref;
    const tpu::TensorRef& t = *st.refs[index];
    const bool foreign = core_->BelongsToAnotherSession(session_id_, t.address);
    std::string what = absl::StrFormat(
        "%s: tensor %d at device address 0x%x (dtype %d, %d dims) is %s",
        op->schema().substr(0, op->schema().find('(')), index, t.address, t.dtype, t.ndim,
        foreign ? "in another session's memory" : "not inside one of this session's segments");
    status = foreign ? absl::PermissionDeniedError(what) : absl::InvalidArgumentError(what);
  }
  if (sync) {
    ctl->response_code = static_cast<uint32_t>(status.code());
    ctl->num_results = 0;
    if (status.ok()) {
      const size_t n = std::min<size_t>(st.results.size(), tpu::kMaxResults);
      for (size_t i = 0; i < n; ++i) {
        const ResultValue& r = st.results[i];
        tpu::ShmResult& out = ctl->results[i];
        std::memset(&out, 0, sizeof(out));
        out.kind = static_cast<uint8_t>(r.kind);
        out.i = r.i;
        out.d = r.d;
        out.d_imag = r.d_imag;
        if (r.kind == ResultValue::Kind::kBool) out.i = r.b;
        if (r.kind == ResultValue::Kind::kTensor) {
          out.dtype = r.tensor.dtype;
          out.ndim = r.tensor.ndim;
          out.address = r.tensor.address;
          out.storage_offset = r.tensor.storage_offset;
          uint64_t numel = 1;
          for (int d = 0; d < r.tensor.ndim; ++d) {
            out.sizes[d] = r.tensor.sizes[d];
            out.strides[d] = r.tensor.strides[d];
            numel *= static_cast<uint64_t>(r.tensor.sizes[d]);
          }
          out.nbytes = numel * tpu::ElementSize(r.tensor.dtype);
        }
      }
      ctl->num_results = static_cast<uint32_t>(n);
      ctl->response_message[0] = '\0';
    } else {
      std::string msg(status.message());
      msg.resize(std::min<size_t>(msg.size(), tpu::kErrorMessageBytes - 1));
      std::memcpy(ctl->response_message, msg.c_str(), msg.size() + 1);
    }
    ctl->response_sequence = sequence;
    // A synchronous op's failure is reported to its caller directly.
    if (!status.ok()) {
      Poison(st, op.get(),
             poison_root_.empty() ? std::string(status.message()) : poison_root_);
      return absl::OkStatus();
    }
  }
  return status;
}

absl::Status SessionDataPlane::RunCopy(const tpu::DecodedCopy& copy) {
  if (copy.bytes == 0) return absl::OkStatus();
  absl::ReaderMutexLock memory_lock(&memory_->mu);
  auto range = [&](bool on_device, uint64_t at) {
    return on_device ? DeviceRange(at, copy.bytes) : HostRange(at, copy.bytes);
  };
  absl::StatusOr<char*> src = range(copy.kind != tpu::CopyKind::kHostToDevice, copy.src);
  if (!src.ok()) return src.status();
  absl::StatusOr<char*> dst = range(copy.kind != tpu::CopyKind::kDeviceToHost, copy.dst);
  if (!dst.ok()) return dst.status();
  std::memmove(*dst, *src, copy.bytes);
  if (copy.kind != tpu::CopyKind::kDeviceToHost) ClearPoison(copy.dst, copy.dst + copy.bytes);
  return absl::OkStatus();
}

absl::Status SessionDataPlane::WaitEvent(const StreamState& st, uint64_t sequence,
                                        const tpu::DecodedEventWait& wait) {
  if (wait.stream >= static_cast<uint32_t>(tpu::kMaxStreams)) {
    return absl::InvalidArgumentError(absl::StrCat("event wait on stream ", wait.stream,
                                                   " (streams are 0..",
                                                   tpu::kMaxStreams - 1, ")"));
  }
  tpu::StreamControl* other = tpu::StreamOf(base_, layout_, wait.stream);
  if (static_cast<int>(wait.stream) == st.index && wait.sequence >= sequence) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream ", st.index, " waits on its own later work (sequence ", wait.sequence,
        " at record ", sequence, "): it would wait forever"));
  }
  if (wait.sequence > other->completed.load() && wait.sequence > other->submitted.load()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "event wait on stream ", wait.stream, " sequence ", wait.sequence,
        ", which that stream was never given (submitted ", other->submitted.load(),
        "); record the event before waiting on it"));
  }
  while (!stopping_.load()) {
    const uint32_t v = other->completion_futex.load();
    other->waiters.fetch_add(1);
    const bool done = other->completed.load() >= wait.sequence || other->dead.load() != 0;
    if (!done) tpu::FutexWait(&other->completion_futex, v, 100 * 1000 * 1000);
    other->waiters.fetch_sub(1);
    if (done) return absl::OkStatus();
  }
  return absl::OkStatus();
}

thread_local std::string SessionDataPlane::poison_root_;

// ---------------------------------------------------------------- DataPlane

DataPlane::DataPlane(RuntimeCore* core, ChipBackend* backend, DataPlaneOptions options)
    : core_(core),
      backend_(backend),
      options_(options),
      scheduler_(core->topology().num_chips()) {}

DataPlane::~DataPlane() { StopAll(); }

absl::StatusOr<int> DataPlane::Attach(uint64_t session_id, absl::string_view token,
                                      const PeerIdentity& peer, uint64_t pinned_bytes) {
  if (pinned_bytes == 0) pinned_bytes = options_.default_pinned_bytes;
  if (pinned_bytes > options_.max_pinned_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "pinned pool of ", tpu::FormatBytes(pinned_bytes), " asked; this daemon allows at most ",
        tpu::FormatBytes(options_.max_pinned_bytes), " per session (--max_pinned_bytes)"));
  }
  absl::StatusOr<std::shared_ptr<SessionMemory>> memory =
      core_->AttachDataPlane(session_id, token, peer);
  if (!memory.ok()) return memory.status();
  auto plane = std::make_shared<SessionDataPlane>(core_, backend_, &scheduler_, *memory,
                                                  options_);
  if (absl::Status s = plane->Create(pinned_bytes); !s.ok()) return s;
  int fd = dup(plane->memfd());
  if (fd < 0) return absl::InternalError(absl::StrCat("dup: ", std::strerror(errno)));
  plane->Start();
  absl::MutexLock lock(&mu_);
  sessions_[session_id] = std::move(plane);
  return fd;
}

void DataPlane::Detach(uint64_t session_id) {
  std::shared_ptr<SessionDataPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    plane = std::move(it->second);
    sessions_.erase(it);
  }
  plane->Stop();
}

SessionActivity DataPlane::Activity(uint64_t session_id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return {};
  return it->second->Activity();
}

void DataPlane::StopAll() {
  absl::flat_hash_map<uint64_t, std::shared_ptr<SessionDataPlane>> sessions;
  {
    absl::MutexLock lock(&mu_);
    sessions.swap(sessions_);
  }
  for (auto& [id, plane] : sessions) plane->Stop();
}

}  // namespace tpud
