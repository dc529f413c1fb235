#include "daemon/hbm/hbm_arena.h"

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// Resident set size of this process, from /proc/self/statm.
uint64_t RssBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t total_pages = 0, resident_pages = 0;
  statm >> total_pages >> resident_pages;
  REQUIRE(statm);
  return resident_pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// The allocator and arena must agree on the page size for Release to work.
uint64_t Page() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

TEST_CASE("an arena reserves address space and RSS follows use") {
  constexpr uint64_t kCapacity = 256 * kMiB;
  constexpr uint64_t kTouched = 64 * kMiB;
  // Slack for what the test itself (Catch2, libc) may allocate meanwhile.
  constexpr uint64_t kSlack = 8 * kMiB;

  const uint64_t rss0 = RssBytes();
  absl::StatusOr<std::unique_ptr<HbmArena>> created =
      HbmArena::Create(3, kCapacity);
  REQUIRE(created.ok());
  HbmArena& arena = **created;
  CHECK(arena.chip() == 3);
  CHECK(arena.capacity() == kCapacity);
  REQUIRE(arena.base() != nullptr);

  const uint64_t rss1 = RssBytes();
  INFO("rss before create " << rss0 << ", after " << rss1);
  CHECK(rss1 < rss0 + kSlack);  // reserved, not committed

  // Touch 64 MiB in the middle of the arena.
  const uint64_t offset = 32 * kMiB;
  std::memset(arena.base() + offset, 0xA5, kTouched);
  const uint64_t rss2 = RssBytes();
  INFO("rss after touching 64 MiB " << rss2);
  CHECK(rss2 >= rss1 + kTouched - kSlack);
  CHECK(rss2 <= rss1 + kTouched + kSlack);

  REQUIRE(arena.Release(offset, kTouched).ok());
  const uint64_t rss3 = RssBytes();
  INFO("rss after release " << rss3);
  CHECK(rss3 + kTouched - kSlack <= rss2);
  CHECK(rss3 < rss1 + kSlack);

  // Released bytes read as zeros (and reading them commits nothing new).
  const char* p = arena.base() + offset;
  uint64_t nonzero = 0;
  for (uint64_t i = 0; i < kTouched; i += sizeof(uint64_t)) {
    uint64_t word;
    std::memcpy(&word, p + i, sizeof(word));
    nonzero += word != 0;
  }
  CHECK(nonzero == 0);
}

TEST_CASE("memory outside a released range keeps its contents") {
  absl::StatusOr<std::unique_ptr<HbmArena>> created =
      HbmArena::Create(0, 16 * Page());
  REQUIRE(created.ok());
  HbmArena& arena = **created;
  std::memset(arena.base(), 0x5A, 4 * Page());
  REQUIRE(arena.Release(Page(), 2 * Page()).ok());
  CHECK(arena.base()[0] == 0x5A);
  CHECK(arena.base()[Page() - 1] == 0x5A);
  CHECK(arena.base()[Page()] == 0);
  CHECK(arena.base()[3 * Page() - 1] == 0);
  CHECK(arena.base()[3 * Page()] == 0x5A);
}

TEST_CASE("Release rejects misaligned and out-of-range requests") {
  absl::StatusOr<std::unique_ptr<HbmArena>> created =
      HbmArena::Create(1, 16 * Page());
  REQUIRE(created.ok());
  HbmArena& arena = **created;

  CHECK(absl::IsInvalidArgument(arena.Release(1, Page())));
  CHECK(absl::IsInvalidArgument(arena.Release(0, Page() + 1)));
  CHECK(absl::IsInvalidArgument(arena.Release(Page() / 2, Page() / 2)));
  CHECK(absl::IsInvalidArgument(arena.Release(16 * Page(), Page())));
  CHECK(absl::IsInvalidArgument(arena.Release(8 * Page(), 9 * Page())));
  // offset + size would wrap around.
  CHECK(absl::IsInvalidArgument(
      arena.Release(Page(), UINT64_MAX - UINT64_MAX % Page())));
  CHECK(arena.Release(0, 16 * Page()).ok());  // the whole arena
  CHECK(arena.Release(16 * Page(), 0).ok());  // empty range at the end
}

TEST_CASE("an arena that cannot be reserved fails with a useful message") {
  absl::StatusOr<std::unique_ptr<HbmArena>> created =
      HbmArena::Create(5, uint64_t{1} << 62);
  REQUIRE(absl::IsResourceExhausted(created.status()));
  const std::string msg(created.status().message());
  INFO(msg);
  CHECK(msg.find("--hbm_bytes") != std::string::npos);
  CHECK(msg.find("chip 5") != std::string::npos);
  CHECK(msg.find("4.00 EiB") != std::string::npos);
}

TEST_CASE("a zero-sized arena is rejected") {
  CHECK(absl::IsInvalidArgument(HbmArena::Create(0, 0).status()));
}

}  // namespace
}  // namespace tpud
