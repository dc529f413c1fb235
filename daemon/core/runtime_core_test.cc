#include "daemon/core/runtime_core.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "catch2_compat/catch.h"
#include "daemon/topology/topology.h"
#include "proto/protocol.h"
#include "tpu/device_address.h"

namespace tpud {
namespace {

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kChipBytes = 64 * kMiB;  // v6e-4 shrunk so tests are cheap
constexpr int kChips = 4;
constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}
absl::Status StatusOf(const absl::Status& s) { return s; }

// Checks the status code of `expr` and shows the whole status on failure.
#define CHECK_CODE(expr, expected_code)                       \
  do {                                                        \
    const absl::Status _status = StatusOf(expr);              \
    INFO(#expr << " -> " << _status.ToString());              \
    CHECK(_status.code() == absl::StatusCode::expected_code); \
  } while (0)

std::unique_ptr<RuntimeCore> MakeCore(RuntimeCore::Options options = {},
                                      const std::string& preset = "v6e-4",
                                      uint64_t hbm_bytes = kChipBytes) {
  absl::StatusOr<Topology> topology = Topology::FromPreset(preset, hbm_bytes);
  INFO(topology.status().ToString());
  REQUIRE(topology.ok());
  absl::StatusOr<std::unique_ptr<RuntimeCore>> core =
      RuntimeCore::Create(*std::move(topology), options);
  INFO(core.status().ToString());
  REQUIRE(core.ok());
  return *std::move(core);
}

PeerIdentity Peer(int32_t pid = 4242) {
  PeerIdentity p;
  p.pid = pid;
  p.uid = 1000;
  p.gid = 1000;
  p.command = "python train.py --steps 10";
  return p;
}

uint64_t MustOpen(RuntimeCore& core, ConnectionId connection,
                  const PeerIdentity& peer = Peer(),
                  const std::string& name = "test") {
  absl::StatusOr<OpenedSession> opened = core.OpenSession(
      connection, peer, kMinProtocolVersion, kMaxProtocolVersion, name);
  INFO(opened.status().ToString());
  REQUIRE(opened.ok());
  REQUIRE(opened->session_id != 0);
  return opened->session_id;
}

SegmentGrant MustAllocate(RuntimeCore& core, ConnectionId connection,
                          uint64_t session, int chip, uint64_t bytes) {
  absl::StatusOr<SegmentGrant> grant =
      core.Allocate(connection, session, chip, bytes);
  INFO("allocate " << bytes << " on chip " << chip << ": "
                   << grant.status().ToString());
  REQUIRE(grant.ok());
  return *grant;
}

uint64_t MustFree(RuntimeCore& core, ConnectionId connection, uint64_t session,
                  uint64_t address) {
  absl::StatusOr<uint64_t> freed = core.Free(connection, session, address);
  INFO(freed.status().ToString());
  REQUIRE(freed.ok());
  return *freed;
}

std::vector<ChipMemoryView> MustStats(RuntimeCore& core,
                                      ConnectionId connection,
                                      uint64_t session) {
  absl::StatusOr<std::vector<ChipMemoryView>> views =
      core.MemoryStats(connection, session);
  INFO(views.status().ToString());
  REQUIRE(views.ok());
  REQUIRE(views->size() == kChips);
  return *std::move(views);
}

uint64_t ChipUsed(const RuntimeCore& core, int chip) {
  return core.Chips().at(chip).hbm.used_bytes;
}

// Every chip is fully free again: nothing used, and one block spanning it.
void RequireAllChipsEmpty(const RuntimeCore& core) {
  for (const ChipSnapshot& chip : core.Chips()) {
    INFO("chip " << chip.id);
    CHECK(chip.hbm.used_bytes == 0);
    CHECK(chip.hbm.segment_count == 0);
    CHECK(chip.hbm.free_bytes == chip.hbm.capacity_bytes);
    CHECK(chip.hbm.largest_free_block == chip.hbm.capacity_bytes);
    CHECK(chip.hbm.free_block_count == 1);
    CHECK(chip.session_count == 0);
  }
}

TEST_CASE("a session opens, closes, and is gone afterwards") {
  auto core = MakeCore();
  CHECK(core->Sessions().empty());

  absl::StatusOr<OpenedSession> opened = core->OpenSession(
      7, Peer(), kMinProtocolVersion, kMaxProtocolVersion, "lifecycle");
  INFO(opened.status().ToString());
  REQUIRE(opened.ok());
  const uint64_t id = opened->session_id;
  CHECK(id != 0);
  CHECK(opened->protocol_version == kMaxProtocolVersion);
  CHECK(opened->quota_bytes_per_chip == 0);
  REQUIRE(core->Sessions().size() == 1);
  CHECK(core->Sessions()[0].id == id);
  CHECK(core->Sessions()[0].connection == 7);

  MustAllocate(*core, 7, id, 0, 5000);  // rounds to 8 KiB
  MustAllocate(*core, 7, id, 2, kMiB);

  absl::StatusOr<uint64_t> closed = core->CloseSession(7, id);
  INFO(closed.status().ToString());
  REQUIRE(closed.ok());
  CHECK(*closed == 8 * kKiB + kMiB);
  CHECK(core->Sessions().empty());
  RequireAllChipsEmpty(*core);

  // Every call on the ended session says it is not there.
  CHECK_CODE(core->Allocate(7, id, 0, 4096), kNotFound);
  CHECK_CODE(core->Free(7, id, tpu::MakeDeviceAddress(0, 0)), kNotFound);
  CHECK_CODE(core->MemoryStats(7, id), kNotFound);
  CHECK_CODE(core->CloseSession(7, id), kNotFound);
  CHECK_CODE(core->KillSession(id, nullptr), kNotFound);
  CHECK_CODE(core->SetSessionQuota(id, kMiB), kNotFound);

  // The connection may carry a new session, with a fresh id.
  const uint64_t again = MustOpen(*core, 7);
  CHECK(again != id);
}

TEST_CASE("protocol versions are negotiated when a session opens") {
  auto core = MakeCore();

  SECTION("a client speaking [2, 2] gets version 2") {
    absl::StatusOr<OpenedSession> opened =
        core->OpenSession(1, Peer(), 2, 2, "v2");
    REQUIRE(opened.ok());
    CHECK(opened->protocol_version == 2);
  }
  SECTION("a client speaking [2, 9] gets the daemon's highest, 2") {
    absl::StatusOr<OpenedSession> opened =
        core->OpenSession(1, Peer(), 2, 9, "newer");
    REQUIRE(opened.ok());
    CHECK(opened->protocol_version == 2);
  }
  SECTION("a client speaking only [3, 5] is refused, naming both ranges") {
    absl::StatusOr<OpenedSession> opened =
        core->OpenSession(1, Peer(), 3, 5, "future");
    INFO(opened.status().ToString());
    REQUIRE(opened.status().code() == absl::StatusCode::kFailedPrecondition);
    const std::string msg(opened.status().message());
    CHECK(Contains(msg, "[3, 5]"));
    CHECK(Contains(msg, "[2, 2]"));
    CHECK(Contains(
        msg, "install the torch_tpu / libtpuclient built with this tpud"));
    CHECK(core->Sessions().empty());
  }
  SECTION(
      "a client of the previous protocol, [1, 1], is refused with what to do") {
    absl::StatusOr<OpenedSession> opened =
        core->OpenSession(1, Peer(), 1, 1, "old plugin");
    REQUIRE(opened.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(Contains(std::string(opened.status().message()), "[1, 1]"));
  }
  SECTION("a client speaking only [0, 0] is refused") {
    CHECK_CODE(core->OpenSession(1, Peer(), 0, 0, "ancient"),
               kFailedPrecondition);
    CHECK(core->Sessions().empty());
  }
  SECTION("an empty range (min > max) is malformed") {
    absl::StatusOr<OpenedSession> opened =
        core->OpenSession(1, Peer(), 3, 1, "confused");
    INFO(opened.status().ToString());
    CHECK(opened.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(Contains(std::string(opened.status().message()), "[3, 1]"));
    CHECK(core->Sessions().empty());
  }
}

TEST_CASE("a connection carries one session") {
  auto core = MakeCore();
  const uint64_t first = MustOpen(*core, 3);
  absl::StatusOr<OpenedSession> second =
      core->OpenSession(3, Peer(), 2, 2, "second");
  INFO(second.status().ToString());
  REQUIRE(second.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(
      Contains(std::string(second.status().message()), std::to_string(first)));
  REQUIRE(core->Sessions().size() == 1);
  CHECK(core->Sessions()[0].id == first);

  // A different connection can open its own.
  const uint64_t other = MustOpen(*core, 4);
  CHECK(other != first);
  CHECK(core->Sessions().size() == 2);
}

TEST_CASE("a session answers only to the connection that opened it") {
  auto core = MakeCore();
  const ConnectionId owner = 10;
  const ConnectionId intruder = 11;
  const uint64_t victim = MustOpen(*core, owner);
  const uint64_t own = MustOpen(*core, intruder);
  const SegmentGrant seg = MustAllocate(*core, owner, victim, 1, kMiB);

  CHECK_CODE(core->Allocate(intruder, victim, 0, 4096), kPermissionDenied);
  CHECK_CODE(core->Free(intruder, victim, seg.address), kPermissionDenied);
  CHECK_CODE(core->MemoryStats(intruder, victim), kPermissionDenied);
  CHECK_CODE(core->CloseSession(intruder, victim), kPermissionDenied);
  // A connection with no session at all fares no better.
  CHECK_CODE(core->Allocate(99, victim, 0, 4096), kPermissionDenied);
  CHECK_CODE(core->CloseSession(99, victim), kPermissionDenied);
  // A session id that never existed is NOT_FOUND.
  CHECK_CODE(core->Allocate(intruder, victim + own + 100, 0, 4096), kNotFound);

  // The victim is untouched: its session and segment are still there.
  REQUIRE(core->Sessions().size() == 2);
  CHECK(ChipUsed(*core, 1) == kMiB);
  CHECK(ChipUsed(*core, 0) == 0);
  std::vector<ChipMemoryView> views = MustStats(*core, owner, victim);
  CHECK(views[1].session_bytes == kMiB);
  CHECK(MustFree(*core, owner, victim, seg.address) == kMiB);
}

TEST_CASE("allocate and free: addresses, rounding and stats") {
  auto core = MakeCore();
  const ConnectionId conn = 1;
  const uint64_t s = MustOpen(*core, conn);

  const SegmentGrant a = MustAllocate(*core, conn, s, 2, 1);
  CHECK(a.chip == 2);
  CHECK(a.size == 4096);
  CHECK(a.requested_bytes == 1);
  CHECK(tpu::DeviceAddressChip(a.address) == 2);
  CHECK(tpu::DeviceAddressOffset(a.address) == a.offset);
  CHECK(a.address != 0);

  const SegmentGrant b = MustAllocate(*core, conn, s, 2, 3 * kMiB + 1);
  CHECK(b.size == 3 * kMiB + 4096);
  CHECK(tpu::DeviceAddressChip(b.address) == 2);
  CHECK(tpu::DeviceAddressOffset(b.address) == b.offset);
  // The two segments do not overlap.
  CHECK((a.offset + a.size <= b.offset || b.offset + b.size <= a.offset));

  const SegmentGrant c = MustAllocate(*core, conn, s, 0, 8192);
  CHECK(c.size == 8192);
  CHECK(tpu::DeviceAddressChip(c.address) == 0);

  std::vector<ChipSnapshot> chips = core->Chips();
  REQUIRE(chips.size() == kChips);
  CHECK(chips[2].hbm.used_bytes == a.size + b.size);
  CHECK(chips[2].hbm.segment_count == 2);
  CHECK(chips[2].hbm.free_bytes == kChipBytes - a.size - b.size);
  CHECK(chips[2].session_count == 1);
  CHECK(chips[0].hbm.used_bytes == 8192);
  CHECK(chips[1].hbm.used_bytes == 0);
  CHECK(chips[1].session_count == 0);

  std::vector<ChipMemoryView> views = MustStats(*core, conn, s);
  CHECK(views[2].chip == 2);
  CHECK(views[2].session_bytes == a.size + b.size);
  CHECK(views[2].session_segments == 2);
  CHECK(views[2].hbm.used_bytes == a.size + b.size);
  CHECK(views[0].session_bytes == 8192);
  CHECK(views[0].session_segments == 1);
  CHECK(views[3].session_bytes == 0);
  CHECK(views[3].session_segments == 0);

  CHECK(MustFree(*core, conn, s, b.address) == b.size);
  CHECK(ChipUsed(*core, 2) == a.size);
  views = MustStats(*core, conn, s);
  CHECK(views[2].session_bytes == a.size);
  CHECK(views[2].session_segments == 1);
  CHECK(views[2].session_peak_bytes == a.size + b.size);

  // Freeing the same address twice is an error the second time.
  CHECK_CODE(core->Free(conn, s, b.address), kInvalidArgument);

  CHECK(MustFree(*core, conn, s, a.address) == a.size);
  CHECK(MustFree(*core, conn, s, c.address) == c.size);
  RequireAllChipsEmpty(*core);
}

TEST_CASE("freeing another session's segment is refused and it survives") {
  auto core = MakeCore();
  const uint64_t alice = MustOpen(*core, 1);
  const uint64_t bob = MustOpen(*core, 2);
  const SegmentGrant seg = MustAllocate(*core, 1, alice, 0, 2 * kMiB);

  absl::StatusOr<uint64_t> freed = core->Free(2, bob, seg.address);
  INFO(freed.status().ToString());
  CHECK(freed.status().code() == absl::StatusCode::kPermissionDenied);
  // Nor may bob free a byte in the middle of it.
  CHECK_CODE(core->Free(2, bob, seg.address + 4096), kPermissionDenied);

  CHECK(ChipUsed(*core, 0) == 2 * kMiB);
  CHECK(MustStats(*core, 1, alice)[0].session_bytes == 2 * kMiB);
  CHECK(MustStats(*core, 2, bob)[0].session_bytes == 0);
  // Alice still owns it and can free it.
  CHECK(MustFree(*core, 1, alice, seg.address) == 2 * kMiB);
}

TEST_CASE("freeing an address where none of one's segments starts") {
  auto core = MakeCore();
  const ConnectionId conn = 1;
  const uint64_t s = MustOpen(*core, conn);
  const SegmentGrant seg = MustAllocate(*core, conn, s, 1, kMiB);

  SECTION("inside one's own segment, not at its start") {
    CHECK_CODE(core->Free(conn, s, seg.address + 4096), kInvalidArgument);
    CHECK_CODE(core->Free(conn, s, seg.address + 1), kInvalidArgument);
    CHECK_CODE(core->Free(conn, s, seg.address + kMiB - 1), kInvalidArgument);
  }
  SECTION("garbage addresses") {
    CHECK_CODE(core->Free(conn, s, 0), kInvalidArgument);
    CHECK_CODE(core->Free(conn, s, 0xdeadbeef), kInvalidArgument);
    CHECK_CODE(core->Free(conn, s, seg.offset), kInvalidArgument);  // no chip
    CHECK_CODE(core->Free(conn, s, tpu::MakeDeviceAddress(kChips, seg.offset)),
               kInvalidArgument);
    CHECK_CODE(core->Free(conn, s, tpu::MakeDeviceAddress(200, 0)),
               kInvalidArgument);
    CHECK_CODE(core->Free(conn, s, kMax), kInvalidArgument);
    // The right offset on the wrong chip.
    CHECK_CODE(core->Free(conn, s, tpu::MakeDeviceAddress(0, seg.offset)),
               kInvalidArgument);
    // Free HBM past the segment.
    CHECK_CODE(core->Free(conn, s, tpu::MakeDeviceAddress(1, 32 * kMiB)),
               kInvalidArgument);
  }
  // None of it disturbed the segment.
  CHECK(ChipUsed(*core, 1) == kMiB);
  CHECK(MustFree(*core, conn, s, seg.address) == kMiB);
}

TEST_CASE("malformed allocations are refused") {
  auto core = MakeCore();
  const ConnectionId conn = 1;
  const uint64_t s = MustOpen(*core, conn);

  for (int chip : {-1, 4, 1000, std::numeric_limits<int>::min()}) {
    INFO("chip " << chip);
    CHECK_CODE(core->Allocate(conn, s, chip, 4096), kInvalidArgument);
  }
  CHECK_CODE(core->Allocate(conn, s, 0, 0), kInvalidArgument);

  absl::StatusOr<SegmentGrant> huge = core->Allocate(conn, s, 0, kMax);
  INFO(huge.status().ToString());
  CHECK(huge.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_CODE(core->Allocate(conn, s, 0, kMax - 4095), kResourceExhausted);
  CHECK_CODE(core->Allocate(conn, s, 0, kChipBytes + 1), kResourceExhausted);

  // Nothing was taken by the failed attempts; the full chip is still there.
  RequireAllChipsEmpty(*core);
  const SegmentGrant whole = MustAllocate(*core, conn, s, 0, kChipBytes);
  CHECK(whole.size == kChipBytes);
}

TEST_CASE("an out-of-memory error says what was asked and what is free") {
  auto core = MakeCore();
  const ConnectionId conn = 1;
  const uint64_t s = MustOpen(*core, conn);
  std::vector<SegmentGrant> quarters;
  for (int i = 0; i < 4; ++i) {
    quarters.push_back(MustAllocate(*core, conn, s, 0, 16 * kMiB));
  }
  CHECK(ChipUsed(*core, 0) == kChipBytes);

  absl::StatusOr<SegmentGrant> more = core->Allocate(conn, s, 0, 32 * kMiB);
  INFO(more.status().ToString());
  REQUIRE(more.status().code() == absl::StatusCode::kResourceExhausted);
  std::string msg(more.status().message());
  CHECK(Contains(msg, "chip 0"));
  CHECK(Contains(msg, "asked"));
  CHECK(Contains(msg, "32.00 MiB"));
  CHECK(Contains(msg, "free"));
  CHECK(Contains(msg, "largest free block"));
  CHECK(Contains(msg, "64.00 MiB"));

  // Fragmented: 32 MiB free in two 16 MiB holes, still no room for 32 MiB.
  MustFree(*core, conn, s, quarters[0].address);
  MustFree(*core, conn, s, quarters[2].address);
  more = core->Allocate(conn, s, 0, 32 * kMiB);
  INFO(more.status().ToString());
  REQUIRE(more.status().code() == absl::StatusCode::kResourceExhausted);
  msg = std::string(more.status().message());
  CHECK(Contains(msg, "free 32.00 MiB of 64.00 MiB"));
  CHECK(Contains(msg, "largest free block 16.00 MiB"));

  // The other chips are unaffected.
  MustAllocate(*core, conn, s, 1, 32 * kMiB);
}

TEST_CASE("per-chip quotas limit what a session may hold") {
  RuntimeCore::Options options;
  options.default_quota_bytes_per_chip = 8 * kMiB;
  auto core = MakeCore(options);
  CHECK(core->default_quota() == 8 * kMiB);

  absl::StatusOr<OpenedSession> opened =
      core->OpenSession(1, Peer(), 2, 2, "quota");
  REQUIRE(opened.ok());
  CHECK(opened->quota_bytes_per_chip == 8 * kMiB);
  const uint64_t s = opened->session_id;

  SECTION("the default quota applies, per chip") {
    const SegmentGrant first = MustAllocate(*core, 1, s, 0, 6 * kMiB);
    MustAllocate(*core, 1, s, 0, 2 * kMiB);  // exactly at quota
    absl::StatusOr<SegmentGrant> over = core->Allocate(1, s, 0, 1);
    INFO(over.status().ToString());
    REQUIRE(over.status().code() == absl::StatusCode::kResourceExhausted);
    const std::string msg(over.status().message());
    CHECK(Contains(msg, "quota"));
    CHECK(Contains(msg, "8.00 MiB"));
    CHECK(Contains(msg, "chip 0"));
    CHECK(ChipUsed(*core, 0) == 8 * kMiB);

    // At quota on chip 0, the session still has its full quota on chip 1.
    MustAllocate(*core, 1, s, 1, 8 * kMiB);
    CHECK_CODE(core->Allocate(1, s, 1, 4096), kResourceExhausted);

    // Freeing makes room again under the quota.
    MustFree(*core, 1, s, first.address);
    MustAllocate(*core, 1, s, 0, 6 * kMiB);
  }

  SECTION("the quota counts rounded sizes") {
    core->SetSessionQuota(s, 8 * kKiB).IgnoreError();
    MustAllocate(*core, 1, s, 0, 5000);  // takes 8 KiB
    CHECK_CODE(core->Allocate(1, s, 0, 1), kResourceExhausted);
  }

  SECTION("an allocation larger than the quota fails even on an empty chip") {
    CHECK_CODE(core->Allocate(1, s, 2, 8 * kMiB + 1), kResourceExhausted);
    CHECK_CODE(core->Allocate(1, s, 2, kMax), kResourceExhausted);
    CHECK(ChipUsed(*core, 2) == 0);
  }

  SECTION("SetSessionQuota raises and removes the quota") {
    MustAllocate(*core, 1, s, 0, 8 * kMiB);
    CHECK_CODE(core->Allocate(1, s, 0, 4096), kResourceExhausted);
    REQUIRE(core->SetSessionQuota(s, 16 * kMiB).ok());
    CHECK(core->Sessions().at(0).quota_bytes_per_chip == 16 * kMiB);
    MustAllocate(*core, 1, s, 0, 8 * kMiB);
    CHECK_CODE(core->Allocate(1, s, 0, 4096), kResourceExhausted);

    REQUIRE(core->SetSessionQuota(s, 0).ok());  // 0 means no quota
    CHECK(core->Sessions().at(0).quota_bytes_per_chip == 0);
    MustAllocate(*core, 1, s, 0, 40 * kMiB);
    CHECK(ChipUsed(*core, 0) == 56 * kMiB);
  }

  SECTION("SetDefaultQuota affects only sessions opened later") {
    core->SetDefaultQuota(4 * kMiB);
    CHECK(core->default_quota() == 4 * kMiB);
    absl::StatusOr<OpenedSession> later =
        core->OpenSession(2, Peer(), 2, 2, "later");
    REQUIRE(later.ok());
    CHECK(later->quota_bytes_per_chip == 4 * kMiB);
    CHECK_CODE(core->Allocate(2, later->session_id, 0, 4 * kMiB + 1),
               kResourceExhausted);
    MustAllocate(*core, 2, later->session_id, 0, 4 * kMiB);

    // The earlier session keeps its 8 MiB.
    MustAllocate(*core, 1, s, 0, 8 * kMiB);
    std::vector<SessionSnapshot> sessions = core->Sessions();
    REQUIRE(sessions.size() == 2);
    CHECK(sessions[0].quota_bytes_per_chip == 8 * kMiB);
    CHECK(sessions[1].quota_bytes_per_chip == 4 * kMiB);

    core->SetDefaultQuota(0);
    absl::StatusOr<OpenedSession> unlimited =
        core->OpenSession(3, Peer(), 2, 2, "unlimited");
    REQUIRE(unlimited.ok());
    CHECK(unlimited->quota_bytes_per_chip == 0);
    MustAllocate(*core, 3, unlimited->session_id, 1, 32 * kMiB);
  }

  SECTION("lowering the quota below holdings keeps the memory") {
    const SegmentGrant a = MustAllocate(*core, 1, s, 0, 4 * kMiB);
    const SegmentGrant b = MustAllocate(*core, 1, s, 0, 4 * kMiB);
    REQUIRE(core->SetSessionQuota(s, 2 * kMiB).ok());
    CHECK(MustStats(*core, 1, s)[0].session_bytes == 8 * kMiB);
    CHECK(ChipUsed(*core, 0) == 8 * kMiB);
    CHECK_CODE(core->Allocate(1, s, 0, 4096), kResourceExhausted);

    CHECK(MustFree(*core, 1, s, a.address) == 4 * kMiB);
    CHECK_CODE(core->Allocate(1, s, 0, 4096), kResourceExhausted);  // 4 > 2
    CHECK(MustFree(*core, 1, s, b.address) == 4 * kMiB);
    MustAllocate(*core, 1, s, 0, 2 * kMiB);
  }

  SECTION("setting the quota of an unknown session is NOT_FOUND") {
    CHECK_CODE(core->SetSessionQuota(s + 1000, kMiB), kNotFound);
  }
}

TEST_CASE("a drained chip refuses new allocations only") {
  auto core = MakeCore();
  const ConnectionId conn = 1;
  const uint64_t s = MustOpen(*core, conn);
  const SegmentGrant before = MustAllocate(*core, conn, s, 1, kMiB);
  const SegmentGrant before2 = MustAllocate(*core, conn, s, 1, kMiB);

  REQUIRE(core->SetDrained(1, true).ok());
  CHECK(core->Chips()[1].drained);
  CHECK_FALSE(core->Chips()[0].drained);
  CHECK(MustStats(*core, conn, s)[1].drained);

  absl::StatusOr<SegmentGrant> refused = core->Allocate(conn, s, 1, 4096);
  INFO(refused.status().ToString());
  REQUIRE(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string msg(refused.status().message());
  CHECK(Contains(msg, "drained"));
  CHECK(Contains(msg, "undrain"));
  CHECK(Contains(msg, "chip 1"));

  // Existing segments there can still be freed; other chips work.
  CHECK(MustFree(*core, conn, s, before.address) == kMiB);
  CHECK(ChipUsed(*core, 1) == kMiB);
  MustAllocate(*core, conn, s, 0, kMiB);
  MustAllocate(*core, conn, s, 3, kMiB);

  // Draining twice is harmless; undraining restores allocation.
  REQUIRE(core->SetDrained(1, true).ok());
  REQUIRE(core->SetDrained(1, false).ok());
  CHECK_FALSE(core->Chips()[1].drained);
  MustAllocate(*core, conn, s, 1, kMiB);
  CHECK(MustFree(*core, conn, s, before2.address) == kMiB);

  for (int chip : {-1, 4, 1000}) {
    INFO("chip " << chip);
    CHECK_CODE(core->SetDrained(chip, true), kInvalidArgument);
  }
}

TEST_CASE("ending a connection reclaims all of its session's memory at once") {
  auto core = MakeCore();
  const ConnectionId doomed = 5;
  const ConnectionId bystander = 6;
  const uint64_t s = MustOpen(*core, doomed);
  const uint64_t keep = MustOpen(*core, bystander);
  const SegmentGrant kept = MustAllocate(*core, bystander, keep, 0, kMiB);

  uint64_t bytes = 0;
  uint64_t segments = 0;
  for (int i = 0; i < 40; ++i) {
    const int chip = i % kChips;
    const uint64_t size = (i + 1) * 100 * kKiB + 1;  // not page multiples
    bytes += MustAllocate(*core, doomed, s, chip, size).size;
    ++segments;
  }
  CHECK(core->Sessions().size() == 2);

  const ReclaimResult result = core->EndConnection(doomed);
  CHECK(result.sessions == 1);
  CHECK(result.segments == segments);
  CHECK(result.bytes == bytes);

  // Only the bystander's segment is left.
  std::vector<SessionSnapshot> sessions = core->Sessions();
  REQUIRE(sessions.size() == 1);
  CHECK(sessions[0].id == keep);
  CHECK(ChipUsed(*core, 0) == kMiB);
  for (int c = 1; c < kChips; ++c) CHECK(ChipUsed(*core, c) == 0);
  CHECK_CODE(core->Allocate(doomed, s, 0, 4096), kNotFound);

  MustFree(*core, bystander, keep, kept.address);
  CHECK(core->EndConnection(bystander).sessions == 1);
  CHECK(core->Sessions().empty());
  RequireAllChipsEmpty(*core);

  // Ending a connection that has no session does nothing.
  const ReclaimResult none = core->EndConnection(12345);
  CHECK(none.sessions == 0);
  CHECK(none.bytes == 0);
  CHECK(none.segments == 0);
  const ReclaimResult twice = core->EndConnection(doomed);
  CHECK(twice.sessions == 0);
}

TEST_CASE("KillSession ends a session and names its connection") {
  auto core = MakeCore();
  const uint64_t s = MustOpen(*core, 77);
  MustAllocate(*core, 77, s, 0, 3 * kMiB);
  MustAllocate(*core, 77, s, 3, 5 * kMiB);

  ConnectionId connection = 0;
  absl::StatusOr<uint64_t> killed = core->KillSession(s, &connection);
  INFO(killed.status().ToString());
  REQUIRE(killed.ok());
  CHECK(*killed == 8 * kMiB);
  CHECK(connection == 77);
  CHECK(core->Sessions().empty());
  RequireAllChipsEmpty(*core);
  CHECK_CODE(core->Allocate(77, s, 0, 4096), kNotFound);
  // The connection is free to open a new session; ending it is then normal.
  const uint64_t next = MustOpen(*core, 77);
  CHECK(next != s);

  CHECK_CODE(core->KillSession(s, &connection), kNotFound);
  CHECK_CODE(core->KillSession(next + 1000, nullptr), kNotFound);
}

TEST_CASE("session snapshots describe who holds what") {
  auto core = MakeCore();
  PeerIdentity peer;
  peer.pid = 31337;
  peer.uid = 1001;
  peer.gid = 1002;
  peer.command = "python3 -m torch_tpu.bench --size 1g";
  const uint64_t s = MustOpen(*core, 21, peer, "bench");
  const uint64_t idle = MustOpen(*core, 22, Peer(99), "idle");

  const SegmentGrant a = MustAllocate(*core, 21, s, 1, 2 * kMiB);
  MustAllocate(*core, 21, s, 1, 1 * kMiB);
  MustAllocate(*core, 21, s, 3, 4096);
  MustFree(*core, 21, s, a.address);

  std::vector<SessionSnapshot> sessions = core->Sessions();
  REQUIRE(sessions.size() == 2);
  const SessionSnapshot& snap = sessions[0].id == s ? sessions[0] : sessions[1];
  const SessionSnapshot& other =
      sessions[0].id == s ? sessions[1] : sessions[0];
  CHECK(snap.id == s);
  CHECK(snap.connection == 21);
  CHECK(snap.peer.pid == 31337);
  CHECK(snap.peer.uid == 1001);
  CHECK(snap.peer.gid == 1002);
  CHECK(snap.peer.command == "python3 -m torch_tpu.bench --size 1g");
  CHECK(snap.client_name == "bench");
  CHECK(snap.protocol_version == kMaxProtocolVersion);
  REQUIRE(snap.bytes_per_chip.size() == kChips);
  REQUIRE(snap.peak_bytes_per_chip.size() == kChips);
  CHECK(snap.bytes_per_chip[0] == 0);
  CHECK(snap.bytes_per_chip[1] == kMiB);
  CHECK(snap.bytes_per_chip[3] == 4096);
  CHECK(snap.peak_bytes_per_chip[1] == 3 * kMiB);
  CHECK(snap.peak_bytes_per_chip[3] == 4096);
  CHECK(snap.segment_count == 2);
  CHECK(snap.total_bytes() == kMiB + 4096);

  CHECK(other.id == idle);
  CHECK(other.peer.pid == 99);
  CHECK(other.client_name == "idle");
  CHECK(other.total_bytes() == 0);
  CHECK(other.segment_count == 0);

  std::vector<ChipSnapshot> chips = core->Chips();
  CHECK(chips[1].session_count == 1);
  CHECK(chips[3].session_count == 1);
  CHECK(chips[0].session_count == 0);
}

TEST_CASE("concurrent sessions allocate and free without interfering") {
  auto core = MakeCore();
  constexpr int kThreads = 8;
  constexpr int kOps = 2000;

  struct Worker {
    ConnectionId connection = 0;
    uint64_t session = 0;
    std::vector<SegmentGrant> held;
  };
  std::vector<Worker> workers(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    workers[t].connection = 1000 + t;
    workers[t].session = MustOpen(*core, workers[t].connection);
  }

  // Catch2's assertions are not thread-safe: threads record failures here.
  std::mutex failures_mu;
  std::vector<std::string> failures;
  std::atomic<int> exhausted{0};
  auto fail = [&](std::string what) {
    std::lock_guard<std::mutex> lock(failures_mu);
    failures.push_back(std::move(what));
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Worker& w = workers[t];
      std::mt19937_64 rng(0x5eed + t);
      for (int op = 0; op < kOps; ++op) {
        const bool allocate =
            w.held.empty() || (w.held.size() < 64 && rng() % 3 != 0);
        if (allocate) {
          const int chip = static_cast<int>(rng() % kChips);
          const uint64_t size = 1 + rng() % (2 * kMiB);  // some OOM too
          absl::StatusOr<SegmentGrant> g =
              core->Allocate(w.connection, w.session, chip, size);
          if (g.ok()) {
            if (g->chip != chip || g->size < size || g->size % 4096 != 0 ||
                tpu::DeviceAddressChip(g->address) != chip ||
                tpu::DeviceAddressOffset(g->address) != g->offset) {
              fail("bad grant");
            }
            w.held.push_back(*g);
          } else if (g.status().code() ==
                     absl::StatusCode::kResourceExhausted) {
            ++exhausted;
          } else {
            fail(g.status().ToString());
          }
        } else {
          const size_t i = rng() % w.held.size();
          const SegmentGrant seg = w.held[i];
          w.held[i] = w.held.back();
          w.held.pop_back();
          absl::StatusOr<uint64_t> freed =
              core->Free(w.connection, w.session, seg.address);
          if (!freed.ok()) {
            fail(freed.status().ToString());
          } else if (*freed != seg.size) {
            fail("freed size differs from the grant");
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();

  for (const std::string& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());
  INFO("allocations refused for lack of memory: " << exhausted.load());

  // What each session holds agrees with what it was granted, and no two live
  // segments anywhere overlap.
  std::vector<std::map<uint64_t, uint64_t>> live(kChips);  // offset -> size
  std::vector<uint64_t> total_per_chip(kChips, 0);
  for (const Worker& w : workers) {
    std::vector<uint64_t> expect(kChips, 0);
    for (const SegmentGrant& g : w.held) {
      expect[g.chip] += g.size;
      total_per_chip[g.chip] += g.size;
      CHECK(live[g.chip].emplace(g.offset, g.size).second);
    }
    std::vector<ChipMemoryView> views =
        MustStats(*core, w.connection, w.session);
    for (int c = 0; c < kChips; ++c) CHECK(views[c].session_bytes == expect[c]);
  }
  for (int c = 0; c < kChips; ++c) {
    CHECK(ChipUsed(*core, c) == total_per_chip[c]);
    uint64_t end = 0;
    for (const auto& [offset, size] : live[c]) {
      CHECK(offset >= end);
      end = offset + size;
    }
  }

  // Half the sessions close, the other half lose their connection.
  for (int t = 0; t < kThreads; ++t) {
    if (t % 2 == 0) {
      CHECK(core->CloseSession(workers[t].connection, workers[t].session).ok());
    } else {
      CHECK(core->EndConnection(workers[t].connection).sessions == 1);
    }
  }
  CHECK(core->Sessions().empty());
  RequireAllChipsEmpty(*core);
}

TEST_CASE("absurd sizes on chips too big to back with memory") {
  RuntimeCore::Options options;
  options.back_with_memory = false;
  auto core = MakeCore(options, "v7x-4", 0);  // the real 192 GiB per chip
  REQUIRE(core->topology().num_chips() == 4);
  for (const ChipSnapshot& chip : core->Chips()) {
    CHECK(chip.hbm.capacity_bytes == 192 * kGiB);
  }
  const uint64_t s = MustOpen(*core, 1);

  const SegmentGrant big = MustAllocate(*core, 1, s, 2, 100 * kGiB);
  CHECK(big.size == 100 * kGiB);
  CHECK(tpu::DeviceAddressChip(big.address) == 2);
  CHECK(ChipUsed(*core, 2) == 100 * kGiB);

  absl::StatusOr<SegmentGrant> second = core->Allocate(1, s, 2, 100 * kGiB);
  INFO(second.status().ToString());
  CHECK(second.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(Contains(std::string(second.status().message()), "192.00 GiB"));

  CHECK_CODE(core->Allocate(1, s, 2, uint64_t{1} << 60), kResourceExhausted);
  CHECK_CODE(core->Allocate(1, s, 0, uint64_t{1} << 60), kResourceExhausted);
  CHECK_CODE(core->Allocate(1, s, 0, kMax), kResourceExhausted);
  CHECK(ChipUsed(*core, 0) == 0);

  // Under a quota, a request so large that holdings + request wraps past
  // 2^64 is still refused.
  REQUIRE(core->SetSessionQuota(s, 101 * kGiB).ok());
  CHECK_CODE(core->Allocate(1, s, 2, kMax - 100 * kGiB + 1),
             kResourceExhausted);
  CHECK_CODE(core->Allocate(1, s, 2, uint64_t{1} << 60), kResourceExhausted);

  CHECK(MustFree(*core, 1, s, big.address) == 100 * kGiB);
  RequireAllChipsEmpty(*core);
}

TEST_CASE("an allocation's token gives a session its chips and quotas") {
  RuntimeCore::Options options;
  options.default_quota_bytes_per_chip = 32 * kMiB;
  auto core = MakeCore(options);

  AllocationSpec spec;
  spec.chips = {1, 3};
  spec.chip_quota_bytes = {8 * kMiB, 16 * kMiB};
  spec.name = "chip-1-share-0,chip-3-share-0,chip-3-share-1";
  absl::StatusOr<CreatedAllocation> created = core->CreateAllocation(spec);
  INFO(created.status().ToString());
  REQUIRE(created.ok());
  CHECK(created->token.size() == 32);
  CHECK(created->token.find_first_not_of("0123456789abcdef") ==
        std::string::npos);

  absl::StatusOr<OpenedSession> opened =
      core->OpenSession(1, Peer(), kMinProtocolVersion, kMaxProtocolVersion,
                        "pod", created->token);
  INFO(opened.status().ToString());
  REQUIRE(opened.ok());
  CHECK(opened->allowed_chips == std::vector<int>{1, 3});
  CHECK(opened->quota_bytes_per_chip == 16 * kMiB);
  const uint64_t s = opened->session_id;

  SECTION("its quota applies per chip, in place of the default") {
    MustAllocate(*core, 1, s, 1, 8 * kMiB);
    absl::StatusOr<SegmentGrant> over = core->Allocate(1, s, 1, 4096);
    REQUIRE(over.status().code() == absl::StatusCode::kResourceExhausted);
    const std::string msg(over.status().message());
    CHECK(Contains(msg, "quota"));
    CHECK(Contains(msg, "8.00 MiB"));
    CHECK(Contains(msg, "allocation"));
    MustAllocate(*core, 1, s, 3, 16 * kMiB);
    CHECK_CODE(core->Allocate(1, s, 3, 4096), kResourceExhausted);
    const std::vector<ChipMemoryView> views = MustStats(*core, 1, s);
    CHECK(views[1].session_quota_bytes == 8 * kMiB);
    CHECK(views[3].session_quota_bytes == 16 * kMiB);
  }

  SECTION(
      "its sessions share the quota: a pod's processes together get its "
      "share") {
    absl::StatusOr<OpenedSession> second =
        core->OpenSession(2, Peer(), kMinProtocolVersion, kMaxProtocolVersion,
                          "pod-2", created->token);
    REQUIRE(second.ok());
    const uint64_t s2 = second->session_id;
    const SegmentGrant first = MustAllocate(*core, 1, s, 1, 6 * kMiB);
    absl::StatusOr<SegmentGrant> over = core->Allocate(2, s2, 1, 4 * kMiB);
    REQUIRE(over.status().code() == absl::StatusCode::kResourceExhausted);
    CHECK(Contains(std::string(over.status().message()),
                   "sessions of allocation"));
    MustAllocate(*core, 2, s2, 1, 2 * kMiB);  // exactly what is left
    CHECK_CODE(core->Allocate(1, s, 1, 4096), kResourceExhausted);
    // Freed bytes come back to every session of the allocation.
    REQUIRE(core->Free(1, s, first.address).ok());
    MustAllocate(*core, 2, s2, 1, 6 * kMiB);
    // A session that ends takes its holdings off the allocation's.
    REQUIRE(core->CloseSession(2, s2).ok());
    MustAllocate(*core, 1, s, 1, 8 * kMiB);
    // An administrator's quota for one session replaces the shared one.
    REQUIRE(core->SetSessionQuota(s, 64 * kMiB).ok());
    MustAllocate(*core, 1, s, 1, 8 * kMiB);
  }

  SECTION("chips outside the allocation are refused, naming the allowed ones") {
    absl::StatusOr<SegmentGrant> other = core->Allocate(1, s, 0, 4096);
    REQUIRE(other.status().code() == absl::StatusCode::kPermissionDenied);
    const std::string msg(other.status().message());
    CHECK(Contains(msg, "chip 0"));
    CHECK(Contains(msg, "chips 1, 3"));
    CHECK(ChipUsed(*core, 0) == 0);
    CHECK_CODE(core->Allocate(1, s, 2, 4096), kPermissionDenied);
  }

  SECTION("a session without a token keeps the default quota and every chip") {
    const uint64_t plain = MustOpen(*core, 2);
    MustAllocate(*core, 2, plain, 0, 32 * kMiB);
    CHECK_CODE(core->Allocate(2, plain, 0, 4096), kResourceExhausted);
    const std::vector<SessionSnapshot> sessions = core->Sessions();
    REQUIRE(sessions.size() == 2);
    CHECK(sessions[0].allocation_id == created->id);
    CHECK(sessions[1].allocation_id == 0);
  }

  SECTION("allocations are listed with their open sessions") {
    const std::vector<AllocationSnapshot> all = core->Allocations();
    REQUIRE(all.size() == 1);
    CHECK(all[0].id == created->id);
    CHECK(all[0].name == spec.name);
    CHECK(all[0].chips == std::vector<int>{1, 3});
    CHECK(all[0].quota_bytes == std::vector<uint64_t>{8 * kMiB, 16 * kMiB});
    CHECK(all[0].session_count == 1);
  }

  SECTION(
      "after release, the token opens nothing; open sessions keep their "
      "limits") {
    REQUIRE(core->ReleaseAllocation(created->token).ok());
    CHECK(core->Allocations().empty());
    CHECK_CODE(core->ReleaseAllocation(created->token), kNotFound);
    CHECK_CODE(core->OpenSession(2, Peer(), kMinProtocolVersion,
                                 kMaxProtocolVersion, "late", created->token),
               kPermissionDenied);
    CHECK_CODE(core->Allocate(1, s, 0, 4096), kPermissionDenied);
  }
}

TEST_CASE("unknown tokens and malformed allocations are refused clearly") {
  auto core = MakeCore();
  absl::StatusOr<OpenedSession> bad = core->OpenSession(
      1, Peer(), kMinProtocolVersion, kMaxProtocolVersion, "pod", "f00d");
  REQUIRE(bad.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(Contains(std::string(bad.status().message()), "TPUD_TOKEN"));

  AllocationSpec none;
  CHECK_CODE(core->CreateAllocation(none), kInvalidArgument);
  AllocationSpec twice;
  twice.chips = {2, 2};
  CHECK_CODE(core->CreateAllocation(twice), kInvalidArgument);
  AllocationSpec off_host;
  off_host.chips = {4};
  CHECK_CODE(core->CreateAllocation(off_host), kInvalidArgument);
  AllocationSpec mismatched;
  mismatched.chips = {0, 1};
  mismatched.chip_quota_bytes = {kMiB};
  CHECK_CODE(core->CreateAllocation(mismatched), kInvalidArgument);

  // A uniform quota applies to every chip of the allocation.
  AllocationSpec uniform;
  uniform.chips = {0};
  uniform.quota_bytes_per_chip = 4 * kMiB;
  absl::StatusOr<CreatedAllocation> a = core->CreateAllocation(uniform);
  REQUIRE(a.ok());
  absl::StatusOr<OpenedSession> s = core->OpenSession(
      2, Peer(), kMinProtocolVersion, kMaxProtocolVersion, "pod", a->token);
  REQUIRE(s.ok());
  MustAllocate(*core, 2, s->session_id, 0, 4 * kMiB);
  CHECK_CODE(core->Allocate(2, s->session_id, 0, 1), kResourceExhausted);
  // An administrator's quota replaces the allocation's; its chips still bind.
  REQUIRE(core->SetSessionQuota(s->session_id, 0).ok());
  MustAllocate(*core, 2, s->session_id, 0, 4 * kMiB);
  CHECK_CODE(core->Allocate(2, s->session_id, 1, 1), kPermissionDenied);
}

}  // namespace
}  // namespace tpud
