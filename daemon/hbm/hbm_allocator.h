#ifndef TPUD_DAEMON_HBM_HBM_ALLOCATOR_H_
#define TPUD_DAEMON_HBM_HBM_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tpud {

// Segments are whole pages so that freed pages can be returned to the OS
// (and so come back zeroed when they are handed out again).
inline constexpr uint64_t kHbmGranularity = 4096;

// A contiguous range [offset, offset + size) of one chip's HBM.
struct HbmBlock {
  uint64_t offset = 0;
  uint64_t size = 0;   // rounded to the allocator's granularity
  uint64_t owner = 0;  // opaque to the allocator (e.g. a session id)
};

struct HbmAllocatorStats {
  uint64_t capacity_bytes = 0;  // capacity rounded down to granularity
  uint64_t used_bytes = 0;      // sum of allocated block sizes (rounded)
  uint64_t peak_used_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t largest_free_block = 0;
  uint64_t segment_count = 0;  // allocated blocks
  uint64_t free_block_count = 0;
};

// A pure offset allocator over [0, capacity) of one chip's HBM. It only does
// bookkeeping and never touches memory; the HbmArena holds the bytes.
//
// Placement is best fit (smallest free block that fits, lowest offset among
// equals), carving from the start of the chosen block; freed blocks coalesce
// with free neighbours, so the free list never holds two adjacent blocks.
// Every operation is O(log n) in the number of blocks.
//
// Thread-safety: not thread-safe. The caller serialises all calls, including
// const ones, e.g. under the chip's HBM mutex.
class HbmAllocator {
 public:
  // REQUIRES: granularity is a power of two.
  explicit HbmAllocator(uint64_t capacity,
                        uint64_t granularity = kHbmGranularity);

  HbmAllocator(const HbmAllocator&) = delete;
  HbmAllocator& operator=(const HbmAllocator&) = delete;

  // Rounds size up to a multiple of granularity. Returns 0 if the result would
  // not fit in uint64_t (and for size 0).
  // REQUIRES: granularity is a power of two.
  static uint64_t RoundUp(uint64_t size, uint64_t granularity);

  // Allocates size bytes (rounded up to the granularity) for owner. Returns
  // nullopt when no free block fits; the caller builds the OOM message from
  // stats(). A size of 0, or one whose rounding overflows or exceeds the
  // capacity, also yields nullopt.
  std::optional<HbmBlock> Allocate(uint64_t size, uint64_t owner);

  // Frees the allocated block that starts exactly at offset and returns it.
  // Returns NOT_FOUND (naming the offset in hex) if no block starts there.
  absl::StatusOr<HbmBlock> Free(uint64_t offset);

  // The allocated block starting at offset, or nullptr. The pointer stays
  // valid until that block is freed.
  const HbmBlock* Find(uint64_t offset) const;
  // The allocated block with offset in [start, start + size), or nullptr.
  const HbmBlock* FindContaining(uint64_t offset) const;

  std::vector<HbmBlock> AllocatedBlocks() const;  // sorted by offset
  std::vector<HbmBlock> FreeBlocks() const;       // sorted by offset (owner 0)

  HbmAllocatorStats stats() const;  // O(1)
  void ResetPeak();                 // peak := used

  uint64_t capacity() const { return capacity_; }
  uint64_t granularity() const { return granularity_; }

  // Verifies every invariant: blocks aligned, sorted, disjoint and together
  // tiling [0, capacity) exactly; no two adjacent free blocks; the size index
  // mirrors the free map; the counters match a recount. O(n); for tests.
  // Returns INTERNAL describing the first violation found.
  absl::Status CheckInvariants() const;

 private:
  void InsertFree(uint64_t offset, uint64_t size);
  // Returns the iterator after the erased entry.
  std::map<uint64_t, uint64_t>::iterator EraseFree(
      std::map<uint64_t, uint64_t>::iterator it);

  const uint64_t granularity_;
  const uint64_t capacity_;  // rounded down to granularity_

  std::map<uint64_t, uint64_t> free_by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset)
  std::map<uint64_t, HbmBlock> allocated_;                // offset -> block

  uint64_t used_bytes_ = 0;
  uint64_t peak_used_bytes_ = 0;
};

}  // namespace tpud

#endif  // TPUD_DAEMON_HBM_HBM_ALLOCATOR_H_
