#include "daemon/hbm/hbm_allocator.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

constexpr uint64_t kPage = kHbmGranularity;
constexpr uint64_t kMiB = uint64_t{1} << 20;

// Allocates or fails the test; keeps the tests below short.
HbmBlock MustAllocate(HbmAllocator& a, uint64_t size, uint64_t owner = 1) {
  std::optional<HbmBlock> b = a.Allocate(size, owner);
  REQUIRE(b.has_value());
  return *b;
}

void MustFree(HbmAllocator& a, uint64_t offset) {
  absl::StatusOr<HbmBlock> freed = a.Free(offset);
  REQUIRE(freed.ok());
}

bool Same(const HbmBlock& x, const HbmBlock& y) {
  return x.offset == y.offset && x.size == y.size && x.owner == y.owner;
}

TEST_CASE("RoundUp rounds to the granularity and is overflow-safe") {
  CHECK(HbmAllocator::RoundUp(0, kPage) == 0);
  CHECK(HbmAllocator::RoundUp(1, kPage) == kPage);
  CHECK(HbmAllocator::RoundUp(kPage, kPage) == kPage);
  CHECK(HbmAllocator::RoundUp(kPage + 1, kPage) == 2 * kPage);
  CHECK(HbmAllocator::RoundUp(100, 64) == 128);
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  CHECK(HbmAllocator::RoundUp(kMax - (kPage - 1), kPage) == kMax - (kPage - 1));
  CHECK(HbmAllocator::RoundUp(kMax - (kPage - 2), kPage) == 0);
  CHECK(HbmAllocator::RoundUp(kMax, kPage) == 0);
}

TEST_CASE("capacity is rounded down and allocations are page-aligned") {
  HbmAllocator a(10 * kPage + 123);
  CHECK(a.stats().capacity_bytes == 10 * kPage);
  CHECK(a.stats().free_bytes == 10 * kPage);
  CHECK(a.stats().free_block_count == 1);

  HbmBlock b1 = MustAllocate(a, 1, 7);
  CHECK(b1.offset == 0);
  CHECK(b1.size == kPage);
  CHECK(b1.owner == 7);
  HbmBlock b2 = MustAllocate(a, kPage + 1);
  CHECK(b2.offset == kPage);
  CHECK(b2.size == 2 * kPage);
  HbmBlock b3 = MustAllocate(a, 3 * kPage);
  CHECK(b3.offset == 3 * kPage);
  CHECK(b3.size == 3 * kPage);
  CHECK(a.stats().used_bytes == 6 * kPage);
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("a smaller granularity is honoured") {
  HbmAllocator a(1000, 64);
  CHECK(a.stats().capacity_bytes == 960);
  HbmBlock b = MustAllocate(a, 65);
  CHECK(b.size == 128);
  CHECK(MustAllocate(a, 1).offset == 128);
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("a capacity below one granule holds nothing") {
  HbmAllocator a(kPage - 1);
  CHECK(a.stats().capacity_bytes == 0);
  CHECK(a.stats().free_block_count == 0);
  CHECK_FALSE(a.Allocate(1, 1).has_value());
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("best fit picks the smallest hole that fits") {
  HbmAllocator a(64 * kPage);
  // Layout: [A:4][x:1][C:2][x:1][E:8][x:1][tail...]
  HbmBlock A = MustAllocate(a, 4 * kPage);
  MustAllocate(a, kPage);
  HbmBlock C = MustAllocate(a, 2 * kPage);
  MustAllocate(a, kPage);
  HbmBlock E = MustAllocate(a, 8 * kPage);
  MustAllocate(a, kPage);
  MustFree(a, E.offset);
  MustFree(a, A.offset);
  MustFree(a, C.offset);
  REQUIRE(a.CheckInvariants().ok());

  SECTION("exact fit goes to the 2-page hole, not the first or largest") {
    CHECK(MustAllocate(a, 2 * kPage).offset == C.offset);
  }
  SECTION("3 pages go to the 4-page hole, carved from its start") {
    HbmBlock b = MustAllocate(a, 3 * kPage);
    CHECK(b.offset == A.offset);
    // The remainder of the hole stays free right after the new block.
    CHECK(a.FreeBlocks().front().offset == A.offset + 3 * kPage);
    CHECK(a.FreeBlocks().front().size == kPage);
  }
  SECTION("5 pages go to the 8-page hole, not the larger tail") {
    CHECK(MustAllocate(a, 5 * kPage).offset == E.offset);
  }
  SECTION("more than any hole goes to the tail") {
    CHECK(MustAllocate(a, 9 * kPage).offset == E.offset + 9 * kPage);
  }
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("among equal holes the lowest offset wins") {
  HbmAllocator a(32 * kPage);
  HbmBlock low = MustAllocate(a, 2 * kPage);
  MustAllocate(a, kPage);
  HbmBlock high = MustAllocate(a, 2 * kPage);
  MustAllocate(a, kPage);
  MustAllocate(a, 26 * kPage);  // fill the rest so only the holes remain
  // Free the high hole last and first: order of freeing must not matter.
  MustFree(a, high.offset);
  MustFree(a, low.offset);
  CHECK(MustAllocate(a, kPage).offset == low.offset);
  CHECK(MustAllocate(a, 2 * kPage).offset == high.offset);
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("freeing coalesces with free neighbours") {
  HbmAllocator a(16 * kPage);
  HbmBlock b0 = MustAllocate(a, kPage);
  HbmBlock b1 = MustAllocate(a, kPage);
  HbmBlock b2 = MustAllocate(a, kPage);
  HbmBlock b3 = MustAllocate(a, kPage);
  MustAllocate(a, 12 * kPage);  // no free tail
  REQUIRE(a.stats().free_block_count == 0);

  SECTION("left neighbour") {
    MustFree(a, b0.offset);
    MustFree(a, b1.offset);
    std::vector<HbmBlock> free = a.FreeBlocks();
    REQUIRE(free.size() == 1);
    CHECK(free[0].offset == 0);
    CHECK(free[0].size == 2 * kPage);
  }
  SECTION("right neighbour") {
    MustFree(a, b2.offset);
    MustFree(a, b1.offset);
    std::vector<HbmBlock> free = a.FreeBlocks();
    REQUIRE(free.size() == 1);
    CHECK(free[0].offset == b1.offset);
    CHECK(free[0].size == 2 * kPage);
  }
  SECTION("both neighbours") {
    MustFree(a, b0.offset);
    MustFree(a, b2.offset);
    CHECK(a.stats().free_block_count == 2);
    MustFree(a, b1.offset);
    std::vector<HbmBlock> free = a.FreeBlocks();
    REQUIRE(free.size() == 1);
    CHECK(free[0].offset == 0);
    CHECK(free[0].size == 3 * kPage);
    CHECK(a.stats().largest_free_block == 3 * kPage);
  }
  SECTION("no free neighbour") {
    MustFree(a, b1.offset);
    MustFree(a, b3.offset);
    CHECK(a.stats().free_block_count == 2);
  }
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("freeing everything restores one block") {
  HbmAllocator a(8 * kPage);
  std::vector<HbmBlock> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(MustAllocate(a, kPage));
  CHECK_FALSE(a.Allocate(1, 1).has_value());  // full
  for (int i : {3, 0, 7, 5, 1, 6, 2, 4}) MustFree(a, blocks[i].offset);
  std::vector<HbmBlock> free = a.FreeBlocks();
  REQUIRE(free.size() == 1);
  CHECK(free[0].offset == 0);
  CHECK(free[0].size == 8 * kPage);
  CHECK(a.AllocatedBlocks().empty());
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("Free of an offset that starts no block is NOT_FOUND") {
  HbmAllocator a(16 * kPage);
  HbmBlock b = MustAllocate(a, 4 * kPage, 9);
  const HbmAllocatorStats before = a.stats();

  SECTION("unknown offset") {
    absl::StatusOr<HbmBlock> r = a.Free(0xabc000);
    REQUIRE(absl::IsNotFound(r.status()));
    CHECK(r.status().message().find("0xabc000") != std::string::npos);
  }
  SECTION("offset in the middle of a block") {
    absl::StatusOr<HbmBlock> r = a.Free(b.offset + kPage);
    REQUIRE(absl::IsNotFound(r.status()));
    CHECK(r.status().message().find("0x1000") != std::string::npos);
    REQUIRE(a.Find(b.offset) != nullptr);  // the block is untouched
  }
  SECTION("offset of a free block") {
    REQUIRE(absl::IsNotFound(a.Free(b.offset + b.size).status()));
  }
  CHECK(a.stats().used_bytes == before.used_bytes);
  CHECK(a.stats().free_block_count == before.free_block_count);
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("Free returns the block with its owner; a double free is NOT_FOUND") {
  HbmAllocator a(16 * kPage);
  HbmBlock b = MustAllocate(a, 4 * kPage, 9);
  absl::StatusOr<HbmBlock> r = a.Free(b.offset);
  REQUIRE(r.ok());
  CHECK(Same(*r, b));
  REQUIRE(absl::IsNotFound(a.Free(b.offset).status()));
  CHECK(a.stats().used_bytes == 0);
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("zero, overflowing and oversized requests fail without effect") {
  HbmAllocator a(16 * kPage);
  CHECK_FALSE(a.Allocate(0, 1).has_value());
  CHECK_FALSE(a.Allocate(std::numeric_limits<uint64_t>::max(), 1).has_value());
  CHECK_FALSE(a.Allocate(16 * kPage + 1, 1).has_value());
  CHECK(a.stats().used_bytes == 0);
  CHECK(a.stats().peak_used_bytes == 0);
  CHECK(MustAllocate(a, 16 * kPage).size == 16 * kPage);  // exactly capacity
  CHECK_FALSE(a.Allocate(1, 1).has_value());
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("fragmented free space does not satisfy a larger request") {
  HbmAllocator a(8 * kPage);
  std::vector<HbmBlock> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(MustAllocate(a, kPage));
  for (int i = 0; i < 8; i += 2) MustFree(a, blocks[i].offset);
  CHECK(a.stats().free_bytes == 4 * kPage);
  CHECK(a.stats().largest_free_block == kPage);
  CHECK_FALSE(a.Allocate(2 * kPage, 1).has_value());
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("stats track used, peak and counts; ResetPeak") {
  HbmAllocator a(32 * kPage);
  HbmBlock b1 = MustAllocate(a, 4 * kPage);
  HbmBlock b2 = MustAllocate(a, 8 * kPage - 100);  // rounds to 8 pages
  HbmAllocatorStats s = a.stats();
  CHECK(s.capacity_bytes == 32 * kPage);
  CHECK(s.used_bytes == 12 * kPage);
  CHECK(s.peak_used_bytes == 12 * kPage);
  CHECK(s.free_bytes == 20 * kPage);
  CHECK(s.largest_free_block == 20 * kPage);
  CHECK(s.segment_count == 2);
  CHECK(s.free_block_count == 1);

  MustFree(a, b2.offset);
  s = a.stats();
  CHECK(s.used_bytes == 4 * kPage);
  CHECK(s.peak_used_bytes == 12 * kPage);
  CHECK(s.segment_count == 1);

  a.ResetPeak();
  CHECK(a.stats().peak_used_bytes == 4 * kPage);
  MustAllocate(a, kPage);
  CHECK(a.stats().peak_used_bytes == 5 * kPage);
  MustFree(a, b1.offset);
  CHECK(a.stats().peak_used_bytes == 5 * kPage);
  CHECK(a.stats().free_block_count == 2);  // [0,4) and the tail
  REQUIRE(a.CheckInvariants().ok());
}

TEST_CASE("Find and FindContaining") {
  HbmAllocator a(16 * kPage);
  MustAllocate(a, kPage, 1);
  HbmBlock b = MustAllocate(a, 3 * kPage, 2);
  MustAllocate(a, kPage, 3);
  MustFree(a, 0);

  REQUIRE(a.Find(b.offset) != nullptr);
  CHECK(Same(*a.Find(b.offset), b));
  CHECK(a.Find(b.offset + 1) == nullptr);
  CHECK(a.Find(0) == nullptr);  // freed

  CHECK(a.FindContaining(0) == nullptr);
  CHECK(a.FindContaining(kPage - 1) == nullptr);
  for (uint64_t off :
       {b.offset, b.offset + 1, b.offset + kPage + 17, b.offset + b.size - 1}) {
    const HbmBlock* c = a.FindContaining(off);
    REQUIRE(c != nullptr);
    CHECK(Same(*c, b));
  }
  const HbmBlock* next = a.FindContaining(b.offset + b.size);
  REQUIRE(next != nullptr);
  CHECK(next->owner == 3);
  CHECK(a.FindContaining(b.offset + b.size + kPage) == nullptr);  // free tail
  CHECK(a.FindContaining(std::numeric_limits<uint64_t>::max()) == nullptr);
}

TEST_CASE("AllocatedBlocks and FreeBlocks are sorted by offset") {
  HbmAllocator a(64 * kPage);
  std::vector<HbmBlock> blocks;
  for (int i = 1; i <= 6; ++i) blocks.push_back(MustAllocate(a, i * kPage, i));
  MustFree(a, blocks[1].offset);
  MustFree(a, blocks[4].offset);
  std::vector<HbmBlock> alloc = a.AllocatedBlocks();
  REQUIRE(alloc.size() == 4);
  for (size_t i = 1; i < alloc.size(); ++i) {
    CHECK(alloc[i - 1].offset < alloc[i].offset);
  }
  CHECK(alloc[2].owner == 4);
  std::vector<HbmBlock> free = a.FreeBlocks();
  REQUIRE(free.size() == 3);
  CHECK(free[0].offset == blocks[1].offset);
  CHECK(free[1].offset == blocks[4].offset);
  CHECK(free[2].offset == blocks[5].offset + blocks[5].size);
}

// Random allocate/free traffic checked against a shadow model of the live
// blocks. Catches bookkeeping slips that the hand-written cases miss.
TEST_CASE("property: random allocate/free keeps every invariant") {
  constexpr uint64_t kCapacity = 384 * kMiB;
  constexpr int kOps = 200000;
  constexpr int kFullCheckEvery = 1000;

  const auto start = std::chrono::steady_clock::now();
  HbmAllocator a(kCapacity);
  std::mt19937_64 rng(0x7075d0a11c);
  std::map<uint64_t, HbmBlock> live;   // shadow model: offset -> block
  std::vector<uint64_t> live_offsets;  // for O(1) random picks
  uint64_t live_bytes = 0;
  uint64_t next_owner = 1;
  int allocs = 0, frees = 0, ooms = 0;

  auto random_size = [&rng]() -> uint64_t {
    const uint64_t pick = rng() % 100;
    if (pick < 60) return 1 + rng() % (64 * 1024);         // small, unaligned
    if (pick < 90) return 1 + rng() % (2 * kMiB);          // medium
    if (pick < 99) return (1 + rng() % 32) * kMiB;         // large, aligned
    return kPage * (1 + rng() % (kCapacity / kPage / 2));  // huge
  };

  for (int op = 0; op < kOps; ++op) {
    // Lean towards allocating when little is live so the heap stays busy.
    const bool do_alloc =
        live_offsets.empty() ||
        rng() % 100 < (live_bytes < kCapacity / 2 ? 60u : 45u);
    if (do_alloc) {
      const uint64_t size = random_size();
      const uint64_t rounded = HbmAllocator::RoundUp(size, kPage);
      const uint64_t largest_before = a.stats().largest_free_block;
      std::optional<HbmBlock> b = a.Allocate(size, next_owner);
      if (!b.has_value()) {
        // Failure is only allowed when no hole is big enough.
        REQUIRE(largest_before < rounded);
        ++ooms;
      } else {
        REQUIRE(b->size == rounded);
        REQUIRE(b->owner == next_owner);
        REQUIRE(b->offset % kPage == 0);
        REQUIRE(b->offset + b->size <= kCapacity);
        // No overlap with the live neighbours in the model.
        auto next = live.lower_bound(b->offset);
        if (next != live.end()) REQUIRE(b->offset + b->size <= next->first);
        if (next != live.begin()) {
          auto prev = std::prev(next);
          REQUIRE(prev->first + prev->second.size <= b->offset);
        }
        live.emplace(b->offset, *b);
        live_offsets.push_back(b->offset);
        live_bytes += rounded;
        ++next_owner;
        ++allocs;
      }
    } else {
      const size_t i = rng() % live_offsets.size();
      const uint64_t offset = live_offsets[i];
      live_offsets[i] = live_offsets.back();
      live_offsets.pop_back();
      absl::StatusOr<HbmBlock> freed = a.Free(offset);
      REQUIRE(freed.ok());
      REQUIRE(Same(*freed, live.at(offset)));
      live_bytes -= freed->size;
      live.erase(offset);
      ++frees;
    }

    const HbmAllocatorStats s = a.stats();
    REQUIRE(s.used_bytes == live_bytes);
    REQUIRE(s.free_bytes == kCapacity - live_bytes);
    REQUIRE(s.segment_count == live.size());
    REQUIRE(s.largest_free_block <= s.free_bytes);
    REQUIRE(s.peak_used_bytes >= s.used_bytes);
    if (op % kFullCheckEvery == 0) {
      absl::Status st = a.CheckInvariants();
      INFO("op " << op << ": " << st.ToString());
      REQUIRE(st.ok());
    }
  }
  REQUIRE(a.CheckInvariants().ok());
  // The mix must have exercised both paths and failures.
  CHECK(allocs > kOps / 4);
  CHECK(frees > kOps / 4);
  CHECK(ooms > 0);

  for (uint64_t offset : live_offsets) MustFree(a, offset);
  const HbmAllocatorStats s = a.stats();
  CHECK(s.used_bytes == 0);
  CHECK(s.segment_count == 0);
  std::vector<HbmBlock> free = a.FreeBlocks();
  REQUIRE(free.size() == 1);
  CHECK(free[0].offset == 0);
  CHECK(free[0].size == kCapacity);
  REQUIRE(a.CheckInvariants().ok());

  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::printf(
      "property test: %d ops (%d allocs, %d frees, %d OOMs) in %.2f s\n", kOps,
      allocs, frees, ooms, secs);
}

}  // namespace
}  // namespace tpud
