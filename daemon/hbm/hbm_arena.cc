#include "daemon/hbm/hbm_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <iterator>
#include <string>
#include <system_error>

#include "absl/strings/str_format.h"

namespace tpud {
namespace {

// "512 B", "1.50 KiB", "32.00 GiB": for messages a person reads.
std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB",
                                           "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrFormat("%d B", bytes);
  double value = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (value >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

// std::error_code gives the errno text without strerror's shared buffer.
std::string ErrnoText(int err) {
  return absl::StrFormat(
      "%s (errno %d)", std::error_code(err, std::generic_category()).message(),
      err);
}

uint64_t PageSize() {
  static const uint64_t page_size =
      static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page_size;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HbmArena>> HbmArena::Create(int chip,
                                                           uint64_t capacity) {
  if (capacity == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "HBM arena for chip %d: capacity must be positive", chip));
  }
  const std::string name = absl::StrFormat("tpud-hbm-chip-%d", chip);
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(capacity)) != 0) {
    const int err = errno;
    if (fd >= 0) close(fd);
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot create the %s memory file for the HBM of chip "
                        "%d: %s; run with a "
                        "smaller --hbm_bytes",
                        HumanBytes(capacity), chip, ErrnoText(err)));
  }
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_NORESERVE, fd, 0);
  const int map_err = errno;
  close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cannot reserve %s of address space for the HBM of chip %d: mmap "
        "failed: %s; run with a smaller --hbm_bytes",
        HumanBytes(capacity), chip, ErrnoText(map_err)));
  }
  return std::unique_ptr<HbmArena>(
      new HbmArena(chip, capacity, static_cast<char*>(p)));
}

HbmArena::HbmArena(int chip, uint64_t capacity, char* base)
    : chip_(chip), capacity_(capacity), base_(base) {}

HbmArena::~HbmArena() { munmap(base_, capacity_); }

absl::Status HbmArena::Release(uint64_t offset, uint64_t size) {
  const uint64_t page = PageSize();
  if (offset % page != 0 || size % page != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "HBM release on chip %d: offset 0x%x and size 0x%x must be multiples "
        "of the page size (%d bytes)",
        chip_, offset, size, page));
  }
  if (offset > capacity_ || size > capacity_ - offset) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "HBM release on chip %d: range [0x%x, +0x%x) lies outside the %s "
        "arena",
        chip_, offset, size, HumanBytes(capacity_)));
  }
  if (size == 0) return absl::OkStatus();
  // MADV_REMOVE punches the pages out of the memory file, for every process
  // that maps it: they are freed at once and later reads see zero pages,
  // exactly "freed HBM reads as zeros".
  if (madvise(base_ + offset, size, MADV_REMOVE) != 0) {
    const int err = errno;
    return absl::InternalError(absl::StrFormat(
        "HBM release on chip %d of [0x%x, +0x%x): madvise failed: %s", chip_,
        offset, size, ErrnoText(err)));
  }
  return absl::OkStatus();
}

}  // namespace tpud
