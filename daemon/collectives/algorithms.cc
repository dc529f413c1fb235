#include "daemon/collectives/algorithms.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "daemon/collectives/reduction.h"
#include "tpu/dtype.h"

namespace tpud {

using tpu::CollectiveKind;
using tpu::ReduceOp;

namespace {

// Per rank, bytes of one tile: small enough that a tile of every rank's
// buffers stays in cache while the ring's steps run over it.
constexpr uint64_t kTileBytes = 64 * 1024;

struct Chunking {
  uint64_t lo, hi;
  int n;
  uint64_t begin(int c) const { return lo + (hi - lo) * c / n; }
  uint64_t end(int c) const { return lo + (hi - lo) * (c + 1) / n; }
};

int Mod(int a, int n) { return ((a % n) + n) % n; }

// Ring all-reduce of elements [lo, hi) of every rank's `buf` (in place),
// ranks in `order`: n - 1 reduce-scatter steps, then n - 1 all-gather steps.
void RingAllReduce(CollectiveTable* t, const CommSlot* comm,
                   const std::vector<int>& order, const std::vector<char*>& buf,
                   const PostedOp& op, uint64_t esize, uint64_t lo,
                   uint64_t hi) {
  const int n = static_cast<int>(order.size());
  if (hi <= lo || n < 2) return;
  const tpu::DType dtype = tpu::DTypeFromCode(op.dtype);
  const Chunking ch{lo, hi, n};
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int src = order[p], dst = order[Mod(p + 1, n)], c = Mod(p - s, n);
      const uint64_t b = ch.begin(c), len = ch.end(c) - b;
      ReduceInto(dtype, op.reduce, buf[dst] + b * esize, buf[src] + b * esize,
                 len);
      CountRoute(t, comm, src, dst, len * esize);
    }
  }
  if (op.reduce == ReduceOp::kAvg) {
    for (int p = 0; p < n; ++p) {
      const int c = Mod(p + 1, n);
      const uint64_t b = ch.begin(c);
      DivideBy(dtype, buf[order[p]] + b * esize, ch.end(c) - b, n);
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int src = order[p], dst = order[Mod(p + 1, n)],
                c = Mod(p + 1 - s, n);
      const uint64_t b = ch.begin(c), len = ch.end(c) - b;
      std::memcpy(buf[dst] + b * esize, buf[src] + b * esize, len * esize);
      CountRoute(t, comm, src, dst, len * esize);
    }
  }
}

// Ring all-gather of elements [lo, hi) of each rank's block: recv[r] holds n
// blocks of `count` elements; block q comes from rank q.
void RingAllGather(CollectiveTable* t, const CommSlot* comm,
                   const std::vector<int>& order,
                   const std::vector<char*>& recv, uint64_t count,
                   uint64_t esize, uint64_t lo, uint64_t hi) {
  const int n = static_cast<int>(order.size());
  const uint64_t len = (hi - lo) * esize;
  if (len == 0) return;
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int src = order[p], dst = order[Mod(p + 1, n)],
                owner = order[Mod(p - s, n)];
      const uint64_t off = (static_cast<uint64_t>(owner) * count + lo) * esize;
      std::memcpy(recv[dst] + off, recv[src] + off, len);
      CountRoute(t, comm, src, dst, len);
    }
  }
}

// Ring reduce-scatter of elements [lo, hi) of every block: send[r] holds n
// blocks of `count` elements; rank r's recv gets block r reduced over ranks.
// Partial sums travel in `scratch` (n positions x n blocks x tile).
void RingReduceScatter(CollectiveTable* t, const CommSlot* comm,
                       const std::vector<int>& order,
                       const std::vector<char*>& send,
                       const std::vector<char*>& recv, const PostedOp& op,
                       uint64_t esize, uint64_t lo, uint64_t hi,
                       char* scratch) {
  const int n = static_cast<int>(order.size());
  const tpu::DType dtype = tpu::DTypeFromCode(op.dtype);
  const uint64_t len = hi - lo;
  if (len == 0) return;
  const uint64_t tile = len * esize;
  // Chunk c at position p lives at scratch + (p * n + c) * tile and holds
  // block order[c - 1]: position p ends with chunk p + 1, its own block.
  auto at = [&](int p, int c) {
    return scratch + (static_cast<uint64_t>(p) * n + c) * tile;
  };
  for (int p = 0; p < n; ++p) {
    for (int c = 0; c < n; ++c) {
      const int block = order[Mod(c - 1, n)];
      std::memcpy(at(p, c),
                  send[order[p]] +
                      (static_cast<uint64_t>(block) * op.count + lo) * esize,
                  tile);
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    for (int p = 0; p < n; ++p) {
      const int q = Mod(p + 1, n), c = Mod(p - s, n);
      ReduceInto(dtype, op.reduce, at(q, c), at(p, c), len);
      CountRoute(t, comm, order[p], order[q], tile);
    }
  }
  for (int p = 0; p < n; ++p) {
    char* own = at(p, Mod(p + 1, n));
    if (op.reduce == ReduceOp::kAvg) DivideBy(dtype, own, len, n);
    std::memcpy(recv[order[p]] + lo * esize, own, tile);
  }
}

// Bytes the ring schedules move in all, over every link, for an element-wise
// kind with `block` bytes per rank.
uint64_t RingBytesMoved(CollectiveKind kind, int n, uint64_t block) {
  const uint64_t hops = static_cast<uint64_t>(n - 1);
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return 2 * hops * block;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      return hops * block * static_cast<uint64_t>(n);
    default:
      return hops * block;
  }
}

}  // namespace

void RunCollective(CollectiveTable* table, CommSlot* comm,
                   const std::vector<const PostedOp*>& ops,
                   const std::vector<char*>& send,
                   const std::vector<char*>& recv,
                   const std::vector<const int64_t*>& send_counts,
                   const std::vector<const int64_t*>& recv_counts,
                   std::vector<char>* scratch) {
  const int n = static_cast<int>(comm->size);
  const PostedOp& op = *ops[0];
  const tpu::DType dtype = tpu::DTypeFromCode(op.dtype);
  const uint64_t esize = static_cast<uint64_t>(tpu::ElementSize(op.dtype));
  const uint64_t count = op.count;
  std::vector<int> order(comm->ring, comm->ring + n);
  std::vector<int> reverse(order.rbegin(), order.rend());
  const uint64_t tile =
      std::max<uint64_t>(kTileBytes / std::max<uint64_t>(esize, 1), 1);
  int start = 0;  // ring position of the root (rooted kinds)
  if (op.kind == CollectiveKind::kBroadcast ||
      op.kind == CollectiveKind::kReduce) {
    while (order[start] != op.peer) ++start;
  }
  // The elements [lo, hi) of every rank's block: the element-wise kinds split
  // into ranges that run independently (on several threads when large).
  auto run_range = [&](uint64_t lo_all, uint64_t hi_all,
                       std::vector<char>& buf) {
    switch (op.kind) {
      case CollectiveKind::kAllReduce: {
        for (int r = 0; r < n; ++r) {
          if (recv[r] != send[r]) {
            std::memmove(recv[r] + lo_all * esize, send[r] + lo_all * esize,
                         (hi_all - lo_all) * esize);
          }
        }
        // Bidirectional ring, pipelined in tiles: the first half of each
        // tile goes one way round, the second half the other.
        const uint64_t big_tile = tile * n;
        for (uint64_t lo = lo_all; lo < hi_all; lo += big_tile) {
          const uint64_t hi = std::min(hi_all, lo + big_tile);
          const uint64_t mid = lo + (hi - lo) / 2;
          RingAllReduce(table, comm, order, recv, op, esize, lo, mid);
          RingAllReduce(table, comm, reverse, recv, op, esize, mid, hi);
        }
        break;
      }
      case CollectiveKind::kAllGather: {
        for (int r = 0; r < n; ++r) {
          std::memmove(
              recv[r] + (static_cast<uint64_t>(r) * count + lo_all) * esize,
              send[r] + lo_all * esize, (hi_all - lo_all) * esize);
        }
        for (uint64_t lo = lo_all; lo < hi_all; lo += tile) {
          const uint64_t hi = std::min(hi_all, lo + tile);
          const uint64_t mid = lo + (hi - lo) / 2;
          RingAllGather(table, comm, order, recv, count, esize, lo, mid);
          RingAllGather(table, comm, reverse, recv, count, esize, mid, hi);
        }
        break;
      }
      case CollectiveKind::kReduceScatter: {
        const uint64_t t = std::max<uint64_t>(tile / n, 1);
        buf.resize(static_cast<size_t>(n) * n * t * esize);
        for (uint64_t lo = lo_all; lo < hi_all; lo += t) {
          const uint64_t hi = std::min(hi_all, lo + t);
          const uint64_t mid = lo + (hi - lo) / 2;
          RingReduceScatter(table, comm, order, send, recv, op, esize, lo, mid,
                            buf.data());
          RingReduceScatter(table, comm, reverse, send, recv, op, esize, mid,
                            hi, buf.data());
        }
        break;
      }
      case CollectiveKind::kBroadcast: {
        // Along the ring from the root, one hop after another.
        const int root = op.peer;
        const uint64_t off = lo_all * esize, len = (hi_all - lo_all) * esize;
        if (recv[root] != send[root])
          std::memmove(recv[root] + off, send[root] + off, len);
        for (int k = 0; k + 1 < n; ++k) {
          const int src = order[Mod(start + k, n)],
                    dst = order[Mod(start + k + 1, n)];
          std::memcpy(recv[dst] + off, recv[src] + off, len);
          CountRoute(table, comm, src, dst, len);
        }
        break;
      }
      case CollectiveKind::kReduce: {
        // Partial results travel the ring towards the root, ending there.
        const int root = op.peer;
        buf.resize(tile * esize);
        for (uint64_t lo = lo_all; lo < hi_all; lo += tile) {
          const uint64_t len = std::min(hi_all, lo + tile) - lo;
          char* acc = buf.data();
          const int first = order[Mod(start + 1, n)];
          std::memcpy(acc, send[first] + lo * esize, len * esize);
          for (int k = 2; k <= n; ++k) {
            const int prev = order[Mod(start + k - 1, n)],
                      r = order[Mod(start + k, n)];
            ReduceInto(dtype, op.reduce, acc, send[r] + lo * esize, len);
            CountRoute(table, comm, prev, r, len * esize);
          }
          if (n == 1) std::memcpy(acc, send[root] + lo * esize, len * esize);
          if (op.reduce == ReduceOp::kAvg) DivideBy(dtype, acc, len, n);
          std::memcpy(recv[root] + lo * esize, acc, len * esize);
        }
        break;
      }
      default:
        break;
    }
  };
  uint64_t moved = 0;
  switch (op.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kReduce: {
      // Large operations are memory-bound: split them over the host's cores
      // (contiguous element ranges, each pipelined in tiles as above).
      const uint64_t bytes = count * esize * static_cast<uint64_t>(n);
      int threads = 1;
      if (bytes >= (uint64_t{16} << 20)) {
        threads = static_cast<int>(std::min<unsigned>(
            std::max(1u, std::thread::hardware_concurrency()), 8u));
      }
      if (threads == 1) {
        run_range(0, count, *scratch);
      } else {
        std::vector<std::thread> pool;
        std::vector<std::vector<char>> bufs(threads);
        const uint64_t step = (count + threads - 1) / threads;
        for (int i = 0; i < threads; ++i) {
          const uint64_t lo = std::min(count, step * i),
                         hi = std::min(count, step * (i + 1));
          if (i + 1 == threads) {
            run_range(lo, hi, bufs[i]);  // this thread takes the last range
          } else {
            pool.emplace_back([&, lo, hi, i] { run_range(lo, hi, bufs[i]); });
          }
        }
        for (std::thread& t : pool) t.join();
      }
      if (n == 1 && op.kind == CollectiveKind::kAllReduce &&
          op.reduce == ReduceOp::kAvg) {
        DivideBy(dtype, recv[0], count, 1);
      }
      moved = RingBytesMoved(op.kind, n, count * esize);
      break;
    }
    case CollectiveKind::kGather:
      for (int r = 0; r < n; ++r) {
        std::memmove(recv[op.peer] + static_cast<uint64_t>(r) * count * esize,
                     send[r], count * esize);
        CountRoute(table, comm, r, op.peer, count * esize);
      }
      moved = (n - 1) * count * esize;
      break;
    case CollectiveKind::kScatter:
      for (int r = 0; r < n; ++r) {
        std::memmove(recv[r],
                     send[op.peer] + static_cast<uint64_t>(r) * count * esize,
                     count * esize);
        CountRoute(table, comm, op.peer, r, count * esize);
      }
      moved = (n - 1) * count * esize;
      break;
    case CollectiveKind::kAllToAll:
      // Direct: block j of rank i goes to rank j's block i, by the shortest
      // route.
      for (int i = 0; i < n; ++i) {
        uint64_t send_off = 0;
        for (int j = 0; j < n; ++j) {
          uint64_t recv_off = 0;
          for (int k = 0; k < i; ++k)
            recv_off += static_cast<uint64_t>(recv_counts[j][k]);
          const uint64_t bytes =
              static_cast<uint64_t>(send_counts[i][j]) * esize;
          std::memcpy(recv[j] + recv_off * esize, send[i] + send_off * esize,
                      bytes);
          CountRoute(table, comm, i, j, bytes);
          if (i != j) moved += bytes;
          send_off += static_cast<uint64_t>(send_counts[i][j]);
        }
      }
      break;
    case CollectiveKind::kBarrier:
    case CollectiveKind::kSend:
    case CollectiveKind::kRecv:
      break;
  }
  comm->bytes_moved.fetch_add(moved, std::memory_order_relaxed);
}

void CountCollectiveTraffic(CollectiveTable* table, CommSlot* comm,
                            const PostedOp& op,
                            const std::vector<const int64_t*>& send_counts) {
  const int n = static_cast<int>(comm->size);
  const uint64_t esize = static_cast<uint64_t>(tpu::ElementSize(op.dtype));
  const uint64_t block = op.count * esize;
  std::vector<int> order(comm->ring, comm->ring + n);
  std::vector<int> reverse(order.rbegin(), order.rend());
  // Each link between ring neighbours, in both directions of the ring.
  auto around = [&](const std::vector<int>& ring, uint64_t per_link) {
    if (n < 2) return;
    for (int p = 0; p < n; ++p)
      CountRoute(table, comm, ring[p], ring[Mod(p + 1, n)], per_link);
  };
  uint64_t moved = 0;
  switch (op.kind) {
    case CollectiveKind::kAllReduce: {
      // Half each way round; 2(n - 1) steps of a 1/n share of that half.
      const uint64_t half = block / 2;
      around(order, 2 * (n - 1) * (half / n));
      around(reverse, 2 * (n - 1) * ((block - half) / n));
      moved = RingBytesMoved(op.kind, n, block);
      break;
    }
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter: {
      const uint64_t half = block / 2;
      around(order, (n - 1) * half);
      around(reverse, (n - 1) * (block - half));
      moved = RingBytesMoved(op.kind, n, block);
      break;
    }
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kReduce: {
      int start = 0;
      while (start < n && order[start] != op.peer) ++start;
      for (int k = 0; k + 1 < n; ++k) {
        const int a = order[Mod(start + k, n)],
                  b = order[Mod(start + k + 1, n)];
        if (op.kind == CollectiveKind::kBroadcast) {
          CountRoute(table, comm, a, b, block);
        } else {
          CountRoute(table, comm, b, a, block);
        }
      }
      moved = RingBytesMoved(op.kind, n, block);
      break;
    }
    case CollectiveKind::kGather:
    case CollectiveKind::kScatter:
      for (int r = 0; r < n; ++r) {
        if (op.kind == CollectiveKind::kGather) {
          CountRoute(table, comm, r, op.peer, block);
        } else {
          CountRoute(table, comm, op.peer, r, block);
        }
      }
      moved = (n - 1) * block;
      break;
    case CollectiveKind::kAllToAll:
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          const uint64_t bytes =
              static_cast<uint64_t>(send_counts[i][j]) * esize;
          CountRoute(table, comm, i, j, bytes);
          if (i != j) moved += bytes;
        }
      }
      break;
    default:
      break;
  }
  comm->bytes_moved.fetch_add(moved, std::memory_order_relaxed);
}

}  // namespace tpud
