#include "daemon/core/shared_regions.h"

#include <sys/wait.h>
#include <unistd.h>

#include "catch2_compat/catch.h"

namespace tpud {
namespace {

constexpr uint64_t kCapacity = 64 << 20;

TEST_CASE(
    "page owners name the segment that holds a range, for its session only") {
  absl::StatusOr<SharedMapping> m = SharedMapping::Create(
      "owners-test", PageOwnerTable::BytesFor(kCapacity), false);
  REQUIRE(m.ok());
  PageOwnerTable t(m->data(), kCapacity);
  t.Assign(8 * kPageBytes, 4 * kPageBytes, 7);
  t.Assign(12 * kPageBytes, 1 * kPageBytes, 9);

  auto seg = t.Find(9 * kPageBytes + 100, 2 * kPageBytes, 7);
  REQUIRE(seg.has_value());
  CHECK(seg->offset == 8 * kPageBytes);
  CHECK(seg->bytes == 4 * kPageBytes);
  // The whole segment, to its last byte.
  CHECK(t.Find(8 * kPageBytes, 4 * kPageBytes, 7).has_value());
  // One byte too far reaches the next segment (another session's).
  CHECK_FALSE(t.Find(8 * kPageBytes, 4 * kPageBytes + 1, 7).has_value());
  // Another session's pages, free pages, ranges past the chip.
  CHECK_FALSE(t.Find(12 * kPageBytes, 8, 7).has_value());
  CHECK(t.Find(12 * kPageBytes, 8, 9).has_value());
  CHECK_FALSE(t.Find(0, 8, 7).has_value());
  CHECK_FALSE(t.Find(kCapacity - 8, 16, 7).has_value());
  CHECK_FALSE(t.Find(~uint64_t{0} - 4, 8, 7).has_value());
  CHECK(t.OwnerOf(12 * kPageBytes) == 9);
  CHECK(t.OwnerOf(0) == 0);

  t.Clear(8 * kPageBytes, 4 * kPageBytes);
  CHECK_FALSE(t.Find(9 * kPageBytes, 8, 7).has_value());
  CHECK(t.OwnerOf(9 * kPageBytes) == 0);
}

TEST_CASE("two adjacent segments of one session are not one segment") {
  absl::StatusOr<SharedMapping> m = SharedMapping::Create(
      "owners-test", PageOwnerTable::BytesFor(kCapacity), false);
  REQUIRE(m.ok());
  PageOwnerTable t(m->data(), kCapacity);
  t.Assign(0, 2 * kPageBytes, 3);
  t.Assign(2 * kPageBytes, 2 * kPageBytes, 3);
  CHECK(t.Find(0, 2 * kPageBytes, 3).has_value());
  CHECK_FALSE(t.Find(kPageBytes, 2 * kPageBytes, 3).has_value());
}

TEST_CASE(
    "a shared mapping is seen by a forked child and sealed against resizing") {
  absl::StatusOr<SharedMapping> m =
      SharedMapping::Create("shared-test", 8192, /*seal=*/true);
  REQUIRE(m.ok());
  m->data()[100] = 1;
  const pid_t pid = fork();
  if (pid == 0) {
    m->data()[200] = static_cast<char>(m->data()[100] + 1);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(m->data()[200] == 2);
  CHECK(ftruncate(m->fd(), 4096) != 0);  // F_SEAL_SHRINK
}

TEST_CASE("a fresh session state region reads as empty") {
  const uint64_t bytes = SessionStateView::BytesFor(4);
  absl::StatusOr<SharedMapping> m =
      SharedMapping::Create("state-test", bytes, false);
  REQUIRE(m.ok());
  SessionStateView::Initialize(m->data(), 42, 5, 4);
  SessionStateView v(m->data());
  CHECK(v.header()->magic == kSessionStateMagic);
  CHECK(v.header()->num_rings == 32);
  CHECK(v.ring(31)->head.load() == 0);
  CHECK(v.chip(3)->poison.count == 0);
  CHECK(v.chip(3)->op_table[kMaxOpIds - 1].length == 0);
  CHECK(reinterpret_cast<char*>(v.chip(3) + 1) <= m->data() + bytes);
}

}  // namespace
}  // namespace tpud
