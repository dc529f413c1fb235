#include "daemon/collectives/groups.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "catch2_compat/catch.h"
#include "tpu/dtype.h"

namespace tpud {
namespace {

using tpu::CollectiveKind;
using tpu::ReduceOp;

constexpr int8_t kFloat32 = tpu::Code(tpu::DType::kFloat);

tpu::CollectiveEntry Entry(CollectiveKind kind, uint64_t count,
                           int32_t peer = 0) {
  tpu::CollectiveEntry e;
  e.kind = kind;
  e.dtype = kFloat32;
  e.count = count;
  e.peer = peer;
  return e;
}

// A communicator of n ranks in a table of its own.
struct Comm {
  std::unique_ptr<CollectiveTable, HeapTableDeleter> table =
      NewHeapCollectiveTable(1);
  CommSlot& comm = *CommAt(table.get(), 0);
  explicit Comm(int n) {
    comm.size = static_cast<uint32_t>(n);
    comm.id.store(7);
    comm.timeout_ns = 3000000000;
    for (int r = 0; r < n; ++r) {
      comm.members[r].chip = r;
      comm.members[r].pid = 100 + r;
    }
  }
  // Posts `group` as rank r's slot k.
  void Post(int r, int k, const tpu::DecodedCollective& group) {
    WriteGroup(group, 0, 1, 0,
               CheckOwnGroup(group, static_cast<int>(comm.size)),
               &comm.slots[r][k]);
  }
};

TEST_CASE("BufferBytes refuses absurd sizes") {
  PostedOp op{};
  op.kind = CollectiveKind::kAllGather;
  op.dtype = tpu::Code(tpu::DType::kFloat);
  op.count = uint64_t{1} << 62;
  uint64_t s = 0, r = 0;
  CHECK(!BufferBytes(op, nullptr, nullptr, 4, 0, &s, &r).ok());
  op.count = 10;
  REQUIRE(BufferBytes(op, nullptr, nullptr, 4, 0, &s, &r).ok());
  CHECK(s == 40);
  CHECK(r == 160);
  op.kind = CollectiveKind::kGather;
  op.peer = 1;
  REQUIRE(BufferBytes(op, nullptr, nullptr, 4, 0, &s, &r).ok());
  CHECK(r == 0);  // only the root receives
}

TEST_CASE("a rank's own mistakes are named") {
  tpu::DecodedCollective g;
  g.index = 1;
  g.ops = {Entry(CollectiveKind::kBroadcast, 4, 5)};
  CHECK(CheckOwnGroup(g, 4).message() ==
        "broadcast root 5 is not a rank of this communicator of 4 ranks");
  g.ops = {Entry(CollectiveKind::kAllReduce, 4),
           Entry(CollectiveKind::kSend, 4, 1)};
  CHECK(CheckOwnGroup(g, 4).message() ==
        "a group mixes point-to-point operations with collectives; group them "
        "separately");
  g.ops = {Entry(CollectiveKind::kAllReduce, 4)};
  CHECK(CheckOwnGroup(g, 4).ok());
  g.index = 0;
  CHECK(CheckOwnGroup(g, 4).message() ==
        "a collective group without an index (it starts at 1)");
}

TEST_CASE(
    "collectives meet when every rank posted the same index, and must agree") {
  Comm c(2);
  tpu::DecodedCollective g;
  g.index = 1;
  g.ops = {Entry(CollectiveKind::kAllReduce, 4)};
  c.Post(0, 0, g);
  std::vector<int> at;
  CHECK(!FindMetGroups(c.comm, 1, &at));
  CHECK(CheckNotIssuedTwice(c.comm, 0, 1).message() ==
        "collective group #1 was issued twice by this rank");
  g.ops[0].count = 8;
  c.Post(1, 3, g);
  REQUIRE(FindMetGroups(c.comm, 1, &at));
  CHECK(at == std::vector<int>{0, 3});
  CHECK(CheckGroupsAgree(c.comm, at, "collective #1").message() ==
        "collective #1 does not match across ranks: rank 0 calls "
        "all_reduce(sum, float32, 4 "
        "elements), rank 1 calls all_reduce(sum, float32, 8 elements)");
}

TEST_CASE("sends pair with receives of the same pair index") {
  Comm c(2);
  tpu::DecodedCollective send, recv;
  send.ops = {Entry(CollectiveKind::kSend, 4, 1)};
  recv.ops = {Entry(CollectiveKind::kRecv, 4, 0)};
  c.Post(0, 0, send);
  int calls = 0;
  int rank = 0;
  auto run = [&](int ka, int ia, int peer, int kb, int ib) {
    ++calls;
    c.comm.slots[rank][ka].ops[ia].done = 1;
    c.comm.slots[peer][kb].ops[ib].done = 1;
  };
  MatchPointToPoint(&c.comm, 0, 0, run);
  CHECK(calls == 0);
  CHECK(TimeoutMessage(c.comm, 0, c.comm.slots[0][0]) ==
        "point-to-point operations of rank 0 timed out after 3 s on "
        "communicator 7: waiting "
        "for rank 1 (pid 101, chip 1), which did not take part");
  c.Post(1, 2, recv);
  rank = 1;
  MatchPointToPoint(&c.comm, 1, 2, run);
  CHECK(calls == 1);
  std::vector<std::pair<int, int>> done;
  ForEachCompletedPointToPoint(c.comm,
                               [&](int r, int k) { done.emplace_back(r, k); });
  CHECK(done == std::vector<std::pair<int, int>>{{0, 0}, {1, 2}});
  PostedOp wide = c.comm.slots[1][2].ops[0];
  wide.dtype = tpu::Code(tpu::DType::kDouble);
  CHECK(CheckPair(c.comm.slots[0][0].ops[0], wide, 0, 1).message() ==
        "send/recv #1 from rank 0 to rank 1 does not match: the sender sends 4 "
        "float32 "
        "elements, the receiver expects 4 float64");
}

}  // namespace
}  // namespace tpud
