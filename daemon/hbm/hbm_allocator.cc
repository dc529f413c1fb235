#include "daemon/hbm/hbm_allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tpud {
namespace {

bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

// A wrong granularity is a programming error, never input: fail loudly rather
// than hand out misaligned segments.
uint64_t CheckedGranularity(uint64_t granularity) {
  if (!IsPowerOfTwo(granularity)) {
    std::fprintf(stderr,
                 "HbmAllocator: granularity %llu is not a power of two\n",
                 static_cast<unsigned long long>(granularity));
    std::abort();
  }
  return granularity;
}

std::string Range(uint64_t offset, uint64_t size) {
  return absl::StrFormat("[0x%x, 0x%x)", offset, offset + size);
}

}  // namespace

HbmAllocator::HbmAllocator(uint64_t capacity, uint64_t granularity)
    : granularity_(CheckedGranularity(granularity)),
      capacity_(capacity & ~(granularity - 1)) {
  if (capacity_ > 0) InsertFree(0, capacity_);
}

uint64_t HbmAllocator::RoundUp(uint64_t size, uint64_t granularity) {
  const uint64_t mask = granularity - 1;
  if (size > std::numeric_limits<uint64_t>::max() - mask) return 0;
  return (size + mask) & ~mask;
}

void HbmAllocator::InsertFree(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

std::map<uint64_t, uint64_t>::iterator HbmAllocator::EraseFree(
    std::map<uint64_t, uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  return free_by_offset_.erase(it);
}

std::optional<HbmBlock> HbmAllocator::Allocate(uint64_t size, uint64_t owner) {
  if (size == 0) return std::nullopt;
  const uint64_t rounded = RoundUp(size, granularity_);
  if (rounded == 0 || rounded > capacity_) return std::nullopt;

  // (size, offset) ordering makes the first entry not below (rounded, 0) the
  // smallest fitting block, and the lowest-offset one among equal sizes.
  auto fit = free_by_size_.lower_bound({rounded, 0});
  if (fit == free_by_size_.end()) return std::nullopt;
  const uint64_t hole_size = fit->first;
  const uint64_t hole_offset = fit->second;

  free_by_size_.erase(fit);
  free_by_offset_.erase(hole_offset);
  if (hole_size > rounded) {
    InsertFree(hole_offset + rounded, hole_size - rounded);
  }

  HbmBlock block{hole_offset, rounded, owner};
  allocated_.emplace(hole_offset, block);
  used_bytes_ += rounded;
  peak_used_bytes_ = std::max(peak_used_bytes_, used_bytes_);
  return block;
}

absl::StatusOr<HbmBlock> HbmAllocator::Free(uint64_t offset) {
  auto it = allocated_.find(offset);
  if (it == allocated_.end()) {
    std::string msg =
        absl::StrFormat("no allocated HBM block starts at offset 0x%x", offset);
    // Freeing an interior pointer is a common client bug; say which block.
    if (const HbmBlock* inner = FindContaining(offset)) {
      absl::StrAppend(&msg, "; it lies inside block ",
                      Range(inner->offset, inner->size),
                      ", free that block's start instead");
    }
    return absl::NotFoundError(msg);
  }
  const HbmBlock block = it->second;
  allocated_.erase(it);
  used_bytes_ -= block.size;

  uint64_t start = block.offset;
  uint64_t end = block.offset + block.size;
  auto next = free_by_offset_.lower_bound(end);
  if (next != free_by_offset_.end() && next->first == end) {
    end += next->second;
    next = EraseFree(next);
  }
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      EraseFree(prev);
    }
  }
  InsertFree(start, end - start);
  return block;
}

const HbmBlock* HbmAllocator::Find(uint64_t offset) const {
  auto it = allocated_.find(offset);
  return it == allocated_.end() ? nullptr : &it->second;
}

const HbmBlock* HbmAllocator::FindContaining(uint64_t offset) const {
  auto it = allocated_.upper_bound(offset);
  if (it == allocated_.begin()) return nullptr;
  --it;
  const HbmBlock& b = it->second;
  return offset - b.offset < b.size ? &b : nullptr;
}

std::vector<HbmBlock> HbmAllocator::AllocatedBlocks() const {
  std::vector<HbmBlock> out;
  out.reserve(allocated_.size());
  for (const auto& [offset, block] : allocated_) out.push_back(block);
  return out;
}

std::vector<HbmBlock> HbmAllocator::FreeBlocks() const {
  std::vector<HbmBlock> out;
  out.reserve(free_by_offset_.size());
  for (const auto& [offset, size] : free_by_offset_) {
    out.push_back(HbmBlock{offset, size, 0});
  }
  return out;
}

HbmAllocatorStats HbmAllocator::stats() const {
  HbmAllocatorStats s;
  s.capacity_bytes = capacity_;
  s.used_bytes = used_bytes_;
  s.peak_used_bytes = peak_used_bytes_;
  s.free_bytes = capacity_ - used_bytes_;
  s.largest_free_block =
      free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  s.segment_count = allocated_.size();
  s.free_block_count = free_by_offset_.size();
  return s;
}

void HbmAllocator::ResetPeak() { peak_used_bytes_ = used_bytes_; }

absl::Status HbmAllocator::CheckInvariants() const {
  auto fail = [](auto&&... parts) {
    return absl::InternalError(
        absl::StrCat("HbmAllocator invariant violated: ", parts...));
  };

  // Walk both maps in offset order; each block must start where the last
  // ended, so together they tile [0, capacity) with no gaps or overlaps.
  uint64_t cursor = 0;
  bool prev_free = false;
  uint64_t used = 0;
  uint64_t free_total = 0;
  uint64_t largest = 0;
  auto a = allocated_.begin();
  auto f = free_by_offset_.begin();
  while (a != allocated_.end() || f != free_by_offset_.end()) {
    const bool take_free = a == allocated_.end() ||
                           (f != free_by_offset_.end() && f->first < a->first);
    uint64_t offset, size;
    if (take_free) {
      offset = f->first;
      size = f->second;
      ++f;
    } else {
      if (a->second.offset != a->first) {
        return fail("allocated block keyed at ", absl::Hex(a->first),
                    " records offset ", absl::Hex(a->second.offset));
      }
      offset = a->first;
      size = a->second.size;
      ++a;
    }
    const char* kind = take_free ? "free" : "allocated";
    if (offset != cursor) {
      return fail(kind, " block ", Range(offset, size),
                  offset < cursor ? " overlaps the previous block ending at "
                                  : " leaves a gap after ",
                  absl::Hex(cursor));
    }
    if (size == 0 || size % granularity_ != 0 || offset % granularity_ != 0) {
      return fail(kind, " block ", Range(offset, size),
                  " is empty or not aligned to ", granularity_);
    }
    if (size > capacity_ - offset) {
      return fail(kind, " block ", Range(offset, size), " runs past capacity ",
                  absl::Hex(capacity_));
    }
    if (take_free && prev_free) {
      return fail("free block ", Range(offset, size),
                  " was not coalesced with the free block before it");
    }
    if (take_free) {
      free_total += size;
      largest = std::max(largest, size);
      if (free_by_size_.count({size, offset}) == 0) {
        return fail("free block ", Range(offset, size),
                    " is missing from the size index");
      }
    } else {
      used += size;
    }
    prev_free = take_free;
    cursor = offset + size;
  }
  if (cursor != capacity_) {
    return fail("blocks end at ", absl::Hex(cursor), ", capacity is ",
                absl::Hex(capacity_));
  }
  if (free_by_size_.size() != free_by_offset_.size()) {
    return fail("size index holds ", free_by_size_.size(),
                " entries, free map holds ", free_by_offset_.size());
  }
  if (used != used_bytes_) {
    return fail("used_bytes is ", used_bytes_, ", recount gives ", used);
  }
  if (used + free_total != capacity_) {
    return fail("used ", used, " + free ", free_total, " != capacity ",
                capacity_);
  }
  if (peak_used_bytes_ < used_bytes_) {
    return fail("peak ", peak_used_bytes_, " is below used ", used_bytes_);
  }
  if (stats().largest_free_block != largest) {
    return fail("largest free block is ", stats().largest_free_block,
                ", recount gives ", largest);
  }
  return absl::OkStatus();
}

}  // namespace tpud
