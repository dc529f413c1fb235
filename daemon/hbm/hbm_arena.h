#ifndef TPUD_DAEMON_HBM_HBM_ARENA_H_
#define TPUD_DAEMON_HBM_HBM_ARENA_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tpud {

// One chip's HBM in the simulated host: a shared mapping of a memfd of
// capacity bytes, so that tpud's executor processes (forked after it exists)
// see the same memory, and HBM outlives any of them. Nothing is committed
// until touched (a sparse file, mapped MAP_NORESERVE), so a host with little
// RAM can still simulate chips with large HBM as long as clients do not fill
// it. Freed ranges go back to the OS via Release() (their pages are punched
// out of the file), so memory use follows what is in use. Offsets handed out
// by HbmAllocator index into base().
//
// Thread-safety: not thread-safe. Create and the destructor need no locking;
// the caller serialises Release() with the allocator that decides what is
// free. Reads and writes through base() are the caller's business.
class HbmArena {
 public:
  // Reserves capacity bytes of address space for chip. Returns
  // INVALID_ARGUMENT for capacity 0 and RESOURCE_EXHAUSTED (naming the chip,
  // the size and the OS error, and suggesting --hbm_bytes) if the mapping
  // cannot be made.
  static absl::StatusOr<std::unique_ptr<HbmArena>> Create(int chip,
                                                          uint64_t capacity);

  HbmArena(const HbmArena&) = delete;
  HbmArena& operator=(const HbmArena&) = delete;
  ~HbmArena();  // unmaps the arena; pointers into it become invalid

  int chip() const { return chip_; }
  uint64_t capacity() const { return capacity_; }
  char* base() const { return base_; }

  // Returns the pages of [offset, offset + size) to the OS; afterwards the
  // range reads as zeros and no longer counts towards the daemon's RSS.
  // REQUIRES: offset and size are multiples of the OS page size and the range
  // lies inside the arena; otherwise returns INVALID_ARGUMENT. size 0 is a
  // no-op.
  absl::Status Release(uint64_t offset, uint64_t size);

 private:
  HbmArena(int chip, uint64_t capacity, char* base);

  const int chip_;
  const uint64_t capacity_;
  char* const base_;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_HBM_HBM_ARENA_H_
