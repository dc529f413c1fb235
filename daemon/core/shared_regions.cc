#include "daemon/core/shared_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tpu/op_error.h"
#include "tpu/shm_layout.h"

namespace tpud {

SharedMapping::~SharedMapping() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

SharedMapping::SharedMapping(SharedMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

SharedMapping& SharedMapping::operator=(SharedMapping&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    if (fd_ >= 0) close(fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void SharedMapping::CloseFd() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::StatusOr<SharedMapping> SharedMapping::Create(const std::string& name,
                                                    uint64_t bytes, bool seal) {
  int fd =
      memfd_create(name.c_str(), MFD_CLOEXEC | (seal ? MFD_ALLOW_SEALING : 0));
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create(", name, "): ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("sizing shared memory ", name, " to ", bytes,
                     " bytes: ", std::strerror(err)));
  }
  if (seal &&
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("sealing ", name, ": ", std::strerror(err)));
  }
  return Map(fd, bytes, /*writable=*/true);
}

absl::StatusOr<SharedMapping> SharedMapping::Map(int fd, uint64_t bytes,
                                                 bool writable) {
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory descriptor is smaller than the ", bytes,
                     " bytes expected"));
  }
  void* p = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                 MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        "mapping ", bytes, " bytes of shared memory: ", std::strerror(err)));
  }
  SharedMapping m;
  m.data_ = static_cast<char*>(p);
  m.size_ = bytes;
  m.fd_ = fd;
  return m;
}

// ----------------------------------------------------------------
// PageOwnerTable

namespace {
constexpr uint64_t Entry(uint32_t tag, uint64_t first_page) {
  return (static_cast<uint64_t>(tag) << 32) | static_cast<uint32_t>(first_page);
}
}  // namespace

uint64_t PageOwnerTable::BytesFor(uint64_t capacity) {
  const uint64_t pages = (capacity + kPageBytes - 1) / kPageBytes;
  const uint64_t bytes = pages * (sizeof(uint64_t) + sizeof(uint32_t));
  return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
}

PageOwnerTable::PageOwnerTable(char* memory, uint64_t capacity)
    : entries_(reinterpret_cast<std::atomic<uint64_t>*>(memory)),
      capacity_(capacity),
      num_pages_((capacity + kPageBytes - 1) / kPageBytes) {
  pages_ = reinterpret_cast<uint32_t*>(memory + num_pages_ * sizeof(uint64_t));
}

void PageOwnerTable::Assign(uint64_t offset, uint64_t bytes, uint32_t tag) {
  const uint64_t first = offset / kPageBytes;
  const uint64_t n = (bytes + kPageBytes - 1) / kPageBytes;
  // The length first: a reader that sees an entry (acquire) sees it too.
  pages_[first] = static_cast<uint32_t>(n);
  for (uint64_t p = first; p < first + n && p < num_pages_; ++p) {
    entries_[p].store(Entry(tag, first), std::memory_order_release);
  }
}

void PageOwnerTable::Clear(uint64_t offset, uint64_t bytes) {
  const uint64_t first = offset / kPageBytes;
  const uint64_t n = (bytes + kPageBytes - 1) / kPageBytes;
  for (uint64_t p = first; p < first + n && p < num_pages_; ++p) {
    entries_[p].store(0, std::memory_order_seq_cst);
  }
}

std::optional<PageOwnerTable::Segment> PageOwnerTable::Find(
    uint64_t offset, uint64_t bytes, uint32_t tag) const {
  if (tag == 0 || offset >= capacity_ || bytes > capacity_ - offset)
    return std::nullopt;
  const uint64_t first = offset / kPageBytes;
  const uint64_t last = (offset + (bytes == 0 ? 1 : bytes) - 1) / kPageBytes;
  const uint64_t e = entries_[first].load(std::memory_order_seq_cst);
  if (static_cast<uint32_t>(e >> 32) != tag) return std::nullopt;
  if (last != first && entries_[last].load(std::memory_order_seq_cst) != e)
    return std::nullopt;
  const uint64_t seg_first = static_cast<uint32_t>(e);
  return Segment{seg_first * kPageBytes,
                 static_cast<uint64_t>(pages_[seg_first]) * kPageBytes};
}

uint32_t PageOwnerTable::OwnerOf(uint64_t offset) const {
  if (entries_ == nullptr || offset >= capacity_) return 0;
  return static_cast<uint32_t>(
      entries_[offset / kPageBytes].load(std::memory_order_acquire) >> 32);
}

// ----------------------------------------------------------------
// SessionStateView

namespace {

uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

struct StateOffsets {
  uint64_t rings, chips, total;
};

StateOffsets OffsetsFor(int num_chips) {
  StateOffsets o;
  o.rings = RoundUp(sizeof(SessionStateHeader), 64);
  o.chips = RoundUp(
      o.rings + sizeof(TrustedRing) * num_chips * tpu::kStreamsPerChip, 64);
  o.total = RoundUp(o.chips + sizeof(SessionChipState) * num_chips, kPageBytes);
  return o;
}

}  // namespace

void RecordRingWarning(tpu::RingControl* ctl, uint64_t sequence,
                       absl::string_view message, bool deprecation) {
  if (ctl->warning_sequence.load() != 0) {
    ctl->warning_count += 1;
    return;
  }
  ctl->warning_count = 1;
  ctl->warning_deprecation = deprecation ? 1 : 0;
  const size_t n =
      std::min<size_t>(message.size(), tpu::kWarningMessageBytes - 1);
  std::memcpy(ctl->warning_message, message.data(), n);
  ctl->warning_message[n] = '\0';
  ctl->warning_sequence.store(sequence);
}

void RecordRingError(tpu::RingControl* ctl, uint64_t sequence,
                     const absl::Status& status) {
  ctl->error_count += 1;
  if (ctl->error_sequence.load() != 0) return;  // the first error sticks
  ctl->error_code = static_cast<uint32_t>(status.code());
  ctl->error_kind = static_cast<uint32_t>(tpu::AtenErrorOf(status));
  const absl::string_view msg = status.message();
  const size_t n = std::min<size_t>(msg.size(), tpu::kErrorMessageBytes - 1);
  std::memcpy(ctl->error_message, msg.data(), n);
  ctl->error_message[n] = '\0';
  ctl->error_sequence.store(sequence);
}

void KillRing(tpu::RingControl* ctl, const absl::Status& status) {
  if (ctl->dead.load() == 0) {
    ctl->error_sequence.store(0);
    RecordRingError(ctl, ctl->completed.load() + 1, status);
    ctl->dead.store(1);
  }
  ctl->completion_futex.fetch_add(1);
  tpu::FutexWakeAll(&ctl->completion_futex);
  ctl->head_futex.fetch_add(1);
  tpu::FutexWakeAll(&ctl->head_futex);
}

uint64_t SessionStateView::BytesFor(int num_chips) {
  return OffsetsFor(num_chips).total;
}

void SessionStateView::Initialize(char* base, uint64_t session_id, uint32_t tag,
                                  int num_chips) {
  const StateOffsets o = OffsetsFor(num_chips);
  auto* h = new (base) SessionStateHeader();
  h->magic = kSessionStateMagic;
  h->session_id = session_id;
  h->tag = tag;
  h->num_chips = static_cast<uint32_t>(num_chips);
  h->num_rings = static_cast<uint32_t>(num_chips * tpu::kStreamsPerChip);
  h->rings_offset = o.rings;
  h->chips_offset = o.chips;
  // The rest of a fresh memfd reads as zeros: every ring at 0, no ops, no
  // poison.
}

void SetCompileWhy(ProgramStat* stat, absl::string_view why) {
  char bytes[sizeof(stat->why)] = {};
  std::memcpy(bytes, why.data(), std::min(why.size(), sizeof(bytes) - 1));
  stat->why_seq.fetch_add(1, std::memory_order_acq_rel);
  for (size_t w = 0; w < std::size(stat->why); ++w) {
    uint64_t word;
    std::memcpy(&word, bytes + w * sizeof(word), sizeof(word));
    stat->why[w].store(word, std::memory_order_relaxed);
  }
  stat->why_seq.fetch_add(1, std::memory_order_release);
}

std::string CompileWhy(const ProgramStat& stat) {
  const uint32_t before = stat.why_seq.load(std::memory_order_acquire);
  if (before % 2 != 0) return {};
  char bytes[sizeof(stat.why)];
  for (size_t w = 0; w < std::size(stat.why); ++w) {
    const uint64_t word = stat.why[w].load(std::memory_order_relaxed);
    std::memcpy(bytes + w * sizeof(word), &word, sizeof(word));
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  if (stat.why_seq.load(std::memory_order_relaxed) != before) return {};
  return std::string(bytes, strnlen(bytes, sizeof(bytes)));
}

}  // namespace tpud
