// libtpuclient's data plane: the producer side of the session's op streams.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_format.h"
#include "session_impl.h"
#include "tpu/units.h"

namespace tpu {
namespace {

constexpr int kStagingSlotsPerStream = 4;
constexpr uint64_t kPinnedAlignment = 256;
// How long a waiting client spins before it sleeps: a round trip without a
// sleeping party is a few microseconds; a futex wake-up costs tens.
constexpr uint64_t kSpinNanos = 30000;

bool PeerGone(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace

Session::Impl::~Impl() {
  if (shm != nullptr) munmap(shm, shm_bytes);
  if (data_plane_fd >= 0) close(data_plane_fd);
}

absl::Status Session::Impl::AttachDataPlane(const std::string& token) {
  if (token.size() != 16) {
    return absl::FailedPreconditionError("tpud sent no data-plane token (protocol mismatch)");
  }
  absl::StatusOr<int> fd = internal::ConnectUnix(options.socket_path, /*admin=*/false);
  if (!fd.ok()) return fd.status();
  data_plane_fd = *fd;
  timeval tv{30, 0};
  setsockopt(data_plane_fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  DataPlaneHello hello{};
  std::memcpy(hello.magic, kDataPlaneMagic, sizeof(hello.magic));
  hello.session_id = id;
  std::memcpy(hello.token, token.data(), sizeof(hello.token));
  hello.pinned_bytes = options.pinned_pool_bytes;
  if (send(data_plane_fd, &hello, sizeof(hello), MSG_NOSIGNAL) != sizeof(hello)) {
    return absl::UnavailableError(
        absl::StrCat("sending the data-plane hello to ", options.socket_path, ": ",
                     std::strerror(errno)));
  }
  DataPlaneReply reply{};
  iovec iov{&reply, sizeof(reply)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(data_plane_fd, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  int memfd = -1;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm != nullptr; cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      std::memcpy(&memfd, CMSG_DATA(cm), sizeof(int));
    }
  }
  if (n != sizeof(reply)) {
    if (memfd >= 0) close(memfd);
    return absl::UnavailableError(absl::StrCat(
        "tpud at ", options.socket_path, " did not answer the data-plane hello"));
  }
  reply.message[sizeof(reply.message) - 1] = '\0';
  if (reply.code != 0 || memfd < 0) {
    if (memfd >= 0) close(memfd);
    return absl::Status(static_cast<absl::StatusCode>(reply.code == 0 ? 13 : reply.code),
                        absl::StrCat("data-plane attach: ", reply.message));
  }
  void* p = mmap(nullptr, reply.shm_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  close(memfd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "mapping the session's shared memory (", FormatBytes(reply.shm_bytes),
        "): ", std::strerror(errno)));
  }
  shm = static_cast<char*>(p);
  shm_bytes = reply.shm_bytes;
  std::memcpy(&layout, shm, sizeof(layout));
  if (layout.magic != kShmMagic || layout.num_streams != static_cast<uint32_t>(kMaxStreams) ||
      layout.total_bytes != shm_bytes || layout.pinned_offset + layout.pinned_bytes > shm_bytes) {
    return absl::FailedPreconditionError(
        "the session's shared memory has an unknown layout (tpud and libtpuclient differ)");
  }
  staging_slots = kStagingSlotsPerStream;
  staging_slot_bytes = (layout.staging_bytes / kMaxStreams / staging_slots) & ~uint64_t{4095};
  for (internal::StreamProducer& s : streams) {
    absl::MutexLock lock(&s.mu);
    s.slot_sequence.assign(staging_slots, 0);
  }
  {
    absl::MutexLock lock(&pinned_mu);
    if (layout.pinned_bytes > 0) pinned_free[layout.pinned_offset] = layout.pinned_bytes;
  }
  {
    absl::MutexLock lock(&events_mu);
    for (int e = kMaxEvents - 1; e >= 0; --e) free_events.push_back(e);
  }
  return absl::OkStatus();
}

absl::Status Session::Impl::CheckStream(int stream) const {
  if (shm == nullptr) return absl::FailedPreconditionError("session has no data plane");
  if (stream < 0 || stream >= kMaxStreams) {
    return absl::InvalidArgumentError(
        absl::StrCat("no stream ", stream, " (streams are 0..", kMaxStreams - 1, ")"));
  }
  return absl::OkStatus();
}

absl::Status Session::Impl::Publish(int stream, internal::StreamProducer& producer) {
  StreamControl* ctl = Control(stream);
  const absl::string_view record = producer.writer.Finish();
  const uint64_t ring = layout.ring_bytes;
  if (record.size() > ring / 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "record of ", record.size(), " bytes does not fit the stream's ring (", ring, ")"));
  }
  uint64_t pos = producer.tail & (ring - 1);
  // Never leave a gap smaller than a record header before the ring's end:
  // the filler record that skips a gap must fit in it.
  const uint64_t after = ring - pos;
  const bool wrap = record.size() > after ||
                    (after - record.size() != 0 && after - record.size() < sizeof(RecordHeader));
  const uint64_t pad = wrap ? after : 0;
  // Wait for room: the consumer frees ring space as it takes records.
  const uint64_t need = pad + record.size();
  int spins = 0;
  uint64_t next_check = 0;
  while (producer.tail + need - ctl->head.load(std::memory_order_acquire) > ring) {
    if (ctl->dead.load()) return TakeError(stream);
    if (++spins > 1000) {
      // The ring is full: the daemon is behind. Yield the core to it, and
      // now and then make sure it is still there.
      const uint64_t now = MonotonicNanos();
      if (now >= next_check) {
        if (PeerGone(data_plane_fd)) {
          return absl::UnavailableError(
              absl::StrCat("tpud at ", options.socket_path, " went away"));
        }
        next_check = now + 50 * 1000 * 1000;
      }
      std::this_thread::yield();
    }
  }
  char* base = RingOf(shm, layout, stream);
  if (pad != 0) {
    RecordHeader h{static_cast<uint32_t>(pad), static_cast<uint16_t>(RecordKind::kPad), 0, 0};
    std::memcpy(base + pos, &h, sizeof(h));
    producer.tail += pad;
    pos = 0;
  }
  std::memcpy(base + pos, record.data(), record.size());
  producer.tail += record.size();
  RecordHeader h;
  std::memcpy(&h, record.data(), sizeof(h));
  ctl->submitted.store(h.sequence, std::memory_order_relaxed);
  ctl->tail.store(producer.tail);  // seq_cst: ordered before the sleeping check
  if (ctl->consumer_sleeping.load()) {
    ctl->doorbell.fetch_add(1);
    FutexWakeAll(&ctl->doorbell);
  }
  return absl::OkStatus();
}

absl::Status Session::Impl::WaitCompleted(int stream, uint64_t sequence) {
  StreamControl* ctl = Control(stream);
  const uint64_t spin_until = MonotonicNanos() + kSpinNanos;
  while (true) {
    if (ctl->completed.load(std::memory_order_acquire) >= sequence) return absl::OkStatus();
    if (ctl->dead.load()) return TakeError(stream);
    if (MonotonicNanos() >= spin_until) break;
    __builtin_ia32_pause();
  }
  while (true) {
    const uint32_t v = ctl->completion_futex.load();
    ctl->waiters.fetch_add(1);
    const bool done = ctl->completed.load() >= sequence || ctl->dead.load() != 0;
    if (!done) FutexWait(&ctl->completion_futex, v, 50 * 1000 * 1000);
    ctl->waiters.fetch_sub(1);
    if (ctl->completed.load(std::memory_order_acquire) >= sequence) return absl::OkStatus();
    if (ctl->dead.load()) return TakeError(stream);
    if (!done && PeerGone(data_plane_fd)) {
      return absl::UnavailableError(absl::StrCat(
          "tpud at ", options.socket_path, " went away while stream ", stream,
          " had unfinished work"));
    }
  }
}

absl::Status Session::Impl::TakeError(int stream) {
  StreamControl* ctl = Control(stream);
  const uint64_t seq = ctl->error_sequence.load(std::memory_order_acquire);
  if (seq == 0) {
    if (ctl->dead.load()) {
      return absl::UnavailableError(absl::StrCat(
          "stream ", stream, " of session ", id, " can make no more progress (the session "
          "failed or ended); open a new session"));
    }
    return absl::OkStatus();
  }
  char message[kErrorMessageBytes];
  std::memcpy(message, ctl->error_message, sizeof(message));
  message[sizeof(message) - 1] = '\0';
  const uint32_t code = ctl->error_code;
  const uint32_t count = ctl->error_count;
  // A dead stream keeps its error: every later call reports it.
  if (!ctl->dead.load()) {
    ctl->error_count = 0;
    ctl->error_sequence.store(0);
  }
  std::string text = message;
  if (count > 1) absl::StrAppend(&text, " (and ", count - 1, " later error(s) on this stream)");
  return absl::Status(static_cast<absl::StatusCode>(code == 0 ? 13 : code), text);
}

bool Session::Impl::PinnedOffset(const void* ptr, uint64_t bytes, uint64_t* offset) const {
  if (shm == nullptr) return false;
  const char* p = static_cast<const char*>(ptr);
  const char* begin = shm + layout.pinned_offset;
  const char* end = begin + layout.pinned_bytes;
  if (p < begin || p >= end || bytes > static_cast<uint64_t>(end - p)) return false;
  *offset = static_cast<uint64_t>(p - shm);
  return true;
}

// ---------------------------------------------------------------- Session

absl::StatusOr<uint64_t> Session::Impl::EnqueueOpLocked(int stream, internal::StreamProducer& p,
                                                       uint32_t op_id, uint32_t flags,
                                                       const OpArg* args, size_t num_args,
                                                       const TensorRef* outputs,
                                                       size_t num_outputs) {
  if (num_args > kMaxArgs || num_outputs > kMaxOutputs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "op with ", num_args, " arguments and ", num_outputs, " outputs (limits ", kMaxArgs,
        " and ", kMaxOutputs, ")"));
  }
  if (op_id >= p.defined.size() || !p.defined[op_id]) {
    std::string schema;
    {
      absl::MutexLock lock(&ops_mu);
      if (op_id >= op_schemas.size()) {
        return absl::InvalidArgumentError(absl::StrCat("op id ", op_id, " was never defined"));
      }
      schema = op_schemas[op_id];
    }
    p.writer.Begin(RecordKind::kDefineOp, p.next_sequence++);
    p.writer.U32(op_id);
    p.writer.U32(static_cast<uint32_t>(schema.size()));
    p.writer.Bytes(schema.data(), schema.size());
    if (absl::Status s = Publish(stream, p); !s.ok()) return s;
    if (op_id >= p.defined.size()) p.defined.resize(op_id + 1, false);
    p.defined[op_id] = true;
  }
  const uint64_t sequence = p.next_sequence++;
  p.writer.Begin(RecordKind::kOp, sequence);
  p.writer.U32(op_id);
  p.writer.U16(static_cast<uint16_t>(num_args));
  p.writer.U16(static_cast<uint16_t>(num_outputs));
  p.writer.U32(flags);
  for (size_t i = 0; i < num_args; ++i) p.writer.Arg(args[i]);
  for (size_t i = 0; i < num_outputs; ++i) p.writer.Tensor(outputs[i]);
  if (absl::Status s = Publish(stream, p); !s.ok()) return s;
  return sequence;
}

absl::StatusOr<uint64_t> Session::Impl::EnqueueCopyLocked(int stream,
                                                         internal::StreamProducer& p,
                                                         CopyKind kind, uint64_t src,
                                                         uint64_t dst, uint64_t bytes) {
  const uint64_t sequence = p.next_sequence++;
  p.writer.Begin(RecordKind::kCopy, sequence);
  p.writer.U8(static_cast<uint8_t>(kind));
  p.writer.Pad(7);
  p.writer.U64(src);
  p.writer.U64(dst);
  p.writer.U64(bytes);
  if (absl::Status s = Publish(stream, p); !s.ok()) return s;
  return sequence;
}

// ---------------------------------------------------------------- Session

absl::StatusOr<uint32_t> Session::DefineOp(absl::string_view schema) {
  if (schema.empty() || schema.size() > kMaxSchemaBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("operator schema of ", schema.size(), " bytes (1..", kMaxSchemaBytes, ")"));
  }
  absl::MutexLock lock(&impl_->ops_mu);
  auto [it, inserted] =
      impl_->op_ids.emplace(std::string(schema), static_cast<uint32_t>(impl_->op_schemas.size()));
  if (inserted) impl_->op_schemas.emplace_back(schema);
  return it->second;
}

absl::StatusOr<uint64_t> Session::EnqueueOp(int stream, uint32_t op_id, const OpArg* args,
                                            size_t num_args, const TensorRef* outputs,
                                            size_t num_outputs) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  return impl_->EnqueueOpLocked(stream, p, op_id, 0, args, num_args, outputs, num_outputs);
}

absl::StatusOr<std::vector<OpResult>> Session::RunSync(int stream, uint32_t op_id,
                                                       const OpArg* args, size_t num_args,
                                                       const TensorRef* outputs,
                                                       size_t num_outputs) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock sync_lock(&p.sync_mu);
  uint64_t sequence = 0;
  {
    absl::MutexLock lock(&p.mu);
    absl::StatusOr<uint64_t> seq = impl_->EnqueueOpLocked(stream, p, op_id, kOpFlagSync, args,
                                                          num_args, outputs, num_outputs);
    if (!seq.ok()) return seq.status();
    sequence = *seq;
  }
  if (absl::Status s = impl_->WaitCompleted(stream, sequence); !s.ok()) return s;
  StreamControl* ctl = impl_->Control(stream);
  if (ctl->response_sequence != sequence) {
    // The record never ran as an op (e.g. the op id was refused earlier):
    // its error is the stream's.
    absl::Status err = impl_->TakeError(stream);
    return err.ok() ? absl::InternalError("synchronous op produced no response") : err;
  }
  if (ctl->response_code != 0) {
    char message[kErrorMessageBytes];
    std::memcpy(message, ctl->response_message, sizeof(message));
    message[sizeof(message) - 1] = '\0';
    return absl::Status(static_cast<absl::StatusCode>(ctl->response_code), message);
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

absl::Status Session::CopyToDevice(int stream, uint64_t dst_address, const void* src,
                                   uint64_t bytes) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  internal::StreamProducer& p = impl_->streams[stream];
  uint64_t pinned = 0;
  absl::MutexLock lock(&p.mu);
  if (impl_->PinnedOffset(src, bytes, &pinned)) {
    return impl_->EnqueueCopyLocked(stream, p, CopyKind::kHostToDevice, pinned, dst_address, bytes)
        .status();
  }
  // Pageable: through this stream's staging slots, so our memcpy of one
  // chunk overlaps the daemon's copy of the previous one.
  const uint64_t slot_bytes = impl_->staging_slot_bytes;
  const uint64_t stream_base =
      impl_->layout.staging_offset + stream * (impl_->layout.staging_bytes / kMaxStreams);
  const char* from = static_cast<const char*>(src);
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t chunk = std::min(slot_bytes, bytes - done);
    const size_t slot = p.next_slot++ % p.slot_sequence.size();
    if (p.slot_sequence[slot] != 0) {
      if (absl::Status s = impl_->WaitCompleted(stream, p.slot_sequence[slot]); !s.ok()) return s;
    }
    const uint64_t offset = stream_base + slot * slot_bytes;
    std::memcpy(impl_->shm + offset, from + done, chunk);
    absl::StatusOr<uint64_t> seq = impl_->EnqueueCopyLocked(
        stream, p, CopyKind::kHostToDevice, offset, dst_address + done, chunk);
    if (!seq.ok()) return seq.status();
    p.slot_sequence[slot] = *seq;
    done += chunk;
  }
  return absl::OkStatus();
}

absl::Status Session::CopyToHost(int stream, void* dst, uint64_t src_address, uint64_t bytes) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  uint64_t pinned = 0;
  if (bytes == 0) return Synchronize(stream);
  if (impl_->PinnedOffset(dst, bytes, &pinned)) {
    uint64_t seq = 0;
    {
      absl::MutexLock lock(&p.mu);
      absl::StatusOr<uint64_t> s =
          impl_->EnqueueCopyLocked(stream, p, CopyKind::kDeviceToHost, src_address, pinned, bytes);
      if (!s.ok()) return s.status();
      seq = *s;
    }
    if (absl::Status s = impl_->WaitCompleted(stream, seq); !s.ok()) return s;
    return impl_->TakeError(stream);
  }
  // Pageable: keep every staging slot busy; copy each chunk out in order.
  absl::MutexLock lock(&p.mu);
  const uint64_t slot_bytes = impl_->staging_slot_bytes;
  const size_t slots = p.slot_sequence.size();
  const uint64_t stream_base =
      impl_->layout.staging_offset + stream * (impl_->layout.staging_bytes / kMaxStreams);
  const uint64_t chunks = (bytes + slot_bytes - 1) / slot_bytes;
  std::vector<uint64_t> seqs(chunks, 0);
  auto issue = [&](uint64_t c) -> absl::Status {
    const size_t slot = c % slots;
    if (p.slot_sequence[slot] != 0) {
      if (absl::Status s = impl_->WaitCompleted(stream, p.slot_sequence[slot]); !s.ok()) return s;
    }
    const uint64_t off = c * slot_bytes;
    absl::StatusOr<uint64_t> seq = impl_->EnqueueCopyLocked(
        stream, p, CopyKind::kDeviceToHost, src_address + off,
        stream_base + slot * slot_bytes, std::min(slot_bytes, bytes - off));
    if (!seq.ok()) return seq.status();
    seqs[c] = p.slot_sequence[slot] = *seq;
    return absl::OkStatus();
  };
  for (uint64_t c = 0; c < std::min<uint64_t>(chunks, slots); ++c) {
    if (absl::Status s = issue(c); !s.ok()) return s;
  }
  char* to = static_cast<char*>(dst);
  for (uint64_t c = 0; c < chunks; ++c) {
    if (absl::Status s = impl_->WaitCompleted(stream, seqs[c]); !s.ok()) return s;
    // A failed copy leaves the slot stale: report instead of handing it out.
    if (impl_->Control(stream)->error_sequence.load() != 0) return impl_->TakeError(stream);
    const uint64_t off = c * slot_bytes;
    std::memcpy(to + off, impl_->shm + stream_base + (c % slots) * slot_bytes,
                std::min(slot_bytes, bytes - off));
    if (c + slots < chunks) {
      if (absl::Status s = issue(c + slots); !s.ok()) return s;
    }
  }
  return impl_->TakeError(stream);
}

absl::Status Session::CopyOnDevice(int stream, uint64_t dst_address, uint64_t src_address,
                                   uint64_t bytes) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  return impl_->EnqueueCopyLocked(stream, p, CopyKind::kDeviceToDevice, src_address,
                                  dst_address, bytes)
      .status();
}

absl::StatusOr<void*> Session::AllocatePinned(uint64_t bytes) {
  if (impl_->shm == nullptr) return absl::FailedPreconditionError("session has no data plane");
  const uint64_t size = std::max<uint64_t>(kPinnedAlignment,
                                           (bytes + kPinnedAlignment - 1) & ~(kPinnedAlignment - 1));
  if (bytes == 0 || size < bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot allocate ", bytes, " bytes of pinned memory: ask for 1 byte up to the pool's ",
        FormatBytes(impl_->layout.pinned_bytes)));
  }
  absl::MutexLock lock(&impl_->pinned_mu);
  for (auto it = impl_->pinned_free.begin(); it != impl_->pinned_free.end(); ++it) {
    if (it->second < size) continue;
    const uint64_t offset = it->first;
    const uint64_t remaining = it->second - size;
    impl_->pinned_free.erase(it);
    if (remaining > 0) impl_->pinned_free[offset + size] = remaining;
    impl_->pinned_used[offset] = size;
    return static_cast<void*>(impl_->shm + offset);
  }
  uint64_t free_total = 0;
  for (const auto& [o, n] : impl_->pinned_free) free_total += n;
  return absl::ResourceExhaustedError(absl::StrCat(
      "pinned host pool exhausted: asked ", FormatBytes(bytes), ", free ",
      FormatBytes(free_total), " of ", FormatBytes(impl_->layout.pinned_bytes),
      "; open the session with a larger ClientOptions::pinned_pool_bytes"));
}

absl::Status Session::FreePinned(void* ptr) {
  if (impl_->shm == nullptr) return absl::FailedPreconditionError("session has no data plane");
  const uint64_t offset = static_cast<uint64_t>(static_cast<char*>(ptr) - impl_->shm);
  absl::MutexLock lock(&impl_->pinned_mu);
  auto it = impl_->pinned_used.find(offset);
  if (static_cast<char*>(ptr) < impl_->shm || it == impl_->pinned_used.end()) {
    return absl::InvalidArgumentError(
        "FreePinned of a pointer that AllocatePinned of this session did not return (or that "
        "was freed already)");
  }
  uint64_t begin = offset, size = it->second;
  impl_->pinned_used.erase(it);
  auto next = impl_->pinned_free.lower_bound(begin);
  if (next != impl_->pinned_free.end() && next->first == begin + size) {
    size += next->second;
    next = impl_->pinned_free.erase(next);
  }
  if (next != impl_->pinned_free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      size += prev->second;
      impl_->pinned_free.erase(prev);
    }
  }
  impl_->pinned_free[begin] = size;
  return absl::OkStatus();
}

bool Session::IsPinned(const void* ptr) const {
  uint64_t offset = 0;
  return impl_->PinnedOffset(ptr, 1, &offset);
}

absl::StatusOr<Event> Session::RecordEvent(int stream) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  uint32_t slot = 0;
  {
    absl::MutexLock lock(&impl_->events_mu);
    if (impl_->free_events.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", kMaxEvents, " events of this session are in use"));
    }
    slot = impl_->free_events.back();
    impl_->free_events.pop_back();
  }
  EventOf(impl_->shm, impl_->layout, slot)->completed_ns.store(0);
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  const uint64_t sequence = p.next_sequence++;
  p.writer.Begin(RecordKind::kEventRecord, sequence);
  p.writer.U32(slot);
  p.writer.Pad(4);
  if (absl::Status s = impl_->Publish(stream, p); !s.ok()) return s;
  return Event{slot, stream, sequence};
}

absl::Status Session::WaitEvent(int stream, const Event& event) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  if (absl::Status s = impl_->CheckStream(event.stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  absl::MutexLock lock(&p.mu);
  p.writer.Begin(RecordKind::kEventWait, p.next_sequence++);
  p.writer.U32(event.slot);
  p.writer.U32(static_cast<uint32_t>(event.stream));
  p.writer.U64(event.sequence);
  return impl_->Publish(stream, p);
}

bool Session::EventDone(const Event& event) {
  if (!impl_->CheckStream(event.stream).ok()) return false;
  return impl_->Control(event.stream)->completed.load() >= event.sequence;
}

absl::Status Session::SynchronizeEvent(const Event& event) {
  if (absl::Status s = impl_->CheckStream(event.stream); !s.ok()) return s;
  return impl_->WaitCompleted(event.stream, event.sequence);
}

absl::StatusOr<double> Session::ElapsedMillis(const Event& start, const Event& end) {
  if (!EventDone(start) || !EventDone(end)) {
    return absl::FailedPreconditionError(
        "elapsed time needs both events completed; SynchronizeEvent the later one first");
  }
  if (start.slot >= static_cast<uint32_t>(kMaxEvents) || end.slot >= static_cast<uint32_t>(kMaxEvents)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "event slot out of range (events of this session are 0..", kMaxEvents - 1, ")"));
  }
  const uint64_t a = EventOf(impl_->shm, impl_->layout, start.slot)->completed_ns.load();
  const uint64_t b = EventOf(impl_->shm, impl_->layout, end.slot)->completed_ns.load();
  return (static_cast<double>(b) - static_cast<double>(a)) / 1e6;
}

void Session::ReleaseEvent(const Event& event) {
  if (event.slot >= static_cast<uint32_t>(kMaxEvents)) return;
  absl::MutexLock lock(&impl_->events_mu);
  impl_->free_events.push_back(event.slot);
}

absl::Status Session::Synchronize(int stream) {
  if (absl::Status s = impl_->CheckStream(stream); !s.ok()) return s;
  internal::StreamProducer& p = impl_->streams[stream];
  uint64_t last = 0;
  {
    absl::MutexLock lock(&p.mu);
    last = p.next_sequence - 1;
  }
  if (absl::Status s = impl_->WaitCompleted(stream, last); !s.ok()) return s;
  return impl_->TakeError(stream);
}

absl::Status Session::WaitIdle() {
  if (impl_->shm == nullptr) return absl::OkStatus();
  for (int s = 0; s < kMaxStreams; ++s) {
    internal::StreamProducer& p = impl_->streams[s];
    uint64_t last = 0;
    {
      absl::MutexLock lock(&p.mu);
      last = p.next_sequence - 1;
    }
    if (last == 0) continue;
    absl::Status st = impl_->WaitCompleted(s, last);
    if (st.code() == absl::StatusCode::kUnavailable) return st;
  }
  return absl::OkStatus();
}

absl::Status Session::SynchronizeAll() {
  absl::Status first;
  for (int s = 0; s < kMaxStreams; ++s) {
    absl::Status st = Synchronize(s);
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

}  // namespace tpu
