#include "daemon/collectives/algorithms.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "catch2_compat/catch.h"
#include "tpu/dtype.h"

namespace tpud {
namespace {

using tpu::CollectiveKind;
using tpu::ReduceOp;

constexpr int8_t kFloat32 = tpu::Code(tpu::DType::kFloat);

// Runs one collective over n ranks on plain host buffers.
struct Harness {
  std::unique_ptr<CollectiveTable, HeapTableDeleter> table =
      NewHeapCollectiveTable(1);
  CommSlot* comm = CommAt(table.get(), 0);
  explicit Harness(int n) {
    comm->size = static_cast<uint32_t>(n);
    for (int r = 0; r < n; ++r) {
      comm->members[r].chip = r;
      comm->ring[r] = r;
    }
    // Chips on a line: route u -> v crosses one link per step (link i joins
    // chips i and i+1).
    table->num_links = static_cast<uint32_t>(n - 1);
    for (int u = 0; u < kMaxTableChips; ++u)
      for (int v = 0; v < kMaxTableChips; ++v)
        for (int k = 0; k < kMaxRouteLinks; ++k) table->routes[u][v][k] = -1;
    for (int u = 0; u < n; ++u) {
      for (int v = 0; v < n; ++v) {
        int k = 0;
        for (int c = u; c != v && k < kMaxRouteLinks;
             c += (v > u ? 1 : -1), ++k) {
          const int link = v > u ? c : c - 1;
          table->routes[u][v][k] =
              static_cast<int16_t>(link * 2 + (v > u ? 0 : 1));
        }
      }
    }
  }
  void Run(const PostedOp& op, std::vector<std::vector<float>>& send,
           std::vector<std::vector<float>>& recv) {
    const int n = static_cast<int>(comm->size);
    std::vector<const PostedOp*> ops(n, &op);
    std::vector<char*> s(n), r(n);
    std::vector<const int64_t*> sc(n, nullptr), rc(n, nullptr);
    for (int i = 0; i < n; ++i) {
      s[i] = reinterpret_cast<char*>(send[i].data());
      r[i] = reinterpret_cast<char*>(recv[i].data());
    }
    std::vector<char> scratch;
    RunCollective(table.get(), comm, ops, s, r, sc, rc, &scratch);
  }
};

TEST_CASE("ring all_reduce equals the sum, for sizes around the tiles") {
  for (int n : {1, 2, 3, 4}) {
    for (uint64_t count : {uint64_t{1}, uint64_t{7}, uint64_t{16384 * 4 + 3},
                           uint64_t{100000}}) {
      Harness h(n);
      PostedOp op{};
      op.kind = CollectiveKind::kAllReduce;
      op.dtype = kFloat32;
      op.count = count;
      op.reduce = ReduceOp::kAvg;
      std::vector<std::vector<float>> send(n, std::vector<float>(count)),
          recv(n, std::vector<float>(count, -1));
      for (int r = 0; r < n; ++r)
        for (uint64_t i = 0; i < count; ++i)
          send[r][i] = static_cast<float>((r + 1) * (i % 13));
      h.Run(op, send, recv);
      const float mean = (n + 1) / 2.0f;
      for (int r = 0; r < n; ++r) {
        for (uint64_t i = 0; i < count; i += 997) {
          INFO("n " << n << " count " << count << " rank " << r << " i " << i);
          CHECK(recv[r][i] == Approx(mean * (i % 13)));
        }
      }
      // A ring moves 2 (n - 1) / n of the buffer per rank over links.
      uint64_t link_bytes = 0;
      for (uint32_t l = 0; l < h.table->num_links; ++l) {
        link_bytes += h.table->links[l].bytes[0].load() +
                      h.table->links[l].bytes[1].load();
      }
      if (n > 1) CHECK(link_bytes > 0);
    }
  }
}

TEST_CASE("reduce_scatter and all_gather put blocks where they belong") {
  const int n = 3;
  const uint64_t count = 40000;
  Harness h(n);
  PostedOp rs{};
  rs.kind = CollectiveKind::kReduceScatter;
  rs.dtype = kFloat32;
  rs.count = count;
  rs.reduce = ReduceOp::kSum;
  std::vector<std::vector<float>> send(n, std::vector<float>(n * count)),
      recv(n, std::vector<float>(count));
  for (int r = 0; r < n; ++r)
    for (uint64_t i = 0; i < n * count; ++i)
      send[r][i] = static_cast<float>(i % 1000 + r);
  h.Run(rs, send, recv);
  for (int r = 0; r < n; ++r) {
    for (uint64_t i = 0; i < count; i += 311) {
      const uint64_t g = r * count + i;
      CHECK(recv[r][i] == static_cast<float>(3 * (g % 1000) + 3));
    }
  }
  PostedOp ag{};
  ag.kind = CollectiveKind::kAllGather;
  ag.dtype = kFloat32;
  ag.count = count;
  std::vector<std::vector<float>> in(n, std::vector<float>(count)),
      out(n, std::vector<float>(n * count));
  for (int r = 0; r < n; ++r)
    for (uint64_t i = 0; i < count; ++i)
      in[r][i] = static_cast<float>(r * 100000 + i);
  h.Run(ag, in, out);
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q)
      for (uint64_t i = 0; i < count; i += 401)
        CHECK(out[r][q * count + i] == in[q][i]);
}

TEST_CASE("broadcast and reduce from a root in the middle of the ring") {
  const int n = 4;
  Harness h(n);
  PostedOp b{};
  b.kind = CollectiveKind::kBroadcast;
  b.dtype = kFloat32;
  b.count = 5;
  b.peer = 2;
  std::vector<std::vector<float>> send(n, std::vector<float>(5)),
      recv(n, std::vector<float>(5));
  for (int i = 0; i < 5; ++i) send[2][i] = static_cast<float>(i + 1);
  h.Run(b, send, recv);
  for (int r = 0; r < n; ++r) CHECK(recv[r] == send[2]);
  PostedOp red = b;
  red.kind = CollectiveKind::kReduce;
  red.reduce = ReduceOp::kMax;
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 5; ++i)
      send[r][i] = static_cast<float>(r * (i % 2 ? 1 : -1));
  std::vector<std::vector<float>> out(n, std::vector<float>(5, 7));
  h.Run(red, send, out);
  CHECK(out[2] == std::vector<float>{0, 3, 0, 3, 0});
  CHECK(out[0] == std::vector<float>(5, 7));  // only the root is written
}

TEST_CASE("large operations split over threads give the same result") {
  // 4 ranks x 2 Mi floats: past the size where RunCollective uses every core.
  const int n = 4;
  const uint64_t count = 2 << 20;
  Harness h(n);
  for (auto kind : {CollectiveKind::kAllReduce, CollectiveKind::kBroadcast,
                    CollectiveKind::kReduce}) {
    PostedOp op{};
    op.kind = kind;
    op.dtype = kFloat32;
    op.count = count;
    op.peer = 1;
    op.reduce = ReduceOp::kSum;
    std::vector<std::vector<float>> send(n, std::vector<float>(count)),
        recv(n, std::vector<float>(count, -1));
    for (int r = 0; r < n; ++r)
      for (uint64_t i = 0; i < count; ++i)
        send[r][i] = static_cast<float>(r + 1 + (i % 7));
    h.Run(op, send, recv);
    for (int r = 0; r < n; ++r) {
      if (kind == CollectiveKind::kReduce && r != 1) continue;
      for (uint64_t i = 0; i < count; i += 4099) {
        const float want = kind == CollectiveKind::kBroadcast
                               ? static_cast<float>(2 + (i % 7))
                               : static_cast<float>(10 + 4 * (i % 7));
        INFO("kind " << static_cast<int>(kind) << " rank " << r << " i " << i);
        CHECK(recv[r][i] == want);
      }
      CHECK(recv[r][count - 1] != -1);
    }
  }
  PostedOp ag{};
  ag.kind = CollectiveKind::kAllGather;
  ag.dtype = kFloat32;
  ag.count = count;
  std::vector<std::vector<float>> in(n, std::vector<float>(count)),
      out(n, std::vector<float>(n * count));
  for (int r = 0; r < n; ++r)
    for (uint64_t i = 0; i < count; ++i)
      in[r][i] = static_cast<float>(r * 3 + i % 11);
  h.Run(ag, in, out);
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q)
      for (uint64_t i = 0; i < count; i += 8191)
        CHECK(out[r][q * count + i] == in[q][i]);
}

}  // namespace
}  // namespace tpud
