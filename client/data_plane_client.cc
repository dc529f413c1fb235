// libtpuclient's data plane: the producer side of the session's op streams.
//
// A stream (0..kStreamsPerChip-1) has one ring per chip; each record goes to
// the ring of the chip it works on (an op's tensors, a copy's device side),
// so that each chip's executor consumes only its own rings. When a stream's
// work moves to another chip, the first record there is an event wait on the
// previous chip's ring: the stream keeps CUDA's in-order semantics across
// chips, and synchronising a stream waits for every ring it used.
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "session_impl.h"
#include "tpu/device_address.h"
#include "tpu/op_error.h"
#include "tpu/units.h"

namespace tpu {

static_assert(kResultDims == kMaxDims, "a sync result holds any tensor");
namespace {

constexpr int kStagingSlotsPerStream = 4;
constexpr uint64_t kPinnedAlignment = 256;
// How long a waiting client spins (when the daemon says a core is free for
// it) before it sleeps: a round trip without a sleeping party is a few
// microseconds; a futex wake-up costs tens.
constexpr uint64_t kSpinNanos = 30000;
// How long it yields instead, while only tpud's parties compete for the
// cores: their round trips then take turns on the cores, and a 4-rank
// all_reduce on 2 cores completes in 80-150 us. Yielding through that
// (rather than 20 us, then a futex sleep and wake-up) took its latency
// from a median of 119 us to 84 us; one process's ops and 16 sharing a
// chip measured the same or better.
constexpr uint64_t kYieldNanos = 100000;
// A sleeping waiter checks that tpud is still there this often.
constexpr int64_t kLivenessCheckNanos = 20 * 1000 * 1000;

}  // namespace

bool internal::PeerGone(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 &&
         (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

using internal::PeerGone;

Session::Impl::~Impl() {
  StopWatcher();
  if (shm != nullptr) munmap(shm, shm_bytes);
  for (int fd : doorbells) close(fd);
  if (data_plane_fd >= 0) close(data_plane_fd);
}

Session::Impl::Call::Call(Impl* impl) : impl_(impl) {
  impl_->Prepare(&ctx_);
  absl::MutexLock lock(&impl_->calls_mu);
  impl_->calls.insert(&ctx_);
  // Gone already: the call fails as soon as it starts.
  if (impl_->daemon_gone.load()) ctx_.TryCancel();
}

Session::Impl::Call::~Call() {
  absl::MutexLock lock(&impl_->calls_mu);
  impl_->calls.erase(&ctx_);
}

absl::Status Session::Impl::Annotate(const grpc::Status& status) {
  // A call cut off by tpud hanging up may come back before the watcher has
  // seen it go: the rings say whether tpud ended the session.
  if (daemon_gone.load() ||
      (status.error_code() == grpc::UNAVAILABLE && !EndedWhy().empty())) {
    return Gone();
  }
  return internal::Annotate(status, options.socket_path);
}

std::string Session::Impl::EndedWhy() {
  // tpud fails every ring of a session it ends (with the reason, where it
  // has one) before it hangs up.
  for (uint32_t r = 0; shm != nullptr && r < layout.num_rings; ++r) {
    RingControl* ctl = Control(static_cast<int>(r));
    if (ctl->dead.load() == 0 || ctl->error_sequence.load() == 0) continue;
    char message[kErrorMessageBytes];
    std::memcpy(message, ctl->error_message, sizeof(message));
    message[sizeof(message) - 1] = '\0';
    return message;
  }
  return "";
}

absl::Status Session::Impl::Gone() {
  const std::string why = EndedWhy();
  if (!why.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "lost the connection to tpud at ", options.socket_path, ": ", why));
  }
  return absl::UnavailableError(
      absl::StrCat("lost the connection to tpud at ", options.socket_path,
                   "; the daemon stopped or ended this session"));
}

void Session::Impl::StartWatcher() {
  watcher_stop_fd = eventfd(0, EFD_CLOEXEC);
  if (watcher_stop_fd < 0) return;
  watcher = std::thread([this] {
    pollfd fds[2] = {{data_plane_fd, POLLRDHUP, 0},
                     {watcher_stop_fd, POLLIN, 0}};
    while (poll(fds, 2, -1) < 0 && errno == EINTR) {
    }
    if (fds[1].revents != 0) return;  // the session is closing
    daemon_gone.store(true);
    absl::MutexLock lock(&calls_mu);
    for (grpc::ClientContext* c : calls) c->TryCancel();
  });
}

void Session::Impl::StopWatcher() {
  if (watcher_stop_fd < 0) return;
  const uint64_t one = 1;
  (void)!write(watcher_stop_fd, &one, sizeof(one));
  if (watcher.joinable()) watcher.join();
  close(watcher_stop_fd);
  watcher_stop_fd = -1;
}

absl::Status Session::Impl::AttachDataPlane(const std::string& token) {
  if (token.size() != 16) {
    return absl::FailedPreconditionError(
        "tpud sent no data-plane token (protocol mismatch)");
  }
  absl::StatusOr<int> fd =
      internal::ConnectUnix(options.socket_path, /*admin=*/false);
  if (!fd.ok()) return fd.status();
  data_plane_fd = *fd;
  timeval tv{30, 0};
  setsockopt(data_plane_fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  DataPlaneHello hello{};
  std::memcpy(hello.magic, kDataPlaneMagic, sizeof(hello.magic));
  hello.session_id = id;
  std::memcpy(hello.token, token.data(), sizeof(hello.token));
  hello.pinned_bytes = options.pinned_pool_bytes;
  if (send(data_plane_fd, &hello, sizeof(hello), MSG_NOSIGNAL) !=
      sizeof(hello)) {
    return absl::UnavailableError(
        absl::StrCat("sending the data-plane hello to ", options.socket_path,
                     ": ", std::strerror(errno)));
  }
  DataPlaneReply reply{};
  iovec iov{&reply, sizeof(reply)};
  constexpr int kMaxFds = 1 + kMaxChipsPerHost;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(data_plane_fd, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  std::vector<int> fds;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm != nullptr;
       cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        fds.push_back(f);
      }
    }
  }
  auto close_fds = [&] {
    for (int f : fds) close(f);
  };
  if (n != sizeof(reply)) {
    close_fds();
    return absl::UnavailableError(
        absl::StrCat("tpud at ", options.socket_path,
                     " did not answer the data-plane hello"));
  }
  reply.message[sizeof(reply.message) - 1] = '\0';
  if (reply.code != 0 || fds.empty()) {
    close_fds();
    return absl::Status(
        static_cast<absl::StatusCode>(reply.code == 0 ? 13 : reply.code),
        absl::StrCat("data-plane attach: ", reply.message));
  }
  void* p = mmap(nullptr, reply.shm_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                 fds[0], 0);
  close(fds[0]);
  doorbells.assign(fds.begin() + 1, fds.end());
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "mapping the session's shared memory (", FormatBytes(reply.shm_bytes),
        "): ", std::strerror(errno)));
  }
  shm = static_cast<char*>(p);
  shm_bytes = reply.shm_bytes;
  std::memcpy(&layout, shm, sizeof(layout));
  if (layout.magic != kShmMagic || layout.layout_version != kDataPlaneVersion ||
      layout.streams_per_chip != static_cast<uint32_t>(kStreamsPerChip) ||
      layout.num_chips == 0 ||
      layout.num_chips > static_cast<uint32_t>(kMaxChipsPerHost) ||
      layout.num_rings != layout.num_chips * layout.streams_per_chip ||
      layout.total_bytes != shm_bytes ||
      layout.pinned_offset + layout.pinned_bytes > shm_bytes ||
      doorbells.size() != layout.num_chips) {
    return absl::FailedPreconditionError(
        "the session's shared memory has an unknown layout (tpud and "
        "libtpuclient differ)");
  }
  num_chips = static_cast<int>(layout.num_chips);
  staging_slots = kStagingSlotsPerStream;
  staging_slot_bytes =
      (layout.staging_bytes / kStreamsPerChip / staging_slots) &
      ~uint64_t{4095};
  for (internal::StreamProducer& s : streams) {
    absl::MutexLock lock(&s.mu);
    s.rings.resize(num_chips);
    s.slot_use.assign(staging_slots, {0, 0});
  }
  {
    absl::MutexLock lock(&pinned_mu);
    if (layout.pinned_bytes > 0)
      pinned_free[layout.pinned_offset] = layout.pinned_bytes;
  }
  {
    absl::MutexLock lock(&events_mu);
    for (int e = kMaxEvents - 1; e >= 0; --e) free_events.push_back(e);
  }
  StartWatcher();
  return absl::OkStatus();
}

absl::Status Session::Impl::CheckStream(int stream) const {
  if (shm == nullptr)
    return absl::FailedPreconditionError("session has no data plane");
  if (stream < 0 || stream >= kStreamsPerChip) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no stream ", stream, " (streams are 0..", kStreamsPerChip - 1, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Session::Impl::ChipOfAddress(uint64_t address,
                                                 const char* what) const {
  const int chip = DeviceAddressChip(address);
  if (chip < 0 || chip >= num_chips) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s 0x%x is not a device address on this host (chips 0..%d)", what,
        address, num_chips - 1));
  }
  return chip;
}

namespace {

// A program's bytes in shared memory (tpu/op_record.h): its ProgramHeader,
// its name padded to 8 bytes, its records, and (a fused eager run) the
// segments dead after it. For a captured program and a fused eager run alike.
uint64_t ProgramBytes(absl::string_view name, const std::string& records,
                      size_t num_dead = 0) {
  return sizeof(ProgramHeader) + (name.size() + 7) / 8 * 8 + records.size() +
         num_dead * sizeof(uint64_t);
}
void WriteProgram(char* at, absl::string_view name, uint32_t num_records,
                  const std::string& records,
                  const std::vector<uint64_t>& dead = {}) {
  const uint64_t name_bytes = (name.size() + 7) / 8 * 8;
  const ProgramHeader header{kProgramMagic, num_records,
                             static_cast<uint32_t>(name.size()),
                             static_cast<uint32_t>(dead.size())};
  std::memcpy(at, &header, sizeof(header));
  std::memset(at + sizeof(header), 0, name_bytes);
  std::memcpy(at + sizeof(header), name.data(), name.size());
  at += sizeof(header) + name_bytes;
  std::memcpy(at, records.data(), records.size());
  if (!dead.empty()) {
    std::memcpy(at + records.size(), dead.data(),
                dead.size() * sizeof(uint64_t));
  }
}

}  // namespace

uint64_t Session::Impl::BeginLocked(int ring, internal::StreamProducer& p,
                                    RecordKind kind, bool defer) {
  // (A failed flush is the ring's failure: the record begun here fails to
  // publish as well.)
  if (p.fused_records != 0 && kind != RecordKind::kDefineOp &&
      (!defer || ring != p.fused_ring))
    (void)FlushLocked(p);
  p.defer_next = defer;
  const uint64_t sequence = p.rings[RingChip(ring)].next_sequence++;
  p.writer.Begin(kind, sequence);
  return sequence;
}

absl::Status Session::Impl::FlushLocked(internal::StreamProducer& p) {
  if (p.fused_records == 0) return absl::OkStatus();
  const int ring = p.fused_ring;
  std::string records;
  records.swap(p.fused);
  std::vector<std::string> issued;
  issued.swap(p.fused_issued);
  std::vector<uint64_t> dead;
  dead.swap(p.fused_dead);
  const uint32_t num_records = p.fused_records;
  p.fused_records = 0;
  p.fused_ring = -1;
  p.defer_next = false;
  p.held_run.store(0, std::memory_order_release);
  // Earlier runs' memory, where their ring is past them.
  for (size_t i = 0; i < p.fused_memory.size();) {
    const internal::StreamProducer::FusedMemory& m = p.fused_memory[i];
    if (Control(m.ring)->completed.load(std::memory_order_acquire) >=
        m.sequence) {
      (void)FreePinned(m.memory);
      p.fused_memory[i] = p.fused_memory.back();
      p.fused_memory.pop_back();
    } else {
      ++i;
    }
  }
  static constexpr absl::string_view kName = "eager";
  const uint64_t bytes = ProgramBytes(kName, records, dead.size());
  absl::StatusOr<void*> memory =
      num_records > 1 ? AllocatePinned(bytes)
                      : absl::StatusOr<void*>(absl::ResourceExhaustedError(""));
  if (!memory.ok()) {
    // One op, or no shared memory left for a program: the records go to the
    // ring as they are, numbered now.
    internal::RingProducer& rp = p.rings[RingChip(ring)];
    for (size_t pos = 0; pos < records.size();) {
      RecordHeader h;
      std::memcpy(&h, records.data() + pos, sizeof(h));
      p.writer.Begin(static_cast<RecordKind>(h.kind), rp.next_sequence++);
      p.writer.Bytes(records.data() + pos + sizeof(h), h.length - sizeof(h));
      if (absl::Status st = Publish(ring, p); !st.ok()) return st;
      pos += h.length;
    }
    return absl::OkStatus();
  }
  char* at = static_cast<char*>(*memory);
  WriteProgram(at, kName, num_records, records, dead);
  const uint64_t sequence = BeginLocked(ring, p, RecordKind::kRunProgram);
  p.writer.U32(kEagerProgramId);
  p.writer.U32(0);  // no bindings
  p.writer.U64(static_cast<uint64_t>(at - shm));
  p.writer.U64(bytes);
  p.writer.U64(0);  // the ops' own seeds
  p.fused_memory.push_back({*memory, ring, sequence});
  if (std::any_of(issued.begin(), issued.end(),
                  [](const std::string& s) { return !s.empty(); })) {
    absl::MutexLock lock(&issued_mu);
    if (issued_runs.size() >= 64) issued_runs.pop_front();
    issued_runs.push_back({ring, sequence, std::move(issued)});
  }
  return Publish(ring, p);
}

absl::StatusOr<int> Session::Impl::RouteLocked(int stream,
                                               internal::StreamProducer& p,
                                               int chip) {
  const int ring = RingIndex(chip, stream);
  // Held ops go first, to the ring they were meant for.
  if (p.fused_records != 0 && p.fused_ring != ring) {
    if (absl::Status s = FlushLocked(p); !s.ok()) return s;
  }
  if (p.last_chip >= 0 && p.last_chip != chip) {
    // The stream moves: this ring first waits for what the stream queued on
    // the previous chip.
    const int prev = RingIndex(p.last_chip, stream);
    const uint64_t prev_last = p.rings[p.last_chip].next_sequence - 1;
    if (prev_last > 0) {
      BeginLocked(ring, p, RecordKind::kEventWait);
      p.writer.U32(0);
      p.writer.U32(static_cast<uint32_t>(prev));
      p.writer.U64(prev_last);
      if (absl::Status s = Publish(ring, p); !s.ok()) return s;
    }
  }
  p.last_chip = chip;
  return ring;
}

absl::Status Session::Impl::Publish(int ring, internal::StreamProducer& p) {
  RingControl* ctl = Control(ring);
  internal::RingProducer& rp = p.rings[RingChip(ring)];
  const absl::string_view record = p.writer.Finish();
  if (p.defer_next) {
    // Fused eager: held for the stream's next program run (FlushLocked).
    p.defer_next = false;
    --rp.next_sequence;
    uint32_t op_id = 0;
    std::memcpy(&op_id, record.data() + sizeof(RecordHeader), sizeof(op_id));
    const uint32_t run_ops = fuse_run_ops.load(std::memory_order_relaxed);
    if (p.fused_records >= run_ops / 2 && op_id == p.fused_first_op &&
        record.size() == p.fused_first_bytes) {
      // A loop that never synchronises: its ops go in runs that start where
      // the held run started (likely the loop's first op), so that the
      // runs repeat, and compile once, instead of being cut anywhere by the
      // bound.
      const std::string op(record);
      if (absl::Status st = FlushLocked(p); !st.ok()) return st;
      p.fused = op;
    } else {
      p.fused.append(record.data(), record.size());
    }
    p.fused_issued.push_back(std::move(p.next_issued));
    p.next_issued.clear();
    if (p.fused_records == 0) {
      p.fused_first_op = op_id;
      p.fused_first_bytes = record.size();
      p.held_run.store(++p.runs, std::memory_order_release);
    }
    p.fused_ring = ring;
    if (++p.fused_records >= run_ops || p.fused.size() >= kMaxFusedBytes)
      return FlushLocked(p);
    return absl::OkStatus();
  }
  if (p.capturing) {
    RecordHeader h;
    std::memcpy(&h, record.data(), sizeof(h));
    const auto kind = static_cast<RecordKind>(h.kind);
    // Op definitions are the session's, not the stream's: they go to the
    // ring as always.
    if (kind != RecordKind::kDefineOp) {
      --rp.next_sequence;  // a captured record takes no place in the ring
      const bool device_copy =
          kind == RecordKind::kCopy &&
          static_cast<uint8_t>(record[sizeof(h)]) ==
              static_cast<uint8_t>(CopyKind::kDeviceToDevice);
      absl::Status refused;
      if (kind != RecordKind::kOp && !device_copy) {
        const char* what = kind == RecordKind::kCopy ? "copy with the host"
                           : kind == RecordKind::kEventRecord ? "event"
                           : kind == RecordKind::kEventWait
                               ? "wait for another stream or chip"
                           : kind == RecordKind::kCollective ? "collective"
                                                             : "program run";
        refused = absl::FailedPreconditionError(
            absl::StrCat("a ", what,
                         " cannot be captured into a program (only ops and "
                         "device-to-device copies)"));
      } else if ((h.kind == static_cast<uint16_t>(RecordKind::kOp) &&
                  (record[sizeof(h) + 8] & kOpFlagSync) != 0)) {
        refused = absl::FailedPreconditionError(
            "a synchronous op (its values go to the host) cannot be captured "
            "into a program");
      } else if (p.capture_chip >= 0 && p.capture_chip != RingChip(ring)) {
        refused = absl::FailedPreconditionError(
            absl::StrCat("a program runs on one chip: chip ", RingChip(ring),
                         " after chip ", p.capture_chip));
      } else if (p.captured.size() + record.size() > (uint64_t{1} << 30) ||
                 p.captured_records >= kMaxProgramRecords) {
        refused = absl::ResourceExhaustedError(
            "a program of more than 1 GiB or 2^20 records");
      }
      if (!refused.ok()) {
        if (p.capture_error.ok()) p.capture_error = refused;
        return refused;
      }
      p.capture_chip = RingChip(ring);
      p.captured.append(record.data(), record.size());
      ++p.captured_records;
      return absl::OkStatus();
    }
  }
  const uint64_t ring_bytes = layout.ring_bytes;
  if (record.size() > ring_bytes / 2 - 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "record of ", record.size(), " bytes does not fit the stream's ring (",
        ring_bytes, ")"));
  }
  uint64_t pos = rp.tail & (ring_bytes - 1);
  // Never leave a gap smaller than a record header before the ring's end:
  // the filler record that skips a gap must fit in it.
  const uint64_t after = ring_bytes - pos;
  const bool wrap =
      record.size() > after || (after - record.size() != 0 &&
                                after - record.size() < sizeof(RecordHeader));
  const uint64_t pad = wrap ? after : 0;
  // Wait for room: the executor frees ring space as it finishes records.
  const uint64_t need = pad + record.size();
  auto full = [&] {
    return rp.tail + need - ctl->head.load(std::memory_order_acquire) >
           ring_bytes;
  };
  if (full()) {
    const uint64_t spin_until =
        WaitAdvice() == kWaitSpin ? MonotonicNanos() + kSpinNanos : 0;
    while (full() && MonotonicNanos() < spin_until) __builtin_ia32_pause();
    if (full() && ctl->sleep_bounded.load() != 0 &&
        ctl->consumer_sleeping.load()) {
      RingDoorbell(ring);  // records left unrung must run now
    }
    while (full()) {
      if (ctl->dead.load()) return TakeError(ring);
      // The daemon is behind: sleep until it has freed what we need and a
      // quarter of the ring more.
      const uint32_t v = ctl->head_futex.load();
      const uint64_t want = rp.tail + need + ring_bytes / 4;
      ctl->wanted_head.store(
          std::min(rp.tail, want > ring_bytes ? want - ring_bytes : 0));
      ctl->producer_waiting.store(1);
      if (full() && ctl->dead.load() == 0)
        FutexWait(&ctl->head_futex, v, kLivenessCheckNanos);
      ctl->producer_waiting.store(0);
      if (full() && PeerGone(data_plane_fd)) {
        return absl::UnavailableError(
            absl::StrCat("tpud at ", options.socket_path, " went away"));
      }
    }
  }
  char* base = RingOf(shm, layout, ring);
  if (pad != 0) {
    RecordHeader h{static_cast<uint32_t>(pad),
                   static_cast<uint16_t>(RecordKind::kPad), 0, 0};
    std::memcpy(base + pos, &h, sizeof(h));
    rp.tail += pad;
    pos = 0;
  }
  std::memcpy(base + pos, record.data(), record.size());
  rp.tail += record.size();
  RecordHeader h;
  std::memcpy(&h, record.data(), sizeof(h));
  ctl->submitted.store(h.sequence, std::memory_order_relaxed);
  ctl->tail.store(rp.tail);  // seq_cst: ordered before the sleeping check
  // One ring of the doorbell per sleep of the executor, not one per record;
  // none for a plain op while that sleep is bounded (kBoundedSleepNanos).
  if (ctl->consumer_sleeping.load()) {
    const uint32_t epoch = ctl->sleep_epoch.load(std::memory_order_acquire);
    if (epoch != rp.rung_epoch && !MayLeaveUnrung(ctl, h, record)) {
      rp.rung_epoch = epoch;
      RingDoorbell(ring);
    }
  }
  return absl::OkStatus();
}

bool Session::Impl::MayLeaveUnrung(RingControl* ctl, const RecordHeader& h,
                                   absl::string_view record) {
  const auto kind = static_cast<RecordKind>(h.kind);
  if (kind == RecordKind::kOp) {
    if (record.size() <= sizeof(h) + 8 ||
        (record[sizeof(h) + 8] & kOpFlagSync) != 0)
      return false;  // someone waits for a synchronous op at once
  } else if (kind != RecordKind::kDefineOp) {
    return false;  // copies, events, collectives: others may wait on them
  }
  return ctl->sleep_bounded.load() != 0 && WaitAdvice() != kWaitSpin;
}

absl::Status Session::Impl::WaitCompleted(int ring, uint64_t sequence) {
  RingControl* ctl = Control(ring);
  if (ctl->completed.load(std::memory_order_acquire) >= sequence)
    return absl::OkStatus();
  // Records left unrung (MayLeaveUnrung) are wanted now.
  if (ctl->sleep_bounded.load() != 0 && ctl->consumer_sleeping.load())
    RingDoorbell(ring);
  {
    // Spin while a core is free for it; while only tpud's parties compete,
    // yield the core (to the executor, likely) for a moment; then sleep.
    const uint32_t advice = WaitAdvice();
    // While other programs load every core ("sleep"), a waiter that sleeps
    // may be woken onto a core where one of them runs, and wait there for
    // its turn to end (up to a 4 ms tick). When nothing but the awaited
    // record is left to run (a lone scalar read), the wait is one op long:
    // spin through it. With 2 busy loops on 2 cores, a scalar read-back
    // went from a median 8.0x a gRPC ping (3 of 18 runs under 4x) to 11.4x
    // (1 of 18).
    const bool lone_record =
        ctl->completed.load(std::memory_order_acquire) + 1 >= sequence;
    const bool spin =
        advice == kWaitSpin || (advice == kWaitSleep && lone_record);
    const uint64_t until =
        advice == kWaitSleep && !spin
            ? 0
            : MonotonicNanos() + (spin ? kSpinNanos : kYieldNanos);
    bool done = false;
    while (!done && MonotonicNanos() < until) {
      done = ctl->completed.load(std::memory_order_acquire) >= sequence ||
             ctl->dead.load();
      if (done) break;
      if (spin) {
        __builtin_ia32_pause();
      } else {
        sched_yield();
      }
    }
    if (ctl->completed.load(std::memory_order_acquire) >= sequence)
      return absl::OkStatus();
    if (ctl->dead.load()) return TakeError(ring);
  }
  while (true) {
    const uint32_t v = ctl->completion_futex.load();
    ctl->waiters.fetch_add(1);
    // Ask to be woken at `sequence` (or earlier, for another waiter); the
    // executor resets wake_at when it wakes us, so this runs every round.
    uint64_t at = ctl->wake_at.load();
    while (at > sequence && !ctl->wake_at.compare_exchange_weak(at, sequence)) {
    }
    const bool done =
        ctl->completed.load() >= sequence || ctl->dead.load() != 0;
    if (!done) FutexWait(&ctl->completion_futex, v, kLivenessCheckNanos);
    ctl->waiters.fetch_sub(1);
    if (ctl->completed.load(std::memory_order_acquire) >= sequence)
      return absl::OkStatus();
    if (ctl->dead.load()) return TakeError(ring);
    if (!done && PeerGone(data_plane_fd)) {
      return absl::UnavailableError(absl::StrCat(
          "tpud at ", options.socket_path, " went away while stream ",
          RingStream(ring), " had unfinished work"));
    }
  }
}

void Session::Impl::TakeWarning(int ring) {
  RingControl* ctl = Control(ring);
  if (ctl->warning_sequence.load(std::memory_order_acquire) == 0) return;
  char message[kWarningMessageBytes];
  std::memcpy(message, ctl->warning_message, sizeof(message));
  message[sizeof(message) - 1] = '\0';
  const bool deprecation = ctl->warning_deprecation != 0;
  const uint32_t count = ctl->warning_count;
  ctl->warning_sequence.store(0);  // the daemon may write the next one
  if (!warning_handler) return;
  std::string text = message;
  if (count > 1)
    absl::StrAppend(&text, " (and ", count - 1, " more warning(s) since)");
  warning_handler(text, deprecation);
}

absl::Status Session::Impl::TakeError(int ring) {
  TakeWarning(ring);
  RingControl* ctl = Control(ring);
  const uint64_t seq = ctl->error_sequence.load(std::memory_order_acquire);
  if (seq == 0) {
    if (ctl->dead.load()) {
      return absl::UnavailableError(
          absl::StrCat("stream ", RingStream(ring), " of session ", id,
                       " can make no more progress (the "
                       "session failed or ended); open a new session"));
    }
    return absl::OkStatus();
  }
  char message[kErrorMessageBytes];
  std::memcpy(message, ctl->error_message, sizeof(message));
  message[sizeof(message) - 1] = '\0';
  const uint32_t code = ctl->error_code;
  const uint32_t count = ctl->error_count;
  const AtenError kind = AtenErrorFromWire(ctl->error_kind);
  // A dead ring keeps its error: every later call reports it.
  if (!ctl->dead.load()) {
    ctl->error_count = 0;
    ctl->error_sequence.store(0);
  }
  std::string text = message;
  AddIssuedAt(ring, seq, &text);
  if (count > 1)
    absl::StrAppend(&text, " (and ", count - 1,
                    " later error(s) on this stream)");
  return WithAtenError(
      absl::Status(static_cast<absl::StatusCode>(code == 0 ? 13 : code), text),
      kind);
}

void Session::Impl::AddIssuedAt(int ring, uint64_t sequence,
                                std::string* text) {
  // tpud names the op as "op K of a fused eager run of N (...)".
  static constexpr absl::string_view kRun = " of a fused eager run of ";
  const size_t at = text->find(kRun.data(), 0, kRun.size());
  if (at == std::string::npos) return;
  size_t digits = at;
  while (digits > 0 && absl::ascii_isdigit((*text)[digits - 1])) --digits;
  uint64_t k = 0;
  if (digits < 3 || text->compare(digits - 3, 3, "op ") != 0 ||
      !absl::SimpleAtoi(text->substr(digits, at - digits), &k) || k == 0)
    return;
  absl::MutexLock lock(&issued_mu);
  for (const IssuedRun& run : issued_runs) {
    if (run.ring != ring || run.sequence != sequence) continue;
    if (k <= run.issued_at.size() && !run.issued_at[k - 1].empty())
      absl::StrAppend(text, " [issued at ", run.issued_at[k - 1], "]");
    return;
  }
}

absl::Status Session::Impl::TakeStreamError(int stream) {
  absl::Status first;
  for (int c = 0; c < num_chips; ++c) {
    absl::Status s = TakeError(RingIndex(c, stream));
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

bool Session::Impl::PinnedOffset(const void* ptr, uint64_t bytes,
                                 uint64_t* offset) const {
  if (shm == nullptr) return false;
  const char* p = static_cast<const char*>(ptr);
  const char* begin = shm + layout.pinned_offset;
  const char* end = begin + layout.pinned_bytes;
  if (p < begin || p >= end || bytes > static_cast<uint64_t>(end - p))
    return false;
  *offset = static_cast<uint64_t>(p - shm);
  return true;
}

absl::StatusOr<uint64_t> Session::Impl::EnqueueOpLocked(
    int stream, internal::StreamProducer& p, uint32_t op_id, uint32_t flags,
    const OpArg* args, size_t num_args, const TensorRef* outputs,
    size_t num_outputs, int* ring_out) {
  if (num_args > kMaxArgs || num_outputs > kMaxOutputs) {
    return absl::InvalidArgumentError(
        absl::StrCat("op with ", num_args, " arguments and ", num_outputs,
                     " outputs (limits ", kMaxArgs, " and ", kMaxOutputs, ")"));
  }
  // The op runs on the chip of its first tensor (the daemon checks that
  // every tensor is there); an op without tensors stays where the stream is.
  int chip = -1;
  auto consider = [&](const TensorRef& t) {
    if (chip < 0 && t.address != 0) chip = DeviceAddressChip(t.address);
  };
  for (size_t i = 0; i < num_args && chip < 0; ++i) {
    const OpArg& a = args[i];
    if (a.tag == ArgTag::kTensor) consider(a.tensor);
    if (a.tag == ArgTag::kTensorList || a.tag == ArgTag::kOptionalTensorList) {
      for (size_t k = 0; k < a.tensors.size(); ++k) {
        if (a.tag == ArgTag::kTensorList || a.tensor_present[k])
          consider(a.tensors[k]);
      }
    }
  }
  for (size_t i = 0; i < num_outputs && chip < 0; ++i) consider(outputs[i]);
  if (chip < 0 || chip >= num_chips) chip = p.last_chip >= 0 ? p.last_chip : 0;
  absl::StatusOr<int> ring = RouteLocked(stream, p, chip);
  if (!ring.ok()) return ring.status();
  internal::RingProducer& rp = p.rings[chip];
  if (op_id >= rp.defined.size() || !rp.defined[op_id]) {
    std::string schema;
    {
      absl::MutexLock lock(&ops_mu);
      if (op_id >= op_schemas.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("op id ", op_id, " was never defined"));
      }
      schema = op_schemas[op_id];
    }
    BeginLocked(*ring, p, RecordKind::kDefineOp);
    p.writer.U32(op_id);
    p.writer.U32(static_cast<uint32_t>(schema.size()));
    p.writer.Bytes(schema.data(), schema.size());
    if (absl::Status s = Publish(*ring, p); !s.ok()) return s;
    if (op_id >= rp.defined.size()) rp.defined.resize(op_id + 1, false);
    rp.defined[op_id] = true;
  }
  // Fused eager holds an op that nobody waits for at once.
  const bool defer = fuse_eager.load(std::memory_order_relaxed) &&
                     !p.capturing &&
                     (flags & (kOpFlagSync | kOpFlagChecked)) == 0;
  const uint64_t sequence = BeginLocked(*ring, p, RecordKind::kOp, defer);
  p.writer.U32(op_id);
  p.writer.U16(static_cast<uint16_t>(num_args));
  p.writer.U16(static_cast<uint16_t>(num_outputs));
  p.writer.U32(flags);
  for (size_t i = 0; i < num_args; ++i) p.writer.Arg(args[i]);
  for (size_t i = 0; i < num_outputs; ++i) p.writer.Tensor(outputs[i]);
  if (absl::Status s = Publish(*ring, p); !s.ok()) return s;
  if (ring_out != nullptr) *ring_out = *ring;
  return sequence;
}

absl::StatusOr<uint64_t> Session::Impl::EnqueueCopyLocked(
    int ring, internal::StreamProducer& p, CopyKind kind, uint64_t src,
    uint64_t dst, uint64_t bytes) {
  const uint64_t sequence = BeginLocked(ring, p, RecordKind::kCopy);
  p.writer.U8(static_cast<uint8_t>(kind));
  p.writer.Pad(7);
  p.writer.U64(src);
  p.writer.U64(dst);
  p.writer.U64(bytes);
  if (absl::Status s = Publish(ring, p); !s.ok()) return s;
  return sequence;
}

// ---------------------------------------------------------------- Session

absl::StatusOr<uint32_t> Session::DefineOp(absl::string_view schema) {
  if (schema.empty() || schema.size() > kMaxSchemaBytes) {
    return absl::InvalidArgumentError(absl::StrCat("operator schema of ",
                                                   schema.size(), " bytes (1..",
                                                   kMaxSchemaBytes, ")"));
  }
  absl::MutexLock lock(&impl_->ops_mu);
  auto [it, inserted] = impl_->op_ids.emplace(
      std::string(schema), static_cast<uint32_t>(impl_->op_schemas.size()));
  if (inserted) impl_->op_schemas.emplace_back(schema);
  return it->second;
}

absl::StatusOr<uint64_t> Session::EnqueueOp(int stream, uint32_t op_id,
                                            const OpArg* args, size_t num_args,
                                            const TensorRef* outputs,
                                            size_t num_outputs, uint32_t flags,
                                            absl::string_view issued_at) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  // Kept by Publish with the op where it holds it for fusion.
  p.next_issued.assign(issued_at.data(), issued_at.size());
  absl::StatusOr<uint64_t> sequence =
      impl_->EnqueueOpLocked(stream, p, op_id, flags & kOpFlagDefaultDtypeMask,
                             args, num_args, outputs, num_outputs, nullptr);
  p.next_issued.clear();
  return sequence;
}

absl::Status Session::RunChecked(int stream, uint32_t op_id, const OpArg* args,
                                 size_t num_args, const TensorRef* outputs,
                                 size_t num_outputs, uint32_t flags) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  uint64_t sequence = 0;
  int ring = 0;
  {
    absl::MutexLock lock(&p.mu);
    absl::StatusOr<uint64_t> seq = impl_->EnqueueOpLocked(
        stream, p, op_id,
        (flags & kOpFlagDefaultDtypeMask) | (p.capturing ? 0 : kOpFlagChecked),
        args, num_args, outputs, num_outputs, &ring);
    if (!seq.ok()) return seq.status();
    // A captured op runs with its program: nothing to wait for now.
    if (p.capturing) return absl::OkStatus();
    sequence = *seq;
  }
  if (absl::Status s = impl_->WaitCompleted(ring, sequence); !s.ok()) return s;
  const uint64_t failed = impl_->Control(ring)->error_sequence.load();
  absl::Status error = impl_->TakeError(ring);
  // An earlier op's error is reported here as any synchronisation reports
  // it: not as this op's own (no ATen class).
  if (failed != sequence) error.ErasePayload(kAtenErrorPayload);
  return error;
}

absl::StatusOr<std::vector<OpResult>> Session::RunSync(
    int stream, uint32_t op_id, const OpArg* args, size_t num_args,
    const TensorRef* outputs, size_t num_outputs, uint32_t flags) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock sync_lock(&p.sync_mu);
  uint64_t sequence = 0;
  int ring = 0;
  {
    absl::MutexLock lock(&p.mu);
    absl::StatusOr<uint64_t> seq = impl_->EnqueueOpLocked(
        stream, p, op_id, kOpFlagSync | (flags & kOpFlagDefaultDtypeMask), args,
        num_args, outputs, num_outputs, &ring);
    if (!seq.ok()) return seq.status();
    sequence = *seq;
  }
  if (absl::Status s = impl_->WaitCompleted(ring, sequence); !s.ok()) return s;
  impl_->TakeWarning(ring);
  RingControl* ctl = impl_->Control(ring);
  if (ctl->response_sequence != sequence) {
    // The record never ran as an op (e.g. the op id was refused earlier):
    // its error is the ring's.
    absl::Status err = impl_->TakeStreamError(stream);
    return err.ok() ? absl::InternalError("synchronous op produced no response")
                    : err;
  }
  // This is a synchronising call: the stream's earlier errors are reported
  // here, once (and not again at the next one). Only a result that holds new
  // device memory (a tensor the caller must adopt) is never dropped for
  // them: then they wait for the next synchronising call.
  bool new_memory = false;
  for (uint32_t i = 0;
       ctl->response_code == 0 && i < ctl->num_results && i < kMaxResults;
       ++i) {
    new_memory =
        new_memory ||
        ctl->results[i].kind == static_cast<uint8_t>(OpResult::Kind::kTensor);
  }
  const absl::Status earlier =
      new_memory ? absl::OkStatus() : impl_->TakeStreamError(stream);
  if (ctl->response_code != 0) {
    char message[kErrorMessageBytes];
    std::memcpy(message, ctl->response_message, sizeof(message));
    message[sizeof(message) - 1] = '\0';
    std::string text = message;
    // Failing on an input that an earlier failed op wrote, the message names
    // that root cause already; an unrelated earlier error is named too.
    if (!earlier.ok() &&
        !absl::StrContains(text, earlier.message().substr(0, 80))) {
      absl::StrAppend(&text, "; earlier on this stream: ", earlier.message());
    }
    return WithAtenError(
        absl::Status(static_cast<absl::StatusCode>(ctl->response_code), text),
        AtenErrorFromWire(ctl->response_kind));
  }
  if (!earlier.ok()) {
    // Another op's error: not this op's own ATen error.
    absl::Status e = earlier;
    e.ErasePayload(kAtenErrorPayload);
    return e;
  }
  std::vector<OpResult> results;
  const uint32_t n = std::min<uint32_t>(ctl->num_results, kMaxResults);
  for (uint32_t i = 0; i < n; ++i) {
    const ShmResult& r = ctl->results[i];
    OpResult out;
    out.kind = static_cast<OpResult::Kind>(r.kind);
    out.i = r.i;
    out.d = r.d;
    out.d_imag = r.d_imag;
    out.b = r.i != 0;
    if (out.kind == OpResult::Kind::kTensor) {
      out.tensor.address = r.address;
      out.tensor.dtype = r.dtype;
      out.tensor.ndim = std::min<uint8_t>(r.ndim, kMaxDims);
      out.tensor.storage_offset = r.storage_offset;
      for (int d = 0; d < out.tensor.ndim; ++d) {
        out.tensor.sizes[d] = r.sizes[d];
        out.tensor.strides[d] = r.strides[d];
      }
      out.nbytes = r.nbytes;
    }
    results.push_back(out);
  }
  return results;
}

absl::Status Session::CopyToDevice(int stream, uint64_t dst_address,
                                   const void* src, uint64_t bytes) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  absl::StatusOr<int> chip =
      impl_->ChipOfAddress(dst_address, "copy destination");
  if (!chip.ok()) return chip.status();
  internal::StreamProducer& p = impl_->streams[stream];
  uint64_t pinned = 0;
  absl::MutexLock lock(&p.mu);
  absl::StatusOr<int> ring = impl_->RouteLocked(stream, p, *chip);
  if (!ring.ok()) return ring.status();
  if (impl_->PinnedOffset(src, bytes, &pinned)) {
    return impl_
        ->EnqueueCopyLocked(*ring, p, CopyKind::kHostToDevice, pinned,
                            dst_address, bytes)
        .status();
  }
  // Pageable: through this stream's staging slots, so our memcpy of one
  // chunk overlaps the daemon's copy of the previous one.
  const uint64_t slot_bytes = impl_->staging_slot_bytes;
  const uint64_t stream_base = impl_->StagingBase(stream);
  const char* from = static_cast<const char*>(src);
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t chunk = std::min(slot_bytes, bytes - done);
    const size_t slot = p.next_slot++ % p.slot_use.size();
    if (p.slot_use[slot].second != 0) {
      absl::Status s =
          impl_->WaitCompleted(p.slot_use[slot].first, p.slot_use[slot].second);
      if (!s.ok()) return s;
    }
    const uint64_t offset = stream_base + slot * slot_bytes;
    std::memcpy(impl_->shm + offset, from + done, chunk);
    absl::StatusOr<uint64_t> seq = impl_->EnqueueCopyLocked(
        *ring, p, CopyKind::kHostToDevice, offset, dst_address + done, chunk);
    if (!seq.ok()) return seq.status();
    p.slot_use[slot] = {*ring, *seq};
    done += chunk;
  }
  return absl::OkStatus();
}

absl::Status Session::CopyToHost(int stream, void* dst, uint64_t src_address,
                                 uint64_t bytes) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  if (bytes == 0) return Synchronize(stream);
  absl::StatusOr<int> chip = impl_->ChipOfAddress(src_address, "copy source");
  if (!chip.ok()) return chip.status();
  internal::StreamProducer& p = impl_->streams[stream];
  uint64_t pinned = 0;
  if (impl_->PinnedOffset(dst, bytes, &pinned)) {
    uint64_t seq = 0;
    int ring = 0;
    {
      absl::MutexLock lock(&p.mu);
      absl::StatusOr<int> r = impl_->RouteLocked(stream, p, *chip);
      if (!r.ok()) return r.status();
      ring = *r;
      absl::StatusOr<uint64_t> s = impl_->EnqueueCopyLocked(
          ring, p, CopyKind::kDeviceToHost, src_address, pinned, bytes);
      if (!s.ok()) return s.status();
      seq = *s;
    }
    if (absl::Status s = impl_->WaitCompleted(ring, seq); !s.ok()) return s;
    return impl_->TakeStreamError(stream);
  }
  // Pageable: keep every staging slot busy; copy each chunk out in order.
  absl::MutexLock lock(&p.mu);
  absl::StatusOr<int> r = impl_->RouteLocked(stream, p, *chip);
  if (!r.ok()) return r.status();
  const int ring = *r;
  const uint64_t slot_bytes = impl_->staging_slot_bytes;
  const size_t slots = p.slot_use.size();
  const uint64_t stream_base = impl_->StagingBase(stream);
  const uint64_t chunks = (bytes + slot_bytes - 1) / slot_bytes;
  std::vector<uint64_t> seqs(chunks, 0);
  auto issue = [&](uint64_t c) -> absl::Status {
    const size_t slot = c % slots;
    if (p.slot_use[slot].second != 0) {
      absl::Status s =
          impl_->WaitCompleted(p.slot_use[slot].first, p.slot_use[slot].second);
      if (!s.ok()) return s;
    }
    const uint64_t off = c * slot_bytes;
    absl::StatusOr<uint64_t> seq = impl_->EnqueueCopyLocked(
        ring, p, CopyKind::kDeviceToHost, src_address + off,
        stream_base + slot * slot_bytes, std::min(slot_bytes, bytes - off));
    if (!seq.ok()) return seq.status();
    seqs[c] = *seq;
    p.slot_use[slot] = {ring, *seq};
    return absl::OkStatus();
  };
  for (uint64_t c = 0; c < std::min<uint64_t>(chunks, slots); ++c) {
    if (absl::Status s = issue(c); !s.ok()) return s;
  }
  char* to = static_cast<char*>(dst);
  for (uint64_t c = 0; c < chunks; ++c) {
    if (absl::Status s = impl_->WaitCompleted(ring, seqs[c]); !s.ok()) return s;
    // A failed copy leaves the slot stale: report instead of handing it out.
    if (impl_->Control(ring)->error_sequence.load() != 0)
      return impl_->TakeStreamError(stream);
    const uint64_t off = c * slot_bytes;
    std::memcpy(to + off, impl_->shm + stream_base + (c % slots) * slot_bytes,
                std::min(slot_bytes, bytes - off));
    if (c + slots < chunks) {
      if (absl::Status s = issue(c + slots); !s.ok()) return s;
    }
  }
  return impl_->TakeStreamError(stream);
}

absl::Status Session::CopyOnDevice(int stream, uint64_t dst_address,
                                   uint64_t src_address, uint64_t bytes) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  // Runs on the destination chip (whose executor owns what it writes).
  absl::StatusOr<int> chip =
      impl_->ChipOfAddress(dst_address, "copy destination");
  if (!chip.ok()) return chip.status();
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  absl::StatusOr<int> ring = impl_->RouteLocked(stream, p, *chip);
  if (!ring.ok()) return ring.status();
  return impl_
      ->EnqueueCopyLocked(*ring, p, CopyKind::kDeviceToDevice, src_address,
                          dst_address, bytes)
      .status();
}

absl::StatusOr<void*> Session::AllocatePinned(uint64_t bytes) {
  return impl_->AllocatePinned(bytes);
}

absl::Status Session::FreePinned(void* ptr) { return impl_->FreePinned(ptr); }

absl::StatusOr<void*> Session::Impl::AllocatePinned(uint64_t bytes) {
  if (shm == nullptr)
    return absl::FailedPreconditionError("session has no data plane");
  const uint64_t size =
      std::max<uint64_t>(kPinnedAlignment, (bytes + kPinnedAlignment - 1) &
                                               ~(kPinnedAlignment - 1));
  if (bytes == 0 || size < bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot allocate ", bytes,
        " bytes of pinned memory: ask for 1 byte up to the pool's ",
        FormatBytes(layout.pinned_bytes)));
  }
  absl::MutexLock lock(&pinned_mu);
  for (auto it = pinned_free.begin(); it != pinned_free.end(); ++it) {
    if (it->second < size) continue;
    const uint64_t offset = it->first;
    const uint64_t remaining = it->second - size;
    pinned_free.erase(it);
    if (remaining > 0) pinned_free[offset + size] = remaining;
    pinned_used[offset] = size;
    return static_cast<void*>(shm + offset);
  }
  uint64_t free_total = 0;
  for (const auto& [o, n] : pinned_free) free_total += n;
  return absl::ResourceExhaustedError(absl::StrCat(
      "pinned host pool exhausted: asked ", FormatBytes(bytes), ", free ",
      FormatBytes(free_total), " of ", FormatBytes(layout.pinned_bytes),
      "; open the session with a larger ClientOptions::pinned_pool_bytes"));
}

absl::Status Session::Impl::FreePinned(void* ptr) {
  if (shm == nullptr)
    return absl::FailedPreconditionError("session has no data plane");
  const uint64_t offset = static_cast<uint64_t>(static_cast<char*>(ptr) - shm);
  absl::MutexLock lock(&pinned_mu);
  auto it = pinned_used.find(offset);
  if (static_cast<char*>(ptr) < shm || it == pinned_used.end()) {
    return absl::InvalidArgumentError(
        "FreePinned of a pointer that AllocatePinned of this session did not "
        "return (or that "
        "was freed already)");
  }
  uint64_t begin = offset, size = it->second;
  pinned_used.erase(it);
  auto next = pinned_free.lower_bound(begin);
  if (next != pinned_free.end() && next->first == begin + size) {
    size += next->second;
    next = pinned_free.erase(next);
  }
  if (next != pinned_free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      size += prev->second;
      pinned_free.erase(prev);
    }
  }
  pinned_free[begin] = size;
  return absl::OkStatus();
}

bool Session::IsPinned(const void* ptr) const {
  uint64_t offset = 0;
  return impl_->PinnedOffset(ptr, 1, &offset);
}

absl::StatusOr<uint64_t> Session::EnqueueCollective(int stream, int chip,
                                                    uint64_t communicator,
                                                    const CollectiveEntry* ops,
                                                    size_t num_ops) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  if (chip < 0 || chip >= impl_->num_chips) {
    return absl::InvalidArgumentError(
        absl::StrCat("no chip ", chip, " on this host"));
  }
  if (num_ops == 0 || num_ops > kMaxGroupOps) {
    return absl::InvalidArgumentError(
        absl::StrCat("a collective group has 1 to ", kMaxGroupOps,
                     " operations, not ", num_ops));
  }
  // Groups meet in the daemon by the order this rank issued them, whatever
  // streams they went to.
  std::vector<CollectiveEntry> stamped(ops, ops + num_ops);
  uint64_t index = 0;
  {
    absl::MutexLock lock(&impl_->comm_mu);
    Impl::CommCounters& c = impl_->comm_counters[communicator];
    bool p2p = true;
    for (CollectiveEntry& e : stamped) {
      if (e.kind == CollectiveKind::kSend) {
        e.pair_sequence = c.sends[e.peer]++;
      } else if (e.kind == CollectiveKind::kRecv) {
        e.pair_sequence = c.recvs[e.peer]++;
      } else {
        p2p = false;
      }
    }
    if (!p2p) index = ++c.groups;
  }
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  absl::StatusOr<int> ring = impl_->RouteLocked(stream, p, chip);
  if (!ring.ok()) return ring.status();
  const uint64_t sequence =
      impl_->BeginLocked(*ring, p, RecordKind::kCollective);
  WriteCollective(p.writer, communicator, index, stamped.data(),
                  stamped.size());
  if (absl::Status s = impl_->Publish(*ring, p); !s.ok()) return s;
  return sequence;
}

absl::StatusOr<Event> Session::RecordEvent(int stream) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  uint32_t slot = 0;
  {
    absl::MutexLock lock(&impl_->events_mu);
    if (impl_->free_events.empty()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "all ", kMaxEvents, " events of this session are in use"));
    }
    slot = impl_->free_events.back();
    impl_->free_events.pop_back();
  }
  EventOf(impl_->shm, impl_->layout, slot)->completed_ns.store(0);
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  // On the ring the stream's work went to last: it follows all of it.
  const int ring = RingIndex(p.last_chip >= 0 ? p.last_chip : 0, stream);
  const uint64_t sequence =
      impl_->BeginLocked(ring, p, RecordKind::kEventRecord);
  p.writer.U32(slot);
  p.writer.Pad(4);
  if (absl::Status s = impl_->Publish(ring, p); !s.ok()) return s;
  return Event{slot, ring, sequence};
}

Event Session::EventAt(int stream, int chip, uint64_t sequence) const {
  return Event{kUntimedEventSlot, RingIndex(chip, stream), sequence};
}

absl::Status Session::WaitEvent(int stream, const Event& event) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  if (event.ring < 0 || event.ring >= impl_->num_chips * kStreamsPerChip) {
    return absl::InvalidArgumentError(
        "event of another session, or not recorded");
  }
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  // Where the stream is now (or, if it has done nothing yet, where the event
  // is).
  const int chip = p.last_chip >= 0 ? p.last_chip : RingChip(event.ring);
  absl::StatusOr<int> ring = impl_->RouteLocked(stream, p, chip);
  if (!ring.ok()) return ring.status();
  // Nothing to wait for: a ring runs its records in order, so an event it
  // was already given is behind anything published after; and a completed
  // event is over. (A wait record would cost the executor a wake each time,
  // e.g. for every synchronous collective's Work.wait.)
  const bool same_ring_published =
      *ring == event.ring &&
      event.sequence < p.rings[RingChip(*ring)].next_sequence;
  if (same_ring_published ||
      impl_->Control(event.ring)->completed.load() >= event.sequence) {
    return absl::OkStatus();
  }
  impl_->BeginLocked(*ring, p, RecordKind::kEventWait);
  p.writer.U32(event.slot);
  p.writer.U32(static_cast<uint32_t>(event.ring));
  p.writer.U64(event.sequence);
  return impl_->Publish(*ring, p);
}

bool Session::EventDone(const Event& event) {
  if (impl_->shm == nullptr || event.ring < 0 ||
      event.ring >= impl_->num_chips * kStreamsPerChip) {
    return false;
  }
  return impl_->Control(event.ring)->completed.load() >= event.sequence;
}

absl::Status Session::SynchronizeEvent(const Event& event) {
  if (impl_->shm == nullptr)
    return absl::FailedPreconditionError("session has no data plane");
  if (event.ring < 0 || event.ring >= impl_->num_chips * kStreamsPerChip) {
    return absl::InvalidArgumentError(
        "event of another session, or not recorded");
  }
  return impl_->WaitCompleted(event.ring, event.sequence);
}

absl::StatusOr<double> Session::ElapsedMillis(const Event& start,
                                              const Event& end) {
  if (!EventDone(start) || !EventDone(end)) {
    return absl::FailedPreconditionError(
        "elapsed time needs both events completed; SynchronizeEvent the later "
        "one first");
  }
  if (start.slot == kUntimedEventSlot || end.slot == kUntimedEventSlot) {
    return absl::InvalidArgumentError(
        "elapsed time needs events made by RecordEvent (an EventAt event has "
        "no timestamp)");
  }
  if (start.slot >= static_cast<uint32_t>(kMaxEvents) ||
      end.slot >= static_cast<uint32_t>(kMaxEvents)) {
    return absl::InvalidArgumentError(
        absl::StrCat("event slot out of range (events of this session are 0..",
                     kMaxEvents - 1, ")"));
  }
  const uint64_t a =
      EventOf(impl_->shm, impl_->layout, start.slot)->completed_ns.load();
  const uint64_t b =
      EventOf(impl_->shm, impl_->layout, end.slot)->completed_ns.load();
  return (static_cast<double>(b) - static_cast<double>(a)) / 1e6;
}

void Session::ReleaseEvent(const Event& event) {
  if (event.slot >= static_cast<uint32_t>(kMaxEvents)) return;
  absl::MutexLock lock(&impl_->events_mu);
  impl_->free_events.push_back(event.slot);
}

void Session::SetWarningHandler(
    std::function<void(absl::string_view, bool)> handler) {
  impl_->warning_handler = std::move(handler);
}

absl::Status Session::Synchronize(int stream) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  // Only the rings this stream has used can hold its work or its errors
  // (torch.tpu.synchronize() visits every stream, most of them unused).
  uint64_t last[kMaxChipsPerHost] = {};
  bool used = false;
  {
    absl::MutexLock lock(&p.mu);
    if (absl::Status s = impl_->FlushLocked(p); !s.ok()) return s;
    for (int c = 0; c < impl_->num_chips; ++c) {
      last[c] = p.rings[c].next_sequence - 1;
      used |= last[c] != 0;
    }
  }
  if (!used) return absl::OkStatus();
  absl::Status first;
  for (int c = 0; c < impl_->num_chips; ++c) {
    if (last[c] == 0) continue;
    const int ring = RingIndex(c, stream);
    if (absl::Status s = impl_->WaitCompleted(ring, last[c]); !s.ok()) return s;
    absl::Status s = impl_->TakeError(ring);
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

absl::Status Session::WaitIdle() {
  if (impl_->shm == nullptr) return absl::OkStatus();
  for (int s = 0; s < kStreamsPerChip; ++s) {
    internal::StreamProducer& p = impl_->streams[s];
    std::vector<uint64_t> last(impl_->num_chips, 0);
    {
      absl::MutexLock lock(&p.mu);
      if (absl::Status st = impl_->FlushLocked(p);
          st.code() == absl::StatusCode::kUnavailable)
        return st;
      for (int c = 0; c < impl_->num_chips; ++c)
        last[c] = p.rings[c].next_sequence - 1;
    }
    for (int c = 0; c < impl_->num_chips; ++c) {
      if (last[c] == 0) continue;
      absl::Status st = impl_->WaitCompleted(RingIndex(c, s), last[c]);
      if (st.code() == absl::StatusCode::kUnavailable) return st;
    }
  }
  return absl::OkStatus();
}

absl::Status Session::SynchronizeAll() {
  absl::Status first;
  for (int s = 0; s < kStreamsPerChip; ++s) {
    absl::Status st = Synchronize(s);
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

void Session::SetEagerFusion(bool on, uint32_t run_ops) {
  if (run_ops != 0)
    impl_->fuse_run_ops.store(std::min(run_ops, kMaxFusedRecords));
  impl_->fuse_eager.store(on);
  if (on || impl_->shm == nullptr) return;
  for (internal::StreamProducer& p : impl_->streams) {
    absl::MutexLock lock(&p.mu);
    (void)impl_->FlushLocked(p);  // a failure is the ring's, reported there
  }
}

bool Session::eager_fusion() const { return impl_->fuse_eager.load(); }

uint64_t Session::HeldRun(int stream) const {
  if (stream < 0 || stream >= kStreamsPerChip) return 0;
  return impl_->streams[stream].held_run.load(std::memory_order_acquire);
}

bool Session::FreedInRun(int stream, uint64_t run, uint64_t address) {
  if (stream < 0 || stream >= kStreamsPerChip || run == 0) return false;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  if (p.held_run.load(std::memory_order_relaxed) != run) return false;
  if (p.fused_dead.size() < kMaxProgramDead) p.fused_dead.push_back(address);
  return true;
}

// ---------------------------------------------------------------- programs

absl::Status Session::BeginCapture(int stream) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  if (p.capturing) {
    return absl::FailedPreconditionError(
        absl::StrCat("stream ", stream, " is capturing already"));
  }
  if (absl::Status s = impl_->FlushLocked(p); !s.ok()) return s;
  p.capturing = true;
  p.captured.clear();
  p.captured_records = 0;
  p.capture_chip = -1;
  p.capture_error = absl::OkStatus();
  return absl::OkStatus();
}

absl::StatusOr<Program> Session::EndCapture(int stream,
                                            const std::string& name) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  std::string records;
  uint32_t num_records = 0;
  int chip = 0;
  {
    absl::MutexLock lock(&p.mu);
    if (!p.capturing) {
      return absl::FailedPreconditionError(
          absl::StrCat("stream ", stream, " is not capturing"));
    }
    p.capturing = false;
    if (!p.capture_error.ok()) {
      return absl::Status(
          p.capture_error.code(),
          absl::StrCat("capture failed: ", p.capture_error.message()));
    }
    records.swap(p.captured);
    num_records = p.captured_records;
    chip = p.capture_chip >= 0 ? p.capture_chip
                               : (p.last_chip >= 0 ? p.last_chip : 0);
  }
  const std::string title = name.substr(0, kMaxProgramNameBytes);
  const uint64_t bytes = ProgramBytes(title, records);
  absl::StatusOr<void*> memory = AllocatePinned(bytes);
  if (!memory.ok()) {
    return absl::Status(
        memory.status().code(),
        absl::StrCat("no shared memory for a program of ", bytes,
                     " bytes: ", memory.status().message()));
  }
  char* at = static_cast<char*>(*memory);
  WriteProgram(at, title, num_records, records);
  static std::atomic<uint32_t> next_id{1};
  Program program;
  program.id = next_id.fetch_add(1);
  program.chip = chip;
  program.offset = static_cast<uint64_t>(at - impl_->shm);
  program.bytes = bytes;
  program.num_records = num_records;
  program.name = title;
  program.memory = *memory;
  return program;
}

absl::StatusOr<uint64_t> Session::RunProgram(
    int stream, const Program& program,
    const std::vector<ProgramBinding>& bindings, uint64_t seed) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  if (bindings.size() > kMaxProgramBindings) {
    return absl::InvalidArgumentError(
        absl::StrCat("a program run with ", bindings.size(),
                     " bindings (at most ", kMaxProgramBindings, ")"));
  }
  if (program.chip < 0 || program.chip >= impl_->num_chips) {
    return absl::InvalidArgumentError(
        absl::StrCat("program on chip ", program.chip));
  }
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  absl::StatusOr<int> ring = impl_->RouteLocked(stream, p, program.chip);
  if (!ring.ok()) return ring.status();
  const uint64_t sequence =
      impl_->BeginLocked(*ring, p, RecordKind::kRunProgram);
  p.writer.U32(program.id);
  p.writer.U32(static_cast<uint32_t>(bindings.size()));
  p.writer.U64(program.offset);
  p.writer.U64(program.bytes);
  p.writer.U64(seed);
  for (const ProgramBinding& b : bindings) {
    p.writer.U64(b.from);
    p.writer.U64(b.bytes);
    p.writer.U64(b.to);
  }
  if (absl::Status s = impl_->Publish(*ring, p); !s.ok()) return s;
  return sequence;
}

absl::Status Session::ReleaseProgram(const Program& program) {
  if (program.memory == nullptr) return absl::OkStatus();
  return FreePinned(program.memory);
}

}  // namespace tpu
